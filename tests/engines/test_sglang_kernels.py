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

from tests.engines import sglang_cells as C  # noqa: E402
from tests.engines import sglang_kernels as K  # noqa: E402
from tests.engines import sglang_selection as S  # noqa: E402
from tests.engines.sglang_harness import reset  # noqa: E402
from tests.engines.outputs import SMALL, per_format, source_and_outputs  # noqa: E402

if not K.flashinfer_available():
    pytest.skip(f"flashinfer_python=={K.flashinfer_pin()} (sglang {K.release()}'s pin) wheel not in {wheels.CACHE}",
                allow_module_level=True)

# A release requant holds by its selection code only (scope "selection", e.g. the one before the
# newest, which CI runs this file for) gets the selection tests; the loader tests need the loader
# harness, which follows the newest release's files.
SELECTION = K.release() in engines.releases("sglang", scope="selection")
loader_only = pytest.mark.skipif(SELECTION, reason=f"sglang {K.release()}'s file is selection-scope: the loader "
                                                   "harness's claims are the newest release's (test_release_file_is_the_engines "
                                                   "holds this one's selection)")


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
    """The engine's answers for the release in use: the loader harness's table, or for a
    selection-scope release the selection executor's (the same shape)."""
    if SELECTION:
        return C.selection_table(K.release())
    return K.table(source_and_outputs(tmp_path_factory.mktemp("sglang_kernels"), SMALL, 3, per_format("sglang")))


def _file_model() -> dict:
    if K.release() not in engines.releases("sglang"):
        pytest.skip(f"requant has no rules for sglang {K.release()} (has {', '.join(engines.releases('sglang'))})")
    return engines.release_data("sglang", K.release())["models"]["deepseek_v4"]


@pytest.fixture(scope="module")
def generated(engine_table) -> tuple[dict, list]:
    """What scripts/generate_sglang_cells.py writes for the release in use."""
    if SELECTION:
        return C.selection_release(K.release())[:2]
    return C.cells(engine_table, loader=True), C.tp_rules(engine_table)


def test_release_file_is_the_engines(generated):
    """The release file as generated from the engine's answers: for the loader release its
    engine_answer, opt_in, fix and tp, and each cell's advise-visible fields as derived from its
    recorded answer; for a selection-scope release every cell field (test_sglang_releases.py
    holds all of those at once; this runs the one in use)."""
    model = _file_model()
    assert C.differences(model["kernels"], model.get("tp", []), *generated, loader=not SELECTION) == []


# a sample of the advise-visible fields of a cell, each edited as a hand edit of the file would
LOADER_MUTATIONS = {
    "runs": lambda c: c.update(runs=not c["runs"]),
    "backend": lambda c: c.update(backend="edited runner: " + c["backend"]),
    "arithmetic": lambda c: c.update(arithmetic="W4A16: edited"),
    "speed": lambda c: c.update(speed="fp4-tensor-cores" if c["speed"] != "fp4-tensor-cores" else "weight-only"),
    "mtp.runs": lambda c: c["mtp"].update(runs=not c["mtp"]["runs"]),
    "fix_flags": lambda c: c.update(fix_flags=(c.get("fix_flags") or "") + " --edited"),
    "opt_in.flags": lambda c: c.update(opt_in=[dict(o, flags=o["flags"] + "x") for o in c.get("opt_in", [])] or [{}]),
    "engine_answer.kernel_built_for_gpu": lambda c: c["engine_answer"].update(
        kernel_built_for_gpu=not c["engine_answer"]["kernel_built_for_gpu"]),
}


@pytest.mark.parametrize("field", sorted(LOADER_MUTATIONS))
def test_an_edited_field_is_a_difference(generated, field):
    """test_release_file_is_the_engines's comparison reports an edit of any of these fields in any
    cell (a cell with no engine answer recorded, a selection release's W4A16, skips that field)."""
    model = _file_model()
    missed = []
    for fmt, gpus in model["kernels"].items():
        for gpu, cell in gpus.items():
            if field.startswith("engine_answer") and not cell.get("engine_answer"):
                continue
            edited = copy.deepcopy(model["kernels"])
            LOADER_MUTATIONS[field](edited[fmt][gpu])
            if not C.differences(edited, model.get("tp", []), *generated, loader=not SELECTION):
                missed.append((fmt, gpu))
    assert missed == []


@loader_only
def test_the_selection_executor_answers_as_the_loader_harness(engine_table):
    """sglang_selection (what the older releases are held by) gives the loader harness's answers
    on the loader release: the same method, NextN method, backend, arithmetic, start-up, kernels
    and fix for every format, GPU and explicit backend; only the cited line ranges differ (it
    cites the statements it executes)."""
    with S.on_release(K.release()):
        selected = {**S.table(), "w4a16": S.w4a16_table()}

    def facts(cell):
        out = {k: v for k, v in cell.items() if k not in ("evidence", "explicit")}
        if "explicit" in cell:
            out["explicit"] = {b: facts(e) for b, e in cell["explicit"].items()}
        return out
    for fmt, gpus in selected.items():
        for gpu, cell in gpus.items():
            assert facts(cell) == facts(engine_table[fmt][gpu]), (fmt, gpu)


@loader_only
def test_kernel_table_is_the_engines(engine_table):
    """Every cell (method, NextN method, resolved backend, arithmetic, starts, kernel built, fix,
    the files of the evidence) is what the release's code gives."""
    want, got = K.without_lines(expected_kernels()), K.without_lines(engine_table)
    diffs = [(f, g, k, want[f][g].get(k), got[f][g].get(k)) for f in want for g in want[f]
             for k in sorted(set(want[f][g]) | set(got[f][g])) if want[f][g].get(k) != got[f][g].get(k)]
    assert diffs == []
    assert want == got


@loader_only
def test_evidence_lines_are_the_releases(engine_table):
    """The cited line ranges are recomputed from the wheels' text: they match the table's."""
    assert engine_table == expected_kernels()


@loader_only
def test_comparison_notices_a_changed_cell(engine_table):
    """The table test can fail: one flipped fact in the engine's answer is a difference."""
    changed = copy.deepcopy(engine_table)
    changed["nvfp4"]["sm_120"]["kernel_built_for_gpu"] = True
    assert K.without_lines(changed) != K.without_lines(expected_kernels())


# ---------------------------------------------------------------------------------------------
# the user report (8x RTX PRO 6000, sm_120, NVFP4 + MTP), each claim held to the engine's answer
# ---------------------------------------------------------------------------------------------
@loader_only
def test_nvfp4_auto_on_sm120_selects_a_kernel_flashinfer_does_not_build(engine_table):
    cell = engine_table["nvfp4"]["sm_120"]
    assert (cell["backend"], cell["method"], cell["starts"]) == ("flashinfer_trtllm_routed", "ModelOptNvFp4FusedMoEMethod", True)
    assert cell["kernel_built_for_gpu"] is False and cell["nextn_kernel_built_for_gpu"] is False
    assert K.trtllm_gen_sms(K.flashinfer_pin()) == {100, 103}


@loader_only
def test_nvfp4_on_sm120_runs_only_with_flashinfer_cutlass_and_no_nextn(engine_table):
    cell = engine_table["nvfp4"]["sm_120"]
    assert cell["explicit"]["flashinfer_cutlass"]["kernel_built_for_gpu"] is True
    assert cell["fix"].startswith("--moe-runner-backend flashinfer_cutlass and no --speculative-algorithm")
    # the NextN block's experts get the TRT-LLM MXFP4 method whatever the backend
    assert {e["nextn_method"] for g in engine_table["nvfp4"].values() for e in [g, *g["explicit"].values()]} == {
        "Mxfp4FlashinferTrtllmMoEMethod"}


@loader_only
def test_unconverted_mxfp4_runs_on_tensor_cores_on_sm120(engine_table):
    cell = engine_table["mxfp4"]["sm_120"]
    assert (cell["backend"], cell["method"]) == ("flashinfer_mxfp4", "Mxfp4FlashinferCutlassMoEMethod")
    assert cell["arithmetic"].startswith("MXFP4 x MXFP8 (W4A8)") and cell["kernel_built_for_gpu"] is True
    assert engine_table["mxfp4"]["sm_90"]["arithmetic"].startswith("MXFP4 weight-only (W4A16)")
    assert engine_table["mxfp4"]["sm_100"]["method"] == "Mxfp4FlashinferTrtllmMoEMethod"


@loader_only
def test_nvfp4_refused_on_hopper_and_ampere_without_marlin(engine_table):
    for gpu in ("sm_80", "sm_90"):
        cell = engine_table["nvfp4"][gpu]
        assert not cell["starts"] and "moe_runner_backend=marlin" in cell["refusal"]
        assert cell["explicit"]["marlin"]["starts"] and cell["fix"].startswith("--moe-runner-backend marlin")
