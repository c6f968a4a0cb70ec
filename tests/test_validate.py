"""requant validate end to end on a small synthetic checkpoint, on the CPU: the kernel under Triton's
interpreter (small shapes) and the torch reference path the CLI takes without a GPU."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import json  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

pytest.importorskip("triton", reason="requant's kernel needs triton (Linux wheels only): pip install 'requant[gpu]'")
from requant.cli import cli  # noqa: E402
from requant.io.checkpoint import Checkpoint  # noqa: E402
from requant.validate import validate  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    src, dst = str(root / "src"), str(root / "nvfp4")
    runner = CliRunner()
    result = runner.invoke(cli, ["synth", src, "--layers", "4", "--experts", "8", "--hidden", "128",
                                 "--intermediate", "128", "--seed", "3"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["convert", src, dst, "--in", "mxfp4", "--out", "nvfp4", "--quiet"])
    assert result.exit_code == 0, result.output
    return src, dst


def test_lossless_nvfp4_passes(checkpoints):
    src, dst = checkpoints
    result = validate(src, dst, layers="0,3,mtp.0", tokens=9, device="cpu", progress=False, kernel=True,
                      serve_modes=["bf16"])
    by = {r.layer: r for r in result.layers}
    assert result.passed and list(by) == ["layers.0", "layers.3", "mtp.0"]
    assert by["layers.0"].hash_routed and not by["layers.3"].hash_routed
    assert (by["layers.3"].src_format, by["layers.3"].dst_format, by["mtp.0"].dst_format) == ("mxfp4", "nvfp4", "nvfp4")
    for r in result.layers:
        # Same decoded weights, products scaled by powers of two: identical outputs.
        assert r.rel_err == 0.0 and r.routing_agreement == 1.0 and r.tokens == 9
        assert 0 < r.kernel_rel_err < 4e-3  # FP32 interpreter vs FP32 reference: BF16 output rounding only
        [served] = r.serving
        assert (served.mode, served.rel_err, served.flushed_blocks) == ("bf16", r.rel_err, 0)


def test_wrong_w3_global_scale_fails(checkpoints, tmp_path):
    """A w3 scaled by w1's global scale (the engine bug docs/formats.md warns about under NVFP4 global
    scale) must be caught."""
    src, dst = checkpoints
    bad = str(tmp_path / "bad")
    shutil.copytree(dst, bad)
    ck = Checkpoint.open(bad)
    shard = ck.locations["layers.3.ffn.experts.1.w3.weight_scale_2"]
    ck.close()
    tensors = load_file(os.path.join(bad, shard))
    tensors["layers.3.ffn.experts.1.w3.weight_scale_2"] *= 2
    save_file(tensors, os.path.join(bad, shard), metadata={"format": "pt"})
    runner = CliRunner()
    result = runner.invoke(cli, ["validate", src, bad, "--layers", "3", "--tokens", "16", "--device", "cpu",
                                 "--serve", "bf16", "--json", "--quiet"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    layer = report["layers"][0]
    assert not report["passed"] and layer["rel_err"] > 1e-3 and layer["routing_agreement"] == 1.0


def test_activations_file_and_cli(checkpoints, tmp_path):
    src, dst = checkpoints
    path = str(tmp_path / "acts.safetensors")
    save_file({"hidden_states": torch.randn(5, 128), "token_ids": torch.arange(5)}, path)
    result = CliRunner().invoke(cli, ["validate", src, dst, "--layers", "1", "--device", "cpu",
                                      "--activations", path, "--serve", "nvfp4-w4a4", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "layers.1" in result.output and "PASSED" in result.output
    served = [line.split() for line in result.output.splitlines() if " nvfp4-w4a4 " in line]
    assert [row[2] for row in served] == ["written", "1.0", "calibrated"]


@pytest.mark.parametrize("scheme", ["sym", "asym"])
def test_w4a16_output_validates_with_its_quantization_error(checkpoints, tmp_path, scheme):
    """W4A16 output (shared-expert scales renamed to weight_scale, F32) runs through the INT4 path;
    its error is the quantization error: reported, non-zero, inside the W4A16 limit."""
    src, _ = checkpoints
    dst = str(tmp_path / "w4a16")
    result = CliRunner().invoke(cli, ["convert", src, dst, "--out", "w4a16", "--group-size", "32", "--scheme", scheme,
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    report = validate(src, dst, layers="2,mtp.0", tokens=7, device="cpu", progress=False, kernel=True,
                      serve_modes=["nvfp4-w4a4", "marlin-w4a16", "bf16"])
    assert report.passed
    for r in report.layers:
        assert (r.src_format, r.dst_format) == ("mxfp4", "w4a16")
        assert 0.01 < r.rel_err < 0.15 and r.routing_agreement == 1.0
        # No NVFP4 activations for INT4 experts; Marlin takes INT4's BF16 scales as they are.
        assert [(s.mode, s.rel_err, s.flushed_blocks) for s in r.serving] == [("marlin-w4a16", r.rel_err, 0),
                                                                            ("bf16", r.rel_err, 0)]


@pytest.mark.parametrize("kernel", [True, False])
def test_serving_modes(tmp_path, kernel):
    """Every serving mode on a layer with blocks below E4M3's normal range (re-quantized by the
    cast to scale 2^-9): Marlin flushes exactly those, W4A4 runs under the checkpoint's largest
    input_scale and under 1.0, each with an activation-quantization error of its own; through the
    kernel (the interpreter here) and through the CPU's torch reference alike."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "nvfp4")
    runner = CliRunner()
    for args in (["synth", src, "--layers", "4", "--experts", "8", "--hidden", "128", "--intermediate", "128",
                  "--seed", "5", "--out-of-window", "3"], ["convert", src, dst, "--out", "nvfp4", "--quiet"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    report = validate(src, dst, layers="3", tokens=8, device="cpu", progress=False, kernel=kernel,
                      serve_modes=["nvfp4-w4a4", "marlin-w4a16", "bf16"])
    [layer] = report.layers
    served = {(s.mode, s.policy): s for s in layer.serving}
    assert list(served) == [("nvfp4-w4a4", "written"), ("nvfp4-w4a4", "1.0"), ("marlin-w4a16", None), ("bf16", None)]
    assert report.passed and 0 < layer.routed_rel_err <= 1e-3   # re-quantized blocks: not exact, within the limit

    ck = Checkpoint.open(dst)
    experts = [f"layers.3.ffn.experts.{e}" for e in range(8)]
    scales = torch.stack([ck.tensor(f"{x}.{p}.weight_scale").view(torch.uint8) for x in experts for p in ("w1", "w3", "w2")])
    written = [max(float(ck.tensor(f"{x}.{p}.input_scale")) for x in experts for p in projs)
               for projs in (("w1", "w3"), ("w2",))]
    ck.close()
    assert int(scales.max()) == 0x78   # 2^8 is the largest: Marlin's factor is 1
    subnormal = int(((scales & 0x78) == 0).logical_and(scales != 0).sum())
    marlin = served[("marlin-w4a16", None)]
    assert marlin.flushed_blocks == subnormal > 0
    # Flushing changes what the layer computes (here those blocks were the cast's re-quantized ones,
    # so zero happens to be nearer the source's tiny values).
    assert marlin.routed_rel_err != layer.routed_rel_err
    assert served[("nvfp4-w4a4", "written")].input_scales == pytest.approx(tuple(written), rel=1e-7)
    assert served[("nvfp4-w4a4", "1.0")].input_scales == (1.0, 1.0)
    for policy in ("written", "1.0"):
        s = served[("nvfp4-w4a4", policy)]
        assert 0.01 < s.routed_rel_err < 0.3 and s.rel_err > layer.rel_err
    assert served[("bf16", None)].rel_err == layer.rel_err


def test_serve_defaults_and_names():
    from requant.errors import RequantError
    from requant.engines.serve import default_modes, parse_modes
    assert default_modes("nvfp4", (10, 0)) == ["nvfp4-w4a4"]
    assert default_modes("nvfp4", (9, 0)) == ["marlin-w4a16"]
    assert default_modes("nvfp4", None) == ["nvfp4-w4a4", "marlin-w4a16"]
    assert default_modes("w4a16", (9, 0)) == default_modes("w4a16", None) == default_modes("mxfp4", (9, 0)) == ["bf16"]
    # MXFP4 as SGLang serves it: W4A8 (MXFP8 activations) on Blackwell, weight-only on Hopper
    assert default_modes("mxfp4", (12, 0)) == default_modes("mxfp4", (10, 0)) == ["mxfp4-w4a8"]
    assert default_modes("mxfp4", None) == ["mxfp4-w4a8", "bf16"]
    assert parse_modes("all") == ["nvfp4-w4a4", "marlin-w4a16", "mxfp4-w4a8", "bf16"] and parse_modes(None) is None
    with pytest.raises(RequantError):
        parse_modes("w4a4")


def test_cpu_reference_path_and_its_notice(checkpoints):
    """Without the kernel (a CPU, by default) the torch reference runs alone: the same verdict on a
    lossless conversion, no kernel error measured, and one line saying so with a time estimate."""
    src, dst = checkpoints
    lines = []
    result = validate(src, dst, layers="3", tokens=9, device="cpu", progress=False, notice=lines.append)
    layer = result.layers[0]
    assert result.passed and layer.rel_err == 0.0 and layer.kernel_rel_err is None
    assert len(lines) == 1 and "torch reference" in lines[0] and "--layers" in lines[0] and "--tokens" in lines[0]
    cli_run = CliRunner().invoke(cli, ["validate", src, dst, "--layers", "3", "--device", "cpu", "--quiet"])
    assert cli_run.exit_code == 0 and "about" in cli_run.stderr and "PASSED" in cli_run.stdout


@pytest.mark.parametrize("kernel", [True, False])
def test_source_as_w4a8(checkpoints, kernel):
    """--serve mxfp4-w4a8 runs the MXFP4 source with MXFP8 activations (side "source"), judged
    against the source's exact path: equal to a plain recomputation of the routed experts with both
    GEMM inputs quantized to MXFP8 (quantizer written in tests/test_mxfp8.py), a real error of
    E4M3's order, and not applied to the NVFP4 candidate."""
    from requant.moe import MoEConfig, route
    from requant.validate import Side, hidden_states, load_layer, router
    from tests.test_mxfp8 import reference_mxfp8

    src, dst = checkpoints
    result = validate(src, dst, layers="3", tokens=12, device="cpu", progress=False, kernel=kernel,
                      serve_modes=["mxfp4-w4a8", "bf16"])
    [layer] = result.layers
    assert result.passed
    assert [(s.mode, s.side) for s in layer.serving] == [("bf16", "candidate"), ("mxfp4-w4a8", "source")]
    w4a8 = layer.serving[1]
    assert 0.005 < w4a8.routed_rel_err < 0.1 and w4a8.rel_err > layer.rel_err

    with Checkpoint.open(src) as ck:   # the same inputs, recomputed by hand
        side = Side(ck, src)
        cfg = MoEConfig.from_model(side.model)
        x = hidden_states(ck, "layers.3", 12, torch.Generator().manual_seed(0))
        block_router = router(side, "layers.3", "cpu")
        ids, weights = route(x, block_router, cfg, None)
        experts = load_layer(side, "layers.3", "mxfp4", cfg.n_routed_experts, "cpu")
        exact = torch.zeros(12, cfg.hidden_size)
        y = torch.zeros(12, cfg.hidden_size)
        xq = reference_mxfp8(x)
        for t in range(12):
            for k in range(ids.shape[1]):
                gate, up, down = experts.dense(int(ids[t, k]))[:3]
                act = cfg.activation
                h = act(xq[t] @ gate.T, xq[t] @ up.T)
                y[t] += weights[t, k] * (reference_mxfp8(h.bfloat16()[None])[0] @ down.T)
                exact[t] += weights[t, k] * (act(x[t].float() @ gate.T, x[t].float() @ up.T) @ down.T)
    rel = float((y - exact).norm() / exact.norm())
    assert w4a8.routed_rel_err == pytest.approx(rel, rel=1e-3)


def test_w4a8_mode_is_refused_nowhere_and_listed(checkpoints):
    """--serve all on an NVFP4 candidate: W4A8 runs for the MXFP4 source only, every mode is finite."""
    src, dst = checkpoints
    run = CliRunner().invoke(cli, ["validate", src, dst, "--layers", "2", "--tokens", "6", "--device", "cpu",
                                   "--serve", "all", "--json", "--quiet"])
    assert run.exit_code == 0, run.output
    served = json.loads(run.stdout)["layers"][0]["serving"]
    assert [(s["mode"], s["side"]) for s in served if s["mode"] == "mxfp4-w4a8"] == [("mxfp4-w4a8", "source")]


def _rename_tensor(path: str, old: str, new: str) -> None:
    """Rename tensor `old` of checkpoint `path` to `new` (the same length): its shard's header, the index."""
    assert len(old) == len(new)
    with Checkpoint.open(path) as ck:
        shard = os.path.join(path, ck.locations[old])
    with open(shard, "r+b") as f:
        data = f.read()
        assert data.count(old.encode()) == 1
        f.seek(0)
        f.write(data.replace(old.encode(), new.encode()))
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        text = f.read()
    with open(index, "w") as f:
        f.write(text.replace(f'"{old}"', f'"{new}"'))


def test_two_different_models_are_refused(checkpoints, tmp_path):
    """validate (and report) compare two checkpoints of one model: config.json's model_type,
    architectures and the recipe's dims, and the modules outside the routed experts, must agree;
    a refusal names what differs, one line, exit 1. A conversion's renamed parts (W4A16's FP8
    attention scales, `.scale` -> `.weight_scale`) are the same modules."""
    src, dst = checkpoints
    runner = CliRunner()
    other = str(tmp_path / "five-layers")
    assert runner.invoke(cli, ["synth", other, "--layers", "5", "--experts", "8", "--hidden", "128",
                               "--intermediate", "128", "--seed", "3", "-q"]).exit_code == 0
    for command in (["validate", src, other, "--device", "cpu"], ["report", src, other, "--out-dir", str(tmp_path / "r")]):
        run = runner.invoke(cli, [*command, "-q"])
        assert run.exit_code == 1, run.output
        assert run.stderr.strip() == (f"requant: error: {src} and {other} are not the same model: config.json's "
                                      "num_hidden_layers differs: 4 vs 5")
    renamed = str(tmp_path / "renamed")
    shutil.copytree(dst, renamed)
    _rename_tensor(renamed, "layers.2.attn.wkv.weight", "layers.2.attn.wkX.weight")   # its scale stays wkv's
    run = runner.invoke(cli, ["validate", src, renamed, "--device", "cpu", "-q", "--layers", "0"])
    assert run.exit_code == 1 and run.stderr.strip().endswith(
        "the modules outside the routed experts differ: second only: layers.2.attn.wkX"), run.stderr
    w4a16 = str(tmp_path / "w4a16")
    assert runner.invoke(cli, ["convert", src, w4a16, "--out", "w4a16", "-q"]).exit_code == 0
    with Checkpoint.open(src) as a, Checkpoint.open(w4a16) as b:
        assert "layers.0.attn.wkv.scale" in a.names and "layers.0.attn.wkv.weight_scale" in b.names
    run = runner.invoke(cli, ["validate", src, w4a16, "--device", "cpu", "-q", "--layers", "0", "--tokens", "4"])
    assert run.exit_code == 0, run.output


def test_a_kept_mxfp4_block_has_one_w4a8_row(checkpoints, tmp_path):
    """MTP experts kept MXFP4 (--mtp keep): the candidate's block is the source's, so its W4A8 row is
    the source's; it is listed once. A converted layer keeps the source's W4A8 row beside its own modes."""
    src, _ = checkpoints
    kept = str(tmp_path / "kept")
    run = CliRunner().invoke(cli, ["convert", src, kept, "--out", "nvfp4", "--mtp", "keep", "--force", "-q"])
    assert run.exit_code == 0, run.output
    result = validate(src, kept, layers="1,mtp.0", tokens=4, device="cpu", progress=False)
    rows = {r.layer: [(s.mode, s.policy, s.side) for s in r.serving] for r in result.layers}
    assert rows["mtp.0"] == [("mxfp4-w4a8", None, "candidate"), ("bf16", None, "candidate")], rows
    assert rows["layers.1"] == [("nvfp4-w4a4", "written", "candidate"), ("nvfp4-w4a4", "1.0", "candidate"),
                                ("marlin-w4a16", None, "candidate"), ("mxfp4-w4a8", None, "source")], rows
