"""Conformance tier, vLLM: checkpoints with a DSpark drafter (DeepSeek-V4-Flash-0731, V4-Pro-0813
and DeepSeek-V4.1-Flash layouts) and requant's NVFP4 outputs of them, and (V4 DSpark releases)
its W4A16 ones, through the vLLM release's own loading code (vllm_harness.py: the deepseek_v4_fp8
config class vLLM builds on CUDA, or its compressed-tensors config, the main model's and the DSpark
draft's load_weights of each family) and its own start-up code for the DSpark serve command
(vllm_startup.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from requant import engines
from requant.model import ModelSpec, named_models
from requant.targets import Options

from . import wheels

if not wheels.available("vllm"):
    pytest.skip(f"vllm=={wheels.version('vllm')} wheel not available in {wheels.CACHE}: vLLM DSpark tier skipped",
                allow_module_level=True)

from . import vllm_harness as vllm  # noqa: E402
from .outputs import (DONOR, DRAFTER_MODE_CASES, DSPARK_MODELS, drafter_mode_name, drafter_mode_refusal,  # noqa: E402
                      drafter_written, dspark_source_and_outputs, graft_differences, with_ignore)
from .vllm_startup import vllm_accepts  # noqa: E402

VERSION = wheels.version("vllm")
DRAFT_ARCH = {"deepseek_v4": "DSparkDraftModel", "deepseek_v41": "DSparkV41DraftModel"}
OUTPUTS = {
    "vllm-nvfp4": ("nvfp4", Options(engine="vllm")),                      # the default: drafter passed through
    "vllm-nvfp4-convert": ("nvfp4", Options(engine="vllm", mtp="convert")),
    "sglang-nvfp4": ("nvfp4", Options(engine="sglang")),
}
# made for the models whose rules serve W4A16 (the V4 DSpark releases; V4.1's are refused)
W4A16_OUTPUTS = {
    "vllm-w4a16": ("w4a16", Options(engine="vllm")),   # the default: the stages' experts converted
    "vllm-w4a16-drafter-kept": ("w4a16", Options(engine="vllm", mtp="keep", force=True)),   # the negative case
}


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    vllm.reset()


@pytest.fixture(scope="module", params=sorted(DSPARK_MODELS))
def ckpts(request, tmp_path_factory) -> dict[str, str]:
    return dspark_source_and_outputs(tmp_path_factory.mktemp(f"vllm-dspark-{request.param}"), request.param,
                                     "vllm", VERSION, 11, OUTPUTS, W4A16_OUTPUTS)


def rules(ckpt: vllm.Checkpoint) -> engines.EngineRules:
    return ModelSpec(ckpt.spec.recipe, ckpt.config).engine("vllm", VERSION)


def test_the_checkpoints_are_dspark_ones(ckpts):
    ckpt = vllm.Checkpoint(ckpts["mxfp4"])
    assert ckpt.dspark and ckpt.spec.recipe.name in (("deepseek_v41",) if ckpt.v41 else
                                                     ("deepseek_v4_dspark", "deepseek_v4_vision"))
    assert rules(ckpt).drafter["kind"] == "dspark"
    # W4A16: established for the V4 DSpark releases (the drafter converted), refused for V4.1
    if ckpt.v41:
        assert rules(ckpt).refusal("w4a16").startswith("not established") and "vllm-w4a16" not in ckpts
    else:
        assert rules(ckpt).refusal("w4a16") is None and rules(ckpt).mtp_format("w4a16") == "w4a16"
        assert rules(ckpt).layout("w4a16", "fp8_linears") == "config_group" and "vllm-w4a16" in ckpts
    stages = [b for b, _ in vllm.expert_blocks(ckpt) if b.startswith("mtp.")]
    assert stages == [f"mtp.{s}" for s in range(vllm.dspark_stage_count(ckpt))] and len(stages) == 3
    stored = {n.split(".")[1] for n in ckpt.header if n.startswith("mtp.") and ".experts." in n}
    assert stored == {"0", "1", "2"}


@pytest.mark.parametrize("name", ["mxfp4", "vllm-nvfp4", "vllm-nvfp4-convert", "sglang-nvfp4"])
def test_vllm_loads_every_tensor(ckpts, name):
    """Every tensor, the three DSpark stages included (DSparkDeepseekV4ForCausalLM.load_weights),
    reaches a parameter of the method vLLM dispatches for its layer, with its bits; that method is
    the one requant's rules name for the stage given the output's `ignore`. (V4.1: through its own
    model.py and dspark.py loaders; its MXFP8 linears, Engram tables and vision tower are followed
    by name, their parameters not built: see vllm_load_report.)"""
    assert vllm.vllm_load_report(ckpts[name]) == []


@pytest.mark.parametrize("name", ["mxfp4", "vllm-nvfp4", "vllm-w4a16"])
def test_vision_tower_is_served_as_the_rules_say(ckpts, name):
    """Vision-Exp keeps architectures DeepseekV4ForCausalLM; vLLM's arch convertor turns it into the
    VL wrapper DeepseekV4ForConditionalGeneration, exactly where the rules say the tower is served,
    and the wrapper's mapper keeps every vision.*, aligner.* and image_* tensor under its own name
    (images allowed), for the source and each output format; test_vllm_loads_every_tensor and
    test_w4a16_loads_every_tensor_with_the_rules_methods hold that the rest loads beside them.
    A family without a vision tower has no vision rules and loads through DeepseekV4ForCausalLM."""
    if vllm.Checkpoint(ckpts["mxfp4"]).v41:
        pytest.skip("V4.1's vision tower loads through deepseek_v41's own wrapper, not V4's")
    ckpt = vllm.Checkpoint(ckpts[name])
    vision = sorted(n for n in ckpt.header if n.startswith(("vision.", "aligner.", "image_")))
    tower = rules(ckpt).vision.get("tower")
    assert ckpt.vl == (tower == "served") == bool(vision)
    if vision:
        mapper = vllm.vl_weights_mapper(ckpt)
        assert [mapper.map_name(n) for n in vision] == vision


@pytest.mark.parametrize("name,drafter", [("vllm-nvfp4", "mxfp4"), ("vllm-nvfp4-convert", "nvfp4"),
                                          ("sglang-nvfp4", "mxfp4")])
def test_drafter_dispatch_follows_ignore_as_the_rules_say(ckpts, name, drafter):
    ckpt = vllm.Checkpoint(ckpts[name])
    dispatch, rule = vllm.dispatch(ckpt), rules(ckpt)
    ignore = ckpt.quant.get("ignore")
    for block, prefix in vllm.expert_blocks(ckpt):
        fmt = ckpt.expert_format(block)
        if block.startswith("mtp."):
            assert fmt == drafter == rule.mtp_format_for("nvfp4", block, ignore), (block, fmt)
        for gpu in vllm.GPUS:
            assert type(dispatch.moe(prefix)).__name__ == rule.kernel(fmt, gpu).method, (block, gpu)


def test_default_output_passes_the_drafter_through_byte_for_byte(ckpts):
    src, out = vllm.Checkpoint(ckpts["mxfp4"]), vllm.Checkpoint(ckpts["vllm-nvfp4"])
    drafter = [n for n in src.header if n.startswith("mtp.")]
    assert drafter and set(drafter) <= set(out.header)
    for name in drafter:
        assert out.header[name] == src.header[name], name
        assert out.tensor(name).view(-1).view(torch.uint8).equal(src.tensor(name).view(-1).view(torch.uint8)), name


def test_kept_stages_outside_ignore_load_as_garbage(ckpts, tmp_path):
    """The rule's other half: MXFP4 stages that `ignore` does not list get ModelOptNvFp4FusedMoE,
    their E8M0 scales copied by value and no global or input scales: no error, garbage drafts."""
    problems = vllm.vllm_load_report(with_ignore(ckpts["vllm-nvfp4"], tmp_path / "bad", ["*.attn.*"]))
    assert problems and all("mtp." in p for p in problems), problems
    for stage in range(3):
        assert f"mtp.{stage}: w13_weight_scale_2 never written" in "\n".join(problems), stage
    assert rules(vllm.Checkpoint(ckpts["vllm-nvfp4"])).mtp_format_for("nvfp4", "mtp.0", ["*.attn.*"]) == "nvfp4"


@pytest.mark.parametrize("fmt,mode", DRAFTER_MODE_CASES)
def test_each_drafter_mode_loads_with_the_rules_method_or_is_refused(ckpts, fmt, mode):
    """convert --drafter keep|convert|graft per output format: where this release's rules allow the mode,
    every tensor loads and each stage's experts, written as the mode says, get the method the rules
    name for the stage given the output's ignore; where they do not, convert refuses it in one line."""
    rule, written = rules(vllm.Checkpoint(ckpts["mxfp4"])), drafter_written(fmt, mode)
    name = drafter_mode_name(fmt, mode)
    if name not in ckpts:
        message = drafter_mode_refusal(ckpts["mxfp4"], "vllm", VERSION, fmt, mode)
        assert "\n" not in message and (rule.refusal(fmt) or not rule.mtp_loads(fmt, written)), message
        return
    assert vllm.vllm_load_report(ckpts[name]) == []
    ckpt = vllm.Checkpoint(ckpts[name])
    dispatch, ignore = vllm.dispatch(ckpt), ckpt.quant.get("ignore")
    stages = [(b, p) for b, p in vllm.expert_blocks(ckpt) if b.startswith("mtp.")]
    assert len(stages) == vllm.dspark_stage_count(ckpt)
    for block, prefix in stages:
        assert ckpt.expert_format(block) == written == rule.mtp_format_for(fmt, block, ignore), block
        for gpu in vllm.GPUS:
            assert type(dispatch.moe(prefix)).__name__ == rule.kernel(written, gpu).method, (block, gpu)
    if mode == "graft":   # the donor's drafter, byte for byte
        assert graft_differences(ckpts[name], ckpts[DONOR]) == []


# ------------------------------------------------------------------------------------- W4A16
# the models whose W4A16 output the rules establish (V4.1's is refused, which
# test_the_checkpoints_are_dspark_ones holds): the W4A16 tests run on these only, so none skips
W4A16_MODELS = [m for m in sorted(DSPARK_MODELS) if engines.rules_for(
    named_models()[DSPARK_MODELS[m].model][0], "vllm", VERSION).refusal("w4a16") is None]
on_w4a16_models = pytest.mark.parametrize("ckpts", W4A16_MODELS, indirect=True)


def w4a16_output(ckpts, name: str = "vllm-w4a16") -> str:
    return ckpts[name]


@on_w4a16_models
def test_w4a16_loads_every_tensor_with_the_rules_methods(ckpts):
    """The draft takes the target's compressed-tensors config: every stage's experts, built as
    model.layers.<num_hidden_layers + s>.ffn.experts, match the INT4 group (the method the rules'
    w4a16 kernel cells name), and DSparkDeepseekV4ForCausalLM.load_weights puts every mtp.* tensor
    into a parameter of its layer's method with its bits; main_proj, context_wkv_proj (from the
    stages' attn.wkv) and the stages' attention get the FP8-block group."""
    path = w4a16_output(ckpts)
    assert vllm.vllm_load_report(path) == []
    ckpt = vllm.Checkpoint(path)
    dispatch, rule = vllm.dispatch(ckpt), rules(ckpt)
    stages = [(b, p) for b, p in vllm.expert_blocks(ckpt) if b.startswith("mtp.")]
    assert len(stages) == vllm.dspark_stage_count(ckpt) == 3
    for block, prefix in stages:
        assert ckpt.expert_format(block) == rule.mtp_format("w4a16") == "w4a16", block
        for gpu in vllm.GPUS:
            assert type(dispatch.moe(prefix)).__name__ == rule.kernel("w4a16", gpu).method, (block, gpu)
    for prefix in ("model.main_proj", "model.context_wkv_proj", f"model.layers.{ckpt.layers}.attn.fused_wqa_wkv"):
        method = vllm.build_linear_method(dispatch.linear(prefix))
        assert getattr(method, "weight_block_size", None) == [128, 128], (prefix, dispatch.linear(prefix))


@on_w4a16_models
def test_w4a16_drafter_bytes_are_the_sources_but_its_experts(ckpts):
    """Every drafter tensor but the routed experts keeps the source's bytes; the FP8-block scales
    take the compressed-tensors name, their E8M0 powers of two re-typed exactly as F32 (the rules'
    fp8_linears: config_group); the experts are INT4 (the rules' mtp_experts)."""
    src, out = vllm.Checkpoint(ckpts["mxfp4"]), vllm.Checkpoint(w4a16_output(ckpts))
    drafter = [n for n in src.header if n.startswith("mtp.")]
    experts = [n for n in drafter if src.spec.expert_tensor(n)]
    assert experts and not set(experts) & set(out.header)
    for name in sorted(set(drafter) - set(experts)):
        if src.header[name][0] == "F8_E8M0":
            renamed = name.removesuffix("scale") + "weight_scale"
            assert out.header[renamed] == ("F32", src.header[name][1]), name
            assert out.tensor(renamed).equal(src.tensor(name).to(torch.float32)), name   # torch's E8M0 is exact
            continue
        assert out.header[name] == src.header[name], name
        assert out.tensor(name).view(-1).view(torch.uint8).equal(src.tensor(name).view(-1).view(torch.uint8)), name
    assert out.header["mtp.0.main_proj.weight_scale"][0] == "F32"


@on_w4a16_models
def test_w4a16_with_the_drafter_kept_mxfp4_does_not_load(ckpts, tmp_path):
    """Why the rule converts the stages: their experts get the INT4 method whatever their bytes,
    so MXFP4 stages (--mtp keep --force) fail its parameters' shapes; naming them in ignore gives
    them the unquantized BF16 method, not an MXFP4 one."""
    path = w4a16_output(ckpts, "vllm-w4a16-drafter-kept")
    problems = vllm.vllm_load_report(path)
    assert problems and all("mtp." in p for p in problems), problems
    # the MXFP4 .scale, renamed .weight_scale (dspark.py), meets the INT4 group scales' shape
    assert any("DSparkDeepseekV4ForCausalLM.load_weights raises" in p and "mtp." in p for p in problems), problems
    ckpt = vllm.Checkpoint(path)
    stages = [p for b, p in vllm.expert_blocks(ckpt) if b.startswith("mtp.")]
    layers = "|".join(p.split(".")[2] for p in stages)   # model.layers.<num_hidden_layers + s>.ffn.experts
    ignore = ckpt.quant["ignore"] + [rf"re:.*\.layers\.({layers})\.ffn\.experts\..*"]
    ignored = vllm.dispatch(vllm.Checkpoint(with_ignore(path, tmp_path / "stages-ignored", ignore)))
    assert {type(ignored.moe(p)).__name__ for p in stages} == {"UnquantizedFusedMoEMethod"}


# ----------------------------------------------------------------------- the serve command
@pytest.fixture
def startup():
    """vllm_startup resolves `vllm.*` imports itself: the loader tests' stand-in modules leave first."""
    vllm.reset()


def test_card_commands_start_the_dspark_draft(ckpts, startup):
    """The command requant's rules give per output format and GPU family passes vLLM's parser,
    serve validation and SpeculativeConfig, which resolves the draft to DSparkDraftModel (the
    drafter under mtp.*, served by DSparkDeepseekV4ForCausalLM)."""
    rule = rules(vllm.Checkpoint(ckpts["vllm-nvfp4"]))
    served = [("nvfp4", "vllm-nvfp4"), ("mxfp4", "mxfp4")] + [("w4a16", "vllm-w4a16")] * ("vllm-w4a16" in ckpts)
    checked = 0
    for fmt, name in served:
        for gpu in engines.GPU_FAMILIES:
            how = rule.serving(fmt, gpu, path="{path}", tp=8)
            assert how.starts and how.speculative, (fmt, gpu, how.note)
            ok, message = vllm_accepts(shlex.split(how.command), ckpts[name], gpu)
            arch = DRAFT_ARCH[json.loads(Path(ckpts[name], "config.json").read_text())["model_type"]]
            assert ok and "method=dspark" in message and f"['{arch}']" in message, (fmt, gpu, message)
            checked += 1
    assert checked == 4 * len(served)


def test_dspark_without_token_count(ckpts, startup):
    """`{"method": "dspark"}` alone: 0.33.0 asks for num_speculative_tokens (speculative.py:1252
    takes the target checkpoint as the draft only when it is given); 0.34.0's DSpark speculator
    takes dspark_block_size from config.json."""
    command = """vllm serve {path} --tensor-parallel-size 8 --speculative-config '{"method": "dspark"}'"""
    ok, message = vllm_accepts(shlex.split(command), ckpts["vllm-nvfp4"], "sm_100")
    if engines.version_key(VERSION) >= (0, 34):
        config = json.loads(Path(ckpts["vllm-nvfp4"], "config.json").read_text())
        block = config.get("text_config", config)["dspark_block_size"]
        assert ok and f"num_speculative_tokens={block}" in message, message
    else:
        assert not ok and "num_speculative_tokens must be provided" in message, message
