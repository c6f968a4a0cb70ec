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

from requant.errors import FormatError
from requant.formats import e2m1, mxfp4

BLOCK = 16
E4M3_MIN_EXPONENT = -9  # smallest power of two E4M3 represents (a subnormal)
E4M3_MAX_EXPONENT = 8   # largest power of two E4M3 represents
DEFAULT_TOP = E4M3_MAX_EXPONENT
_BYTE_MASKS = {4: 0x7777777777777777, 8: -0x7777777777777778}  # low-3-bit and sign-bit masks


def e4m3_power_of_two(e: int) -> int:
    """The E4M3 byte encoding 2^e, e in [-9, 8]."""
    if not E4M3_MIN_EXPONENT <= e <= E4M3_MAX_EXPONENT:
        raise ValueError(f"2^{e} is not exactly representable in E4M3")
    if e >= -6:  # normal: exponent field e + 7, mantissa 0
        return (e + 7) << 3
    return 1 << (e + 9)  # subnormal: mantissa/8 * 2^-6


_POW2_BYTES = torch.tensor(
    [e4m3_power_of_two(e) for e in range(E4M3_MIN_EXPONENT, E4M3_MAX_EXPONENT + 1)], dtype=torch.uint8
)


@dataclass
class CastResult:
    weight: torch.Tensor          # uint8 [out, K/2], E2M1 codes
    weight_scale: torch.Tensor    # uint8 [out, K/16], E4M3 bytes
    weight_scale_2: float         # global scale, a power of two
    blocks: int                   # MXFP4 blocks in the tensor
    exact_blocks: int             # blocks whose decoded values are unchanged
    requantized_blocks: int       # blocks below the window that were re-rounded


def global_exponent(k_max: int | None, top: int = DEFAULT_TOP) -> int:
    """Exponent of weight_scale_2 for a tensor (or fused pair) whose largest block exponent is k_max.

    An all-zero tensor has no k_max; 2^-top is as good as any and matches NVIDIA's exporter.
    """
    return (0 if k_max is None else k_max) - top


def clear_negative_zero(packed: torch.Tensor) -> torch.Tensor:
    """Return a copy of packed E2M1 bytes with every -0 nibble (0x8) replaced by +0.

    Works on 64-bit words: adding 7 to a nibble's low three bits carries into its bit 3 exactly when
    they are non-zero, and never into the next nibble.
    """
    words = packed.contiguous().view(torch.int64)
    low_zero = (words & _BYTE_MASKS[4]) + _BYTE_MASKS[4]
    low_zero.bitwise_not_()
    low_zero &= words
    low_zero &= _BYTE_MASKS[8]
    return (words ^ low_zero).view(torch.uint8).view(packed.shape)


def cast_from_mxfp4(weight: torch.Tensor, scale: torch.Tensor, k_max: int | None,
                    top: int = DEFAULT_TOP) -> CastResult:
    """Cast one MXFP4 tensor to NVFP4 on the bits.

    k_max is the largest block exponent of the tensor, or of the fused w1/w3 pair it belongs to
    (both then share weight_scale_2). `top` places k_max's block scale at 2^top; a smaller top
    lowers the largest block scale at the cost of a narrower lossless window.
    """
    weight = weight.contiguous().view(torch.uint8)
    scale = scale.contiguous().view(torch.uint8)
    mxfp4.check_shapes(tuple(weight.shape), tuple(scale.shape))
    if weight.shape[1] % 8:
        raise FormatError(f"packed row length {weight.shape[1]} is not a multiple of 8 bytes")
    mxfp4.check_scales(scale.numpy())
    m = global_exponent(k_max, top)
    rel = scale.to(torch.int16) - (mxfp4.E8M0_BIAS + m)
    if rel.numel() and int(rel.max()) > top:
        raise FormatError(f"a block exponent exceeds k_max={k_max}")
    in_window = rel >= E4M3_MIN_EXPONENT
    block_scale = _POW2_BYTES[(rel.clamp(min=E4M3_MIN_EXPONENT) - E4M3_MIN_EXPONENT).long()]
    codes = clear_negative_zero(weight)
    below = ~in_window
    n_below = int(below.sum())
    exact_below = 0
    if n_below:
        exact_below = _requantize_below_window(weight, scale, codes, below, m)
    return CastResult(
        weight=codes,
        weight_scale=block_scale.repeat_interleave(2, dim=1),
        weight_scale_2=float(2.0**m),
        blocks=scale.numel(),
        exact_blocks=scale.numel() - n_below + exact_below,
        requantized_blocks=n_below - exact_below,
    )


def _requantize_below_window(weight, scale, codes, below, m) -> int:
    """Re-round the blocks below the window in `codes` (in place); return how many stay exact.

    The arithmetic is float32 IEEE, value / (2^-9 * 2^m), so results (signs of underflowed zeros
    included) are those of a float quantizer fed the dequantized weights.
    """
    rows, blocks = below.nonzero(as_tuple=True)
    src = weight.view(weight.shape[0], -1, mxfp4.BLOCK // 2)[rows, blocks]           # [n, 16] bytes
    nibbles = e2m1.unpack(src).numpy()                                                # [n, 32]
    lut = np.array(e2m1.MAGNITUDES + tuple(-v for v in e2m1.MAGNITUDES), dtype=np.float32)
    exps = scale[rows, blocks].numpy().astype(np.int32) - mxfp4.E8M0_BIAS
    values = lut[nibbles] * np.exp2(exps.astype(np.float32))[:, None]
    denominator = np.float32(2.0**E4M3_MIN_EXPONENT) * np.float32(2.0**m)
    new = e2m1.round_to_nibbles(values / denominator)
    out = codes.view(weight.shape[0], -1, mxfp4.BLOCK // 2)
    out[rows, blocks] = e2m1.pack(torch.from_numpy(new))
    restored = lut[new] * denominator
    return int((restored == values).all(axis=1).sum())


def decode(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: float | torch.Tensor) -> torch.Tensor:
    """Dequantize to float32 [out, K]. Plain torch, independent of the cast."""
    rows, half_k = weight.shape
    if tuple(weight_scale.shape) != (rows, half_k * 2 // BLOCK):
        raise FormatError(f"weight_scale shape {list(weight_scale.shape)} does not match weight {list(weight.shape)}")
    values = e2m1.signed_values(device=weight.device)[e2m1.unpack(weight).long()]
    factors = weight_scale.view(torch.float8_e4m3fn).to(torch.float32).repeat_interleave(BLOCK, dim=-1)
    return values * factors * float(weight_scale_2)
