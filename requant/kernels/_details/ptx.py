"""The inline PTX that turns a byte pair of a kernel word (`layout.PAIR_TERMS`) into two BF16
weights, one bf16x2 register of the wgmma operand. Strings only, no triton: `_decode` passes them
to `tl.inline_asm_elementwise`; tests/test_kernel_ptx.py runs them through a bit-level model of
their instructions.
"""

from __future__ import annotations

from requant.kernels._details.layout import PAIR_TERMS


def rotation_asm(dst: str, r: int, mask: int) -> str:
    """PTX for a term's rotation of the word ($2) into dst: a funnel shift where the term keeps
    bits that the rotation wraps around, else a plain left shift, which ptxas issues as IMAD.SHL on
    the FMA pipe instead of SHF on the integer pipe (docs/kernel-notes.md, "Shifts on the FMA pipe")."""
    if mask & ((1 << r) - 1):
        return f"shf.l.wrap.b32 {dst}, $2, $2, {r};"
    return f"shl.b32 {dst}, $2, {r};"


def pair_asm(kind: str, m: int, scaled: bool = True) -> str:
    """PTX turning byte pair m of a kernel word ($2) into its two weights, nibble 2m ($0) and
    2m + 1 ($1), as one bf16x2 (the pair of adjacent K columns that a thread holds of the wgmma
    register operand).

    Inputs after the word: its block scale's BF16 bits where scaled, then -(128 + zero) as BF16
    bits for "integer_zero_point". The pair's `PAIR_TERMS`: a rotation (`rotation_asm`) and a mask
    each, the second OR-ed in by one lop3; the mask of INT4's term and the OR with 128.0's bits
    are one lop3 too.
    E2M1 ("e2m1", "e2m1_folded"): the pair's register is then two BF16s worth code x 2^-126; "e2m1"
    multiplies by 2^126, then by the block scale (exact both, E8M0 scales span all of BF16's
    range); "e2m1_folded" takes a scale already times 2^119 (`_decode.scale_bf16_bits`: E4M3's
    448 x 2^119 still fits BF16) and multiplies once, leaving the weights 2^-7 times the true ones
    for the accumulator to take back. Every product is exact: at most 2 x 4 significant bits.
    INT4 ("integer", "integer_zero_point"): 128 + n; minus (128 + zero) is exact, then times the
    scale, or not at all where not scaled (`KernelConfig.scale_after_dot`: the code minus its zero
    point, exact). 3.25 (E2M1 folded) and 4 (INT4) instructions per pair; at decode sizes that issue
    rate, not DRAM, is the limit (docs/kernel-notes.md, "Decoding in packed BF16 PTX").
    """
    integer = kind.startswith("integer")
    (r, mask), *more = PAIR_TERMS["integer" if integer else "e2m1"][m]
    lines = ["{", ".reg .b32 s, k, z, t, u;", "mov.b32 z, 0x80008000;"]
    if scaled:
        lines.append("mov.b32 s, {$3, $3};")
    src = "$2"
    if r:
        lines.append(rotation_asm("t", r, mask))
        src = "t"
    if integer:
        zero = "$4" if scaled else "$3"  # -(128 + zero)'s bits, after the scale's where scaled
        lines += [f"lop3.b32 t, {src}, {mask:#x}, 0x43004300, 0xEA;",  # (src & mask) | 0x43004300
                  "mov.b32 u, 0x3F803F80;",
                  f"mov.b32 k, {{{zero}, {zero}}};" if kind == "integer_zero_point" else "mov.b32 k, 0xC308C308;",
                  "fma.rn.bf16x2 t, t, u, k;"]
    else:
        lines.append(f"and.b32 t, {src}, {mask:#x};")
        for r2, mask2 in more:
            lines += [rotation_asm("u", r2, mask2), f"lop3.b32 t, t, u, {mask2:#x}, 0xF8;"]  # t | (u & mask2)
        if kind == "e2m1":
            lines += ["mov.b32 k, 0x7E807E80;", "fma.rn.bf16x2 t, t, k, z;"]  # x 2^126
    if scaled:
        lines.append("fma.rn.bf16x2 t, t, s, z;")
    return "\n".join(lines + ["mov.b32 {$0, $1}, t;", "}"])


# By PTX kind and scaled, the four byte pairs' PTX.
PAIR_ASM = {(kind, scaled): tuple(pair_asm(kind, m, scaled) for m in range(4))
            for kind in ("e2m1", "e2m1_folded", "integer", "integer_zero_point") for scaled in (True, False)
            if scaled or kind.startswith("integer")}
