"""INT4 numerics: requant's packing and decode against the compressed-tensors package itself, and
the exhaustive scale search against brute force and the default search against the exhaustive one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from requant import synth
from requant.formats import int4, int4_search, mxfp4
from requant.targets.w4a16 import e8m0_to_f32


def _mxfp4(rows, k, seed, hard=synth.HardCases()):
    values = synth._Values(seed, hard)
    w, s = values.expert(rows, k, pooled=False)
    return w.view(torch.uint8), s.view(torch.uint8)


def _ct_scheme(group, scheme):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=scheme == "sym", strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def test_pack_matches_compressed_tensors():
    q = torch.randint(-8, 8, (24, 64), dtype=torch.int8)
    assert torch.equal(int4.pack(q), pack_to_int32(q, 4))
    assert torch.equal(int4.pack_zero_point(q), pack_to_int32(q, 4, packed_dim=0))
    assert torch.equal(int4.unpack(int4.pack(q)), q)
    assert torch.equal(int4.unpack_zero_point(int4.pack_zero_point(q), 24), q)


@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_compressed_tensors_decompresses_what_requant_decodes(group, scheme):
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    hard = synth.HardCases(out_of_window=2, zero_blocks=3, neg_zero_blocks=1)
    w, s = _mxfp4(64, 512, seed, hard)
    enc = int4_search.encode_mxfp4(w, s, group, scheme)
    ours = int4.decode(enc.packed, enc.scale, enc.zero_point)
    state = {"weight_packed": enc.packed, "weight_scale": enc.scale, "weight_shape": torch.tensor([64, 512])}
    if scheme == "asym":
        state["weight_zero_point"] = enc.zero_point
    theirs = PackedQuantizationCompressor.decompress(state, _ct_scheme(group, scheme))["weight"]
    assert torch.equal(theirs.float(), ours.to(theirs.dtype).float()), f"seed {seed}"
    source = mxfp4.decode(w, s).double()
    assert enc.signal_energy == pytest.approx(float(source.square().sum()), rel=1e-9)
    assert enc.error_energy == pytest.approx(float((ours.double() - source).square().sum()), rel=1e-5, abs=1e-30)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_exhaustive_search_is_the_optimum(group, scheme):
    """The oracle: no BF16 scale in the searched range (s' * 2^R, R = floor(log2 max|x|), s' in
    _SCALE_RANGE) and zero point does better on any group than the one the exhaustive search chose
    (round-to-nearest codes). Brute force on the float weights, independent of the encoder."""
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    w, s = _mxfp4(16, 256, seed)
    enc = int4_search.encode_mxfp4(w, s, group, scheme, exhaustive=True)
    x = mxfp4.decode(w, s).view(-1, group)
    ours = ((int4.decode(enc.packed, enc.scale, enc.zero_point).view(-1, group) - x).square()).sum(1)
    top = torch.exp2(torch.floor(torch.log2(x.abs().amax(1, keepdim=True))))
    bits = torch.arange(0x3000, 0x4000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    lo, hi = int4_search._SCALE_RANGE[scheme]
    best = torch.full_like(ours, math.inf)
    for z in (int4_search._ZERO_POINTS if scheme == "asym" else [0]):
        for rel in bits[(bits >= lo) & (bits <= hi)]:
            cand = top * rel                                 # a BF16 scale, group by group
            err = (((torch.clamp(torch.round(x / cand) + z, -8, 7) - z) * cand - x).square()).sum(1)
            best = torch.minimum(best, err)
    assert bool((ours <= best * (1 + 1e-5) + 1e-30).all()), f"seed {seed}"


@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_fast_search_is_within_tolerance_of_the_exhaustive_one(group, scheme):
    """The default coarse-to-fine search gives up at most 0.05 dB of SQNR against the oracle."""
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    w, s = _mxfp4(256, 2048, seed, synth.HardCases(out_of_window=2, zero_blocks=3, neg_zero_blocks=1))
    fast = int4_search.encode_mxfp4(w, s, group, scheme)
    exact = int4_search.encode_mxfp4(w, s, group, scheme, exhaustive=True)
    loss_db = 10 * math.log10(fast.error_energy / exact.error_energy)
    assert -1e-9 <= loss_db <= 0.05, (loss_db, seed)
    assert fast.signal_energy == exact.signal_energy


def test_beats_compressed_tensors_rule():
    """Against compressed-tensors' own symmetric rule (scale = amax / 7.5) on the same weights."""
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    w, s = _mxfp4(256, 1024, seed)
    x = mxfp4.decode(w, s)
    signal = float(x.double().square().sum())
    for group, sym_gain, asym_gain in ((32, 1.0, 3.0), (128, 0.7, 1.8)):
        g = x.view(256, -1, group)
        scale = (g.abs().amax(-1, keepdim=True) / 7.5).to(torch.bfloat16).float()
        ct = (torch.clamp(torch.round(g / scale), -8, 7) * scale).view_as(x)
        ct_db = 10 * math.log10(signal / float((ct - x).double().square().sum()))
        for scheme, gain in (("sym", sym_gain), ("asym", asym_gain)):
            enc = int4_search.encode_mxfp4(w, s, group, scheme)
            ours = 10 * math.log10(signal / enc.error_energy)
            assert ours >= ct_db + gain, (group, scheme, ours, ct_db, seed)


def test_e8m0_to_f32_is_exact():
    b = torch.arange(0, 255, dtype=torch.uint8)
    f = e8m0_to_f32(b)
    assert f.dtype == torch.float32
    assert [float(v) for v in f] == [2.0 ** (int(v) - 127) for v in b]

