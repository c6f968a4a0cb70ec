"""report/compare.c against the torch passes it replaces on a CPU (weights.compare_chunks over the
codecs' own decoders): every count equal, the sums to float32 accuracy; its AVX2 and portable paths
bit-equal; and the torch passes taking over, saying why, where no library builds."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

import requant.c_helpers
from requant import formats
from requant.formats import int4
from requant.report import c_compare, weights

pytestmark = pytest.mark.skipif(not c_compare.available(), reason=f"the C comparison is unavailable here: {c_compare.status()}")

ROWS, K = 24, 512


def _forget():
    """Look for the library again (the environment changed)."""
    requant.c_helpers.load.cache_clear()
    c_compare._library.cache_clear()


def _mxfp4(g, rows=ROWS, k=K):
    scale = torch.randint(118, 128, (rows, k // 32), generator=g, dtype=torch.uint8)
    scale[0, 0] = 0   # 2^-127: subnormal values and errors
    return {"weight": torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8).view(torch.int8),
            "scale": scale.view(torch.float8_e8m0fnu)}


def _w4a16(g, group, asym, rows=ROWS, k=K):
    parts = {"weight_packed": torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8).view(torch.int32),
             "weight_scale": (torch.rand(rows, k // group, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)}
    if asym:
        parts["weight_zero_point"] = int4.pack_zero_point(torch.randint(-8, 8, (rows, k // group), generator=g))
    return parts


def _nvfp4(g, rows=ROWS, k=K):
    scale = torch.randint(0, 0x7F, (rows, k // 16), generator=g, dtype=torch.uint8)   # E4M3 below its NaN
    return {"weight": torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8),
            "weight_scale": scale.view(torch.float8_e4m3fn), "weight_scale_2": torch.tensor([2.0 ** -9])}


def _torch_sums(ca, ta, cb, tb, block):
    return weights.compare_chunks(weights.decoded_row_chunks(ca, ta, cb, tb, ca.decode, cb.decode), block)


def _assert_same(c, t):
    """c (compare.c) against t (the torch passes): counts equal, sums within float32 dot accuracy."""
    for name in ("n", "blocks", "exact_blocks", "nonfinite", "zero_error", "hist", "max_abs"):
        assert getattr(c, name) == getattr(t, name), name
    for name in ("sum_a2", "sum_e2"):
        assert getattr(c, name) == pytest.approx(getattr(t, name), rel=1e-5, abs=1e-30), name
    # derived from sum(a^2) and sum(e a): accurate to their size
    for name in ("sum_b2", "sum_e_apb"):
        assert getattr(c, name) == pytest.approx(getattr(t, name), abs=1e-5 * (t.sum_a2 + t.sum_e2)), name


def _mostly_equal(g, src):
    """An MXFP4 copy of src that differs in a few bytes: exact blocks, zero errors, -0 against +0."""
    out = {n: t.clone() for n, t in src.items()}
    w = out["weight"].view(torch.uint8)
    w[1:3] ^= 0x88 * (w[1:3] & 0x77 == 0)            # +0 <-> -0 codes: equal values
    w[5, ::7] = torch.randint(0, 256, w[5, ::7].shape, generator=g, dtype=torch.uint8)
    out["scale"].view(torch.uint8)[7, 3] += 1
    return out


CASES = ["w4a16-g32-sym", "w4a16-g64-asym", "w4a16-g128-sym", "w4a16-g128-asym", "nvfp4", "mxfp4-mostly-equal"]


def _case(name, g):
    a = _mxfp4(g)
    if name == "nvfp4":
        return a, formats.get("nvfp4"), _nvfp4(g)
    if name == "mxfp4-mostly-equal":
        return a, formats.get("mxfp4"), _mostly_equal(g, a)
    _, group, scheme = name.split("-")
    return a, formats.get("w4a16"), _w4a16(g, int(group[1:]), scheme == "asym")


@pytest.mark.parametrize("case", CASES)
def test_the_c_pass_counts_what_the_torch_passes_count(case):
    g = torch.Generator().manual_seed(CASES.index(case))
    ta, cb, tb = _case(case, g)
    ca = formats.get("mxfp4")
    c = c_compare.compare(ca.nibbles(ta), cb.nibbles(tb), 32)
    t = _torch_sums(ca, ta, cb, tb, 32)
    _assert_same(c, t)
    assert c.n == ROWS * K and c.blocks == ROWS * K // 32
    if case == "mxfp4-mostly-equal":
        assert 0 < c.exact_blocks < c.blocks and c.zero_error > ROWS * K // 2
    # and against float64 numpy on the decoded values: sums in float64 over float32 lanes
    x, y = (codec.decode(parts).double().numpy() for codec, parts in ((ca, ta), (cb, tb)))
    e = (torch.from_numpy(y).float() - torch.from_numpy(x).float()).double().numpy()
    assert c.sum_e2 == pytest.approx((e * e).sum(), rel=1e-6) and c.sum_a2 == pytest.approx((x * x).sum(), rel=1e-6)


def test_non_finite_candidates_count_as_zeros_in_both():
    g = torch.Generator().manual_seed(11)
    ta, tb = _mxfp4(g), _w4a16(g, 32, False)
    tb["weight_scale"][2, 1] = float("inf")        # (q - 8) * inf: inf, and NaN where q = 8
    tb["weight_scale"][4, 0] = float("nan")
    ca, cb = formats.get("mxfp4"), formats.get("w4a16")
    c = c_compare.compare(ca.nibbles(ta), cb.nibbles(tb), 32)
    _assert_same(c, _torch_sums(ca, ta, cb, tb, 32))
    assert c.nonfinite == 64


@pytest.mark.skipif(not c_compare.status().endswith("(avx2)"), reason="this CPU has no AVX2: one path only")
@pytest.mark.parametrize("case", CASES)
def test_the_avx2_and_portable_paths_give_the_same_bits(case):
    g = torch.Generator().manual_seed(20 + CASES.index(case))
    ta, cb, tb = _case(case, g)
    if case.startswith("w4a16"):
        tb["weight_scale"][3, 0] = float("inf")    # a unit redone element by element among vector ones
    na, nb = formats.get("mxfp4").nibbles(ta), cb.nibbles(tb)
    assert c_compare.compare(na, nb, 32, vectorised=True) == c_compare.compare(na, nb, 32, vectorised=False)


def test_layouts_it_does_not_take_are_left_to_the_torch_passes():
    g = torch.Generator().manual_seed(30)
    na = formats.get("mxfp4").nibbles(_mxfp4(g))
    assert c_compare.compare(dataclasses.replace(na, group=8, scale=na.scale.repeat_interleave(4, 1)), na, 32) is None
    assert c_compare.compare(na, dataclasses.replace(na, scale=na.scale[:, :-1]), 32) is None   # shapes disagree
    assert c_compare.compare(na, na, 48) is None                                                # block across groups


def test_without_a_compiler_the_status_says_why_and_the_report_still_compares(monkeypatch, tmp_path):
    g = torch.Generator().manual_seed(40)
    ta, tb = _mxfp4(g), _w4a16(g, 64, True)
    ca, cb = formats.get("mxfp4"), formats.get("w4a16")
    with_c = c_compare.compare(ca.nibbles(ta), cb.nibbles(tb), 32)
    monkeypatch.setenv("REQUANT_CACHE_DIR", str(tmp_path / "cache"))
    try:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        _forget()
        assert c_compare.status() == f"torch: no C compiler ({tmp_path / 'no-such-cc'} not found)"
        assert c_compare.compare(ca.nibbles(ta), cb.nibbles(tb), 32) is None
        monkeypatch.setenv("REQUANT_NATIVE", "0")
        _forget()
        assert c_compare.status() == "torch: REQUANT_NATIVE=0"
        monkeypatch.delenv("REQUANT_NATIVE")
        monkeypatch.delenv("CC")
        _forget()   # a fresh cache directory: built there, whole
        assert c_compare.status().startswith("c (")
        built = os.listdir(tmp_path / "cache" / "native")
        assert len(built) == 1 and built[0].startswith("compare-") and built[0].endswith(".so")
        assert c_compare.compare(ca.nibbles(ta), cb.nibbles(tb), 32) == with_c
    finally:
        monkeypatch.undo()
        _forget()


def test_the_report_says_which_comparison_ran(tmp_path, monkeypatch):
    from requant.convert import convert
    from requant.report import build
    from requant.synth import Dims, write_checkpoint
    from requant.targets import Options
    from requant.targets.w4a16 import W4A16Options

    src, dst = str(tmp_path / "src"), str(tmp_path / "w4")
    write_checkpoint(src, Dims(layers=1, experts=6, hidden=128, intermediate=128))
    convert(src, dst, "w4a16", Options(target=W4A16Options(group_size=32)), progress=False)
    fast = build.build(src, dst, workers=1, progress=False, device="cpu")
    monkeypatch.setenv("REQUANT_NATIVE", "0")
    _forget()
    try:
        slow = build.build(src, dst, workers=1, progress=False, device="cpu")
    finally:
        monkeypatch.undo()
        _forget()
    assert fast["timing"]["comparison"].startswith("c (") and slow["timing"]["comparison"] == "torch: REQUANT_NATIVE=0"
    for key in ("elements", "blocks", "exact_blocks", "max_abs_error", "nonfinite"):
        assert fast["overall"][key] == slow["overall"][key]
    assert fast["overall"]["sqnr_db"] == pytest.approx(slow["overall"]["sqnr_db"], abs=1e-4)
    assert fast["error_histogram"] == slow["error_histogram"]
    assert math.isfinite(fast["overall"]["sqnr_db"])
