"""formats/int4_encode.c against the torch passes it replaces on a CPU (int4_search._search, the same
tables): the same codes, scale bits, zero points and energies for every group size and scheme,
hard cases and the E8M0 range's ends included; its AVX2 and portable paths equal; and the torch
passes taking over, saying why, where no library builds."""

from __future__ import annotations

import functools

import pytest
import torch

import requant.c_helpers
from requant.formats import int4, int4_search, int4_search_c
from requant.synth import HardCases, _Values
from tests.helpers.encodings import same_encoding

pytestmark = pytest.mark.skipif(int4_search_c.status().startswith("torch"),
                                reason=f"the C encoder is unavailable here: {int4_search_c.status()}")


def _realistic(rows=64, k=1024):
    """Trained-layer-like MXFP4 with planted zero, -0 and far-below blocks."""
    w, s = _Values(3, HardCases(out_of_window=40, zero_blocks=40, neg_zero_blocks=40)).expert(rows, k, pooled=False)
    return w, s


def _extreme(rows=64, k=1024):
    """Random codes under E8M0 exponents across the whole range (0 and 254 included): subnormal,
    huge and overflowing scales, groups mixing blocks far apart."""
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 255, (rows, k // 32), generator=g, dtype=torch.uint8)
    s[0, :4], s[1, :4], s[2, ::2] = 0, 254, 1
    w[3] = 0x88   # -0 codes only
    return w.view(torch.int8), s.view(torch.float8_e8m0fnu)


def _encoded(monkeypatch, w, s, group, scheme, encode=None):
    with monkeypatch.context() as m:
        if encode is not None:
            m.setattr(int4_search_c, "encode", encode)
        return int4_search.encode_mxfp4(w, s, group, scheme)


@pytest.mark.parametrize("source", [_realistic, _extreme])
@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_the_c_encoder_writes_the_torch_passes_bytes(monkeypatch, source, group, scheme):
    w, s = source()
    calls = []
    real = int4_search_c.encode

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    c = _encoded(monkeypatch, w, s, group, scheme, counted)
    assert calls, "the C pass did not run"
    t = _encoded(monkeypatch, w, s, group, scheme, lambda *a, **k: None)
    assert same_encoding(c, t)
    assert c.error_energy > 0 and torch.isfinite(int4.decode(c.packed, c.scale, c.zero_point)).any()


@pytest.mark.skipif(not int4_search_c.status().endswith("(avx2)"), reason="this CPU has no AVX2: one path only")
@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_the_avx2_and_portable_paths_agree(monkeypatch, scheme):
    w, s = _realistic()
    vector = _encoded(monkeypatch, w, s, 32, scheme)
    portable = _encoded(monkeypatch, w, s, 32, scheme, functools.partial(int4_search_c.encode, vectorised=False))
    assert same_encoding(vector, portable)


def test_the_exhaustive_oracle_stays_in_torch(monkeypatch):
    w, s = _realistic(16, 256)
    monkeypatch.setattr(int4_search_c, "encode", lambda *a, **k: pytest.fail("the C pass ran for the oracle"))
    int4_search.encode_mxfp4(w, s, 32, "asym", exhaustive=True)


def test_without_the_library_the_torch_passes_encode_and_say_why(monkeypatch):
    w, s = _realistic(16, 256)
    before = int4_search.encode_mxfp4(w, s, 32, "sym")
    monkeypatch.setenv("REQUANT_NATIVE", "0")
    requant.c_helpers.load.cache_clear()
    int4_search_c._library.cache_clear()
    try:
        assert int4_search_c.status() == "torch: REQUANT_NATIVE=0"
        assert int4_search.ready_cpu("sym") == "torch: REQUANT_NATIVE=0"
        assert same_encoding(int4_search.encode_mxfp4(w, s, 32, "sym"), before)
    finally:
        monkeypatch.delenv("REQUANT_NATIVE")
        requant.c_helpers.load.cache_clear()
        int4_search_c._library.cache_clear()
    assert int4_search_c.status().startswith("c (")
