"""gpt-oss as a recipe: stacked MXFP4 experts read, synthesized, inspected, verified; engine refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from requant import sources, synth
from requant.cli import cli
from requant.formats import mxfp4
from requant.inspect import inspect_checkpoint
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.verify import verify

# openai/gpt-oss-20b's model.safetensors.index.json: metadata.total_size (recipes/gpt_oss.json, models)
RELEASE_20B_TOTAL_SIZE = 13761264768
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gptoss") / "src")
    synth.write_checkpoint(path, synth.Dims("gpt-oss-20b"))
    return path


def test_full_scale_20b_has_the_release_layout(tmp_path):
    path = str(tmp_path / "full")
    synth.write_checkpoint(path, synth.Dims("gpt-oss-20b", full_scale=True), sparse=True)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert index["metadata"]["total_size"] == RELEASE_20B_TOTAL_SIZE
    with Checkpoint.open(path) as ck:
        blocks = ck.info("model.layers.0.mlp.experts.gate_up_proj_blocks").spec
        assert (blocks.dtype, blocks.shape) == ("U8", (32, 5760, 90, 16))
        assert ck.info("model.layers.23.mlp.experts.down_proj_scales").spec.shape == (32, 2880, 90)
        assert ck.info("model.layers.5.mlp.experts.gate_up_proj_bias").spec.dtype == "BF16"
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert ModelSpec.for_config(config).model_name == "gpt-oss-20b"


def test_120b_dimensions():
    d = synth.Dims("gpt-oss-120b", full_scale=True)
    shards = synth.layout(d)
    names = {s.name: s for specs in shards for s in specs}
    assert names["model.layers.35.mlp.experts.gate_up_proj_blocks"].shape == (128, 5760, 90, 16)
    assert "model.layers.36.mlp.experts.gate_up_proj_blocks" not in names


def test_stacked_reader_gives_one_unit_per_layer(small):
    with Checkpoint.open(small) as ck:
        model = ModelSpec.for_config(ck.config)
        reader = sources.reader(model)
        units = reader.experts(ck.names)
        assert [u.block for u in units] == ["model.layers.0", "model.layers.1"]
        unit = units[0]
        assert unit.expert is None
        assert unit.parts["gate_up_proj"] == {"weight": "model.layers.0.mlp.experts.gate_up_proj_blocks",
                                              "scale": "model.layers.0.mlp.experts.gate_up_proj_scales",
                                              "bias": "model.layers.0.mlp.experts.gate_up_proj_bias"}
        assert reader.expert_count(unit, ck) == 8
        assert reader.matrix_shape(ck.info(unit.parts["down_proj"]["weight"]).spec.shape) == (256, 64)
        assert model.projection_shape("gate_up_proj") == (256, 256)


def test_stacked_expert_decodes_as_the_release_defines_mxfp4(small):
    """Expert e's matrix view decoded by the codec equals the release's own rule (transformers'
    integrations/mxfp4.py: low nibble is the even element, value = E2M1 * 2^(scale - 127))."""
    with Checkpoint.open(small) as ck:
        blocks = ck.tensor("model.layers.1.mlp.experts.down_proj_blocks").view(torch.uint8)
        scales = ck.tensor("model.layers.1.mlp.experts.down_proj_scales").view(torch.uint8)
    e = 5
    b, s = blocks[e].numpy().astype(np.int64), scales[e].numpy().astype(np.int64)
    lut = np.array(E2M1, dtype=np.float64)
    pairs = np.stack([lut[b & 0x0F], lut[b >> 4]], axis=-1).reshape(*b.shape[:2], 32)
    expected = (pairs * np.exp2(s - 127)[..., None]).reshape(b.shape[0], -1)
    rows = blocks.shape[1]
    got = mxfp4.decode(blocks[e].reshape(rows, -1), scales[e])
    assert np.array_equal(got.numpy().astype(np.float64), expected)
    assert np.abs(expected).max() > 0


def test_inspect_and_verify_recognise_it(small):
    info = inspect_checkpoint(small)
    assert (info["recipe"], info["expert_format"], info["routed_experts"]) == ("gpt_oss", "mxfp4", 16)
    result = verify(small, progress=False)
    assert result["ok"], result["findings"]
    assert result["format"] == "mxfp4"


def test_verify_counts_stacked_experts(tmp_path, small):
    path = tmp_path / "fewer"
    synth.write_checkpoint(str(path), synth.Dims("gpt-oss-20b", experts=4))
    config = json.loads((path / "config.json").read_text())
    config["num_local_experts"] = 8
    (path / "config.json").write_text(json.dumps(config))
    codes = {f["code"] for f in verify(str(path), progress=False)["findings"] if f["severity"] == "error"}
    assert "missing-expert" in codes


def test_vllm_refuses_nvfp4_in_one_line(small, tmp_path):
    dest = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", small, str(dest), "--out", "nvfp4"])
    assert result.exit_code != 0
    message = result.output.strip()
    assert "\n" not in message and "Traceback" not in message
    assert "vLLM 0.33.0 cannot serve --out nvfp4" in message and "no expert biases" in message
    assert "--out w4a16" in message and "--force" in message
    assert not dest.exists()


def test_forced_nvfp4_output_is_recognised_and_judged(small, tmp_path):
    """The ModelOpt-layout output: inspect and verify read it as stacked NVFP4 experts (shapes
    checked in its (E, in, out) orientation, config in ModelOpt's form); the one error is vLLM's."""
    dest = str(tmp_path / "nvfp4")
    result = CliRunner().invoke(cli, ["convert", small, dest, "--out", "nvfp4", "--force"])
    assert result.exit_code == 0, result.output
    info = inspect_checkpoint(dest)
    assert (info["expert_format"], info["routed_experts"]) == ("nvfp4", 16)
    result = verify(dest, progress=False)
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    assert [f["code"] for f in errors] == ["engine-unsupported"], result["findings"]
    assert not [f for f in result["findings"] if f["severity"] == "warning"]
    config = json.load(open(os.path.join(dest, "config.json")))
    config["quantization_config"]["quant_method"] = "fp8"
    json.dump(config, open(os.path.join(dest, "config.json"), "w"))
    codes = {f["code"] for f in verify(dest, progress=False)["findings"]}
    assert "quant-method" in codes


@pytest.mark.parametrize("command", ["validate", "report"])
def test_commands_that_read_single_experts_refuse_stacked_ones_in_one_line(small, tmp_path, command):
    args = [command, small, small] + (["--out-dir", str(tmp_path / "r")] if command == "report" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert result.output.strip().splitlines()[-1] == (
        f"requant: error: {command} does not read stacked experts yet (gpt_oss stores each layer's experts "
        "in [E, ...] tensors); verify and inspect do")
