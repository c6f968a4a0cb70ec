"""engines.serve_paths.compare_paths on a small synthetic checkpoint: plausible ordering, agreement with validate
on a real conversion, and the W4A8 path against a plain dequant-and-matmul recomputation."""

import math

import pytest
import torch

from requant import synth
from requant.convert import convert
from requant.engines.serve_paths import compare_paths
from requant.targets import Options

DIMS = synth.Dims(layers=3, experts=8, hidden=256, intermediate=128)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    exact, hard = str(root / "exact"), str(root / "hard")
    synth.write_checkpoint(exact, DIMS, seed=4)
    synth.write_checkpoint(hard, DIMS, seed=4, hard=synth.HardCases(out_of_window=3))
    return exact, hard, root


def test_ordering_on_a_lossless_source(source):
    exact, _, _ = source
    r = compare_paths(exact, "1,2", tokens=24)
    assert [layer["block"] for layer in r["layers"]] == ["layers.1", "layers.2"]
    for layer in r["layers"] + [r["overall"]]:
        res = layer["results"]
        # the reference is itself; the lossless NVFP4 cast decodes to the same weights: identical output
        assert res["mxfp4:bf16"]["rel_err"] == 0 and res["mxfp4:bf16"]["sqnr_db"] is None
        assert res["nvfp4:bf16"]["rel_err"] == 0 and res["nvfp4:bf16"]["routed_rel_err"] == 0
        assert res["nvfp4:marlin-w4a16"]["routed_rel_err"] == 0     # no block below 2^-6: nothing flushed
        assert "nvfp4:bf16" in layer["exact"] and layer["closest"]["rel_err"] == 0
        # lossy paths are lossy, in the expected order
        g32, g128 = res["w4a16-g32-sym:bf16"], res["w4a16-g128-sym:bf16"]
        assert 0 < g32["routed_rel_err"] < g128["routed_rel_err"] < 0.5
        w4a8 = res["mxfp4:mxfp4-w4a8"]["routed_rel_err"]
        w4a4 = [res[f"nvfp4:nvfp4-w4a4:{p}"]["routed_rel_err"] for p in ("written", "1.0", "calibrated")]
        assert 0.005 < w4a8 < min(w4a4)          # E4M3 activations beat E2M1 ones
        best = layer["closest_inexact"]
        assert best["path"] == "mxfp4:mxfp4-w4a8" and best["margin_db"] > 3
        assert best["margin_db"] == pytest.approx(res[best["path"]]["sqnr_db"] - res[best["next"]]["sqnr_db"])
        assert layer["ranking"][0] in layer["exact"] and "mxfp4:bf16" not in layer["ranking"]
        for v in res.values():
            if v["sqnr_db"] is not None:
                assert v["sqnr_db"] == pytest.approx(-20 * math.log10(v["rel_err"]), rel=1e-9)


def test_agrees_with_validate_on_the_written_conversion(source, tmp_path):
    """The in-memory NVFP4 cast and its serving modes give what validate measures on the checkpoint
    convert writes (blocks below the window included: Marlin flushes them)."""
    from requant.validate import validate

    _, hard, _ = source
    dst = str(tmp_path / "nvfp4")
    convert(hard, dst, "nvfp4", Options(), progress=False)
    paths = compare_paths(hard, "2", tokens=12)["layers"][0]["results"]
    v = validate(hard, dst, layers="2", tokens=12, device="cpu", progress=False, kernel=False,
                 serve_modes=["nvfp4-w4a4", "marlin-w4a16", "mxfp4-w4a8", "bf16"])
    served = {(s.mode, s.policy, s.side): s for s in v.layers[0].serving}
    assert served[("marlin-w4a16", None, "candidate")].flushed_blocks > 0
    pairs = {("nvfp4-w4a4", "written", "candidate"): "nvfp4:nvfp4-w4a4:written",
             ("nvfp4-w4a4", "1.0", "candidate"): "nvfp4:nvfp4-w4a4:1.0",
             ("marlin-w4a16", None, "candidate"): "nvfp4:marlin-w4a16",
             ("bf16", None, "candidate"): "nvfp4:bf16",
             ("mxfp4-w4a8", None, "source"): "mxfp4:mxfp4-w4a8"}
    for key, name in pairs.items():
        assert served[key].routed_rel_err == pytest.approx(paths[name]["routed_rel_err"], rel=1e-6, abs=1e-12), name
        assert served[key].rel_err == pytest.approx(paths[name]["rel_err"], rel=1e-6, abs=1e-12), name


def test_expert_subset_and_refusals(source):
    exact, _, _ = source
    r = compare_paths(exact, ["layers.1"], tokens=16, experts=3)
    layer = r["layers"][0]
    assert layer["experts_computed"] == 3 and layer["pairs_dropped"] > 0
    assert layer["pairs"] + layer["pairs_dropped"] == 16 * DIMS.top_k
    from requant.errors import RequantError
    with pytest.raises(RequantError):
        compare_paths(exact, [], tokens=4)
