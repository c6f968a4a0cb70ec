"""Selection tier, vLLM half: every kernel-cell field requant states for a vLLM release (runs,
arithmetic, speed, mode, selects, opt-in backends with their flags, switches and packages, the fix
where the default does not run, the DSpark drafter's path; for selection-scope releases also the
backend prose and evidence) equals what that release's own selection code gives
(vllm_kernels.derive: its oracle selectors, kernel support checks and envs.py, executed), and the
files hold nothing typed where the tier computes it (scripts/generate_engine_cells.py writes them).

The release in use (--engine-release, else the newest) is checked in full; with the newest in use,
every selection-scope release is checked too, each from its own wheel, plus the evidence its file
cites (the files and lines exist in that wheel, the method classes are defined there). A mutation of
any generated field of any vLLM release file fails the comparison (test_a_mutated_field_fails).
"""

from __future__ import annotations

import copy
import re
import zipfile

import pytest

from requant import engines

from . import wheels

if not wheels.available("vllm"):
    pytest.skip(f"vllm=={wheels.version('vllm')} wheel not available in {wheels.CACHE}: vLLM selection tier skipped",
                allow_module_level=True)

from . import vllm_harness as vllm  # noqa: E402
from . import vllm_kernels  # noqa: E402

IN_USE = wheels.version("vllm")
# every selection-scope release, checked from its wheel when the tier runs the newest release (CI's
# README command); a run against another release checks that one only
OLDER = engines.releases("vllm", scope="selection") if IN_USE == wheels.NEWEST["vllm"] else []


def _check(version: str) -> tuple[dict, dict]:
    """(the release's merged data, what its code gives) with `version`'s wheel in use."""
    wheels.use([f"vllm=={version}"])
    vllm.reset()
    data = engines.release_data("vllm", version)
    return data, vllm_kernels.expected(vllm_kernels.derive(), data)


@pytest.fixture(scope="module")
def in_use():
    if IN_USE not in engines.releases("vllm"):
        pytest.fail(f"requant has no release file for vllm {IN_USE}: add it (docs/engines.md) before this tier holds it")
    yield _check(IN_USE)
    wheels.use([f"vllm=={IN_USE}"])
    vllm.reset()


def test_release_file_is_its_code(in_use):
    data, want = in_use
    assert want, "no kernel cells derived"
    assert vllm_kernels.mismatches(data, want) == []


def _selection_release_is_its_code(version):
    try:
        data, want = _check(version)
        assert vllm_kernels.mismatches(data, want) == []
        assert not evidence_problems(version, data)
    finally:
        wheels.use([f"vllm=={IN_USE}"])
        vllm.reset()


if OLDER:   # defined only where there is something to check: an empty parametrization reports a skip
    test_selection_release_is_its_code = pytest.mark.parametrize("version", OLDER)(_selection_release_is_its_code)


if IN_USE in engines.releases("vllm", scope="selection"):
    def test_in_use_selection_release_citations(in_use):
        """A selection-scope release in use (--engine-release): its citations too."""
        assert not evidence_problems(IN_USE, in_use[0])


CITED = re.compile(r"((?:[\w.]+/)+[\w.]+\.py):(\d+)(?:-(\d+))?")


def evidence_problems(version: str, data: dict) -> list[str]:
    """Where a selection-scope file's prose (changes, mtp/unsupported evidence, serve evidence)
    cites a file:line of this release that its wheel does not have, or names a method class the
    wheel never defines. The rules themselves were read there, not executed: this holds the
    citations, not the reading."""
    problems = []
    texts = list(data.get("changes", ()))
    rules = data["models"]["deepseek_v4"]
    texts += [str(v) for v in (rules.get("unsupported") or {}).values()]
    texts += [str((f or {}).get("mtp_evidence", "")) for f in (rules.get("formats") or {}).values()]
    texts += [e for e in rules.get("serve", {}).get("evidence", ()) if e.startswith(f"vllm {version}:")]
    names = set(wheels._zip("vllm").namelist())
    for text in texts:
        for path, first, last in CITED.findall(text):
            full = next((n for n in names if n.endswith("vllm/" + path.removeprefix("vllm/"))), None)
            if full is None:
                problems.append(f"{version}: {path} is not in the wheel ({text[:80]})")
                continue
            lines = wheels.source("vllm", full).count("\n") + 1
            if int(last or first) > lines:
                problems.append(f"{version}: {path}:{last or first} is past its end ({lines} lines)")
    for fmt, cells in (rules.get("kernels") or {}).items():
        for gpu, cell in (cells or {}).items():
            if not any(f"class {cell['method']}(" in wheels.source("vllm", n) for n in names
                       if n.endswith(".py") and "quantization" in n):
                problems.append(f"{version}: {fmt} {gpu}: no class {cell['method']} in the wheel's quantization code")
    return problems


# The advise-visible fields of a cell, and how to change each for the mutation test.
MUTATIONS = {
    "runs": lambda v: not v,
    "arithmetic": lambda v: "W4A4: NVFP4 weights x NVFP4 activations (quantized under input_scale)"
    if not str(v).startswith("W4A4") else "W4A16: MXFP4 weights dequantized to BF16",
    "speed": lambda v: "fallback" if v != "fallback" else "fp4-tensor-cores",
    "mode": lambda v: "bf16" if v != "bf16" else "nvfp4-w4a4",
    "selects": lambda v: {**v, "default": "EMULATION"},
    "fix_flags": lambda v: "--moe-backend marlin" if v != "--moe-backend marlin" else "",
}


def _mutants(data: dict):
    """(description, mutated data) for a sample of fields of every cell: each MUTATIONS field, the
    opt-in entries' flags, runs and packages, and the drafter's runs."""
    for family, rules in data["models"].items():
        for fmt, cells in (rules.get("kernels") or {}).items():
            for gpu, cell in (cells or {}).items():
                def mutated(change):
                    out = copy.deepcopy(data)
                    change(out["models"][family]["kernels"][fmt][gpu])
                    return out
                for key, how in MUTATIONS.items():
                    yield f"{family} {fmt} {gpu} {key}", mutated(lambda c, k=key, h=how: c.__setitem__(k, h(c.get(k))))
                for i, _ in enumerate(cell.get("opt_in") or ()):
                    yield (f"{family} {fmt} {gpu} opt_in[{i}].flags",
                           mutated(lambda c, i=i: c["opt_in"][i].__setitem__("flags", c["opt_in"][i]["flags"] + "x")))
                    yield (f"{family} {fmt} {gpu} opt_in[{i}].runs",
                           mutated(lambda c, i=i: c["opt_in"][i].__setitem__("runs", not c["opt_in"][i]["runs"])))
                    yield (f"{family} {fmt} {gpu} opt_in[{i}].packages",
                           mutated(lambda c, i=i: c["opt_in"][i]["packages"].append(
                               {"name": "deep_gemm", "spec": "", "in_requirements": True})))
                if cell.get("mtp"):
                    yield (f"{family} {fmt} {gpu} mtp.runs",
                           mutated(lambda c: c["mtp"].__setitem__("runs", not c["mtp"]["runs"])))
                if not cell.get("opt_in"):
                    yield f"{family} {fmt} {gpu} opt_in added", mutated(
                        lambda c: c.__setitem__("opt_in", [{"flags": "--moe-backend marlin", "runs": True}]))


def test_a_mutated_field_fails(in_use):
    """Every sampled mutation of the release in use's file is caught by the comparison above."""
    data, want = in_use
    caught = missed = 0
    for what, mutant in _mutants(data):
        if vllm_kernels.mismatches(mutant, want):
            caught += 1
        else:
            missed += 1
            pytest.fail(f"mutating {what} in vllm {IN_USE}'s rules is not caught")
    cells = sum(len(c or {}) for r in data["models"].values() for c in (r.get("kernels") or {}).values())
    assert caught >= len(MUTATIONS) * cells > 0 and not missed, caught


OTHERS = [v for v in engines.releases("vllm") if v != IN_USE]


@pytest.mark.parametrize("version", sorted({OTHERS[0], OTHERS[-1]}, key=engines.version_key))   # oldest, newest
def test_a_mutated_older_release_fails(version):
    """The same for an older release's file, checked against its own code."""
    try:
        data, want = _check(version)
        mutants = list(_mutants(data))
        assert mutants and all(vllm_kernels.mismatches(m, want) for _, m in mutants)
    finally:
        wheels.use([f"vllm=={IN_USE}"])
        vllm.reset()


def test_w4a8_opt_ins_of_the_source_on_sm_120():
    """The issue's case in vLLM 0.34.0's file (generated, and held above to its code): the MXFP4
    source on sm_120 runs weight-only by default and has W4A8 (MXFP4 x MXFP8) paths behind
    --moe-backend b12x (the b12x package, a vllm[b12x] extra, not a plain requirement) and
    --moe-backend flashinfer_cutlass (FlashInfer, pinned by vLLM)."""
    cell = engines.release_data("vllm", "0.34.0")["models"]["deepseek_v4"]["kernels"]["mxfp4"]["sm_120"]
    w4a8 = {o["flags"]: o for o in cell["opt_in"] if o["arithmetic"] == "W4A8: MXFP4 weights x MXFP8 activations"}
    assert cell["speed"] == "weight-only" and set(w4a8) >= {"--moe-backend b12x", "--moe-backend flashinfer_cutlass"}
    assert w4a8["--moe-backend b12x"]["packages"] == [{"name": "b12x", "spec": "==1.5.1", "in_requirements": False,
                                                        "extra": "b12x"}]
    assert w4a8["--moe-backend flashinfer_cutlass"]["packages"][0] == {
        "name": "flashinfer-python", "spec": "==0.7.3", "in_requirements": True}


def test_the_files_start_at_the_first_release_that_serves_dsv4():
    """advise's "does not serve" (engines.first_serving) rests on this: the oldest vLLM file is the
    first release with DeepSeek-V4's model files, and the release before it has none."""
    first = engines.releases("vllm")[0]
    before = {"0.20.0": "0.19.1"}.get(first)
    assert before, f"the oldest vLLM file is {first}: name the release before it here"
    for version, serves in ((first, True), (before, False)):
        path = wheels.wheel("vllm", version, slim=True)
        if path is None:
            pytest.skip(f"vllm=={version} wheel not available in {wheels.CACHE}")
        with zipfile.ZipFile(path) as wheel_zip:
            assert any(re.search(r"vllm/model_executor/models/deepseek_v4", n) for n in wheel_zip.namelist()) == serves
