"""gpt-oss as a recipe: stacked MXFP4 experts read, synthesized, inspected, verified; engine refusals."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from requant import sources, synth
from requant.cli import cli
from requant.formats import mxfp4
from requant.describe import inspect_checkpoint
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.verify import verify

from requant import engines as _engines  # noqa: E402

VLLM = f"vLLM {_engines.releases('vllm')[-1]}"   # the release a bare --engine vllm means here (none installed)

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
    assert f"{VLLM} cannot serve --out nvfp4" in message and "no expert biases" in message
    assert "use --out w4a16" not in message and "--force" in message
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


def test_report_compares_stacked_experts(small, tmp_path):
    """report reads each layer's stacked tensors once and compares every expert: the forced NVFP4
    output (ModelOpt's transposed layout) is exact block for block; one changed code is found in
    its expert."""
    dest = str(tmp_path / "nvfp4")
    assert CliRunner().invoke(cli, ["convert", small, dest, "--out", "nvfp4", "--force", "--quiet"]).exit_code == 0

    def report(name):
        result = CliRunner().invoke(cli, ["report", small, dest, "--out-dir", str(tmp_path / name), "--json",
                                          "--quiet", "--serve", "bf16"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    exact = report("exact")
    assert [(l["block"], l["experts"]) for l in exact["by_layer"]] == [("model.layers.0", 8), ("model.layers.1", 8)]
    assert exact["overall"]["exact_block_fraction"] == 1.0 and exact["overall"]["max_abs_error"] == 0
    with Checkpoint.open(dest) as ck:
        name = "model.layers.1.mlp.experts.down_proj"
        where = ck.info(name)
        path = ck.shard_path(ck.locations[name])
    with open(path, "r+b") as f:   # expert 3's first byte of ModelOpt's [E, in/2, out] weight
        at = where.start + 3 * where.spec.shape[1] * where.spec.shape[2]
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x77]))
    changed = report("changed")
    layer = {l["block"]: l for l in changed["by_layer"]}["model.layers.1"]
    assert layer["metrics"]["exact_blocks"] == layer["metrics"]["blocks"] - 1
    fractions = changed["exact_block_map"]["fraction"][1]
    assert fractions[3] < 1.0 and fractions[2] == 1.0


def _release_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [E, out, in] by the release's own MXFP4 rule (see the decode test above)."""
    b, s = blocks.view(torch.uint8).long(), scales.view(torch.uint8).long()
    lut = torch.tensor(E2M1, dtype=torch.float64)
    pairs = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).reshape(*b.shape[:3], 32)
    return (pairs * torch.exp2((s - 127).double())[..., None]).reshape(b.shape[0], b.shape[1], -1)


def _gpt_oss_moe(ck: Checkpoint, block: str, x: torch.Tensor, top_k: int, limit: float) -> torch.Tensor:
    """gpt-oss' routed experts written out from transformers' modeling_gpt_oss.py: router logits
    with bias, softmax over the top k; gate/up interleaved (even rows gate), biases before the
    clamp, (up + 1) * gate * sigmoid(1.702 gate), the down bias before the routing weight."""
    t = lambda n: ck.tensor(f"{block}.mlp.{n}")  # noqa: E731
    x = x.double()
    logits = x @ t("router.weight").double().T + t("router.bias").double()
    top = logits.topk(top_k, dim=-1)
    weights = torch.softmax(top.values, dim=-1)
    w13 = _release_decode(t("experts.gate_up_proj_blocks"), t("experts.gate_up_proj_scales"))
    w2 = _release_decode(t("experts.down_proj_blocks"), t("experts.down_proj_scales"))
    b13, b2 = t("experts.gate_up_proj_bias").double(), t("experts.down_proj_bias").double()
    y = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for k in range(top_k):
            e = int(top.indices[i, k])
            gu = w13[e] @ x[i] + b13[e]
            gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y[i] += weights[i, k] * (w2[e] @ h + b2[e])
    return y


def test_validate_runs_gpt_oss_routing_activation_and_biases(small, tmp_path):
    """validate's CPU reference on the source equals gpt-oss' forward written out above, and the
    forced NVFP4 output (ModelOpt's transposed layout) validates as lossless against it."""
    from requant.moe import MoEConfig, route, routed_experts
    from requant.validate import Side, kernel_format, reference_experts, router, validate

    dest = str(tmp_path / "nvfp4")
    assert CliRunner().invoke(cli, ["convert", small, dest, "--out", "nvfp4", "--force", "--quiet"]).exit_code == 0
    with Checkpoint.open(small) as ck:
        side = Side(ck, small)
        cfg = MoEConfig.from_model(side.model)
        block = side.moe_blocks()[1]
        gen = torch.Generator().manual_seed(0)
        x = (torch.randn(5, cfg.hidden_size, generator=gen) * 0.5).bfloat16().float()
        ids, weights = route(x, router(side, block, "cpu"), cfg)
        got = routed_experts(x, ids, weights, reference_experts(side, block, kernel_format(side, block)),
                             cfg.activation)
        expected = _gpt_oss_moe(ck, block, x, cfg.router.top_k, cfg.activation.limit)
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5
    result = validate(small, dest, tokens=8, device="cpu", progress=False, serve_modes=["bf16"])
    assert [r.layer for r in result.layers] == ["model.layers.0", "model.layers.1"]
    assert result.passed and all(r.rel_err <= 1e-3 and r.routing_agreement == 1.0 for r in result.layers)


def test_validate_through_the_kernel(small, tmp_path):
    """The same comparison through requant's kernel (Triton's interpreter here): the interleaved
    gate/up as row views, the recipe's activation and the biases; W4A4 serving too."""
    from requant.validate import validate

    dest = str(tmp_path / "nvfp4")
    assert CliRunner().invoke(cli, ["convert", small, dest, "--out", "nvfp4", "--force", "--quiet"]).exit_code == 0
    result = validate(small, dest, layers="0", tokens=4, device="cpu", progress=False, kernel=True,
                      serve_modes=["bf16", "nvfp4-w4a4"])
    (layer,) = result.layers
    assert layer.passed and layer.rel_err <= 1e-3 and layer.kernel_rel_err <= 1e-2
    assert [s.mode for s in layer.serving][:1] == ["bf16"] and any(s.mode == "nvfp4-w4a4" for s in layer.serving)


def test_validate_runs_dims_off_the_kernels_k_tile_on_the_kernel(tmp_path, monkeypatch):
    """gpt-oss' 2880 is not a whole number of the kernel's 128-wide K tiles (here 160 and 96): the
    kernel masks the last tile, so validate runs such layers on it; a K the kernel does not take
    (forced onto the kernel) is refused in one line."""
    from requant.errors import UnsupportedError
    from requant.kernels import fused_moe
    from requant.validate import validate

    src = str(tmp_path / "src")
    synth.write_checkpoint(src, synth.Dims("gpt-oss-20b", layers=1, hidden=160, intermediate=96))
    (layer,) = validate(src, src, tokens=2, device="cpu", progress=False, kernel=True).layers
    assert layer.passed and layer.kernel_rel_err <= 1e-2
    monkeypatch.setattr(fused_moe, "K_STEP", 64)
    with pytest.raises(UnsupportedError, match="multiples of 64 .*, not hidden 160 / intermediate 96"):
        validate(src, src, tokens=2, device="cpu", progress=False, kernel=True)


@pytest.mark.parametrize("command", ["validate", "report"])
def test_a_nan_scale_in_stacked_experts_is_one_line_naming_the_tensor(small, tmp_path, command):
    bad = str(tmp_path / "bad")
    shutil.copytree(small, bad)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    with Checkpoint.open(bad) as ck:
        where, path = ck.info(name), ck.shard_path(ck.locations[name])
    with open(path, "r+b") as f:
        f.seek(where.start + 5)
        f.write(b"\xff")
    args = [command, small, bad, "--quiet"] + (["--out-dir", str(tmp_path / "r")] if command == "report" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("requant: error:") and name in last and "E8M0 scale is NaN" in last
    assert not os.path.exists(tmp_path / "r")


def test_layer_scales_are_the_scales_load_layer_reads(small, tmp_path):
    """Marlin's CPU path reads a layer's scales alone (layer_scales): for stacked experts they are
    exactly those load_layer reads with the weights, gate and up as the interleaved rows."""
    from requant.validate import ROLES, Side, fused_roles, layer_scales, load_layer

    dest = str(tmp_path / "nvfp4")
    assert CliRunner().invoke(cli, ["convert", small, dest, "--out", "nvfp4", "--force", "--quiet"]).exit_code == 0
    with Checkpoint.open(dest) as ck:
        side = Side(ck, dest)
        block = side.moe_blocks()[0]
        layer = load_layer(side, block, "nvfp4", side.model.value("num_experts"), "cpu")
        scales = layer_scales(side, block, "nvfp4")
        assert fused_roles(side) == layer.fused == [["gate", "up"]]
        for role, w in zip(ROLES, layer.weights):
            assert torch.equal(scales[role], w.scale), role
        assert not torch.equal(scales["gate"], scales["up"])
