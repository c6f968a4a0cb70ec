"""Conformance tier, vLLM: serve commands for requant's DeepSeek-V4 outputs through vLLM's own
`vllm serve` argument parser, serve-argument validation and SpeculativeConfig
(tests/engines/vllm_startup.py), for the vLLM release in use (wheels.version("vllm")).
"""

from __future__ import annotations

import json
import shlex

import pytest

from requant import synth
from tests.engines import wheels

if not wheels.available("vllm"):
    pytest.skip(f"vllm=={wheels.version('vllm')} wheel not available in {wheels.CACHE}: vLLM start-up tier skipped",
                allow_module_level=True)

from tests.engines.vllm_startup import vllm_accepts  # noqa: E402
from tests.engines.outputs import SMALL, per_format, source_and_outputs  # noqa: E402

SERVE = "vllm serve {path} --tensor-parallel-size 8 "
MTP1 = """--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'"""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return source_and_outputs(tmp_path_factory.mktemp("vllm_startup"), SMALL, 3, per_format("vllm"))


def accepts(ckpts, flags, fmt="nvfp4", gpu="sm_100"):
    return vllm_accepts(shlex.split(SERVE + flags), ckpts[fmt], gpu)


def test_every_card_command_is_accepted(ckpts):
    """The serve command requant's rules give for each checkpoint kind and GPU family (what the
    model card prints) passes the release's parser, serve validation and SpeculativeConfig, and
    where it drafts, vLLM resolves the MTP draft from the checkpoint's own config."""
    from requant import engines
    from requant.model import ModelSpec

    rules = ModelSpec.for_config(synth.make_config(synth.Dims())).engine("vllm", wheels.version("vllm"))
    checked = 0
    for fmt in ("mxfp4", "nvfp4", "w4a16"):
        for gpu in engines.GPU_FAMILIES:
            how = rules.serving(fmt, gpu, path="{path}", tp=8)
            if not how.starts:
                continue
            ok, message = vllm_accepts(shlex.split(how.command), ckpts[fmt], gpu)
            assert ok, (fmt, gpu, how.command, message)
            if how.speculative:
                assert "method=mtp" in message and "DeepSeekV4MTPModel" in message, (fmt, gpu, message)
            checked += 1
    assert checked, "requant's rules give no vLLM command that starts"


def test_the_mtp_draft_is_the_checkpoint_itself(ckpts):
    """method "mtp" without a model: the draft is the target checkpoint, hf_config_override turns
    deepseek_v4 into deepseek_mtp / DeepSeekV4MTPModel with n_predict = num_nextn_predict_layers."""
    ok, message = accepts(ckpts, MTP1)
    layers = json.loads(open(f"{ckpts['nvfp4']}/config.json").read())["num_nextn_predict_layers"]
    assert ok and f"n_predict={layers}" in message and "draft tp=8" in message, message


@pytest.mark.parametrize("flags,stage", [
    ("--tensor-paralel-size 8", "argument parser"),                                       # mistyped flag
    ("""--speculative-config '{"method": "mtp", "num_speculative_tokens": 1'""", "argument parser"),  # bad JSON
    ("--moe-backend no_such_backend", "argument parser"),                                  # bad choice
    ("""--speculative-config '{"method": "no_such_method", "num_speculative_tokens": 1}'""",
     "speculative config (vllm/config/speculative.py:"),                                  # unknown method
    ("""--speculative-config '{"method": "mtp", "num_speculative_token": 1}'""",
     "speculative config (vllm/config/speculative.py:"),                                  # unknown key
    ("""--speculative-config '{"method": "mtp", "num_speculative_tokens": 0}'""",
     "speculative config (vllm/config/speculative.py:"),                                  # Field(gt=0)
    ("""--speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "tensor_parallel_size": 8}'""",
     "speculative config ("),                                                             # _verify_args
    ("""--speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 4}'""",
     "speculative config ("),                                                             # _verify_and_get_draft_tp
])
def test_refused(ckpts, flags, stage):
    ok, message = accepts(ckpts, flags)
    assert not ok and message.startswith(stage), message


def test_one_mtp_layer_does_not_bound_num_speculative_tokens(ckpts):
    """vLLM's only check of num_speculative_tokens against the draft is divisibility by n_predict
    when it exceeds it (0.33.0 config/speculative.py __post_init__; 0.34.0 speculator_config.py
    DraftModelSpeculatorConfig.resolve_num_speculative_tokens), which n_predict = 1 always
    meets: more tokens rerun the one MTP layer (a logged warning, not a refusal)."""
    ok, message = accepts(ckpts, """--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'""")
    assert ok and "num_speculative_tokens=3" in message and "n_predict=1" in message, message


def test_two_mtp_layers_need_a_multiple(ckpts, tmp_path):
    """The same check does refuse where it can: num_nextn_predict_layers 2, tokens 3."""
    ckpt = tmp_path / "two_mtp"
    ckpt.mkdir()
    config = json.loads(open(f"{ckpts['nvfp4']}/config.json").read())
    config["num_nextn_predict_layers"] = 2
    (ckpt / "config.json").write_text(json.dumps(config))
    spec = """--speculative-config '{"method": "mtp", "num_speculative_tokens": %d}'"""
    ok, message = vllm_accepts(shlex.split(SERVE + spec % 3), str(ckpt), "sm_100")
    assert not ok and "must be divisible by n_predict=2" in message, message
    ok, message = vllm_accepts(shlex.split(SERVE + spec % 4), str(ckpt), "sm_100")
    assert ok and "n_predict=2" in message, message


def test_draft_model_without_a_model_is_refused(ckpts):
    """Only mtp (and dspark) take the target checkpoint as their draft by default; method
    draft_model with no `model` is refused ("num_speculative_tokens was provided but without
    speculative model": 0.33.0 SpeculativeConfig.__post_init__, 0.34.0
    DraftModelSpeculatorConfig.default_model)."""
    ok, message = accepts(ckpts, """--speculative-config '{"method": "draft_model", "num_speculative_tokens": 1}'""")
    assert not ok and "without speculative model" in message and message.startswith("speculative config (vllm/"), message
