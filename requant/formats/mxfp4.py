"""MXFP4: E2M1 elements with one power-of-two E8M0 scale per 32 consecutive K elements.

Weight bytes are [out, K/2] (two nibbles per byte, even element low), scales are [out, K/32] E8M0
bytes meaning 2^(byte - 127). Byte 0xFF is NaN, which no valid checkpoint contains.
"""

from __future__ import annotations

import numpy as np
import torch

from requant import formats
from requant.errors import FormatError
from requant.formats import e2m1

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def check_shapes(weight_shape, scale_shape) -> None:
    """Raise FormatError unless scale_shape is the block-scale shape of a packed weight_shape."""
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise FormatError(f"expected 2-D weight and scale, got {list(weight_shape)} and {list(scale_shape)}")
    rows, half_k = weight_shape
    if scale_shape[0] != rows or half_k * 2 != scale_shape[1] * BLOCK:
        raise FormatError(
            f"scale shape {list(scale_shape)} does not match packed weight shape {list(weight_shape)} "
            f"(expected [{rows}, {half_k * 2 // BLOCK}] for blocks of {BLOCK})"
        )


def check_scales(scales: np.ndarray) -> None:
    """Raise FormatError if any E8M0 byte is the NaN encoding."""
    if scales.size == 0 or int(scales.max()) != E8M0_NAN:
        return
    nan = scales == E8M0_NAN
    if nan.any():
        at = ", ".join(str(int(i)) for i in np.argwhere(nan)[0])   # any rank: stacked experts too
        raise FormatError(f"E8M0 scale is NaN (byte 0xFF) at [{at}], {int(nan.sum())} in all")


def value_problems(read, shape) -> list[formats.Problem]:
    """NaN scale bytes (0xFF), which no valid checkpoint holds."""
    nan = int((read("scale").view(torch.uint8) == E8M0_NAN).sum())
    return [formats.Problem("error", "nan-block-scale", "NaN block scales (E8M0 0xFF)", "scale", f"{nan} blocks")] \
        if nan else []


def max_exponent(scales: np.ndarray) -> int | None:
    """Largest unbiased exponent over non-zero scale bytes; None when every block is all-zero."""
    largest = int(scales.max(initial=0))
    return largest - E8M0_BIAS if largest > 0 else None


def decode(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize to float32 [out, K] (into `out` when given). Plain torch, independent of the fast
    cast."""
    check_shapes(tuple(weight.shape), tuple(scale.shape))
    rows, nblocks = scale.shape
    values = e2m1.decode_packed(weight, out).view(rows, nblocks, BLOCK)
    values *= checked_factors(scale)[..., None]
    return values.view(rows, nblocks * BLOCK)


def factors(scale: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) per E8M0 byte (the NaN byte gives inf)."""
    return torch.exp2(scale.view(torch.uint8).to(torch.float32) - E8M0_BIAS)


def checked_factors(scale: torch.Tensor) -> torch.Tensor:
    """factors, with a FormatError on the NaN byte."""
    if (scale.view(torch.uint8) == E8M0_NAN).any():
        raise FormatError("E8M0 scale is NaN (byte 0xFF)")
    return factors(scale)


def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 [out, K] to (packed uint8 [out, K/2], E8M0 uint8 [out, K/32]).

    OCP MX rule: the block exponent is floor(log2(amax)) - 2, so the largest element lands in [4, 8)
    and saturates at 6; an all-zero block gets scale byte 0, as DeepSeek's quantizer writes it.
    """
    rows, k = x.shape
    if k % BLOCK:
        raise FormatError(f"K={k} is not a multiple of {BLOCK}")
    blocks = x.astype(np.float32).reshape(rows, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(amax)) - 2
    exponent = np.where(amax > 0, np.clip(exponent, -E8M0_BIAS, E8M0_BIAS), -E8M0_BIAS)
    scaled = blocks / np.exp2(exponent)[..., None].astype(np.float32)
    nibbles = e2m1.round_to_nibbles(scaled.reshape(rows, k))
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed.astype(np.uint8), (exponent + E8M0_BIAS).astype(np.uint8)


CODEC = formats.Codec(
    name="mxfp4",
    elements="e2m1",
    parts=(formats.Part("weight", formats.WEIGHT, ("I8", "U8"), lambda out, k, p: (out, k // 2)),
           # gpt-oss stores its E8M0 scale bytes as U8
           formats.Part("scale", formats.SCALE, ("F8_E8M0", "U8"), lambda out, k, p: (out, k // BLOCK))),
    elements_per_word=2,
    packed_dtype=torch.uint8,
    decode=lambda t, out=None: decode(t["weight"].view(torch.uint8), t["scale"], out),
    fixed_group=BLOCK,
    group_sizes=(BLOCK,),
    kernel_code=1,
    check_scales=check_scales,
    value_problems=value_problems,
    code_tables=e2m1.TABLES,
    # 0xFF (NaN) gives inf here, which no other scale equals: such blocks are decoded (and refused).
    block_scales=lambda t: factors(t["scale"]),
    nibbles=lambda t: e2m1.nibbles(t["weight"], checked_factors(t["scale"]), BLOCK),
)
