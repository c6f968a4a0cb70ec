"""FP8 E4M3 weights with one E8M0 power-of-two scale per block of rows x columns: 128x128
(DeepSeek-V4's attention, shared experts, MTP projections), 32x32 (DeepSeek-V4.1's dense weights)
or 1x32 (DeepSeek-V4.1's Engram tables, one scale per 32 of a row). Decode only: requant passes
these tensors through. A block is given as its side (square) or as (rows, columns)."""

from __future__ import annotations

import math

import torch

from requant import formats
from requant.errors import FormatError

BLOCK = 128                            # the block side where a checkpoint does not say otherwise
BLOCKS = ((128, 128), (32, 32), (1, 32))   # the blocks requant reads, (rows, columns)


def _pair(block) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else tuple(block)


def scale_shape(weight_shape, block=BLOCK) -> tuple[int, int]:
    rows, cols = weight_shape
    block_rows, block_cols = _pair(block)
    return math.ceil(rows / block_rows), math.ceil(cols / block_cols)


def block_of(weight_shape, scale_shape_) -> tuple[int, int]:
    """The block a scale grid gives a weight: two blocks give one grid only where each covers the
    same rows and columns, so the first that fits decodes the same values."""
    for block in BLOCKS:
        if tuple(scale_shape_) == scale_shape(weight_shape, block):
            return block
    raise FormatError(f"scale shape {list(scale_shape_)} does not match weight {list(weight_shape)} in blocks of "
                      f"{' or '.join(f'{r}x{c}' for r, c in BLOCKS)}")


def decode(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [out, in] (into `out` when given) from E4M3 bytes and a block-scale grid: E8M0 bytes
    as DeepSeek stores them, or the same powers of two as F32 (compressed-tensors' `weight_scale`)."""
    block = block_of(weight.shape, scale.shape)
    values = weight.view(torch.float8_e4m3fn).to(torch.float32)
    if scale.dtype == torch.float32:
        factors = scale
    else:
        factors = torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127)
    rows, cols = weight.shape
    factors = factors.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return torch.mul(values, factors, out=out)


def encode(x: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 [out, in] to (E4M3 uint8, E8M0 uint8) with power-of-two scales per block."""
    rows, cols = x.shape
    block_rows, block_cols = _pair(block)
    br, bc = scale_shape(x.shape, block)
    padded = torch.zeros(br * block_rows, bc * block_cols, dtype=torch.float32)
    padded[:rows, :cols] = x
    blocks = padded.view(br, block_rows, bc, block_cols)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[:, None, :, None]
    codes = scaled.reshape(br * block_rows, bc * block_cols)[:rows, :cols].to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), (exponent + 127).to(torch.uint8)


CODEC = formats.Codec(
    name="fp8_block",
    elements="e4m3",
    parts=(formats.Part("weight", formats.WEIGHT, ("F8_E4M3",), lambda out, k, p: (out, k)),
           formats.Part("scale", formats.SCALE, ("F8_E8M0",),
                        lambda out, k, p: scale_shape((out, k), p.group_size or BLOCK))),
    elements_per_word=1,
    packed_dtype=torch.uint8,
    decode=lambda t, out=None: decode(t["weight"], t["scale"], out),
    group_sizes=(BLOCK, 32),   # square sides; a Params of this codec may carry a (rows, columns) block
)
