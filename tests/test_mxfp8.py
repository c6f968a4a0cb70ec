"""MXFP8 activation quantization (engines.numerics, FlashInfer 0.7.2's mxfp8_quantize rule)
against a straightforward torch quantizer written here from the rule's statement: per 32 values
along K, scale 2^ceil(log2(amax / 448)) (E8M0, 2^-127 .. 2^127; a block whose amax / 448 is at
most 2^-127 gets code 0 and quantizes to zeros), values / scale rounded to E4M3 (nearest, ties to
even) by torch.float8_e4m3fn."""

import math

import pytest
import torch

from requant.engines import numerics as en

BLOCK = 32


def reference_codes(x: torch.Tensor) -> torch.Tensor:
    """int64 E8M0 codes [T, K/32] of x [T, K]: float64 arithmetic, frexp for the exponent."""
    amax = x.double().abs().reshape(x.shape[0], -1, BLOCK).amax(-1)
    codes = torch.zeros_like(amax, dtype=torch.int64)
    for i, a in enumerate(amax.reshape(-1).tolist()):
        ratio = a / 448.0
        if ratio <= 2.0**-127:           # zero (or a block too small for any E8M0 scale)
            continue
        mantissa, exponent = math.frexp(ratio)   # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
        e = exponent - 1 if mantissa == 0.5 else exponent   # ceil(log2(ratio))
        codes.view(-1)[i] = min(e, 127) + 127
    return codes


def reference_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] quantized to MXFP8 and decoded, float32."""
    rows, k = x.shape
    codes = reference_codes(x)
    scale = torch.exp2(codes.double() - 127)
    blocks = x.double().reshape(rows, -1, BLOCK)
    scaled = torch.where((codes == 0)[..., None], blocks * 0.0, blocks / scale[..., None])
    e4m3 = scaled.float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (e4m3 * scale[..., None]).float().reshape(rows, k)


def edge_activations() -> torch.Tensor:
    """BF16 rows: random blocks over 2^-140 .. 2^100 plus one block per edge case."""
    gen = torch.Generator().manual_seed(7)
    rows, k = 16, 32 * 24
    x = torch.randn(rows, k, generator=gen)
    x *= torch.exp2(torch.randint(-140, 100, (rows, k // BLOCK, 1), generator=gen).float()).expand(
        -1, -1, BLOCK).reshape(rows, k)
    b = x.reshape(rows, -1, BLOCK)
    b[0, 0] = 0.0                                        # all-zero block
    b[0, 1] = -0.0                                       # all negative zeros
    b[0, 2] = torch.linspace(-1, 1, BLOCK); b[0, 2, 5] = -0.0; b[0, 2, 0] = 32.0     # amax a power of two
    b[0, 3] = torch.linspace(-3, 3, BLOCK); b[0, 3, 0] = 448.0                       # amax 448 exactly
    b[0, 4] = torch.linspace(-3, 3, BLOCK) * 2.0**-20; b[0, 4, 0] = -448.0 * 2.0**-20           # 448 * 2^k, negative
    b[0, 5] = torch.linspace(-3, 3, BLOCK); b[0, 5, 0] = 464.0   # rounded to nearest, 2^0 would overflow 448
    b[0, 6] = torch.linspace(-3, 3, BLOCK); b[0, 6, 0] = 450.0
    b[0, 7] = torch.full((BLOCK,), 1.0); b[0, 7, 0] = 448.0; b[0, 7, 1:4] = torch.tensor([432.0, 0.01, 2.0**-10])
    b[0, 8] = torch.full((BLOCK,), 2.0**-130)            # BF16 subnormals: below any E8M0 scale, to zero
    b[0, 9] = torch.full((BLOCK,), 1.75 * 2.0**-119)     # amax / 448 = 2^-127 exactly: code 0, zeros
    b[0, 10] = torch.full((BLOCK,), 2.0**-118)           # amax / 448 = 2^-126.8: code 1 (2^-126)
    b[0, 11] = torch.full((BLOCK,), 3.0e38)              # near BF16's largest
    b[0, 12] = torch.linspace(-1, 1, BLOCK) * 2.0**-9; b[0, 12, 0] = 448.0 * 2.0**-3   # E4M3 subnormals
    return x.bfloat16()


def test_mxfp8_matches_the_plain_reference_bit_for_bit():
    x = edge_activations()
    values, codes = en.quantize_mxfp8(x)
    ref_codes = reference_codes(x)
    assert torch.equal(codes.long(), ref_codes)
    ours = en.fake_quantize_mxfp8(x)
    ref = reference_mxfp8(x)
    assert ours.dtype == torch.float32 and torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # -0 kept
    assert values.abs().max() <= 448
    c = codes[0].tolist()
    # the edge cases land where the rule says
    assert c[0] == c[1] == c[8] == c[9] == 0 and c[10] == 1
    assert c[2] == 127 - 3            # 32 / 448 -> 2^-3.8 -> 2^-3: the block's 32 becomes 256
    assert c[3] == 127 and c[4] == 127 - 20 and values[0, 3 * 32] == 448 and values[0, 4 * 32] == -448
    assert c[5] == c[6] == 128        # 464 and 450: rounded up to 2^1, so 232 and 225 , not past 448
    assert values[0, 5 * 32] == values[0, 6 * 32] == 224   # 232 (a tie) and 225 round to E4M3 224
    assert ours[0, 8 * 32:10 * 32].eq(0).all() and ours[0, 10 * 32] == 2.0**-118
    assert torch.signbit(ours[0, 32:64]).all() and torch.signbit(ours[0, 2 * 32 + 5])
    # E4M3 subnormals (steps of 2^-9 below 2^-6) in block 12, ties to even in block 7: 432 -> 448
    assert values[0, 7 * 32 + 1] == 448 and values[0, 7 * 32 + 3] == 0 and values[0, 7 * 32 + 2] == 0.009765625
    sub = values[0, 12 * 32:13 * 32].abs()
    assert ((sub > 0) & (sub < 2.0**-6)).any()
    assert not ours.isnan().any() and ours[0, 11 * 32] == pytest.approx(3.0e38, rel=0.07)


def test_reference_rounding_primitive_is_round_half_even():
    """The E4M3 cast both sides use: ties to even, subnormals included, saturating under the clamp."""
    v = torch.tensor([2.0**-10, 3 * 2.0**-10, 2.0**-9 * 1.5, 17.0, 19.0, 432.0, 440.0, -0.0])
    expect = torch.tensor([0.0, 2 * 2.0**-9, 2 * 2.0**-9, 16.0, 20.0, 448.0, 448.0, -0.0])
    got = v.to(torch.float8_e4m3fn).float()
    assert torch.equal(got.view(torch.int32), expect.view(torch.int32))


def test_random_activations_every_scale_and_error_size():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 4096, generator=gen) * torch.exp2(torch.randint(-12, 12, (64, 1), generator=gen).float())
         ).bfloat16()
    ours, ref = en.fake_quantize_mxfp8(x), reference_mxfp8(x)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    rel = float((ours - x.float()).norm() / x.float().norm())
    assert 0.005 < rel < 0.04      # E4M3's 3 mantissa bits on Gaussian blocks


def test_a_nearest_exponent_rule_would_differ():
    """The test can fail: rounding the exponent to nearest (not up) changes codes on these inputs."""
    x = edge_activations()
    amax = x.float().abs().reshape(x.shape[0], -1, BLOCK).amax(-1)
    nearest = torch.round(torch.log2(amax / 448)) + 127
    assert not torch.equal(nearest[amax > 2.0**-100].long(), reference_codes(x)[amax > 2.0**-100])


def test_width_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError):
        en.quantize_mxfp8(torch.zeros(2, 48, dtype=torch.bfloat16))
