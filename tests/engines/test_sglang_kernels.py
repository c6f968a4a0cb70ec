"""Conformance tier, SGLang: the MoE kernel table (checkpoint kind x GPU family x
--moe-runner-backend) as SGLang's own code selects it, held to the expected table.

The selection (backend override, method dispatch, refusals) is SGLang's code executed from the
release wheel (tests/engines/sglang_kernels.py, sglang_harness.py); whether the kernel is built
for the GPU is read from the FlashInfer wheel the sglang wheel pins. A release that changes any
cell fails test_kernel_table_is_the_engines.
"""

from __future__ import annotations

import copy

import pytest

from requant import engines
from tests.engines import wheels

if not wheels.available("sglang"):
    pytest.skip(f"sglang=={wheels.version('sglang')} wheel not available in {wheels.CACHE}: SGLang tier skipped",
                allow_module_level=True)

from tests.engines import sglang_kernels as K  # noqa: E402
from tests.engines.sglang_harness import reset  # noqa: E402
from tests.engines.outputs import SMALL, per_format, source_and_outputs  # noqa: E402

if not K.flashinfer_available():
    pytest.skip(f"flashinfer_python=={K.flashinfer_pin()} (sglang {K.release()}'s pin) wheel not in {wheels.CACHE}",
                allow_module_level=True)


def expected_kernels() -> dict:
    """The engine's answers requant's rules record for the SGLang release in use (format -> GPU
    family -> cell): requant/engines/releases/sglang-<release>.json, each kernel's engine_answer."""
    if K.release() not in engines.releases("sglang"):
        pytest.skip(f"requant has no rules for sglang {K.release()} (has {', '.join(engines.releases('sglang'))})")
    kernels = engines.release_data("sglang", K.release())["models"]["deepseek_v4"]["kernels"]
    return {fmt: {gpu: k["engine_answer"] for gpu, k in gpus.items()} for fmt, gpus in kernels.items()}


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    reset()


@pytest.fixture(scope="module")
def engine_table(tmp_path_factory):
    return K.table(source_and_outputs(tmp_path_factory.mktemp("sglang_kernels"), SMALL, 3, per_format("sglang")))


def test_kernel_table_is_the_engines(engine_table):
    """Every cell (method, NextN method, resolved backend, arithmetic, starts, kernel built, fix,
    the files of the evidence) is what the release's code gives."""
    want, got = K.without_lines(expected_kernels()), K.without_lines(engine_table)
    diffs = [(f, g, k, want[f][g].get(k), got[f][g].get(k)) for f in want for g in want[f]
             for k in sorted(set(want[f][g]) | set(got[f][g])) if want[f][g].get(k) != got[f][g].get(k)]
    assert diffs == []
    assert want == got


def test_evidence_lines_are_the_releases(engine_table):
    """The cited line ranges are recomputed from the wheels' text: they match the table's."""
    assert engine_table == expected_kernels()


def test_comparison_notices_a_changed_cell(engine_table):
    """The table test can fail: one flipped fact in the engine's answer is a difference."""
    changed = copy.deepcopy(engine_table)
    changed["nvfp4"]["sm_120"]["kernel_built_for_gpu"] = True
    assert K.without_lines(changed) != K.without_lines(expected_kernels())


# ---------------------------------------------------------------------------------------------
# the user report (8x RTX PRO 6000, sm_120, NVFP4 + MTP), each claim held to the engine's answer
# ---------------------------------------------------------------------------------------------
def test_nvfp4_auto_on_sm120_selects_a_kernel_flashinfer_does_not_build(engine_table):
    cell = engine_table["nvfp4"]["sm_120"]
    assert (cell["backend"], cell["method"], cell["starts"]) == ("flashinfer_trtllm_routed", "ModelOptNvFp4FusedMoEMethod", True)
    assert cell["kernel_built_for_gpu"] is False and cell["nextn_kernel_built_for_gpu"] is False
    assert K.trtllm_gen_sms(K.flashinfer_pin()) == {100, 103}


def test_nvfp4_on_sm120_runs_only_with_flashinfer_cutlass_and_no_nextn(engine_table):
    cell = engine_table["nvfp4"]["sm_120"]
    assert cell["explicit"]["flashinfer_cutlass"]["kernel_built_for_gpu"] is True
    assert cell["fix"].startswith("--moe-runner-backend flashinfer_cutlass and no --speculative-algorithm")
    # the NextN block's experts get the TRT-LLM MXFP4 method whatever the backend
    assert {e["nextn_method"] for g in engine_table["nvfp4"].values() for e in [g, *g["explicit"].values()]} == {
        "Mxfp4FlashinferTrtllmMoEMethod"}


def test_unconverted_mxfp4_runs_on_tensor_cores_on_sm120(engine_table):
    cell = engine_table["mxfp4"]["sm_120"]
    assert (cell["backend"], cell["method"]) == ("flashinfer_mxfp4", "Mxfp4FlashinferCutlassMoEMethod")
    assert cell["arithmetic"].startswith("MXFP4 x MXFP8 (W4A8)") and cell["kernel_built_for_gpu"] is True
    assert engine_table["mxfp4"]["sm_90"]["arithmetic"].startswith("MXFP4 weight-only (W4A16)")
    assert engine_table["mxfp4"]["sm_100"]["method"] == "Mxfp4FlashinferTrtllmMoEMethod"


def test_nvfp4_refused_on_hopper_and_ampere_without_marlin(engine_table):
    for gpu in ("sm_80", "sm_90"):
        cell = engine_table["nvfp4"][gpu]
        assert not cell["starts"] and "moe_runner_backend=marlin" in cell["refusal"]
        assert cell["explicit"]["marlin"]["starts"] and cell["fix"].startswith("--moe-runner-backend marlin")
