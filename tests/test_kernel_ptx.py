"""The kernel's dequantization PTX, run on the CPU by a bit-level model of the few PTX instructions
it uses, against plain decoding.

The interpreter tests (test_kernel_moe.py) take the FP32 route; the inline PTX runs only on a GPU.
This checks the PTX text itself: byte selectors, shifts, masks and the bf16x2 arithmetic, for every
byte value in every byte position of a word.
"""

import re
import struct

import pytest
import torch

pytest.importorskip("triton", reason="requant's kernel needs triton (Linux wheels only): pip install 'requant[gpu]'")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from requant.kernels import fused_moe as fm  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SCALES = [1.0, 0.25, 3.0, 448.0, 2.0**-9 * 1.125, 0.0078125]


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def f16_value(bits: int) -> float:
    return float(torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16).item())


def f16_bits(x: float) -> int:
    """Round to nearest even, as the mul.rn the PTX uses."""
    return int(torch.tensor([x], dtype=torch.float64).to(torch.float16).view(torch.int16).item()) & 0xFFFF


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
        elif op == "cvt.rn.f16x2.e4m3x2":  # the 16-bit source's byte h // 16 into the result's half h
            r = sum(f16_bits(e4m3_value((a[0] >> (h // 2)) & 0xFF)) << h for h in (0, 16))
        elif op == "mul.rn.f16x2":
            r = sum(f16_bits(f16_value(a[0] >> h) * f16_value(a[1] >> h)) << h for h in (0, 16))
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


@pytest.mark.parametrize("kind", ["e2m1", "int4", "int4-zero-point"])
def test_pair_ptx_decodes_every_byte(kind):
    asm = {"e2m1": fm._ASM_FP4, "int4": fm._ASM_INT4, "int4-zero-point": fm._ASM_INT4_ZP}[kind].value
    for i, word in enumerate(words()):
        scale = SCALES[i % len(SCALES)]
        zero = i % 16
        for m in range(4):  # byte m of the word
            out = run_ptx(asm[m], {2: word, 3: bf16_bits(scale), 4: zero | 0xC300})  # $4: -(128 + zero) if asym
            for j, name in ((2 * m, "$0"), (2 * m + 1, "$1")):
                nib = (word >> 4 * j) & 15
                if kind == "e2m1":
                    want = (-1 if nib & 8 else 1) * E2M1[nib & 7] * scale
                else:
                    want = (nib - (8 if kind == "int4" else zero)) * scale
                assert bf16_value(out[name]) == bf16_value(bf16_bits(want)), (kind, hex(word), m, j)


@triton.jit
def _scale_bits_kernel(raw_ptr, out_ptr, FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, fm._scale_bf16_bits(tl.load(raw_ptr + offs), FMT))


def kernel_scale_bits() -> list[int]:
    """The BF16 bits the kernel gives each E4M3 byte as an NVFP4 block scale (`_scale_bf16_bits`,
    run by Triton's interpreter)."""
    out = torch.empty(256, dtype=torch.int16)
    _scale_bits_kernel[(1,)](torch.arange(256, dtype=torch.int32).to(torch.uint8), out, FMT=fm.NVFP4)
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
    for i, word in enumerate(words()):
        byte = scales[(37 * i) % len(scales)]
        for m in range(4):
            out = run_ptx(fm._ASM_FP4_FOLDED.value[m], {2: word, 3: scale_bits[byte]})
            for j, name in ((2 * m, "$0"), (2 * m + 1, "$1")):
                nib = (word >> 4 * j) & 15
                want = (-1 if nib & 8 else 1) * E2M1[nib & 7] * e4m3_value(byte) * 2.0**-7
                assert bf16_value(out[name]) == want, (hex(word), hex(byte), m, j)


def test_e2m1_as_e4m3_ptx_decodes_every_byte_exactly_in_fp16():
    """NVFP4's FP16 route: each weight comes out as code x scale x 2^-6, exactly, for every byte in
    every position and E4M3 block scales from the smallest subnormal to 448."""
    scales = [e4m3_value(b) for b in range(1, 0x7F)]
    for i, word in enumerate(words()):
        scale = scales[(37 * i) % len(scales)]
        for m in range(4):
            out = run_ptx(fm._ASM_E2M1_F16.value[m], {2: word, 3: f16_bits(scale)})
            for j, name in ((2 * m, "$0"), (2 * m + 1, "$1")):
                nib = (word >> 4 * j) & 15
                want = (-1 if nib & 8 else 1) * E2M1[nib & 7] * scale * 2.0**-6
                assert f16_value(out[name]) == want and (out[name] == 0x8000) == (nib == 8), (hex(word), m, j)
