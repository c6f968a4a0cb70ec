"""FP8 E4M3 weights with one E8M0 power-of-two scale per 128x128 block (DeepSeek attention,
shared experts, MTP projections). Decode only: requant passes these tensors through."""

from __future__ import annotations

import math

import torch

from requant import formats
from requant.errors import FormatError

BLOCK = 128


def scale_shape(weight_shape) -> tuple[int, int]:
    rows, cols = weight_shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def decode(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [out, in] (into `out` when given) from E4M3 bytes and a block-scale grid: E8M0 bytes
    as DeepSeek stores them, or the same powers of two as F32 (compressed-tensors' `weight_scale`)."""
    if tuple(scale.shape) != scale_shape(weight.shape):
        raise FormatError(f"scale shape {list(scale.shape)} does not match weight {list(weight.shape)}")
    values = weight.view(torch.float8_e4m3fn).to(torch.float32)
    if scale.dtype == torch.float32:
        factors = scale
    else:
        factors = torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127)
    rows, cols = weight.shape
    factors = factors.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return torch.mul(values, factors, out=out)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 [out, in] to (E4M3 uint8, E8M0 uint8) with power-of-two block scales."""
    rows, cols = x.shape
    br, bc = scale_shape(x.shape)
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = x
    blocks = padded.view(br, BLOCK, bc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[:, None, :, None]
    codes = scaled.reshape(br * BLOCK, bc * BLOCK)[:rows, :cols].to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), (exponent + 127).to(torch.uint8)


CODEC = formats.Codec(
    name="fp8_block",
    elements="e4m3",
    parts=(formats.Part("weight", formats.WEIGHT, ("F8_E4M3",), lambda out, k, p: (out, k)),
           formats.Part("scale", formats.SCALE, ("F8_E8M0",), lambda out, k, p: scale_shape((out, k)))),
    elements_per_word=1,
    packed_dtype=torch.uint8,
    decode=lambda t, out=None: decode(t["weight"], t["scale"], out),
    fixed_group=BLOCK,
    group_sizes=(BLOCK,),
)
