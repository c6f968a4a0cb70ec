"""Conformance tier, SGLang: checkpoints with a DSpark drafter (DeepSeek-V4-Flash-0731, V4-Pro-0813
and DeepSeek-V4.1-Flash layouts) and requant's NVFP4 outputs of them, and (V4 DSpark releases) its
W4A16 ones, through SGLang's own code:
its quantization config and MoE methods per layer, the DSpark draft's load_weights
(DeepseekV4ForCausalLMDSpark, models/deepseek_v4_dspark.py) over every mtp.* tensor, and the
DSpark serve command through its option parser and DeepSeek-V4 / speculative hooks.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from requant import engines
from requant.model import ModelSpec
from requant.targets import Options
from tests.engines import wheels

if not wheels.available("sglang"):
    pytest.skip(f"sglang=={wheels.version('sglang')} wheel not available in {wheels.CACHE}: SGLang DSpark tier skipped",
                allow_module_level=True)

from tests.engines import sglang_kernels as K  # noqa: E402
from tests.engines.outputs import (DONOR, DRAFTER_MODE_CASES, DSPARK_MODELS, drafter_mode_name,  # noqa: E402
                                   drafter_mode_refusal, drafter_written, dspark_source_and_outputs, graft_differences)
from tests.engines.sglang_harness import engine, hf_config, reset, sglang_load_report  # noqa: E402
from tests.engines.sglang_startup import sglang_accepts  # noqa: E402

VERSION = wheels.version("sglang")
OUTPUTS = {"nvfp4": ("nvfp4", Options(engine="sglang")),
           "vllm-nvfp4-convert": ("nvfp4", Options(engine="vllm", mtp="convert"))}   # for the negative case
# made for the models whose rules serve W4A16 (the V4 DSpark releases; V4.1's are refused)
W4A16_OUTPUTS = {"w4a16": ("w4a16", Options(engine="sglang")),   # the default: the stages' experts converted
                 "w4a16-drafter-kept": ("w4a16", Options(engine="sglang", mtp="keep", force=True))}   # negative


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    reset()


@pytest.fixture(scope="module", params=sorted(DSPARK_MODELS))
def ckpts(request, tmp_path_factory) -> dict[str, str]:
    return dspark_source_and_outputs(tmp_path_factory.mktemp(f"sglang-dspark-{request.param}"), request.param,
                                     "sglang", VERSION, 13, OUTPUTS, W4A16_OUTPUTS)


def rules_of(path) -> engines.EngineRules:
    return ModelSpec.for_config(json.loads((Path(path) / "config.json").read_text())).engine("sglang", VERSION)


def drafter_problems(report) -> list[str]:
    """The report's findings about the drafter and the routed experts: what this test holds
    requant to. (For V4.1 the main model's vision tower, Engram and bias_vl loading is not
    modelled by sglang_harness, whose main-model stand-in is V4's: those findings are left out.)"""
    return [p for p in report.problems if p.startswith("mtp.") or "stages." in p or ".experts." in p or "DSpark" in p]


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_dspark_stages_load_as_mxfp4(ckpts, name):
    """SGLang drafts with DeepseekV4ForCausalLMDSpark (model_config.py: the checkpoint bundles
    dspark_* keys), one stage per dspark_target_layer_ids entry; loader.py adds stages.* to the
    NVFP4 exclusions, so every stage's experts get the MXFP4 method requant's rules name, and the
    passed-through MXFP4 bytes load into them without a finding."""
    report = sglang_load_report(ckpts[name], "sm_100")
    rules = rules_of(ckpts[name])
    stages = {p: m for p, m in report.methods.items() if p.startswith("stages.")}
    hf = hf_config(ckpts[name])
    assert sorted(stages) == [f"stages.{s}.mlp.experts" for s in range(len(hf["dspark_target_layer_ids"]))]
    kernel = rules.kernel(name, "sm_100")
    assert set(stages.values()) == {kernel.mtp_path["method"]}, stages
    assert rules.mtp_format(name) == "mxfp4"
    assert {m for p, m in report.methods.items() if p.startswith("model.layers.")} == {kernel.method}
    assert drafter_problems(report) == [], drafter_problems(report)
    assert any(k.startswith("w13_weight <- ") for k in report.loads)


# what sglang_harness's V4 main-model stand-in does not build for V4.1 (vision=None, layers without
# Engram): findings naming only these are the harness's limit, not requant's output
V41_UNMODELLED = ("vision.", "aligner.", "image_", ".engram.", "bias_vl")


def test_every_tensor_loads(ckpts):
    """Every tensor of the source and of the NVFP4 (and, where served, W4A16) output reaches a
    parameter of the right kind, main model and drafter, but those the rules say this release
    skips (Vision-Exp's vision tower); for V4.1, everything but the parts the harness does not model."""
    for name in [n for n in ("mxfp4", "nvfp4", "w4a16") if n in ckpts]:
        problems = sglang_load_report(ckpts[name], "sm_100").problems
        if hf_config(ckpts[name])["model_type"] == "deepseek_v41":
            problems = [p for p in map(modelled_part, problems) if p]
        assert unclaimed(ckpts[name], problems) == [], name


def unclaimed(path, problems: list[str]) -> list[str]:
    """The findings less those about tensors this release's rules say its loader skips."""
    claimed = skipped_by_rules(path)
    remap = engine().model.remap_weight_name_to_dpsk_hf_format
    # SGLang names a skipped tensor by its remapped name in its 'not found in params_dict' warning
    claimed |= {remap(n) for n in claimed}
    return [p for p in problems if re.split(r":? ", p, maxsplit=1)[0] not in claimed]


def skipped_by_rules(path) -> set[str]:
    """The checkpoint's tensors this release's rules say its loader skips."""
    with open(Path(path) / "model.safetensors.index.json") as f:
        names = json.load(f)["weight_map"]
    return rules_of(path).vision_skipped(names, hf_config(path).get("num_hash_layers", 0))


def test_vision_tower_is_skipped_as_the_rules_say(ckpts):
    """Vision-Exp (model_type deepseek_v4 with vision_n_layers): SGLang builds no vision tower for
    it and loads the text model; the tensors its load_weights loads into nothing (main model, and
    the draft's remap drops) are exactly those the rules' vision entry names, in the source and
    each output, and the rules call the tower ignored exactly when there are any. For the other
    families the rules name none and the loaders skip none (V4.1: its tower is not modelled here)."""
    for name in [n for n in ("mxfp4", "nvfp4", "w4a16") if n in ckpts]:
        if hf_config(ckpts[name])["model_type"] == "deepseek_v41":
            pytest.skip("V4.1's vision tower and bias_vl are not modelled by sglang_harness")
        report = sglang_load_report(ckpts[name], "sm_100")
        # a DSpark checkpoint's confidence head: SGLang builds none while SGLANG_RAGGED_VERIFY_MODE
        # is static (its default), for every DSpark family
        skipped = {n for n in report.skipped if ".confidence_head." not in n}
        expected = skipped_by_rules(ckpts[name])
        assert skipped == expected, (name, sorted(skipped ^ expected))
        assert (rules_of(ckpts[name]).vision.get("tower") == "ignored") == bool(expected)


def modelled_part(problem: str) -> str:
    """A V4.1 finding less the parameters or tensors V41_UNMODELLED names ('' when nothing is left)."""
    names = re.findall(r"'([^']+)'", problem)
    if problem.startswith("parameters left at their initial values") and names:
        rest = [n for n in names if not any(part in n for part in V41_UNMODELLED)]
        return f"parameters left at their initial values: {rest}" if rest else ""
    return "" if any(part in problem for part in V41_UNMODELLED) else problem


@pytest.mark.parametrize("fmt,mode", DRAFTER_MODE_CASES)
def test_each_drafter_mode_loads_with_the_rules_method_or_is_refused(ckpts, fmt, mode):
    """convert --drafter keep|convert|graft per output format: where this release's rules allow the mode,
    each stage's experts get the draft method the rules' kernel cell names and the drafter loads
    without a finding; where they do not, convert refuses it in one line."""
    rules, written = rules_of(ckpts["mxfp4"]), drafter_written(fmt, mode)
    name = drafter_mode_name(fmt, mode)
    if name not in ckpts:
        message = drafter_mode_refusal(ckpts["mxfp4"], "sglang", VERSION, fmt, mode)
        assert "\n" not in message and (rules.refusal(fmt) or not rules.mtp_loads(fmt, written)), message
        return
    assert rules.mtp_format(fmt) == written
    report = sglang_load_report(ckpts[name], "sm_100")
    stages = {p: m for p, m in report.methods.items() if p.startswith("stages.")}
    assert len(stages) == len(hf_config(ckpts[name])["dspark_target_layer_ids"])
    assert set(stages.values()) == {rules.kernel(fmt, "sm_100").mtp_path["method"]}, stages
    assert drafter_problems(report) == [], drafter_problems(report)
    if mode == "graft":   # the donor's drafter, byte for byte
        assert graft_differences(ckpts[name], ckpts[DONOR]) == []


def test_converted_stages_are_skipped(ckpts):
    """The layout vLLM also loads (stages converted to NVFP4, ignore leaving them out) is not one
    SGLang loads: the stages stay MXFP4 there, so the NVFP4 scale tensors reach no parameter."""
    problems = drafter_problems(sglang_load_report(ckpts["vllm-nvfp4-convert"], "sm_100"))
    assert any("weight_scale_2" in p and "stages." in p for p in problems), problems


# ------------------------------------------------------------------------------------- W4A16
def w4a16_output(ckpts, name: str = "w4a16") -> str:
    if name not in ckpts:
        pytest.skip("V4.1 W4A16 is refused by the rules (test_w4a16_is_served_for_v4_dspark_only holds that)")
    return ckpts[name]


def test_w4a16_is_served_for_v4_dspark_only(ckpts):
    rules = rules_of(ckpts["mxfp4"])
    if hf_config(ckpts["mxfp4"])["model_type"] == "deepseek_v41":
        assert rules.refusal("w4a16").startswith("not established") and "w4a16" not in ckpts
    else:
        assert rules.refusal("w4a16") is None and rules.mtp_format("w4a16") == "w4a16"
        assert rules.layout("w4a16", "fp8_linears") == "linear_fp8_config" and "w4a16" in ckpts


@pytest.mark.parametrize("gpu", sorted(engines.GPU_FAMILIES))
def test_w4a16_stages_load_as_int4(ckpts, gpu):
    """The draft takes the target's compressed-tensors config: every stage's experts
    (stages.<s>.mlp.experts) match the INT4 group and get the method the rules' w4a16 cells name for
    the draft; loader.py's stages.* exclusion is the NVFP4 config's only. main_proj and the stages'
    attention get Fp8LinearMethod from linear_fp8_config, so their E8M0 .scale tensors load as
    weight_scale_inv; every mtp.* tensor reaches a parameter (or is one the rules say is skipped),
    with no finding."""
    path = w4a16_output(ckpts)
    report, rules = sglang_load_report(path, gpu), rules_of(path)
    kernel = rules.kernel("w4a16", gpu)
    stages = {p: m for p, m in report.methods.items() if p.startswith("stages.")}
    assert sorted(stages) == [f"stages.{s}.mlp.experts" for s in range(len(hf_config(path)["dspark_target_layer_ids"]))]
    assert set(stages.values()) == {kernel.mtp_path["method"]}, stages
    assert {m for p, m in report.methods.items() if p.startswith("model.layers.")} == {kernel.method}
    assert unclaimed(path, report.problems) == []
    assert report.loads["w13_weight_packed <- int32"]
    assert report.loads["stages.0.main_proj.weight_scale_inv <- float8_e8m0fnu"]


def test_w4a16_drafter_bytes_are_the_sources_but_its_experts(ckpts):
    """linear_fp8_config describes the FP8-block linears as they ship: every drafter tensor but the
    routed experts keeps the source's name and bytes; the experts are INT4 (the rules' mtp_experts)."""
    src, out = _tensors(ckpts["mxfp4"], "mtp."), _tensors(w4a16_output(ckpts), "mtp.")
    spec = ModelSpec.for_config(hf_config(ckpts["mxfp4"]))
    experts = {n for n in src if spec.expert_tensor(n)}
    assert experts and not experts & set(out)
    assert {n: src[n] for n in set(src) - experts} == {n: out[n] for n in set(src) - experts}
    assert any(n.endswith(".weight_packed") for n in out)


def _tensors(path: str, prefix: str) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, bytes) of the checkpoint's tensors under `prefix`."""
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        if name.startswith(prefix):
            with safe_open(str(Path(path, shard)), "pt") as f:
                t = f.get_tensor(name)
            out[name] = (str(t.dtype), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def test_w4a16_with_the_drafter_kept_mxfp4_does_not_load(ckpts):
    """Why the rule converts the stages: they get the INT4 method whatever their bytes, so MXFP4
    stages (--mtp keep --force) reach none of its parameters: SGLang skips them with a warning and
    serves the stages' INT4 parameters uninitialised."""
    report = sglang_load_report(w4a16_output(ckpts, "w4a16-drafter-kept"), "sm_100")
    assert {m for p, m in report.methods.items() if p.startswith("stages.")} == {"CompressedTensorsWNA16MoE"}
    problems = "\n".join(drafter_problems(report))
    assert "mtp.0.ffn.experts.0.w1.weight: reaches no parameter (SGLang skips it)" in problems, problems
    assert re.search(r"parameters left at their initial values .*'stages\.0\.mlp\.experts\.w13_weight_packed'",
                     problems), problems


# ----------------------------------------------------------------------- the serve command
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "w4a16"])
def test_card_commands_start_dspark(ckpts, fmt):
    """The command requant's rules give per GPU family goes through SGLang's option parser, its
    DeepSeek-V4 model override and hook (EAGLE or DSPARK only) and _handle_dspark (the draft path
    defaults to the checkpoint, which bundles dspark_* keys); where the drafter's MXFP4 method has
    a kernel for the GPU in the pinned FlashInfer, the command drafts."""
    path = w4a16_output(ckpts) if fmt == "w4a16" else ckpts[fmt]
    rules = rules_of(path)
    assert rules.data["serve"]["speculative"] == "--speculative-algorithm DSPARK"
    for gpu in engines.GPU_FAMILIES:
        how = rules.serving(fmt, gpu, path="{path}", tp=8)
        if not how.starts:
            continue
        ok, message = sglang_accepts(shlex.split(how.command), path, gpu, kernels=K.flashinfer_available())
        assert ok, (fmt, gpu, how.command, message)
        if how.speculative:
            assert "speculative_algorithm=DSPARK (steps 1, topk 1, draft tokens" in message, message


def test_dspark_draft_tokens_must_be_gamma_plus_one(ckpts):
    base = "python -m sglang.launch_server --model-path {path} --tp 8 --speculative-algorithm DSPARK "
    ok, message = sglang_accepts(shlex.split(base + "--speculative-dspark-block-size 5"), ckpts["mxfp4"], "sm_100",
                                 kernels=False)
    assert ok and "draft tokens 6)" in message, message
    flags = "--speculative-dspark-block-size 5 --speculative-num-draft-tokens 3"
    ok, message = sglang_accepts(shlex.split(base + flags), ckpts["mxfp4"], "sm_100", kernels=False)
    assert not ok and "must equal gamma + 1" in message and "speculative_hook.py:" in message, message
