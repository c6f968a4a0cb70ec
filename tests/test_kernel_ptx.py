"""The kernel's dequantization PTX, run on the CPU by a bit-level model of the few PTX instructions
it uses, against plain decoding.

The interpreter tests (test_kernel_moe.py) take the FP32 route; the inline PTX runs only on a GPU.
This checks the PTX text itself: rotations, masks and the bf16x2 arithmetic, for every byte value
in every byte position of a word, on the words as the kernel holds them (`kernel_words`: the
stored bits moved into the kernel's layout), against the stored nibbles. The FP32 route's reading
of the same layout (`_decode.pair_nibbles`) runs here through Triton's interpreter.
"""

import re
import struct

import pytest
import torch

pytest.importorskip("triton", reason="requant's kernel needs triton (Linux wheels only): pip install 'requant[gpu]'")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from requant.kernels._details import _decode as dec  # noqa: E402
from requant.kernels._details import layout  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SCALES = [1.0, 0.25, 3.0, 448.0, 2.0**-9 * 1.125, 0.0078125]


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def e4m3_value(byte: int) -> float:
    """OCP E4M3 (bias 7, subnormals at exponent 0; 0x7F and 0xFF, NaN, never occur here)."""
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    v = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -v if byte & 0x80 else v


def bf16_bits(x: float) -> int:
    """Round to nearest even, as the fma.rn the PTX uses."""
    return int(torch.tensor([x]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def run_ptx(asm: str, args: dict[int, int]) -> dict[str, int]:
    """Execute the PTX block on operand values $n = args[n]; returns the 16-bit outputs by name."""
    regs, outs = {}, {}

    def value(tok: str) -> int:
        if tok.startswith("$"):
            return args[int(tok[1:])]
        if tok.startswith("{"):  # a pair of 16-bit values packed into 32 bits
            lo, hi = (value(t.strip()) for t in tok[1:-1].split(","))
            return (lo & 0xFFFF) | (hi & 0xFFFF) << 16
        if tok.startswith("0x") or tok.isdigit():
            return int(tok, 0)
        return regs[tok]

    for line in asm.split("\n"):
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = (t.strip() for t in re.split(r",(?![^{]*})", rest))
        a = [value(t) for t in src]
        if op == "mov.b32" and dst.startswith("{"):  # unpack into two 16-bit values
            lo, hi = (t.strip() for t in dst[1:-1].split(","))
            outs[lo], outs[hi] = regs[lo], regs[hi] = a[0] & 0xFFFF, a[0] >> 16
            continue
        if op == "mov.b32":
            r = a[0]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "shf.l.wrap.b32":  # the upper half of the 64 bits {b, a} shifted left by c mod 32
            r = ((a[1] << 32 | a[0]) << (a[2] & 31)) >> 32 & 0xFFFFFFFF
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "lop3.b32":  # bit i of the result is bit (a_i b_i c_i) of the lookup table
            r = sum(((a[3] >> ((a[0] >> i & 1) << 2 | (a[1] >> i & 1) << 1 | (a[2] >> i & 1))) & 1) << i
                    for i in range(32))
        elif op == "prmt.b32":  # default mode: selector nibble i picks output byte i from a's bytes 0-3, b's 4-7
            pool = [(a[0] >> 8 * i) & 0xFF for i in range(4)] + [(a[1] >> 8 * i) & 0xFF for i in range(4)]
            assert all((a[2] >> 4 * i) & 8 == 0 for i in range(4)), "sign-replicating selectors are not modelled"
            r = sum(pool[(a[2] >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "fma.rn.bf16x2":
            r = sum(bf16_bits(bf16_value(a[0] >> h) * bf16_value(a[1] >> h) + bf16_value(a[2] >> h)) << h
                    for h in (0, 16))
        else:
            raise AssertionError(f"PTX instruction {op} is not modelled")
        regs[dst] = r
    return outs


def words():
    """Words whose 4 byte positions each take all 256 byte values."""
    return [sum(((b + 67 * k) % 256) << 8 * k for k in range(4)) for b in range(256)]


def kernel_words(stored: list[int], fmt) -> list[int]:
    """The stored words in the kernel's layout (`layout.kernel_words`, the torch code the kernel's
    callers run), as unsigned 32-bit values."""
    signed = torch.tensor([w - (1 << 32) if w >> 31 else w for w in stored], dtype=torch.int32)
    return [w & 0xFFFFFFFF for w in layout.kernel_words(signed, fmt.value).tolist()]


@pytest.mark.parametrize("fmt", [dec.NVFP4, dec.MXFP4, dec.INT4])
def test_kernel_words_move_every_bit_once(fmt):
    """A permutation of the 32 bit positions, the same for every word: each single-bit word lands
    on a single bit, no two on the same one."""
    landed = kernel_words([1 << i for i in range(32)], fmt)
    assert sorted(landed) == [1 << i for i in range(32)]
    stored = words()
    for w, k in zip(stored, kernel_words(stored, fmt)):
        assert k == sum(landed[i] for i in range(32) if w >> i & 1)


@pytest.mark.parametrize("kind", ["e2m1", "int4", "int4-zero-point", "int4-unscaled", "int4-zero-point-unscaled"])
def test_pair_ptx_decodes_every_byte(kind):
    """Unscaled (`KernelConfig.scale_after_dot`): the code minus its zero point, exactly, the zero
    point then the third operand ($3) where the scale was."""
    asm = {"e2m1": dec.ASM_FP4, "int4": dec.ASM_INT4, "int4-zero-point": dec.ASM_INT4_ZP,
           "int4-unscaled": dec.ASM_INT4_UNSCALED, "int4-zero-point-unscaled": dec.ASM_INT4_ZP_UNSCALED}[kind].value
    scaled = not kind.endswith("unscaled")
    asym = "zero-point" in kind
    stored = words()
    for i, (word, kernel_word) in enumerate(zip(stored, kernel_words(stored, dec.MXFP4 if kind == "e2m1" else dec.INT4))):
        scale = SCALES[i % len(SCALES)] if scaled else 1.0
        zero = i % 16 if asym else 8
        # After the word: the scale's bits where scaled, then -(128 + zero)'s where asymmetric.
        args = {2: kernel_word, 3: bf16_bits(scale), 4: zero | 0xC300} if scaled else {2: kernel_word, 3: zero | 0xC300}
        for m in range(4):  # byte m of the word
            out = run_ptx(asm[m], args)
            for j, name in ((2 * m, "$0"), (2 * m + 1, "$1")):
                nib = (word >> 4 * j) & 15
                if kind == "e2m1":
                    want = (-1 if nib & 8 else 1) * E2M1[nib & 7] * scale
                else:
                    want = (nib - zero) * scale
                assert bf16_value(out[name]) == bf16_value(bf16_bits(want)), (kind, hex(word), m, j)
            if not scaled:
                assert "$4" not in asm[m] and ("$3" in asm[m]) == asym


@triton.jit
def _scale_bits_kernel(raw_ptr, out_ptr, FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, dec.scale_bf16_bits(tl.load(raw_ptr + offs), FMT))


def kernel_scale_bits() -> list[int]:
    """The BF16 bits the kernel gives each E4M3 byte as an NVFP4 block scale (`_scale_bf16_bits`,
    run by Triton's interpreter)."""
    out = torch.empty(256, dtype=torch.int16)
    _scale_bits_kernel[(1,)](torch.arange(256, dtype=torch.int32).to(torch.uint8), out, FMT=dec.NVFP4)
    return [b & 0xFFFF for b in out.tolist()]


def test_nvfp4_scale_bits_are_the_scale_times_2_to_119():
    bits = kernel_scale_bits()
    for byte in [b for b in range(256) if b & 0x7F != 0x7F]:   # every E4M3 value but NaN
        assert bf16_value(bits[byte]) == e4m3_value(byte) * 2.0**119, hex(byte)
        assert bits[byte] >> 15 == byte >> 7, hex(byte)   # -0 too


def test_folded_e2m1_ptx_decodes_every_byte_exactly():
    """NVFP4's BF16 route: one multiply by the scale times 2^119 leaves code x scale x 2^-7, exactly,
    for every byte in every position and every E4M3 block scale from the smallest subnormal to 448
    (the accumulator takes 2^7 back)."""
    scales = [b for b in range(0x7F)] + [0x80 | b for b in range(1, 0x7F)]
    scale_bits = kernel_scale_bits()
    stored = words()
    for i, (word, kernel_word) in enumerate(zip(stored, kernel_words(stored, dec.NVFP4))):
        byte = scales[(37 * i) % len(scales)]
        for m in range(4):
            out = run_ptx(dec.ASM_FP4_FOLDED.value[m], {2: kernel_word, 3: scale_bits[byte]})
            for j, name in ((2 * m, "$0"), (2 * m + 1, "$1")):
                nib = (word >> 4 * j) & 15
                want = (-1 if nib & 8 else 1) * E2M1[nib & 7] * e4m3_value(byte) * 2.0**-7
                assert bf16_value(out[name]) == want, (hex(word), hex(byte), m, j)


@triton.jit
def _pair_nibbles_kernel(words_ptr, out_ptr, FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    w = tl.load(words_ptr + offs)
    for m in tl.static_range(4):
        lo, hi = dec.pair_nibbles(w, m, FMT)
        tl.store(out_ptr + (2 * m) * 256 + offs, lo)
        tl.store(out_ptr + (2 * m + 1) * 256 + offs, hi)


@pytest.mark.parametrize("fmt", [dec.NVFP4, dec.INT4])
def test_fp32_route_reads_the_kernel_layout(fmt):
    """The interpreter's (FP32) route recovers every stored nibble from the kernel words."""
    stored = words()
    k = torch.tensor(kernel_words(stored, fmt), dtype=torch.int64).to(torch.int32)
    out = torch.empty(8, 256, dtype=torch.int32)
    _pair_nibbles_kernel[(1,)](k, out, FMT=fmt)
    assert out.tolist() == [[(w >> 4 * j) & 15 for w in stored] for j in range(8)]
