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
    result = validate(src, dst, layers="0,3,mtp.0", tokens=9, device="cpu", progress=False, kernel=True)
    by = {r.layer: r for r in result.layers}
    assert result.passed and list(by) == ["layers.0", "layers.3", "mtp.0"]
    assert by["layers.0"].hash_routed and not by["layers.3"].hash_routed
    assert (by["layers.3"].src_format, by["layers.3"].dst_format, by["mtp.0"].dst_format) == ("mxfp4", "nvfp4", "mxfp4")
    for r in result.layers:
        # Same decoded weights, products scaled by powers of two: identical outputs.
        assert r.rel_err == 0.0 and r.routing_agreement == 1.0 and r.tokens == 9
        assert 0 < r.kernel_rel_err < 4e-3  # FP32 interpreter vs FP32 reference: BF16 output rounding only


def test_wrong_w3_global_scale_fails(checkpoints, tmp_path):
    """A w3 scaled by w1's global scale (the engine bug formats.md warns about) must be caught."""
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
                                 "--json", "--quiet"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    layer = report["layers"][0]
    assert not report["passed"] and layer["rel_err"] > 1e-3 and layer["routing_agreement"] == 1.0


def test_activations_file_and_cli(checkpoints, tmp_path):
    src, dst = checkpoints
    path = str(tmp_path / "acts.safetensors")
    save_file({"hidden_states": torch.randn(5, 128), "token_ids": torch.arange(5)}, path)
    result = CliRunner().invoke(cli, ["validate", src, dst, "--layers", "1", "--device", "cpu",
                                      "--activations", path, "--quiet"])
    assert result.exit_code == 0, result.output
    assert "layers.1" in result.output and "PASSED" in result.output


@pytest.mark.parametrize("scheme", ["sym", "asym"])
def test_w4a16_output_validates_with_its_quantization_error(checkpoints, tmp_path, scheme):
    """W4A16 output (shared-expert scales renamed to weight_scale, F32) runs through the INT4 path;
    its error is the quantization error: reported, non-zero, inside the W4A16 limit."""
    src, _ = checkpoints
    dst = str(tmp_path / "w4a16")
    result = CliRunner().invoke(cli, ["convert", src, dst, "--out", "w4a16", "--group-size", "32", "--scheme", scheme,
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    report = validate(src, dst, layers="2,mtp.0", tokens=7, device="cpu", progress=False, kernel=True)
    assert report.passed
    for r in report.layers:
        assert (r.src_format, r.dst_format) == ("mxfp4", "int4")
        assert 0.01 < r.rel_err < 0.15 and r.routing_agreement == 1.0


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
