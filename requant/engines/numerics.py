"""What serving engines do to NVFP4 numbers at run time, as plain torch (no I/O).

Two rules change the numbers a converted checkpoint computes with, beyond decoding its weights:

- W4A4 (Blackwell's FP4 tensor cores): each activation row is quantized to NVFP4 before the GEMM,
  one E4M3 scale per 16 values from the block's absolute maximum, under the global scale
  1 / input_scale (one input_scale per layer and GEMM input: engines keep the largest over the
  layer's experts, and over w1/w3). `fake_quantize_activations` reproduces vLLM 0.33.0's reference
  quantizer (`ref_nvfp4_quant` / `ref_nvfp4_quant_dequant` in
  `layers/quantization/utils/nvfp4_emulation_utils.py`) bit for bit; the order of the float32
  operations below is theirs, since a different but equivalent order rounds differently.
- Marlin W4A16 (Hopper): vLLM 0.33.0 (`layers/quantization/utils/marlin_utils_fp4.py`) turns E4M3
  block scales into an 8-bit format without a sign or subnormals, through fp16. One power-of-two
  factor per layer and fused GEMM (w1 and w3 together, over all experts) lifts the layer's largest
  block scale into [224, 448]; a block whose scale times that factor is below 2^-6 is set to zero.
  Every other scale survives exactly and the global scale is divided by the same factor, so the
  served weights are the checkpoint's with those blocks flushed (`marlin_flush`).
- W4A8 (MXFP4 weights as stored, MXFP8 activations): SGLang 0.5.23 runs DeepSeek-V4's MXFP4 experts
  this way on sm_120 (FlashInfer's CUTLASS MXFP8 x MXFP4 grouped GEMM) and on sm_100 (FlashInfer's
  TRT-LLM MXFP4 x MXFP8 MoE); `fake_quantize_mxfp8` is FlashInfer 0.7.2's `mxfp8_quantize`, see
  MXFP8 below for the rule and where it was read.
"""

from __future__ import annotations

import math

import torch

from requant.formats import e2m1, mxfp4, nvfp4

BLOCK = nvfp4.BLOCK                 # activations are quantized in the weights' blocks
E4M3_MAX = 448.0
MARLIN_MIN_SCALE = 2.0**-6          # smaller block scales (after the layer's factor) are flushed to 0
_E4M3_NAN = 0x7F                    # 0x7F and 0xFF are E4M3's NaNs; 0x01-0x7E its positive values, in order
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().tolist()
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_MAGNITUDES = torch.tensor(e2m1.MAGNITUDES)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded onto the E2M1 grid (round half to even, |x| <= 6 expected), sign kept:
    a negative value that rounds to zero gives -0."""
    a = x.abs()
    index = torch.bucketize(a, _MIDPOINTS.to(a.device))   # midpoints strictly below a
    on_tie = _MIDPOINTS.to(a.device)[index.clamp(max=len(_MIDPOINTS) - 1)] == a
    index = index + (on_tie & (index % 2 == 1))
    mag = _MAGNITUDES.to(a.device)[index]
    return torch.where(x < 0, -mag, mag)


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    # vLLM's guard: 1 / (t + 1e8 where t == 0), so a zero scale never divides.
    return 1.0 / (t + (t == 0) * 1e8)


def activation_global_scale(input_scale: float) -> torch.Tensor:
    """The quantizer's global scale for a layer whose (largest) input_scale is `input_scale`:
    1 / input_scale in float32, as the engines compute it."""
    return 1.0 / torch.tensor(input_scale, dtype=torch.float32)


def quantize_activations(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values [T, K] float32, E4M3 block scales [T, K/16] float32) of activations x [T, K]."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    scale = global_scale * (amax * (1 / e2m1.MAX))
    scale = scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    multiplier = _reciprocal(scale * _reciprocal(global_scale))
    scaled = (blocks.float() * multiplier).clamp(-e2m1.MAX, e2m1.MAX)
    return round_e2m1(scaled).reshape(rows, k), scale.squeeze(-1)


def fake_quantize_activations(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """x [T, K] quantized to NVFP4 under `input_scale` and decoded again, in x's dtype: what a W4A4
    GEMM multiplies the weights with."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"activation width {k} is not a multiple of {BLOCK}")
    gs = activation_global_scale(input_scale).to(x.device)
    values, scale = quantize_activations(x, gs)
    decoded = values.reshape(rows, k // BLOCK, BLOCK) * (scale.unsqueeze(-1) / gs)
    return decoded.reshape(rows, k).to(x.dtype)


def marlin_scale_factor(histogram: torch.Tensor) -> float:
    """vLLM 0.33.0's power-of-two factor for one fused GEMM of a layer (BF16 activations), from the
    `scale_histogram` of all its E4M3 block scales (summed over the GEMM's projections): the largest
    non-zero scale times the factor lands in (224, 448]; 1 when it is 448 already (or every scale is
    zero). fp16 activations get no factor."""
    counts = histogram.tolist()
    # positive E4M3 bytes (0x01-0x7E) order as their values: the largest is the highest one present
    top = max((b for b in range(1, _E4M3_NAN) if counts[b]), default=0)
    return marlin_factor(_E4M3_VALUES[top])


def scale_histogram(scales: torch.Tensor) -> torch.Tensor:
    """int64 [256]: how many of these E4M3 block scales hold each byte value (one pass, no float
    copy: a layer's scales as float32 would be GBs)."""
    return torch.bincount(scales.view(torch.uint8).reshape(-1), minlength=256).cpu()


def marlin_factor(largest: float) -> float:
    """The factor for a fused GEMM whose largest block scale is `largest` (0: no non-zero scale)."""
    if largest == 0 or largest >= E4M3_MAX:
        return 1.0
    # 448 / largest is a power of two only for mantissa 1.75, where floor(log2) is exact anyway.
    return 2.0 ** math.floor(math.log2(E4M3_MAX / largest))


def marlin_flush(scales: torch.Tensor, factor: float) -> tuple[torch.Tensor, int]:
    """(E4M3 bytes with the blocks Marlin zeroes set to 0, how many were non-zero before). Negative
    scales, which Marlin's format cannot hold, are zeroed too."""
    b = scales.view(torch.uint8)
    flushed = torch.zeros_like(b, dtype=torch.bool)
    for r in _flushed_bytes(factor):
        flushed |= (b >= r.start) & (b < r.stop)
    return torch.where(flushed, torch.zeros_like(scales), scales), int(flushed.sum())


def marlin_flushed_blocks(histogram: torch.Tensor, factor: float) -> int:
    """How many blocks `marlin_flush` zeroes, from the scales' `scale_histogram`."""
    counts = histogram.tolist()
    return sum(sum(counts[r.start:r.stop]) for r in _flushed_bytes(factor))


def _flushed_bytes(factor: float) -> tuple[range, range]:
    """The E4M3 bytes Marlin zeroes under `factor`: the positive ones whose value times the factor
    is below MARLIN_MIN_SCALE, which (positive bytes order as their values) are those below the
    smallest it keeps; and every negative one but -0 and NaN. The float rule over all 256 bytes is
    the test's oracle."""
    kept = next((x for x in range(1, _E4M3_NAN) if _E4M3_VALUES[x] * factor >= MARLIN_MIN_SCALE), _E4M3_NAN)
    return range(1, kept), range(0x81, 0x80 | _E4M3_NAN)


# MXFP8 activations ---------------------------------------------------------------------------
# The rule, as read in the pinned wheels (flashinfer_python-0.7.2, sglang-0.5.23):
# - SGLang sm_120: srt/layers/moe/moe_runner/flashinfer_cutlass.py:541-547 quantizes the routed
#   input with flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=32) (backend
#   "cuda") when the MXFP4 method (srt/layers/quantization/mxfp4_flashinfer_cutlass_moe.py:41,
#   `_use_mxfp8_act_scaling = is_sm120`) sets a weight global scale; sm_100:
#   srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py:28 and 359-372 call the same function
#   with backend "cute-dsl" (precision "default"; "bf16" would keep BF16 activations).
# - "cuda" backend: data/csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh:853-920,
#   cvt_warp_fp16_to_mxfp8: amax of the 32 BF16 values; SF = amax * rcp.approx(448);
#   __nv_cvt_float_to_e8m0(SF, __NV_SATFINITE, cudaRoundPosInf), i.e. the exponent rounded UP;
#   values times 1/SF, clamped to +-448, then cvt.rn.satfinite to E4M3 (round to nearest even).
# - "cute-dsl" backend: quantization/kernels/mxfp8_quantize.py:359-366 with
#   quantization/quantization_cute_dsl_utils.py:42 (INV_FLOAT8_E4M3_MAX = 1/448 as float32) and
#   159-242 (float_to_ue8m0_fast: biased float32 exponent of amax/448, +1 when its mantissa is
#   non-zero except for subnormals <= 2^-127, clamped to 254, 0 for zero; inverse scale
#   2^(127 - code), 0 for code 0). The host reference data/csrc/nv_internal/tensorrt_llm/thop/
#   fp8Quantize.cpp:79-92 (float_to_ue8m0) is the same round-up.
# - The w2 (down) input: on sm_120 FlashInfer's CUTLASS MoE quantizes it inside its activation
#   kernel (data/csrc/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh:2572-2583 calling
#   quantizePackedFPXValue, 1086-1133, which rounds the FP32 activation to BF16 and calls the same
#   cvt_warp_fp16_to_mxfp8): the same rule on bf16(act(gate, up)), with no per-tensor scale
#   (quant_scale 1). On sm_100 the TRT-LLM MoE kernels are precompiled cubins, not in the wheel:
#   that they quantize the w2 input the same way is assumed, not read.
# Modelled here as float32 arithmetic: amax * float32(1/448) rounded to float32 (rcp.approx of
# 448 is taken to be the correctly rounded 1/448, which the cute-dsl kernel uses by construction),
# then the E8M0 round-up on its bits. A block whose code is 0 (amax <= 448 * 2^-127: an all-zero
# block, in practice) quantizes to zeros, as the cute-dsl kernel and the "cuda" kernel's
# SFValue != 0 guard do.
MXFP8_BLOCK = mxfp4.BLOCK           # one E8M0 scale per 32 values, as every OCP MX format
_INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)


def mxfp8_scale_codes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (int32) for blocks whose absolute maxima (float32) are `amax`: the exponent of
    amax / 448 rounded up, as FlashInfer's `float_to_ue8m0`."""
    sf = amax.float() * _INV_E4M3_MAX.to(amax.device)
    bits = sf.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = (mantissa != 0) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = (exponent + bump.int()).clamp(max=254)
    return torch.where(sf > 0, code, torch.zeros_like(code))


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [T, K] float32, E8M0 codes [T, K/32] uint8) of activations x [T, K] (BF16)."""
    rows, k = x.shape
    if k % MXFP8_BLOCK:
        raise ValueError(f"activation width {k} is not a multiple of {MXFP8_BLOCK}")
    blocks = x.float().reshape(rows, k // MXFP8_BLOCK, MXFP8_BLOCK)
    code = mxfp8_scale_codes(blocks.abs().amax(-1, keepdim=True))
    # 2^(127 - code) built on the bits (exponent field 254 - code); 0 for code 0
    inverse = ((254 - code).clamp(min=0) << 23).view(torch.float32)
    inverse = torch.where(code == 0, torch.zeros_like(inverse), inverse)
    scaled = (blocks * inverse).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float8_e4m3fn).float()
    return values.reshape(rows, k), code.squeeze(-1).to(torch.uint8)


def mxfp8_scales(codes: torch.Tensor) -> torch.Tensor:
    """float32 2^(code - 127) of E8M0 codes (0..254)."""
    return torch.exp2(codes.float() - mxfp4.E8M0_BIAS)


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] quantized to MXFP8 and decoded again, float32 (exact: E4M3 times a power of two):
    what a W4A8 GEMM multiplies the MXFP4 weights with."""
    rows, k = x.shape
    values, codes = quantize_mxfp8(x)
    decoded = values.reshape(rows, k // MXFP8_BLOCK, MXFP8_BLOCK) * mxfp8_scales(codes).unsqueeze(-1)
    return decoded.reshape(rows, k)
