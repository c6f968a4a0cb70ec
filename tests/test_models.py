"""Named models (recipe `models`): DeepSeek-V4-Pro built from its recorded facts, recognised from its
config, planned at full scale, and converted, verified and validated at reduced dimensions."""

from __future__ import annotations

import json
import os

import pytest

from requant import synth
from requant.convert import convert, plan_conversion
from requant.describe import inspect_checkpoint
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.targets import Options
from requant.validate import validate
from requant.verify import verify
from tests import release_fixture
from tests.helpers.cli import run_cli

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def pro_release_config() -> dict:
    with open(os.path.join(FIXTURES, "deepseek_v4_pro_config.json"), encoding="utf-8") as f:
        return json.load(f)["config.json"]


def test_pro_config_is_the_release_config():
    assert synth.make_config(synth.Dims("deepseek-v4-pro", full_scale=True)) == pro_release_config()


def test_named_model_recognised_from_config():
    assert ModelSpec.for_config(pro_release_config()).model_name == "deepseek-v4-pro"
    assert ModelSpec.for_config(release_fixture.load()["config.json"]).model_name == "deepseek-v4-flash"
    assert ModelSpec.for_config(synth.make_config(synth.Dims("deepseek-v4-pro"))).model_name is None


def test_pro_full_scale_layout_plans(tmp_path):
    src = str(tmp_path / "pro")
    result = run_cli("synth", src, "--model", "deepseek-v4-pro", "--full-scale", "--sparse")
    assert result.returncode == 0, result.stderr
    info = inspect_checkpoint(src)
    assert info["model"] == "deepseek-v4-pro" and info["routed_experts"] == (61 + 1) * 384
    plan = plan_conversion(src, "nvfp4", Options())
    assert plan.counts["converted tensors"] == (61 + 1) * 384 * 6   # the MTP block too (vLLM's layout)
    # Per expert, NVFP4 doubles each projection's scale bytes (E4M3 per 16 for E8M0 per 32) and adds
    # two FP32 scalars per projection: 3 * (3072 * 7168 / 32 + 8) bytes.
    assert plan.total_size - plan.source.tensor_bytes == (61 + 1) * 384 * 3 * (3072 * 7168 // 32 + 8)
    with Checkpoint.open(src) as ck:
        shapes = {n: ck.info(n).spec.shape for n in ("layers.60.ffn.experts.383.w2.weight", "layers.0.ffn.gate.weight")}
    assert shapes == {"layers.60.ffn.experts.383.w2.weight": (7168, 3072 // 2), "layers.0.ffn.gate.weight": (384, 7168)}


@pytest.fixture(scope="module")
def pro_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pro")
    src, dst = str(root / "src"), str(root / "nvfp4")
    synth.write_checkpoint(src, synth.Dims("deepseek-v4-pro", layers=3, experts=6), seed=2)
    convert(src, dst, "nvfp4", Options(), progress=False)
    return src, dst


def test_pro_layout_differs_from_flash_where_the_release_does(pro_pair):
    with Checkpoint.open(pro_pair[0]) as ck:
        names = set(ck.names)
        assert ck.config["compress_ratios"] == [128, 128, 4, 0] and ck.config["routed_scaling_factor"] == 2.5
    # Pro compresses its first two layers (ratio 128, no indexer), where Flash keeps plain attention.
    assert "layers.0.attn.compressor.ape" in names and "layers.0.attn.indexer.wq_b.weight" not in names
    assert "layers.2.attn.indexer.wq_b.weight" in names


def test_pro_converts_verifies_and_validates(pro_pair):
    src, dst = pro_pair
    result = verify(dst, progress=False)
    assert result["ok"], result["findings"]
    assert result["format"] == "nvfp4" and result["experts_checked"] == (3 + 1) * 6
    checked = validate(src, dst, layers="1,2,mtp.0", tokens=8, device="cpu", progress=False, serve_modes=["bf16"])
    assert checked.passed and [r.layer for r in checked.layers] == ["layers.1", "layers.2", "mtp.0"]
    assert all(r.rel_err == 0.0 and r.routing_agreement == 1.0 for r in checked.layers)
    with open(os.path.join(dst, "requant.json"), encoding="utf-8") as f:
        assert json.load(f)["model"] is None   # reduced dimensions: no named model's
    with Checkpoint.open(dst) as ck:   # vLLM (the default engine) loads the MTP experts converted
        ignore = ModelSpec.for_config(ck.config).quantization_ignore("nvfp4", mtp_converted=True)
        assert ck.config["quantization_config"]["ignore"] == ignore
