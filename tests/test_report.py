"""requant report: numbers against an independent computation, outputs, and an offline render."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from requant.engines import serve
from requant.cli import cli
from requant.compute import kernel_device
from requant.convert import convert
from requant.report import c_compare, html, make_report, render, weights
from requant.synth import Dims, HardCases
from requant.targets import Options
from requant.targets.nvfp4 import NVFP4Options
from tests.factory import converted_pair

DIMS = Dims(layers=2, experts=6, hidden=256, intermediate=128, hash_layers=1)
ROOT = Path(__file__).resolve().parents[1]
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    src, dst = converted_pair(tmp_path_factory.mktemp("report"), DIMS, 11, HardCases(out_of_window=3, zero_blocks=1),
                              Options(engine="sglang"))   # MTP experts kept MXFP4
    return src, dst, convert


def _load(path):
    """Routed-expert tensors as numpy (1-byte dtypes as uint8), read through the safetensors package."""
    out = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():
                if ".ffn.experts." in k:
                    t = f.get_tensor(k)
                    out[k] = (t.view(torch.uint8) if t.element_size() == 1 else t).numpy()
    return out


def _nibbles(packed: np.ndarray) -> np.ndarray:
    b = packed.view(np.uint8)
    return np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1)


def _mx(t, prefix):
    scale = np.exp2(t[f"{prefix}.scale"].view(np.uint8).astype(np.float64) - 127)
    return E2M1[_nibbles(t[f"{prefix}.weight"])] * np.repeat(scale, 32, axis=1)


def _nv(t, prefix):
    s = t[f"{prefix}.weight_scale"].view(np.uint8).astype(np.int64)
    # E4M3 by hand: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals below exponent 1
    exp, man = (s >> 3) & 15, s & 7
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0))
    g = float(t[f"{prefix}.weight_scale_2"].reshape(-1)[0])
    return E2M1[_nibbles(t[f"{prefix}.weight"])] * np.repeat(val, 16, axis=1) * g


def test_numbers_match_an_independent_computation(pair, tmp_path, monkeypatch):
    src, dst, _ = pair
    monkeypatch.setattr(weights, "_CHUNK_ELEMENTS", 3 * 256 + 1)   # several row chunks, a partial last one
    report = make_report(src, dst, str(tmp_path / "r"), progress=False, forward=False)
    a, b = _load(src), _load(dst)
    prefixes = sorted({k.rsplit(".", 1)[0] for k in a if ".ffn.experts." in k})
    sa2 = se2 = sab = sb2 = 0.0
    blocks = exact = 0
    max_abs = 0.0
    hist = np.zeros(len(report["error_histogram"]["log10_abs_error_edges"]) - 1, dtype=np.int64)
    for p in prefixes:
        x = _mx(a, p)
        y = _nv(b, p) if f"{p}.weight_scale" in b else _mx(b, p)
        e = y - x
        sa2, sb2, sab, se2 = sa2 + (x * x).sum(), sb2 + (y * y).sum(), sab + (x * y).sum(), se2 + (e * e).sum()
        max_abs = max(max_abs, np.abs(e).max())
        eq = (e == 0).reshape(x.shape[0], -1, 32).all(axis=-1)
        blocks, exact = blocks + eq.size, exact + int(eq.sum())
        # bins of powers of two from 2^-40, the ends taking everything beyond
        err = np.abs(e[e != 0]).astype(np.float32)
        hist += np.bincount(np.clip(np.floor(np.log2(err)).astype(int) + 40, 0, len(hist) - 1), minlength=len(hist))
    o = report["overall"]
    assert hist.sum() > 0 and sum(np.array(c) for c in report["error_histogram"]["by_projection"].values()).tolist() \
        == hist.tolist()
    assert report["error_histogram"]["log10_abs_error_edges"][0] == pytest.approx(-40 * math.log10(2))
    assert o["blocks"] == blocks and o["exact_blocks"] == exact and 0 < blocks - exact
    assert o["sqnr_db"] == pytest.approx(10 * math.log10(sa2 / se2), rel=1e-6)
    assert o["rel_rmse"] == pytest.approx(math.sqrt(se2 / sa2), rel=1e-6)
    assert o["max_abs_error"] == pytest.approx(max_abs, rel=1e-6)
    assert o["cosine"] == pytest.approx(sab / math.sqrt(sa2 * sb2), abs=1e-12)
    # per-layer numbers add up to the overall, and the kept-MXFP4 MTP block is exact (SQNR infinite)
    assert sum(layer["metrics"]["blocks"] for layer in report["by_layer"]) == blocks
    mtp = next(layer for layer in report["by_layer"] if layer["block"] == "mtp.0")
    assert mtp["metrics"]["sqnr_db"] is None and mtp["metrics"]["exact_block_fraction"] == 1.0


def test_outputs_and_schema(pair, tmp_path):
    src, dst, _ = pair
    out = tmp_path / "r"
    run = CliRunner().invoke(cli, ["report", src, dst, "--out-dir", str(out), "--layers", "1,mtp.0", "--quiet", "--no-forward"])
    assert run.exit_code == 0, run.output
    assert "lowest SQNR: layers.1" in run.output and "forward" in run.output
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "requant.report/1"
    assert report["selection"]["blocks"] == ["layers.1", "mtp.0"]
    assert report["selection"]["experts_compared"] == 2 * DIMS.experts
    assert len(report["exact_block_map"]["fraction"]) == 2
    assert len(report["exact_block_map"]["fraction"][0]) == DIMS.experts
    assert report["forward"] == {"status": "not run", "reason": "not requested (--no-forward)"}
    assert report["paths"] == {"status": "not run", "reason": "not requested (--no-forward)"}
    edges = report["error_histogram"]["log10_abs_error_edges"]
    for proj, counts in report["error_histogram"]["by_projection"].items():
        assert len(counts) == len(edges) - 1
        m = report["by_projection"][proj]
        assert sum(counts) + report["error_histogram"]["zero_error_elements"][proj] == m["elements"]
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", (ROOT / "docs" / "report-schema.md").read_text(), re.M))
    assert set(report) <= documented and set(report["overall"]) <= documented
    md = (out / "report.md").read_text()
    assert "## Per layer" in md and "| layers.1 |" in md and "MoE forward: not run" in md
    for png in ("sqnr_per_layer.png", "error_histogram.png", "exact_block_map.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page), "the page must not load anything"
    assert page.count('src="data:image/png;base64,') == 3


def test_nvfp4_against_another_nvfp4_build(pair, tmp_path):
    src, dst, _ = pair
    safe = str(tmp_path / "safe")
    convert(src, safe, "nvfp4", Options(target=NVFP4Options(scale_headroom=3)), progress=False)
    report = make_report(dst, safe, str(tmp_path / "r"), layers="0-1", progress=False, forward=False)
    assert report["source"]["format"] == report["candidate"]["format"] == "nvfp4"
    # a narrower window re-rounds more of the planted low blocks, never fewer
    assert 0 < report["overall"]["exact_block_fraction"] < 1


def test_forward_comparison_says_what_ran_where(pair, tmp_path):
    pytest.importorskip("triton", reason="the forward comparison runs requant's kernel: pip install 'requant[gpu]'")
    out = tmp_path / "r"
    report = make_report(pair[0], pair[1], str(out), layers="1", progress=False)
    forward = report["forward"]
    # the weight comparison's device: the C pass on the CPU where it builds, GPU or not
    assert report["timing"]["comparison"] == (c_compare.status() if c_compare.available() or not torch.cuda.is_available()
                                              else "torch (cuda)")
    assert forward["status"] == "run", forward
    on_gpu = kernel_device(None) == "cuda"   # not under Triton's interpreter, which conftest sets by default
    assert forward["device"].startswith("cuda" if on_gpu else "cpu")
    assert [r["block"] for r in forward["by_layer"]] == ["layers.1"]
    # the lossless cast with a few re-rounded tiny blocks: the layer output barely moves
    assert forward["passed"] and forward["by_layer"][0]["rel_error"] < 1e-3
    assert "MoE forward on cpu" in (out / "report.md").read_text() or on_gpu
    # drawn only when some layer's output differs: a log axis has no place for identical outputs
    assert (out / "forward_error_per_layer.png").exists() == any(r["rel_error"] > 0 for r in forward["by_layer"])
    # Served numerics: what the GPU that ran it serves the candidate's format with (serve.default_modes:
    # Hopper and Ampere Marlin's W4A16, Blackwell NVFP4's W4A4 under both input_scale policies; without
    # a GPU the serving GPU is unknown: both). The source as SGLang serves it on Blackwell (MXFP8
    # activations, side "source") is the serving paths' number for this layer, listed there alone.
    served = [(s["mode"], s["policy"], s["side"]) for s in forward["by_layer"][0]["serving"]]
    capability = torch.cuda.get_device_capability() if on_gpu else None
    expected = [(m, p, "candidate") for m in serve.default_modes("nvfp4", capability)
                for p in (("written", "1.0") if m == "nvfp4-w4a4" else (None,))]
    assert served == expected, (capability, served)
    if not on_gpu:
        assert served == [("nvfp4-w4a4", "written", "candidate"), ("nvfp4-w4a4", "1.0", "candidate"),
                          ("marlin-w4a16", None, "candidate")]
    md = (out / "report.md").read_text()
    # the words above the table name the modes that ran and no other
    [words] = [line for line in md.splitlines() if line.startswith("Served numerics")]
    for mode, text in render.SERVED_MODE_WORDS.items():
        assert (text in words) == (mode in {m for m, _, _ in served}), (mode, words)
    assert served_words_in_html(out) == words
    # Serving paths: the source's first selected layer through every path, conversions in memory;
    # the in-memory cast's weight-only path is the written candidate's (same tokens), the INT4 ones
    # are lossy, g32 closer than g128.
    paths = report["paths"]
    assert paths["status"] == "run" and paths["layers"][0]["block"] == "layers.1"
    res = paths["layers"][0]["results"]
    if not on_gpu:
        assert res["nvfp4:bf16"]["rel_err"] == pytest.approx(forward["by_layer"][0]["rel_error"], rel=1e-6)
    assert res["nvfp4:bf16"]["rel_err"] < 1e-3 < res["w4a16-g32-sym:bf16"]["rel_err"] < res["w4a16-g128-sym:bf16"]["rel_err"]
    assert md.count("| mxfp4:mxfp4-w4a8 |") == 1 and "| mxfp4-w4a8 |" not in md   # one row: the paths table's
    closest = paths["layers"][0]["closest_inexact"]["path"]
    assert f"closest inexact: {closest}" in md and "| w4a16-g128-sym:bf16 |" in md
    assert "Serving paths" in (out / "report.html").read_text()


def served_words_in_html(out) -> str:
    import html

    page = (out / "report.html").read_text()
    found = re.search(r"<p>(Served numerics[^<]*)</p>", page)
    return html.unescape(found.group(1)) if found else ""


def test_unknown_layers_are_refused(pair, tmp_path):
    run = CliRunner().invoke(cli, ["report", pair[0], pair[1], "--out", str(tmp_path / "r"), "--layers", "7"])
    assert run.exit_code == 1 and "layers.7" in run.output


def _screenshot_module():
    spec = importlib.util.spec_from_file_location("screenshot_report", ROOT / "scripts" / "screenshot_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_html_renders_offline_in_chromium(pair, tmp_path):
    shot = _screenshot_module()
    if shot.find_browser() is None:
        pytest.skip("no Chromium installed (apt-get install -y chromium) to render report.html")
    from PIL import Image

    out = tmp_path / "r"
    make_report(pair[0], pair[1], str(out), progress=False, forward=False)
    png = tmp_path / "shot.png"
    shot.screenshot(str(out / "report.html"), str(png), width=1100, height=2400)
    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert image.shape[:2] == (2400, 1100)
    # the plots drew: saturated colours (lines, heat map) cover a real area, not a blank page
    saturation = image.max(axis=-1) - image.min(axis=-1)
    assert (saturation > 80).mean() > 0.02
    # the verdict box (orange: not exact) comes first, the plots and heat map well below it
    rows = np.nonzero((saturation > 80).any(axis=1))[0]
    assert rows.min() < 150 and rows.max() > 1000
    orange = (image[..., 0] > 200) & (image[..., 2] < 140) & (image[..., 1] > 150)
    assert orange[:150].any(), "no verdict box at the top of the page"


CELL_BORDER = re.compile(r"(?<!\\)\|")


def _md_tables(md: str) -> list[list[str]]:
    tables, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


@pytest.fixture(scope="module")
def exact_pair(tmp_path_factory):
    """A source without out-of-window blocks: its NVFP4 conversion is exact everywhere."""
    return converted_pair(tmp_path_factory.mktemp("exact"), DIMS, 12)


def test_markdown_tables_have_one_cell_per_column(pair, tmp_path):
    make_report(pair[0], pair[1], str(tmp_path / "r"), layers="1", progress=False)
    tables = _md_tables((tmp_path / "r" / "report.md").read_text())
    assert len(tables) == 5   # overall, per layer, forward, served numerics, serving paths
    for table in tables:
        widths = {len(CELL_BORDER.findall(row)) for row in table}
        assert widths == {len(CELL_BORDER.findall(table[0]))}, table
        assert set(table[1]) <= set("|-")


def test_exact_conversion_says_exact_and_rerun_drops_stale_plots(pair, exact_pair, tmp_path):
    out = tmp_path / "r"
    make_report(pair[0], pair[1], str(out), progress=False, forward=False)   # lossy: every error plot
    assert (out / "sqnr_per_layer.png").exists() and (out / "error_histogram.png").exists()
    run = CliRunner().invoke(cli, ["report", *exact_pair, "--out-dir", str(out), "--quiet", "--no-forward"])
    assert run.exit_code == 0, run.output
    assert run.output.startswith("Exact: every weight of the 18 experts in 3 layers decodes identically")
    assert sorted(p.name for p in out.glob("*.png")) == ["exact_block_map.png"], "stale plots of the first run"
    md = (out / "report.md").read_text()
    assert md.splitlines()[2].startswith("**Exact: every weight") and "sqnr_per_layer.png" not in md
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 1
    assert page.index("Exact: every weight") < page.index("<h2>Overall</h2>")


@pytest.mark.parametrize("largest", [0.5, 100.0])   # every |error| below 2 (exponents counted in pairs) or not
def test_compare_chunks_counts_every_error_where_numpy_does(largest):
    """Zeros of either sign, subnormal errors, exact blocks, the clamped end bins: against plain numpy."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(6, 256, generator=g) * 0.01
    b = a + torch.randn(6, 256, generator=g) * torch.logspace(-45, math.log10(largest), 256) ** 0.5 * 0.1
    b[0] = a[0]                                    # exact blocks
    b[1, :32] = a[1, :32]                          # an exact block among inexact ones
    a[2, 5], b[2, 5] = 0.0, 1e-42                  # a subnormal error
    a[3, :64] = 0.0
    b[3, :64] = -0.0                               # -0 against +0 is no error
    b[4, 7] = a[4, 7] + largest
    s = weights.compare_chunks([(a[:4], b[:4].clone()), (a[4:], b[4:].clone())], 32)   # b's chunks become errors
    e = (b.double() - a.double()).numpy()
    e32 = np.abs((b - a).numpy())
    assert s.n == e.size and s.blocks == e.size // 32
    assert s.exact_blocks == int((e32.reshape(6, -1, 32) == 0).all(-1).sum())
    assert s.zero_error == int((e32 == 0).sum()) and s.max_abs == float(e32.max())
    nz = e32[e32 != 0]
    expected = np.bincount(np.clip(np.frexp(nz)[1] - 1 - weights.HIST_MIN_EXPONENT, 0, weights.HIST_BINS - 1),
                           minlength=weights.HIST_BINS)
    assert s.hist == expected.tolist() and s.hist[0] > 0
    ad, bd = a.double().numpy(), b.double().numpy()
    assert (s.sum_a2, s.sum_b2, s.sum_e2) == pytest.approx(((ad * ad).sum(), (bd * bd).sum(), (e * e).sum()), rel=1e-6)
    assert s.sum_e_apb == pytest.approx((e * (ad + bd)).sum(), rel=1e-6)


def test_compare_chunks_counts_non_finite_values_and_compares_them_as_zeros():
    """NaN or inf in the candidate: counted, and the sums are those of the candidate with 0 there."""
    g = torch.Generator().manual_seed(6)
    a = torch.randn(4, 64, generator=g)
    b = a + torch.randn(4, 64, generator=g) * 0.01
    b[1, 3], b[2, 40], b[3, 0] = float("nan"), float("inf"), -float("inf")
    s = weights.compare_chunks([(a, b.clone())], 32)
    zeroed = torch.where(torch.isfinite(b), b, 0.0).double().numpy()
    e = zeroed - a.double().numpy()
    assert s.nonfinite == 3 and s.n == a.numel()
    assert (s.sum_e2, s.sum_b2) == pytest.approx(((e * e).sum(), (zeroed * zeroed).sum()), rel=1e-6)
    assert s.max_abs == pytest.approx(float(np.abs(e).max()))


def test_a_bad_scale_byte_is_one_line_naming_its_file_and_tensor(pair, tmp_path):
    """Experts are compared in forked worker processes on the CPU: a decode error raised there
    still reaches the user as one line naming the file and tensor, and no report is written."""
    import shutil

    from requant.io.checkpoint import Checkpoint

    src = tmp_path / "src"
    shutil.copytree(pair[0], src)
    with Checkpoint.open(str(src)) as ck:
        name = sorted(n for n in ck.names if ".ffn.experts.1.w2.scale" in n)[0]
        path, info = ck.where(name)
    with open(path, "r+b") as f:   # an E8M0 NaN, which no valid MXFP4 file holds
        f.seek(info.start)
        f.write(b"\xff")
    out = tmp_path / "r"
    run = CliRunner().invoke(cli, ["report", str(src), pair[1], "--out", str(out), "--no-forward", "--workers", "2",
                                   "--device", "cpu"])
    assert run.exit_code == 1, run.output
    message = [line for line in run.output.splitlines() if "NaN" in line]
    assert len(message) == 1 and name in message[0] and Path(path).name in message[0], run.output
    assert "Traceback" not in run.output and not (out / "report.json").exists()


def test_plot_axes_start_at_zero_or_say_they_are_zoomed(pair, tmp_path, monkeypatch):
    """Two layers a few hundredths of a dB apart must not look like a cliff: the SQNR axis starts at
    zero, as the forward-error and histogram axes do; the exact-block map's colour scale, which spans
    only 99-100% where every expert is that close, says it is zoomed."""
    report = make_report(pair[0], pair[1], str(tmp_path / "r"), layers="0,1", progress=False, forward=False)
    report["forward"] = {"status": "run", "device": "cpu", "by_layer": [
        {"block": "layers.1", "rel_error": 0.0200}, {"block": "layers.2", "rel_error": 0.0202}]}
    figures = {}

    def keep(fig):
        figures[fig.axes[0].get_title()] = fig
        return b""

    monkeypatch.setattr(html, "_png", keep)
    drawn = html.plots(report)
    assert set(drawn) == set(html.PLOTS)
    by_title = {title.split(" (")[0].split(";")[0]: fig.axes for title, fig in figures.items()}
    assert by_title["Weight SQNR per layer"][0].get_ylim()[0] <= 0
    assert by_title["MoE forward error per layer"][0].get_ylim()[0] == 0
    assert by_title["Weight error histogram"][0].get_ylim()[0] == 0
    exact_map = next(title for title in figures if title.startswith("Exact scale blocks"))
    low = figures[exact_map].axes[0].images[0].get_clim()[0]
    assert 0 < low < 100 and f"zoomed: colour scale from {low:g}%" in exact_map


def test_percentages_never_round_to_exact():
    assert render.percent(1) == "100%" and render.percent(0) == "0%" and render.percent(0.5) == "50.000%"
    assert render.percent(1 - 3e-7) == "99.99997%" and render.percent(2e-6) == "0.0002%"
