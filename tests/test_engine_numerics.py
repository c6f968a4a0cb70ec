"""requant's emulation of the engines' run-time NVFP4 numerics against vLLM 0.33.0's own functions,
executed from the pinned wheel (tests/engines/wheels.py): W4A4 activation quantization bit for bit,
and Marlin's fp16 block-scale processing (factor and flush rule)."""

from types import SimpleNamespace

import pytest
import torch

from engines import wheels
from requant.engines import numerics as en
from requant.formats.e2m1 import MAGNITUDES

EMULATION = "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py"
MARLIN = "vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py"

needs_vllm = pytest.mark.skipif(not wheels.available("vllm"),
                                reason=f"vllm=={wheels.ENGINES['vllm']} wheel not available (no network?)")


@pytest.fixture(scope="module")
def vllm_quantizer():
    # Stand-ins for what the module imports: E2M1's largest value, and a platform without CUDA so
    # the reference path (not the Triton kernel) runs.
    ns = {"torch": torch, "scalar_types": SimpleNamespace(float4_e2m1f=SimpleNamespace(max=lambda: 6.0)),
          "current_platform": SimpleNamespace(is_cuda_alike=lambda: False)}
    return wheels.extract("vllm", EMULATION, ["FLOAT4_E2M1_MAX", "FLOAT4_E2M1_MAX_RECIPROCAL", "get_reciprocal",
                                              "cast_to_fp4", "ref_nvfp4_quant", "ref_nvfp4_quant_dequant"], ns)


@pytest.fixture(scope="module")
def vllm_marlin():
    ns = {"torch": torch, "logger": SimpleNamespace(warning_once=lambda *a, **k: None)}
    return wheels.extract("vllm", MARLIN, ["_nvfp4_compute_scale_factor", "nvfp4_marlin_process_scales"], ns)


def hard_activations(gen: torch.Generator) -> torch.Tensor:
    """BF16 rows of 16-blocks spanning 2^-40 .. 2^12 in magnitude, with zero blocks, -0, exact E2M1
    ties after scaling, and outliers that saturate the E4M3 scale."""
    rows, k = 24, 512
    x = torch.randn(rows, k, generator=gen)
    x *= torch.exp2(torch.randint(-40, 13, (rows, k // 16, 1), generator=gen).float()).repeat_interleave(16, 1)[..., 0]
    x[0, :16] = 0
    x[1, :16] = -0.0
    x[2, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -5.0, 1e-30])
    x[3] *= 1e6
    return x.bfloat16()


@needs_vllm
@pytest.mark.parametrize("input_scale", [1.0, 0.0238, 3.1e-5, 17.0])
def test_w4a4_activations_bit_equal_to_vllm(vllm_quantizer, input_scale):
    gen = torch.Generator().manual_seed(int(input_scale * 1e6))
    x = hard_activations(gen)
    gs = torch.tensor([1.0], dtype=torch.float32) / torch.tensor([input_scale], dtype=torch.float32)
    ref_values, ref_scale = vllm_quantizer["ref_nvfp4_quant"](x, gs, 16)
    values, scale = en.quantize_activations(x, en.activation_global_scale(input_scale))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32))
    ref = vllm_quantizer["ref_nvfp4_quant_dequant"](x, gs, 16)
    ours = en.fake_quantize_activations(x, input_scale)
    assert ours.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))   # bit-equal, signed zeros included
    # Not vacuous: the inputs reach zero, subnormal, saturated and mid-range block scales.
    assert (scale == 0).any() and (scale == 448).any() and ((scale > 0) & (scale < 2**-6)).any()
    assert len(set(values.abs().unique().tolist())) == len(MAGNITUDES)


def test_round_e2m1_is_round_half_to_even():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, -0.2, -0.0, 6.0])
    expect = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, -0.0, 0.0, 6.0])
    got = en.round_e2m1(x)
    assert torch.equal(got.view(torch.int32), expect.view(torch.int32))


def e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn).view(torch.uint8)


def random_scales(gen, experts, rows, cols, low, high) -> torch.Tensor:
    """E4M3 bytes of 2^[low, high] times any mantissa, subnormals and zeros included."""
    exp = torch.randint(low, high + 1, (experts, rows, cols), generator=gen).float()
    mant = 1 + torch.randint(0, 8, (experts, rows, cols), generator=gen).float() / 8
    v = (mant * torch.exp2(exp)).clamp(max=448)
    v[torch.rand(v.shape, generator=gen) < 0.02] = 0
    return e4m3_bytes(v)


def decode_marlin(out: torch.Tensor, factor: float) -> torch.Tensor:
    """vLLM's processed scales (S0E5M3: the high byte of fp16 bits << 1) back to the values they
    stand for, in the original column order."""
    half = (out.view(torch.uint8).to(torch.int16) << 7).view(torch.float16).float() / 2**7 / factor
    return half.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(half.shape)


@pytest.mark.parametrize("factor", [2.0**k for k in range(0, 12)])
def test_marlin_flush_on_bytes_is_the_float_rule(factor):
    """Every E4M3 byte (NaNs, both zeros, negatives included) is flushed exactly when its value is
    non-zero and, times the factor, below 2^-6; the largest positive scale ignores NaNs and negatives."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    v = b.view(torch.float8_e4m3fn).float()
    expect = (v != 0) & (v * factor < en.MARLIN_MIN_SCALE)
    out, flushed = en.marlin_flush(b, factor)
    assert torch.equal(out, torch.where(expect, 0, b).to(torch.uint8)) and flushed == int(expect.sum())
    assert en.marlin_flushed_blocks(en.scale_histogram(b), factor) == flushed
    assert en.marlin_scale_factor(en.scale_histogram(b)) == en.marlin_factor(float(torch.where(v > 0, v, 0).max()))
    some = b.reshape(-1)[[0x80, 0x7F, 0xFF, 0x05, 0x3A, 0x85]]   # -0, NaNs, a negative: largest is 0x3A's
    assert en.marlin_scale_factor(en.scale_histogram(some)) == en.marlin_factor(
        float(some[4:5].view(torch.float8_e4m3fn).float()))


@needs_vllm
@pytest.mark.parametrize("low,high", [(-14, 8), (-9, 8), (-12, 3), (-9, -5)])
def test_marlin_flush_matches_vllm(vllm_marlin, low, high):
    """Scales as requant's cast writes them (largest 2^8) and as other exporters do (largest below
    224, so the factor is > 1): requant's factor and flushed scales are vLLM's."""
    gen = torch.Generator().manual_seed(high - low)
    w1, w3 = (random_scales(gen, 4, 32, 8, low, high) for _ in range(2))
    w13 = torch.cat([w1, w3], 1)
    bf16 = lambda b: b.view(torch.float8_e4m3fn).to(torch.bfloat16)  # noqa: E731  vLLM's params_dtype
    ref_factor = vllm_marlin["_nvfp4_compute_scale_factor"](bf16(w13), torch.bfloat16)
    factor = en.marlin_scale_factor(en.scale_histogram(w1) + en.scale_histogram(w3))
    assert factor == ref_factor
    flushed_total = 0
    for e in range(w13.shape[0]):
        out, _ = vllm_marlin["nvfp4_marlin_process_scales"](bf16(w13[e]).T.contiguous(), scale_factor=ref_factor,
                                                            a_dtype=torch.bfloat16)
        ours, flushed = en.marlin_flush(w13[e], factor)
        flushed_total += flushed
        expect = ours.view(torch.float8_e4m3fn).float()
        assert torch.equal(decode_marlin(out, ref_factor).T, expect)
    if low <= -14 and high == 8:   # a span past 14 octaves under 2^8 must lose blocks
        assert flushed_total > 0
    if high < 7:
        assert factor > 1
