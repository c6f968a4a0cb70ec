"""NVFP4: E2M1 elements, one E4M3 scale per 16 K elements, one FP32 global scale per tensor.

Dequantized value: E2M1[code] * weight_scale[r, k // 16] * weight_scale_2.

The cast from MXFP4 works on the bits. With m = k_max - top (top = 8 by default), the global
scale is 2^m and a source block with exponent k gets block scale 2^(k - m). E4M3 holds 2^e exactly
for e in [-9, 8], so a block with k - m >= -9 keeps its codes (only -0 becomes +0, as NVIDIA's
exporter writes it); a block below that window gets scale 2^-9 and its values are re-rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from requant import formats
from requant.errors import FormatError
from requant.formats import e2m1, mxfp4

BLOCK = 16
E4M3_MIN_EXPONENT = -9  # smallest power of two E4M3 represents (a subnormal)
E4M3_MAX_EXPONENT = 8   # largest power of two E4M3 represents
DEFAULT_TOP = E4M3_MAX_EXPONENT
_CHUNK_WORDS = 1 << 15                  # 256 KiB: the bit passes below stay in cache


def e4m3_power_of_two(e: int) -> int:
    """The E4M3 byte encoding 2^e, e in [-9, 8]."""
    if not E4M3_MIN_EXPONENT <= e <= E4M3_MAX_EXPONENT:
        raise ValueError(f"2^{e} is not exactly representable in E4M3")
    if e >= -6:  # normal: exponent field e + 7, mantissa 0
        return (e + 7) << 3
    return 1 << (e + 9)  # subnormal: mantissa/8 * 2^-6


_POW2_BYTES = np.array([e4m3_power_of_two(e) for e in range(E4M3_MIN_EXPONENT, E4M3_MAX_EXPONENT + 1)],
                       dtype=np.uint8)


@dataclass
class CastResult:
    weight: np.ndarray            # uint8 [out, K/2], E2M1 codes
    weight_scale: np.ndarray      # uint8 [out, K/16], E4M3 bytes
    weight_scale_2: float         # global scale, a power of two
    blocks: int                   # MXFP4 blocks in the tensor
    exact_blocks: int             # blocks whose decoded values are unchanged
    requantized_blocks: int       # blocks below the window that were re-rounded


def global_exponent(k_max: int | None, top: int = DEFAULT_TOP) -> int:
    """Exponent of weight_scale_2 for a tensor (or fused pair) whose largest block exponent is k_max.

    An all-zero tensor has no k_max; 2^-top is as good as any and matches NVIDIA's exporter.
    """
    return (0 if k_max is None else k_max) - top


def clear_negative_zero(packed: np.ndarray, in_place: bool = False) -> np.ndarray:
    """Packed E2M1 bytes with every -0 nibble (0x8) replaced by +0: a copy, or `packed` itself
    rewritten when `in_place` (one pass over memory fewer, no fresh pages).

    Works on 64-bit words, with e2m1's carry rule for non-zero magnitudes.
    """
    if in_place and not packed.flags.c_contiguous:
        raise ValueError("an in-place -0 fix needs contiguous bytes")
    words = (packed if in_place else np.ascontiguousarray(packed)).reshape(-1).view(np.uint64)
    out = words if in_place else np.empty_like(words)
    scratch = np.empty(min(_CHUNK_WORDS, len(words)), dtype=np.uint64)
    for i in range(0, len(words), _CHUNK_WORDS):
        src, dst = words[i:i + _CHUNK_WORDS], out[i:i + _CHUNK_WORDS]
        t = scratch[: len(src)]
        np.bitwise_and(src, e2m1.MAGNITUDE_BITS, out=t)
        t += e2m1.MAGNITUDE_BITS
        np.invert(t, out=t)          # bit 3 of a nibble now set iff its magnitude is zero
        t &= src
        t &= e2m1.SIGN_BITS          # ...and it is negative
        np.bitwise_xor(src, t, out=dst)
    return out.view(np.uint8).reshape(packed.shape)


def cast_from_mxfp4(weight: np.ndarray, scale: np.ndarray, k_max: int | None,
                    top: int = DEFAULT_TOP, in_place: bool = False) -> CastResult:
    """Cast one MXFP4 tensor (uint8 codes [out, K/2], E8M0 bytes [out, K/32]) to NVFP4 on the bits.

    k_max is the largest block exponent of the tensor, or of the fused w1/w3 pair it belongs to
    (both then share weight_scale_2). `top` places k_max's block scale at 2^top; a smaller top
    lowers the largest block scale at the cost of a narrower lossless window. `in_place` writes the
    codes over `weight` (the caller's own buffer): only -0 nibbles change, and the blocks re-rounded
    below the window decode the same from +0 as from -0.
    """
    mxfp4.check_shapes(weight.shape, scale.shape)
    if weight.shape[1] % 8:
        raise FormatError(f"packed row length {weight.shape[1]} is not a multiple of 8 bytes")
    mxfp4.check_scales(scale)
    m = global_exponent(k_max, top)
    # Block scale for each possible E8M0 byte: 2^(k - m), clamped below at 2^-9.
    rel = np.arange(256) - (mxfp4.E8M0_BIAS + m)
    if scale.size and int(scale.max()) - (mxfp4.E8M0_BIAS + m) > top:
        raise FormatError(f"a block exponent exceeds k_max={k_max}")
    lut = _POW2_BYTES[np.clip(rel, E4M3_MIN_EXPONENT, E4M3_MAX_EXPONENT) - E4M3_MIN_EXPONENT]
    block_scale = lut[scale]
    # Each MXFP4 block of 32 is two NVFP4 blocks of 16 with the same scale: b * 257 = [b, b].
    weight_scale = (block_scale.astype(np.uint16) * 257).view(np.uint8)
    codes = clear_negative_zero(weight, in_place)
    below = scale < mxfp4.E8M0_BIAS + m + E4M3_MIN_EXPONENT
    n_below = int(np.count_nonzero(below))
    exact_below = _requantize_below_window(weight, scale, codes, below, m) if n_below else 0
    return CastResult(
        weight=codes,
        weight_scale=weight_scale,
        weight_scale_2=float(2.0**m),
        blocks=scale.size,
        exact_blocks=scale.size - n_below + exact_below,
        requantized_blocks=n_below - exact_below,
    )


def _requantize_below_window(weight, scale, codes, below, m) -> int:
    """Re-round the blocks below the window in `codes` (in place); return how many stay exact.

    The arithmetic is float32 IEEE, value / (2^-9 * 2^m), so results (signs of underflowed zeros
    included) are those of a float quantizer fed the dequantized weights.
    """
    # Blocks of zero bytes re-round to zeros, exactly: skipped, since in a pruned or empty tensor
    # (a scale byte of 0) nearly every block is one, and the float pass below costs ~70x the cast.
    words = weight.reshape(weight.shape[0], -1, mxfp4.BLOCK // 2).view(np.uint64)
    zeros = below & ((words[..., 0] | words[..., 1]) == 0)
    rows, blocks = np.nonzero(below & ~zeros)
    src = weight.reshape(weight.shape[0], -1, mxfp4.BLOCK // 2)[rows, blocks]        # [n, 16] bytes
    nibbles = np.stack([src & 0x0F, src >> 4], axis=-1).reshape(len(rows), mxfp4.BLOCK)
    lut = np.array(e2m1.MAGNITUDES + tuple(-v for v in e2m1.MAGNITUDES), dtype=np.float32)
    exps = scale[rows, blocks].astype(np.int32) - mxfp4.E8M0_BIAS
    values = lut[nibbles] * np.exp2(exps.astype(np.float32))[:, None]
    denominator = np.float32(2.0**E4M3_MIN_EXPONENT) * np.float32(2.0**m)
    new = e2m1.round_to_nibbles(values / denominator)
    out = codes.reshape(weight.shape[0], -1, mxfp4.BLOCK // 2)
    out[rows, blocks] = new[:, 0::2] | (new[:, 1::2] << 4)
    restored = lut[new] * denominator
    return int(np.count_nonzero(zeros)) + int((restored == values).all(axis=1).sum())


def decode(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: float | torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize to float32 [out, K] (into `out` when given). Plain torch, independent of the cast."""
    rows, half_k = weight.shape
    if tuple(weight_scale.shape) != (rows, half_k * 2 // BLOCK):
        raise FormatError(f"weight_scale shape {list(weight_scale.shape)} does not match weight {list(weight.shape)}")
    values = e2m1.decode_packed(weight, out).view(rows, -1, BLOCK)
    values *= factors(weight_scale, weight_scale_2)[..., None]
    return values.view(rows, half_k * 2)


# Every E4M3 byte's value as float32 (0x7F and 0xFF: NaN). Block scales are decoded by looking
# their bytes up here, or in its product with the global scale: 256 products instead of one per
# block, and no float8 conversion pass (torch's is 5x numpy's lookup on a CPU).
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _by_byte(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float32 table[code] for every byte of `codes` (any 1-byte dtype), in its shape and on its device."""
    codes = codes.view(torch.uint8)
    if codes.device.type != "cpu":
        return table.to(codes.device)[codes.int()]
    out = torch.empty(codes.shape, dtype=torch.float32)
    np.take(table.numpy(), codes.numpy(), out=out.numpy(), mode="wrap")   # "wrap": no bounds checks (bytes)
    return out


def factors(weight_scale: torch.Tensor, weight_scale_2: float | torch.Tensor) -> torch.Tensor:
    """float32 [out, K/16]: what each block's codes are multiplied by (E4M3 scale x global scale).
    Each is the float32 product of the two, as an elementwise multiply gives it."""
    return _by_byte(_E4M3_VALUES * float(weight_scale_2), weight_scale)


def count_nonfinite(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: float | torch.Tensor) -> int:
    """How many values `decode` would give that are not finite, decoding only where a scale byte
    the projection holds could make one: every code times every byte's factor is 256 x 16 products,
    and a valid file holds none that overflow (verify --deep asks this of every expert)."""
    if tuple(weight_scale.shape) != (weight.shape[0], weight.shape[1] * 2 // BLOCK):
        raise FormatError(f"weight_scale shape {list(weight_scale.shape)} does not match weight {list(weight.shape)}")
    products = e2m1.signed_values()[None, :] * factors(torch.arange(256, dtype=torch.uint8), weight_scale_2)[:, None]
    risky = ~torch.isfinite(products).all(dim=1)   # scale bytes under which some code decodes to inf or NaN
    present = torch.bincount(weight_scale.view(torch.uint8).flatten().cpu(), minlength=256) > 0
    if not (risky & present).any():
        return 0
    return int((~torch.isfinite(decode(weight, weight_scale, weight_scale_2))).sum())


def block_scale_values(weight_scale: torch.Tensor) -> torch.Tensor:
    """The stored E4M3 block scales as float32 (E4M3's two NaN bytes give NaN)."""
    return _by_byte(_E4M3_VALUES, weight_scale)


def value_problems(read, shape) -> list[formats.Problem]:
    """Block scales no decoder should meet (NaN, negative; zero over non-zero codes, which decode
    to 0) and global or input scales that are not finite and positive (engines divide by the
    input scale: docs/formats.md, NVFP4 input_scale)."""
    problems = []
    raw = read("weight_scale").view(torch.uint8)
    # Counted on the bytes (E4M3: 0x7F/0xFF NaN, 0x81-0xFE negative, 0x00/0x80 zero): a histogram
    # costs a small fraction of decoding every scale, and verify --deep runs this on each expert.
    counts = torch.bincount(raw.flatten(), minlength=256)
    nan, negative = int(counts[0x7F] + counts[0xFF]), int(counts[0x81:0xFF].sum())
    if nan:
        problems.append(formats.Problem("error", "nan-block-scale", "NaN block scales (E4M3 0x7F/0xFF)",
                                        "weight_scale", f"{nan} blocks"))
    if negative:
        problems.append(formats.Problem("error", "negative-block-scale", "negative block scales", "weight_scale",
                                        f"{negative} blocks"))
    if counts[0x00] + counts[0x80]:
        zero = (raw & 0x7F) == 0
        weight = read("weight").view(torch.uint8)
        live = (weight.reshape(*raw.shape, BLOCK // 2) & 0x77).ne(0).any(dim=-1)   # any non-zero code
        lost = int((zero & live).sum())
        if lost:
            problems.append(formats.Problem("warning", "zero-block-scale", "zero block scales over non-zero codes "
                                            "(those weights decode to 0)", "weight_scale", f"{lost} blocks"))
    for part, code, message in (
            ("weight_scale_2", "bad-global-scale", "weight_scale_2 is not finite and positive"),
            ("input_scale", "bad-input-scale", "input_scale is not finite and positive (engines divide by it: "
                                               "NaN or empty output)")):
        tensor = read(part)
        why = None if tensor is None else formats.bad_scalar(formats.scalar(tensor))
        if why is not None:
            problems.append(formats.Problem("error", code, message, part, why))
    return problems


CODEC = formats.Codec(
    name="nvfp4",
    elements="e2m1",
    parts=(formats.Part("weight", formats.WEIGHT, ("U8",), lambda out, k, p: (out, k // 2)),
           formats.Part("weight_scale", formats.SCALE, ("F8_E4M3",), lambda out, k, p: (out, k // BLOCK)),
           formats.Part("weight_scale_2", formats.GLOBAL_SCALE, ("F32",), lambda out, k, p: ()),
           formats.Part("input_scale", formats.INPUT_SCALE, ("F32",), lambda out, k, p: ())),
    elements_per_word=2,
    packed_dtype=torch.uint8,
    decode=lambda t, out=None: decode(t["weight"].view(torch.uint8), t["weight_scale"],
                                      formats.scalar(t["weight_scale_2"]), out),
    count_nonfinite=lambda t: count_nonfinite(t["weight"].view(torch.uint8), t["weight_scale"],
                                              formats.scalar(t["weight_scale_2"])),
    fixed_group=BLOCK,
    group_sizes=(BLOCK,),
    kernel_code=0,
    value_problems=value_problems,
    # The lossless cast on the bits: (weight, scale, k_max, top, in_place) -> CastResult.
    encoders={"mxfp4": cast_from_mxfp4},
    code_tables=e2m1.TABLES,
    block_scales=lambda t: factors(t["weight_scale"], formats.scalar(t["weight_scale_2"])),
    nibbles=lambda t: e2m1.nibbles(t["weight"], factors(t["weight_scale"], formats.scalar(t["weight_scale_2"])), BLOCK),
)
