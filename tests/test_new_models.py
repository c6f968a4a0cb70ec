"""The DeepSeek releases after the first: V4-Flash-0731 and V4-Pro-0813 (a DSpark drafter under mtp.)
and V4.1-Flash (Engram tables, 32x32 FP8, a vision tower). Their full-scale layouts against the
published facts (docs/models/deepseek-v4-family.md), detection, and small checkpoints through
convert, verify and inspect with the drafter's bytes kept where the engine's rule keeps them."""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch

from requant import synth
from requant.advise import advise, format_advice
from requant.convert import convert, plan_conversion
from requant.describe import inspect_checkpoint
from requant.errors import UnsupportedCheckpoint
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec, named_models
from requant.targets import Options
from requant.verify import verify
from tests.helpers.cli import run_cli

NEW = ["deepseek-v4-flash-0731", "deepseek-v4-pro-0813", "deepseek-v4.1-flash"]


def _layout(model: str) -> dict[str, tuple[str, tuple, int]]:
    """name -> (dtype, shape, shard number from 1) of a named model at full scale."""
    shards = synth.layout(synth.Dims(model, full_scale=True))
    return {s.name: (s.dtype, tuple(s.shape), i + 1) for i, specs in enumerate(shards) for s in specs}


def test_v41_full_scale_is_the_published_inventory():
    """The release's 48 shard headers, as a third-party inventory sums them (the recipe's source):
    tensor count, total_size and bytes per dtype, all exact."""
    shards = synth.layout(synth.Dims("deepseek-v4.1-flash", full_scale=True))
    by_dtype = collections.Counter()
    for specs in shards:
        for s in specs:
            by_dtype[s.dtype] += s.nbytes
    assert len(shards) == 48 and sum(map(len, shards)) == 96_085
    assert sum(by_dtype.values()) == 510_286_023_000
    assert by_dtype == {"I8": 278_585_671_680, "F8_E4M3": 204_015_223_296, "F8_E8M0": 23_563_015_184,
                        "BF16": 3_952_883_712, "F32": 169_229_128}


def test_v41_full_scale_names_and_shapes_are_the_loaders():
    t = _layout("deepseek-v4.1-flash")
    # MXFP4 experts, one E8M0 per 32 along K; 32x32 FP8 dense weights (third-party header reads)
    assert t["layers.0.ffn.experts.0.w1.weight"][:2] == ("I8", (2304, 2560))
    assert t["layers.0.ffn.experts.0.w1.scale"][:2] == ("F8_E8M0", (2304, 160))
    assert t["layers.0.attn.wq_b.weight"][:2] == ("F8_E4M3", (32768, 1280))
    assert t["layers.0.attn.wq_b.scale"][:2] == ("F8_E8M0", (1024, 40))
    # Engram tables: FP8 rows with a scale per 32, in the last two shards
    assert t["layers.1.engram.embed.weight"] == ("F8_E4M3", (384_006_168, 256), 47)
    assert t["layers.14.engram.embed.scale"] == ("F8_E8M0", (384_016_682, 8), 48)
    assert t["layers.14.engram.wkv.weight"][:2] == ("F8_E4M3", (25600, 6144))
    # compressors only on the kv sources (no ape; no wgate at ratio 1), indexers on the index sources
    compressed = {n.split(".")[1] for n in t if ".attn.compressor.wkv." in n}
    assert compressed == {"2", "8", "14", "20"} and not any(n.endswith(".ape") for n in t)
    assert "layers.20.attn.compressor.wgate.weight" not in t and "layers.14.attn.compressor.wgate.weight" in t
    assert {n.split(".")[1] for n in t if n.endswith("indexer.wq_b.weight")} == {"2", "8", "14", "20", "24", "28",
                                                                                  "32", "36"}
    assert "layers.24.attn.indexer.wk.weight" not in t and "layers.20.attn.indexer.wk.weight" in t
    # no hash routing, an image-token bias, no hc_head anywhere
    assert not any("tid2eid" in n or "hc_head" in n for n in t)
    assert t["layers.0.ffn.gate.bias_vl"][:2] == ("F32", (384,))
    # the drafter: three stages of 128 experts, main_proj on stage 0, the heads on the last
    assert "mtp.2.ffn.experts.127.w2.weight" in t and "mtp.2.ffn.experts.128.w2.weight" not in t
    assert t["mtp.0.main_proj.weight"][:2] == ("F8_E4M3", (5120, 15360))
    assert t["mtp.2.markov_head.embed.weight"][:2] == ("BF16", (129280, 256))
    assert t["mtp.2.confidence_head.proj.weight"][:2] == ("BF16", (1, 5376))
    assert t["aligner.w1.weight"][:2] == ("BF16", (5120, 9216)) and t["vision.blocks.31.mlp.w1.weight"][1] == (5632, 1024)


def test_dspark_full_scale_layouts():
    t = _layout("deepseek-v4-flash-0731")
    shards = synth.layout(synth.Dims("deepseek-v4-flash-0731", full_scale=True))
    assert len(shards) == 48    # third-party: "167 GB, 48 safetensor shards", mtp.0..2 in the last three
    assert round(sum(s.nbytes for specs in shards for s in specs) / 1e9) == 167
    assert {t[f"mtp.{s}.ffn.experts.255.w1.weight"][2] for s in range(3)} == {46, 47, 48}
    assert t["mtp.0.main_proj.weight"][:2] == ("F8_E4M3", (4096, 3 * 4096))
    assert t["mtp.2.markov_head.markov_w2.weight"][:2] == ("BF16", (129280, 256))
    assert "mtp.2.hc_head_fn" in t and not any(n.startswith("mtp.") and ".e_proj" in n for n in t)
    config = synth.make_config(synth.Dims("deepseek-v4-flash-0731", full_scale=True))
    assert config["dspark_target_layer_ids"] == [40, 41, 42] and config["num_nextn_predict_layers"] == 1
    assert len(config["compress_ratios"]) == 43 + 3   # vLLM builds the stages as layers.43-45
    pro = _layout("deepseek-v4-pro-0813")
    assert pro["mtp.1.ffn.experts.383.w2.weight"][:2] == ("I8", (7168, 3072 // 2))


@pytest.mark.parametrize("model", NEW)
def test_full_scale_config_is_recognised(model):
    config = synth.make_config(synth.Dims(model, full_scale=True))
    assert ModelSpec.for_config(config).model_name == model


@pytest.mark.parametrize("model", NEW)
def test_full_scale_dry_run_plans_the_layout(model, tmp_path):
    src = str(tmp_path / "full")
    result = run_cli("synth", src, "--model", model, "--full-scale", "--sparse")
    assert result.returncode == 0, result.stderr
    result = run_cli("convert", src, str(tmp_path / "out"), "--out", "nvfp4", "--dry-run", "--json")
    plan = json.loads(result.stdout)
    assert result.returncode in (0, 3), result.stderr   # 3: this machine's disk is short of the plan
    assert not os.path.exists(tmp_path / "out")
    with Checkpoint.open(src) as ck:
        spec = ModelSpec.for_checkpoint(ck)
        blocks = {n.rsplit(".ffn.experts.", 1)[0] for n in ck.names if ".ffn.experts." in n}
    converted_drafter = spec.engine().mtp_format("nvfp4") == "nvfp4"
    per_block = {b: spec.value("num_experts", b) for b in blocks if converted_drafter or not spec.is_mtp(b)}
    assert plan["tensors"]["converted tensors"] == 6 * sum(per_block.values())
    full = plan_conversion(src, "nvfp4", Options())
    # per expert, NVFP4 doubles each projection's scale bytes and adds two FP32 scalars per projection
    hidden, inter = spec.value("hidden_size"), spec.value("intermediate_size")
    assert full.total_size - full.source.tensor_bytes == sum(per_block.values()) * 3 * (hidden * inter // 32 + 8)


@pytest.mark.parametrize("layers", [1, 2, 3, 21])
def test_v41_full_scale_takes_any_layer_count(layers):
    """Fewer layers than the release keep the release's layer lists below that count: the config
    names only layers the checkpoint has, and each Engram table comes with its layer."""
    d = synth.Dims("deepseek-v4.1-flash", full_scale=True, layers=layers)
    synth.check_request(d, synth.HardCases())
    text = synth.make_config(d)["text_config"]
    ids = [*text["kv_source_layer_ids"], *text["index_source_layer_ids"], *text["engram_layer_ids"],
           text["candidate_source_layer_id"]]
    assert max(ids) < layers and text["num_hidden_layers"] == layers
    assert set(text["kv_source_layer_ids"]) == {i for i in (2, 8, 14, 20) if i < layers}
    assert text["engram_num_embeddings"] == [rows for i, rows in ((1, 384_006_168), (14, 384_016_682)) if i < layers]
    assert text["candidate_source_layer_id"] in (text["kv_source_layer_ids"] or [0])
    names = {s.name for specs in synth.layout(d) for s in specs}
    assert {n.split(".")[1] for n in names if n.endswith(".engram.embed.weight")} == \
        {str(i) for i in text["engram_layer_ids"]}


def test_v41_full_scale_few_layers_synthesizes_and_plans(tmp_path):
    src = str(tmp_path / "full")
    result = run_cli("synth", src, "--model", "deepseek-v4.1-flash", "--full-scale", "--sparse", "--layers", "3")
    assert result.returncode == 0, result.stderr
    plan = plan_conversion(src, "nvfp4", Options())
    assert plan.blocks[:3] == ["layers.0", "layers.1", "layers.2"]
    assert plan.source.info("layers.1.engram.embed.weight").spec.shape == (384_006_168, 256)


def test_v41_small_mode_keeps_engram_tables_small():
    shards = synth.layout(synth.Dims("deepseek-v4.1-flash"))
    tables = [s for specs in shards for s in specs if ".engram.embed." in s.name]
    assert len(tables) == 4 and sum(s.nbytes for s in tables) < 2**20
    assert sum(s.nbytes for specs in shards for s in specs) < 16 * 2**20


@pytest.fixture(scope="module", params=NEW)
def small(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("new") / request.param)
    synth.write_checkpoint(path, synth.Dims(request.param), seed=5)
    return request.param, path


def _drafter_bytes(path: str) -> dict[str, bytes]:
    with Checkpoint.open(path) as ck:
        return {n: ck.tensor(n).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for n in ck.names if n.startswith("mtp.")}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_small_converts_to_nvfp4_verifies_and_keeps_the_drafter(small, engine, tmp_path):
    model, src = small
    dst = str(tmp_path / "nvfp4")
    convert(src, dst, "nvfp4", Options(engine=engine), progress=False)
    result = verify(dst, engine=engine, progress=False)
    assert result["ok"], result["findings"]
    with Checkpoint.open(src) as ck:
        rules = ModelSpec.for_checkpoint(ck).engine(engine)
    if rules.mtp_format("nvfp4") != "nvfp4":   # the release loads the drafter as it ships: byte for byte
        assert _drafter_bytes(dst) == _drafter_bytes(src)
    info = inspect_checkpoint(dst)
    assert info["expert_format"] == "nvfp4" and info["model_type"] == synth.make_config(synth.Dims(model))["model_type"]


def test_small_w4a16_is_refused_in_one_line(small, tmp_path):
    """W4A16 loading of V4.1 is not established (the research doc): the engine rules refuse it, and
    the recipe cannot describe its FP8 linears in a W4A16 config either, so not even --force writes
    one. The V4 DSpark releases convert, their drafter's experts too, and verify (the engines'
    loading of them: tests/engines/test_vllm_dspark.py, test_sglang_dspark.py)."""
    model, src = small
    result = run_cli("convert", src, str(tmp_path / "w4a16"), "--out", "w4a16")
    if model != "deepseek-v4.1-flash":
        assert result.returncode == 0, result.stderr
        assert verify(str(tmp_path / "w4a16"), progress=False)["ok"]
        return
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "cannot serve --out w4a16" in lines[0] or "--out w4a16 is refused" in lines[0]
    assert not os.path.exists(tmp_path / "w4a16")
    result = run_cli("convert", src, str(tmp_path / "w4a16"), "--out", "w4a16", "--force")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "requant: error: --out w4a16 is refused for deepseek_v41 checkpoints: no engine's W4A16 (compressed-tensors) "
        "description of V4.1's 32x32 FP8 linears and Engram projections was found; vLLM reads them only through "
        "its FP8 config (docs/models/deepseek-v4-family.md, section 3.3)"]
    assert not os.path.exists(tmp_path / "w4a16")


def test_drafter_stages_take_their_own_expert_count():
    config = synth.make_config(synth.Dims("deepseek-v4.1-flash", full_scale=True))
    spec = ModelSpec.for_config(config)
    assert spec.value("num_experts", "mtp.1") == 128 and spec.router("mtp.1")["top_k"] == 3
    assert spec.value("num_experts", "layers.7") == 384 and spec.router()["top_k"] == 6
    assert spec.config_key("num_experts", "mtp.0") == "text_config.dspark_n_routed_experts"


# detection ----------------------------------------------------------------------------------------

def _config(model: str) -> dict:
    return synth.make_config(synth.Dims(model))


def _names(model: str) -> list[str]:
    return [s.name for specs in synth.layout(synth.Dims(model)) for s in specs]


@pytest.mark.parametrize("model", [*NEW, "deepseek-v4-flash", "gpt-oss-20b"])
def test_each_checkpoint_is_detected_as_its_own_recipe(model):
    spec = ModelSpec.for_config(_config(model), names=_names(model))
    assert spec.recipe is named_models()[model][0]


def test_a_v41_checkpoint_given_a_v4_model_is_refused_in_one_line(tmp_path):
    config, names = _config("deepseek-v4.1-flash"), _names("deepseek-v4.1-flash")
    with pytest.raises(UnsupportedCheckpoint) as e:
        ModelSpec.for_config(config, "v41/config.json", names, model="deepseek-v4-flash")
    message = str(e.value)
    assert message.startswith("v41/config.json: --model deepseek-v4-flash is a deepseek_v4 model, but this checkpoint "
                              "is not one (model_type 'deepseek_v41', not 'deepseek_v4'") and "\n" not in message
    # and the reverse: a V4 checkpoint is no V4.1 one, nor a DSpark release without its drafter
    with pytest.raises(UnsupportedCheckpoint, match="is a deepseek_v41 model, but this checkpoint is not one"):
        ModelSpec.for_config(_config("deepseek-v4-flash"), names=_names("deepseek-v4-flash"), model="deepseek-v4.1-flash")
    with pytest.raises(UnsupportedCheckpoint, match=r"no tensor matches \^mtp"):
        ModelSpec.for_config(_config("deepseek-v4-flash"), names=_names("deepseek-v4-flash"),
                             model="deepseek-v4-flash-0731")
    # --model only chooses the named model among what detection allows
    spec = ModelSpec.for_config(config, names=names, model="deepseek-v4.1-flash")
    assert spec.model_name == "deepseek-v4.1-flash"


def test_a_config_that_lies_about_its_kind_is_refused():
    """V4.1 tensors under a config claiming V4, and a DSpark config over the one-layer MTP's tensors."""
    lying = {**_config("deepseek-v4.1-flash"), "model_type": "deepseek_v4"}
    with pytest.raises(UnsupportedCheckpoint, match="architectures \\['DeepseekV41ForCausalLM'\\], not DeepseekV4"):
        ModelSpec.for_config(lying, names=_names("deepseek-v4.1-flash"))
    with pytest.raises(UnsupportedCheckpoint, match="nearest is deepseek_v4_dspark .* no tensor matches"):
        ModelSpec.for_config(_config("deepseek-v4-flash-0731"), names=_names("deepseek-v4-flash"))
    legacy = _names("deepseek-v4-flash-0731") + ["mtp.0.e_proj.weight"]
    with pytest.raises(UnsupportedCheckpoint, match="tensor mtp.0.e_proj.weight is not one"):
        ModelSpec.for_config(_config("deepseek-v4-flash-0731"), names=legacy)


def test_an_unknown_architecture_is_refused_in_one_line(tmp_path):
    src = str(tmp_path / "llama")
    synth.write_checkpoint(src, synth.Dims("deepseek-v4-flash", layers=1), seed=1)
    path = os.path.join(src, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    result = run_cli("convert", src, str(tmp_path / "out"), "--out", "nvfp4")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].endswith("llama/config.json: model_type 'llama', architectures ['LlamaForCausalLM'] has no recipe "
                             "(supported: deepseek_v4 (DeepseekV4ForCausalLM), deepseek_v41 (DeepseekV41ForCausalLM), "
                             "gpt_oss (GptOssForCausalLM))")


def test_convert_refuses_a_model_of_another_kind_in_one_line(small, tmp_path):
    model, src = small
    other = "deepseek-v4-flash" if model == "deepseek-v4.1-flash" else "deepseek-v4.1-flash"
    result = run_cli("convert", src, str(tmp_path / "out"), "--out", "nvfp4", "--model", other)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert f"--model {other} is a " in lines[0] and "but this checkpoint is not one (model_type" in lines[0]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("block, shape, grid", [(128, (300, 260), (3, 3)), (32, (96, 70), (3, 3)),
                                                ((1, 32), (5, 64), (5, 2))])
def test_fp8_block_takes_its_block_from_the_scale_grid(block, shape, grid):
    from requant.errors import FormatError
    from requant.formats import fp8_block

    x = torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]   # rows of very different ranges
    codes, scale = fp8_block.encode(x, block)
    assert tuple(scale.shape) == grid == fp8_block.scale_shape(shape, block)
    decoded = fp8_block.decode(codes, scale)
    # E4M3 keeps 3 mantissa bits: within 1/16 of each value, relative to its block's largest
    rows, cols = (block, block) if isinstance(block, int) else block
    for r in range(0, shape[0], rows):
        for c in range(0, shape[1], cols):
            ref = x[r:r + rows, c:c + cols]
            assert (decoded[r:r + rows, c:c + cols] - ref).abs().max() <= ref.abs().max() / 16 + 1e-30
    with pytest.raises(FormatError, match="does not match weight"):
        fp8_block.decode(codes, scale[:, :1].contiguous())


def test_a_large_engram_table_is_written_in_pieces(tmp_path, monkeypatch):
    """Block-FP8 tensors past synth's piece size are encoded a band of rows at a time (so a full-size
    Engram table never sits in memory): every band lands at its offset, scales with it."""
    from requant.formats import fp8_block

    monkeypatch.setattr(synth, "_PIECE_BYTES", 64 << 10)
    path = str(tmp_path / "v41")
    synth.write_checkpoint(path, synth.Dims("deepseek-v4.1-flash", engram_rows=[5003, 1000]), seed=2)
    with Checkpoint.open(path) as ck:
        weight, scale = ck.tensor("layers.1.engram.embed.weight"), ck.tensor("layers.1.engram.embed.scale")
        assert weight.nbytes > 4 * synth._PIECE_BYTES and tuple(scale.shape) == (5003, 64 // 32)
        codes = weight.view(torch.uint8)
        assert bool((codes != 0).any(dim=1).all()), "a band of rows was never written"
        assert bool((scale.view(torch.uint8) > 100).all())   # ~0.02-sized values: E8M0 exponents near 2^-9
        values = fp8_block.decode(weight, scale)
        assert 0.015 < float(values.std()) < 0.025


# every command on the new models: per-block expert counts and top-k, expert_dtype's place -------

V41, DSPARK = "deepseek-v4.1-flash", "deepseek-v4-pro-0813"
# V4.1 with a drafter of more experts than the main layers: a count or top-k taken from the main
# layers for the drafter either drops its experts or reads ones it lacks
V41_WIDE_DRAFTER = {"experts": 4, "top_k": 2, "dspark_experts": 8, "dspark_top_k": 3}


def _pair(checkpoints, model: str, engine: str = "vllm", **dims) -> tuple[str, str]:
    src = checkpoints.source(synth.Dims(model, **dims), seed=5)
    return src, checkpoints.converted(src, "nvfp4", Options(engine=engine))


def _text_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config.get("text_config", config)


def _edit_config(path: str, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    edit(config)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_v41_expert_dtype_is_read_inside_quantization_config(checkpoints, engine, tmp_path):
    """V4.1 keeps expert_dtype in quantization_config (vLLM's DeepseekV41Config copies it from there):
    verify finds it there (no note that it is missing) and refuses a wrong one; inspect shows it. A
    DSpark (V4) config keeps it at the top level, where verify still looks."""
    _, dst = _pair(checkpoints, V41, engine)
    result = verify(dst, engine=engine, progress=False)
    assert result["ok"] and result["findings"] == [], result["findings"]
    assert inspect_checkpoint(dst)["expert_dtype"] == "fp4"
    fp8 = checkpoints.copy(dst, tmp_path / "fp8")
    _edit_config(fp8, lambda c: c["quantization_config"].update(expert_dtype="fp8"))
    result = verify(fp8, engine=engine, progress=False)
    wrong = [f for f in result["findings"] if f["code"] == "expert-dtype"]
    assert not result["ok"] and len(wrong) == 1, result["findings"]
    assert wrong[0]["severity"] == "error" and wrong[0]["message"].startswith("quantization_config.expert_dtype must be")
    assert inspect_checkpoint(fp8)["expert_dtype"] == "fp8"

    _, dspark = _pair(checkpoints, DSPARK, engine)
    moved = checkpoints.copy(dspark, tmp_path / "dspark")
    _edit_config(moved, lambda c: (c["quantization_config"].update(expert_dtype="fp8"), c.pop("expert_dtype")))
    result = verify(moved, engine=engine, progress=False)
    assert [(f["code"], f["message"]) for f in result["findings"]] == [
        ("expert-dtype-missing", "config.json has no expert_dtype; vLLM defaults it to 'fp4'")]


@pytest.mark.parametrize("dims", [{}, V41_WIDE_DRAFTER], ids=["drafter-narrower", "drafter-wider"])
def test_v41_validate_runs_each_block_with_its_own_experts_and_top_k(checkpoints, monkeypatch, dims):
    """validate routes every block by its own expert count and top-k (config.json's dspark_* for the
    drafter's), in the torch reference (a CPU) and through the kernel alike."""
    import requant.validate.layer as layer_module
    from requant.validate import validate

    src, dst = _pair(checkpoints, V41, **dims)
    text = _text_config(src)
    expected = {(text["n_routed_experts"], text["num_experts_per_tok"]),
                (text["dspark_n_routed_experts"], text["dspark_num_experts_per_tok"])}
    routed = set()
    route = layer_module.route

    def recorded(x, layer, cfg, token_ids=None):
        ids, weights = route(x, layer, cfg, token_ids)
        routed.add((layer.gate_weight.shape[0], ids.shape[1]))
        return ids, weights
    monkeypatch.setattr(layer_module, "route", recorded)
    last = f"{text['num_hidden_layers'] - 1}"
    result = validate(src, dst, layers=f"{last},mtp.0,mtp.2", tokens=8, device="cpu", progress=False)
    assert [r.layer for r in result.layers] == [f"layers.{last}", "mtp.0", "mtp.2"]
    assert all(r.passed and r.rel_err == 0 and r.routing_agreement == 1 for r in result.layers), result.layers
    assert routed == expected
    pytest.importorskip("triton", reason="requant's kernel needs triton")
    (stage,) = validate(src, dst, layers="mtp.1", tokens=4, device="cpu", progress=False, kernel=True).layers
    assert stage.passed and stage.kernel_rel_err is not None and stage.kernel_rel_err < 1e-2, stage


def test_v41_report_maps_the_drafter_s_own_experts(checkpoints, tmp_path):
    """report's exact-block map holds each block's own experts (a drafter with more than the main
    layers keeps all of its columns); its forward and serving-path sections route the drafter by
    its own top-k."""
    from requant.report import PATHS_TOKENS, make_report

    src, dst = _pair(checkpoints, V41, **V41_WIDE_DRAFTER)
    text = _text_config(src)
    report = make_report(src, dst, str(tmp_path / "report"), layers="1,mtp.0", workers=1, progress=False)
    grid = report["exact_block_map"]
    assert grid["blocks"] == ["layers.1", "mtp.0"] and grid["experts"] == text["dspark_n_routed_experts"] == 8
    assert grid["fraction"] == [[1.0] * 4 + [None] * 4, [1.0] * 8]
    assert report["selection"]["experts_compared"] == 4 + 8 and report["overall"]["sqnr_db"] is None
    assert report["forward"]["status"] == "run" and report["forward"]["passed"], report["forward"]
    report = make_report(src, dst, str(tmp_path / "drafter"), layers="mtp.0", workers=1, progress=False)
    assert report["forward"]["passed"] and report["paths"]["status"] == "run", report["paths"]
    (layer,) = report["paths"]["layers"]
    assert layer["block"] == "mtp.0" and layer["pairs"] + layer["pairs_dropped"] == PATHS_TOKENS * 3


@pytest.mark.parametrize("model, ep, refused", [
    (V41, 4, "6 routed experts of the mtp blocks (text_config.dspark_n_routed_experts) do not divide over --ep 4"),
    (V41, 3, "8 routed experts do not divide over --ep 3"),
    (V41, 2, None),
    (DSPARK, 4, None),
    (DSPARK, 3, "8 routed experts do not divide over --ep 3")])
def test_advise_splits_every_block_s_experts_over_ep(checkpoints, model, ep, refused):
    """EP keeps experts whole: the drafter's own count must divide too (V4.1's small one: 6)."""
    from requant.advise import advise

    src = checkpoints.source(synth.Dims(model), seed=5)
    with Checkpoint.open(src) as ck:
        answer = advise(ck, ["vllm", "sglang"], "sm_100", ep=ep)
    for engine in answer["answers"]:
        as_is = engine["paths"][0]
        assert as_is["problems"] == ([refused] if refused else []), as_is["problems"]
        assert as_is["starts"] is (refused is None)


@pytest.mark.parametrize("model", [V41, DSPARK])
def test_resumed_in_place_and_hub_conversions_are_the_uninterrupted_one(checkpoints, model, tmp_path, monkeypatch):
    """A conversion stopped part-way then resumed, one in place, and one from a Hub repository (the
    local stand-in of tests/test_hub.py) hold the bytes of the uninterrupted one; advise reads the
    Hub repository's headers only."""
    import threading

    from click.testing import CliRunner

    from requant.cli import cli
    from requant.errors import RequantError
    from requant.io import fsutil, journal
    from tests.helpers.files import output_tree
    from tests.test_hub import REPO, FakeHub

    options = Options(engine="sglang")
    src, clean = _pair(checkpoints, model, "sglang")
    clean = output_tree(clean)
    resumed = str(tmp_path / "resumed")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@12")   # a few shards in
    with pytest.raises(RequantError, match="No space left"):
        convert(src, resumed, "nvfp4", options, progress=False)
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    shards = journal.load(resumed)[0]["shards"]
    assert 0 < sum(s["done"] for s in shards) < len(shards), "the fault should fall between shards"
    assert not os.path.exists(os.path.join(resumed, "config.json"))
    convert(src, resumed, "nvfp4", options, progress=False, resume=True)
    assert output_tree(resumed) == clean

    in_place = checkpoints.copy(src, tmp_path / "in-place")
    convert(in_place, None, "nvfp4", options, progress=False)
    assert output_tree(in_place) == clean

    server = FakeHub(src)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        result = CliRunner().invoke(cli, ["advise", REPO, "--gpu", "sm_100", "--json"])
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["mtp_format"] == "mxfp4"
        assert not [n for n in server.gets if n.endswith(".safetensors")], "advise downloaded a shard"
        hub = str(tmp_path / "hub")
        result = CliRunner().invoke(cli, ["convert", REPO, hub, "--out", "nvfp4", "--engine", "sglang", "--quiet"])
        assert result.exit_code == 0, result.stderr
        assert output_tree(hub) == clean
    finally:
        server.shutdown()


# DeepSeek-V4-Flash-Vision-Exp ---------------------------------------------------------------------

VISION = "deepseek-v4-flash-vision-exp"


def test_vision_exp_full_scale_is_the_published_index():
    """The counts third-party checkers record of the release's index at 86f746b3, all exact (the
    recipe's source): tensors by group, total_size, and the vision group's BF16 bytes in shard 1."""
    shards = synth.layout(synth.Dims(VISION, full_scale=True))
    names = [s.name for specs in shards for s in specs]
    vision = [s for s in shards[0] if s.name != "embed.weight"]
    assert len(shards) == 48 and len(names) == 72_633
    assert sum(s.nbytes for specs in shards for s in specs) == 167_811_372_792
    assert sum(n.startswith("mtp.") for n in names) == 4_708
    assert len(vision) == 267 and {s.dtype for s in vision} == {"BF16"}
    assert sum(s.nbytes for s in vision) == 932_786_176
    t = _layout(VISION)
    # an image-token bias on every MoE layer and drafter stage; gate.bias on the hash layers too
    assert sum(n.endswith(".ffn.gate.bias_vl") for n in names) == 43 + 3
    assert t["layers.0.ffn.gate.bias"][:2] == ("F32", (256,)) and "layers.0.ffn.gate.tid2eid" in t
    assert t["mtp.2.ffn.gate.bias_vl"][:2] == ("F32", (256,))
    assert t["image_pad"][:2] == ("BF16", (4096,)) and t["aligner.w1.weight"][:2] == ("BF16", (4096, 9216))
    # the rest is 0731's layout, tensor for tensor
    base = _layout("deepseek-v4-flash-0731")
    extra = set(t) - set(base)
    assert set(base) <= set(t) and all(t[n][:2] == base[n][:2] for n in base)
    assert extra == {s.name for s in vision} | {n for n in t if n.endswith(".bias_vl")} | \
        {f"layers.{i}.ffn.gate.bias" for i in range(3)}


def test_vision_exp_config_keeps_the_text_architecture_and_flat_vision_keys():
    config = synth.make_config(synth.Dims(VISION, full_scale=True))
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["model_type"] == "deepseek_v4"
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vision_n_layers", "vision_dim",
                                   "vision_n_heads", "vision_max_n_token", "num_nextn_predict_layers",
                                   "dspark_block_size")} == {
        "hidden_size": 4096, "num_hidden_layers": 43, "vision_n_layers": 32, "vision_dim": 1024,
        "vision_n_heads": 16, "vision_max_n_token": 384, "num_nextn_predict_layers": 3, "dspark_block_size": 5}
    assert ModelSpec.for_config(config, names=list(_layout(VISION))).model_name == VISION


def test_vision_exp_is_told_apart_from_0731():
    """vision_n_layers and the vision tensors make a Vision-Exp checkpoint; either without the other
    is refused in one line naming what was seen."""
    config, names = _config(VISION), _names(VISION)
    assert ModelSpec.for_config(config, names=names).recipe is named_models()[VISION][0]
    assert ModelSpec.for_config(_config("deepseek-v4-flash-0731"),
                                names=_names("deepseek-v4-flash-0731")).name == "deepseek_v4_dspark"
    text_only = [n for n in names if not n.startswith(("vision.", "aligner.", "image_"))]
    with pytest.raises(UnsupportedCheckpoint) as e:
        ModelSpec.for_config(config, "vx/config.json", text_only)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "vx/config.json: model_type 'deepseek_v4', architectures ['DeepseekV4ForCausalLM'] is no kind of checkpoint")
    # the nearest recipe names what it lacks: the vision tensors, or (0731's) a vision_n_layers it forbids
    assert str(e.value).endswith(("no tensor matches ^vision\\.patch_embed\\.proj\\.weight$",
                                  "but config.json has vision_n_layers"))
    without_key = {k: v for k, v in config.items() if k != "vision_n_layers"}
    with pytest.raises(UnsupportedCheckpoint, match="config.json lacks vision_n_layers|tensor vision.* is not one"):
        ModelSpec.for_config(without_key, names=names)


def test_vision_exp_small_converts_the_text_model_and_the_card_says_what_each_engine_does_with_the_tower(tmp_path):
    """A small Vision-Exp checkpoint is detected as itself and converts for the loader-tier releases
    (their rules: vLLM serves the tower, SGLang 0.5.23 skips it and serves the text model); the vision
    tensors are passed through byte for byte and the card says what the release does with them. A
    release whose rules do not cover the family (vLLM 0.32.0, a selection-scope file) is refused in one line."""
    src = str(tmp_path / "vx")
    result = run_cli("synth", src, "--model", VISION)
    assert result.returncode == 0, result.stderr
    with Checkpoint.open(src) as ck:
        assert ModelSpec.for_checkpoint(ck).name == "deepseek_v4_vision"
        assert sum(n.startswith("vision.blocks.0.") for n in ck.names) == 8
        vision = {n: ck.tensor(n) for n in ck.names if n.startswith(("vision.", "aligner.", "image_"))}
    for fmt, engine, tower in (("nvfp4", "vllm==0.34.0", "served"), ("w4a16", "sglang==0.5.23", "ignored")):
        out = str(tmp_path / f"out-{fmt}")
        result = run_cli("convert", src, out, "--out", fmt, "--engine", engine)
        assert result.returncode == 0, result.stderr
        with Checkpoint.open(out) as ck:
            assert all(torch.equal(ck.tensor(n), t) for n, t in vision.items())
            rules = ModelSpec.for_checkpoint(ck).engine(engine)
        assert rules.vision["tower"] == tower
        card = open(os.path.join(out, "README.md")).read()
        assert rules.vision_summary and rules.vision_summary in card
    result = run_cli("convert", src, str(tmp_path / "old"), "--out", "nvfp4", "--engine", "vllm==0.32.0")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "vLLM 0.32.0: requant has no rules for deepseek_v4_vision models (" in lines[0]
    assert not os.path.exists(tmp_path / "old")


def test_vision_exp_verify_and_advise_say_what_each_release_does_with_the_tower(tmp_path):
    """verify and advise judge Vision-Exp by the loader-tier releases' rules and say, per release,
    whether it serves the vision tower or the text model only; a release without rules for the
    family is "not checked" (a warning), never "loads it"."""
    src = str(tmp_path / "vx")
    synth.write_checkpoint(src, synth.Dims(VISION), seed=3)
    result = verify(src, progress=False)
    assert result["ok"], result["findings"]
    notes = {f["message"] for f in result["findings"] if f["code"] == "vision"}
    for name in ("vllm", "sglang"):
        assert result["engines"][name]["checked"] is True and result["engines"][name]["loads"] is True
    assert any(n.startswith("SGLang 0.5.23 serves this model text-only") for n in notes), notes
    assert any(n.startswith("vLLM 0.34.0 serves the vision tower too") for n in notes), notes
    old = verify(src, engine="vllm==0.32.0", progress=False)
    found = [(f["severity"], f["code"]) for f in old["findings"] if f["severity"] != "info"]
    assert found == [("warning", "no-engine-rules")] and old["engines"]["vllm"]["loads"] is None, old["findings"]
    with Checkpoint.open(src) as ck:
        answer = advise(ck, [], "sm_100")
    text = format_advice(answer).splitlines()
    assert sorted(a["engine"] for a in answer["answers"]) == ["sglang", "vllm"]
    for a in answer["answers"]:
        assert a["status"] == "checked" and a["vision"] and f"  vision: {a['vision']}" in text


def test_a_recipe_base_may_have_its_own_base_and_a_circle_is_refused():
    from requant.recipe import RecipeError, parse
    root = os.path.join(os.path.dirname(__file__), "..", "recipes")
    raw = {f: json.load(open(os.path.join(root, f), encoding="utf-8"))
           for f in ("deepseek_v4.json", "deepseek_v4_dspark.json", "deepseek_v4_vision.json")}
    recipe = parse(raw["deepseek_v4_vision.json"], "deepseek_v4_vision.json", raw)
    assert recipe.router == parse(raw["deepseek_v4.json"], "deepseek_v4.json", raw).router
    looped = {**raw, "deepseek_v4.json": {**raw["deepseek_v4.json"], "base": "deepseek_v4_vision.json"}}
    with pytest.raises(RecipeError, match="deepseek_v4_vision.json -> deepseek_v4_dspark.json -> deepseek_v4.json "
                                          "-> deepseek_v4_vision.json is a circle"):
        parse(raw["deepseek_v4_vision.json"], "deepseek_v4_vision.json", looped)
