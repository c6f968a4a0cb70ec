"""Conformance tier, SGLang: serve commands for requant's DeepSeek-V4 outputs through SGLang's own
option parser, DeepSeek-V4 hook, speculative hook and MoE start-up (tests/engines/sglang_startup.py).

Call `sglang_accepts(argv, checkpoint_dir, gpu)` over every command a model card prints to hold
the cards to the engine; this file holds the speculative-decoding rules themselves.
"""

from __future__ import annotations

import ast
import shlex

import pytest

from requant import synth
from tests.engines import wheels

if not wheels.available("sglang"):
    pytest.skip(f"sglang=={wheels.version('sglang')} wheel not available in {wheels.CACHE}: SGLang tier skipped",
                allow_module_level=True)

from tests.engines import sglang_kernels as K  # noqa: E402
from tests.engines.sglang_harness import SRT, reset  # noqa: E402
from tests.engines.sglang_startup import sglang_accepts  # noqa: E402
from tests.engines.outputs import SMALL, per_format, source_and_outputs  # noqa: E402

if not K.flashinfer_available():
    pytest.skip(f"flashinfer_python=={K.flashinfer_pin()} wheel not in {wheels.CACHE}", allow_module_level=True)

LAUNCH = "python -m sglang.launch_server --model-path {path} --tp 8 "
EAGLE1 = "--speculative-algorithm EAGLE --speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 2"


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    reset()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return source_and_outputs(tmp_path_factory.mktemp("sglang_startup"), SMALL, 3, per_format("sglang"))


def accepts(ckpts, fmt, gpu, flags):
    return sglang_accepts(shlex.split(LAUNCH + flags), ckpts[fmt], gpu)


def test_the_dsv4_hook_runs_before_nextn_becomes_eagle():
    """pipeline.py: handle_model_specific_adjustments (which calls apply_deepseek_v4_defaults)
    runs before handle_speculative_decoding, where NEXTN is aliased to EAGLE."""
    src = wheels.source("sglang", SRT + "arg_groups/pipeline.py")
    calls = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "run_hook" and isinstance(node.args[0], ast.Name):
            calls.setdefault(node.args[0].id, node.lineno)
    assert calls["handle_model_specific_adjustments"] < calls["handle_speculative_decoding"]


@pytest.mark.parametrize("fmt,gpu,flags,stage", [
    ("nvfp4", "sm_100", "--speculative-algorithm NEXTN", "deepseek_v4_hook.py:"),
    ("w4a16", "sm_90", "--moe-runner-backend marlin --speculative-algorithm NEXTN", "deepseek_v4_hook.py:"),
    ("mxfp4", "sm_100", "--speculative-algorithm nextn", "deepseek_v4_hook.py:"),
    ("mxfp4", "sm_100", "--speculative-algorithm eagle --speculative-eagle-topk 1 --speculative-num-steps 1",
     "deepseek_v4_hook.py:"),   # compared before upper-casing
    ("mxfp4", "sm_100", "--speculative-algorithm EAGLE", "deepseek_v4_hook.py:"),                   # topk unset
    ("mxfp4", "sm_100", "--speculative-algorithm EAGLE --speculative-eagle-topk 2 --speculative-num-steps 1",
     "deepseek_v4_hook.py:"),
    ("mxfp4", "sm_100", "--speculative-algorithm EAGLE --speculative-eagle-topk 1", "speculative_hook.py:"),  # steps unset
    ("mxfp4", "sm_100", "--speculative-algorithm DSPARK", "speculative_hook.py:"),   # no DSpark draft in the checkpoint
    ("mxfp4", "sm_100", "--moe-runner-backend no_such_backend", "argument parser"),
])
def test_refused(ckpts, fmt, gpu, flags, stage):
    ok, message = accepts(ckpts, fmt, gpu, flags)
    assert not ok and stage in message, message


@pytest.mark.parametrize("fmt,gpu,flags", [
    ("mxfp4", "sm_100", EAGLE1),
    ("mxfp4", "sm_120", EAGLE1),
    ("mxfp4", "sm_90", EAGLE1),
    ("nvfp4", "sm_100", "--speculative-algorithm EAGLE --speculative-eagle-topk 1 --speculative-num-steps 3"),
    ("nvfp4", "sm_120", "--moe-runner-backend flashinfer_cutlass"),
    ("nvfp4", "sm_90", "--moe-runner-backend marlin"),
    ("w4a16", "sm_90", "--moe-runner-backend marlin " + EAGLE1),
    ("w4a16", "sm_120", "--moe-runner-backend marlin " + EAGLE1),
])
def test_accepted(ckpts, fmt, gpu, flags):
    ok, message = accepts(ckpts, fmt, gpu, flags)
    assert ok, message


def test_draft_tokens_follow_the_steps(ckpts):
    """_handle_eagle_family: with topk 1, speculative_num_draft_tokens becomes num_steps + 1."""
    ok, message = accepts(ckpts, "mxfp4", "sm_100", "--speculative-algorithm EAGLE --speculative-eagle-topk 1 "
                                                     "--speculative-num-steps 2 --speculative-num-draft-tokens 8")
    assert ok and "(steps 2, topk 1, draft tokens 3)" in message, message


@pytest.mark.parametrize("gpu", ["sm_80", "sm_90", "sm_120"])
def test_nvfp4_nextn_has_no_kernel_off_sm100(ckpts, gpu):
    """The NextN experts' Mxfp4FlashinferTrtllmMoEMethod (whatever the backend) needs TRT-LLM-gen
    cubins FlashInfer ships for sm100/sm103 only; the main layers run with the backend given."""
    backend = "flashinfer_cutlass" if gpu == "sm_120" else "marlin"
    ok, message = accepts(ckpts, "nvfp4", gpu, f"--moe-runner-backend {backend} " + EAGLE1)
    assert not ok and message.startswith("kernel: NextN experts' Mxfp4FlashinferTrtllmMoEMethod"), message
    assert accepts(ckpts, "nvfp4", gpu, f"--moe-runner-backend {backend}")[0]


def test_nvfp4_default_backend_on_sm120_has_no_kernel(ckpts):
    ok, message = accepts(ckpts, "nvfp4", "sm_120", "")
    assert not ok and "ModelOptNvFp4FusedMoEMethod on flashinfer_trtllm_routed has no kernel for sm_120" in message
    assert sglang_accepts(shlex.split(LAUNCH), ckpts["nvfp4"], "sm_120", kernels=False)[0]   # Python start-up passes


def test_every_card_command_starts_and_the_unserveable_ones_do_not(ckpts):
    """The serve command requant's rules give for each checkpoint kind and GPU family (the model
    card's, advise's, the README table's) is accepted by the release's own start-up code, kernels
    included; where the rules say it cannot start, the bare command is refused too."""
    from requant import engines
    from requant.model import ModelSpec

    rules = ModelSpec.for_config(synth.make_config(synth.Dims())).engine("sglang", wheels.version("sglang"))
    for fmt in ("mxfp4", "nvfp4", "w4a16"):
        for gpu in engines.GPU_FAMILIES:
            how = rules.serving(fmt, gpu, path="{path}", tp=8)
            if how.starts:
                ok, message = sglang_accepts(shlex.split(how.command), ckpts[fmt], gpu)
                assert ok, (fmt, gpu, how.command, message)
            bare = rules.data["serve"]["command"].format(path="{path}", tp=8) + " " + rules.data["serve"]["speculative"]
            ok, _ = sglang_accepts(shlex.split(bare), ckpts[fmt], gpu)
            assert ok == (how.starts and not how.flags and how.speculative), (fmt, gpu, bare)
