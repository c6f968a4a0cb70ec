"""Conformance tier, SGLang: every selection-scope release file (0.5.12 .. 0.5.22) held to that
release's own code.

For each release requant has a selection-scope file for, its DeepSeek-V4 MoE selection is executed
from its wheel (tests/engines/sglang_selection.py: the auto-backend default, Fp8Config's and the
hybrid NVFP4 config's method choice, the NVFP4 platform refusal) and the cells generated from it
(sglang_cells.selection_release) must equal the file's, field for field; each cited engine line
range must exist in that wheel and name what the cell says it selects; and a changed field of the
file must be a difference the comparison reports (the mutation tests). Only the selection code
runs here: a release's wheel and the FlashInfer it pins are read, no checkpoint is built, so each
release costs about a second once its wheels are cached.
"""

from __future__ import annotations

import copy
import json
import re
import types

import pytest

from requant import engines
from tests.engines import sglang_cells as C
from tests.engines import wheels
from tests.engines.sglang_harness import reset

SELECTION = engines.releases("sglang", scope="selection")
EVIDENCE = re.compile(r"^sglang (\S+): (sglang/\S+):(\d+)-(\d+)$")
# where the class a cell names must appear in its evidence (a read, not executed, choice included)
NAMED = {"Mxfp4FlashinferCutlassMoEMethod", "Mxfp4FlashinferTrtllmMoEMethod", "Mxfp4MarlinMoEMethod",
         "ModelOptNvFp4FusedMoEMethod", "CompressedTensorsWNA16MoE", "CompressedTensorsWNA16TritonMoE"}


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    reset()


@pytest.fixture(scope="module")
def generated():
    """version -> (kernels, tp) the release's code gives; releases whose wheels cannot be had skip."""
    out = {}

    def get(version):
        if version not in out:
            with C.S.on_release(version):
                missing = C.missing_wheels()
            if missing:
                pytest.skip(f"{', '.join(missing)} not available in {wheels.CACHE}")
            out[version] = C.selection_release(version)[:2]
        return out[version]
    return get


def _file(version: str) -> tuple[dict, list]:
    model = engines.release_data("sglang", version)["models"]["deepseek_v4"]
    return model["kernels"], model.get("tp", [])


def _cells(kernels: dict):
    for fmt, gpus in kernels.items():
        for gpu, cell in gpus.items():
            yield fmt, gpu, cell


@pytest.mark.parametrize("version", SELECTION)
def test_release_file_is_the_releases_code(version, generated):
    kernels, tp = generated(version)
    assert C.differences(*_file(version), kernels, tp, loader=False) == []


@pytest.mark.parametrize("version", SELECTION)
def test_cited_lines_are_in_the_release_and_name_the_selection(version, generated):
    """Every engine line range a cell (its opt_in, fix and tp rules included) cites is in this
    release's wheel, and the ranges of a cell together name its method class and, where auto
    resolved it, the backend."""
    generated(version)   # skips where the wheel cannot be had
    kernels, tp = _file(version)
    with C.S.on_release(version):
        # (what, entry, whether auto resolved its backend: then the cited default names it)
        entries = [(f"{fmt} {gpu}", cell, True) for fmt, gpu, cell in _cells(kernels)]
        entries += [(f"{fmt} {gpu} {o['flags']}", o, False) for fmt, gpu, cell in _cells(kernels) for o in cell.get("opt_in", [])]
        entries += [(f"{fmt} {gpu} fix", cell["fix_kernel"], False) for fmt, gpu, cell in _cells(kernels) if cell.get("fix_kernel")]
        entries += [(f"tp {r['when']}", {"method": "Mxfp4FlashinferCutlassMoEMethod", "evidence": r["evidence"]}, False)
                    for r in tp]
        problems = []
        for what, entry, resolved in entries:
            text = ""
            for cited in entry.get("evidence", []):
                m = EVIDENCE.match(cited)
                if not m:
                    continue   # FlashInfer's lines: sglang_kernels reads them
                release, path, first, last = m[1], m[2], int(m[3]), int(m[4])
                lines = wheels.source("sglang", path).splitlines() if release == version else []
                if release != version or not 1 <= first <= last <= len(lines):
                    problems.append((what, cited))
                text += "\n".join(lines[first - 1:last])
            if entry.get("method") in NAMED and entry["method"] not in text:
                problems.append((what, entry["method"], "not in its cited lines"))
            backend = (entry.get("selects") or {}).get("default", "auto")
            if resolved and backend != "auto" and f'"{backend}"' not in text:
                problems.append((what, backend, "not in its cited lines"))
    assert problems == []


# a sample of the fields advise, verify, the cards and the README state, each changed as an edit would
MUTATIONS = {
    "runs": lambda c: c.update(runs=not c["runs"]),
    "backend": lambda c: c.update(backend=c["backend"] + " (edited)"),
    "arithmetic": lambda c: c.update(arithmetic="W4A16: edited"),
    "speed": lambda c: c.update(speed="fp4-tensor-cores" if c["speed"] != "fp4-tensor-cores" else "weight-only"),
    "mtp.runs": lambda c: c["mtp"].update(runs=not c["mtp"]["runs"]),
    "fix_flags": lambda c: c.update(fix_flags=(c.get("fix_flags") or "") + " --edited"),
    "opt_in.flags": lambda c: c["opt_in"][0].update(flags="--moe-runner-backend edited") if c["opt_in"] else c.update(
        opt_in=[{"flags": "--moe-runner-backend edited"}]),
    "opt_in.runs": lambda c: c["opt_in"][0].update(runs=not c["opt_in"][0]["runs"]) if c["opt_in"] else c.update(
        opt_in=[{"runs": True}]),
}


@pytest.mark.parametrize("field", sorted(MUTATIONS))
@pytest.mark.parametrize("version", SELECTION)
def test_an_edited_field_is_a_difference(version, field, generated):
    """The comparison test_release_file_is_the_releases_code runs fails when any of these fields of
    any cell of the file is edited (the file's data changed in memory)."""
    kernels, tp = generated(version)
    have, have_tp = _file(version)
    missed = []
    for fmt, gpu, _ in _cells(have):
        edited = copy.deepcopy(have)
        MUTATIONS[field](edited[fmt][gpu])
        if not C.differences(edited, have_tp, kernels, tp, loader=False):
            missed.append((fmt, gpu))
    assert missed == []


@pytest.mark.parametrize("version", SELECTION)
def test_an_edited_tp_rule_is_a_difference(version, generated):
    kernels, tp = generated(version)
    have, have_tp = _file(version)
    edited = [dict(r, gpus=r["gpus"][:-1]) for r in have_tp] or [{"format": "mxfp4", "when": "edited", "gpus": ["sm_120"]}]
    assert C.differences(have, edited, kernels, tp, loader=False)


def test_the_files_start_at_the_first_release_that_serves_dsv4_and_chain_to_the_newer():
    """One file per release from SGLang's first DeepSeek-V4 release (the first wheel with
    models/deepseek_v4.py; the release before it has none) up, each selection file based on the next newer."""
    known = engines.releases("sglang")
    first, before = known[0], f"0.5.{int(known[0].split('.')[-1]) - 1}"
    for version, serves in ((first, True), (before, False)):
        with C.S.on_release(version):
            if not wheels.available("sglang"):
                pytest.skip(f"sglang=={version} wheel not available in {wheels.CACHE}")
            assert any(n.endswith("sglang/srt/models/deepseek_v4.py") for n in wheels._zip("sglang").namelist()) == serves
    for older, newer in zip(known, known[1:]):
        if older in SELECTION:
            assert json.loads(engines._release_files()["sglang"][older].read_text())["base"] == newer


def test_the_sm120_user_case_across_releases():
    """8x RTX PRO 6000 with the unconverted source, as the files (held above to each release's code)
    state it: W4A8 on FP4 tensor cores with its MTP block by default first in 0.5.19; before, no
    MXFP4 default runs on sm_120, 0.5.16-0.5.18 run W4A8 only with --moe-runner-backend flashinfer_mxfp4,
    0.5.13-0.5.15 only weight-only with --moe-runner-backend marlin, and 0.5.12 has no MXFP4 path there."""
    by_release = {v: engines.rules_for(types.SimpleNamespace(name="deepseek_v4"), "sglang", v).kernel("mxfp4", "sm_120")
                  for v in engines.releases("sglang")}
    w4a8_default = [v for v, k in by_release.items() if k.runs and k.speed == "fp4-tensor-cores" and k.mtp_path["runs"]]
    assert w4a8_default[0] == "0.5.19" and w4a8_default == [v for v in by_release if engines.version_key(v) >= (0, 5, 19)]
    fixes = {v: k.fix_flags for v, k in by_release.items() if not k.runs}
    assert fixes == {"0.5.12": "", **{f"0.5.{n}": "--moe-runner-backend marlin" for n in (13, 14, 15)},
                     **{f"0.5.{n}": "--moe-runner-backend flashinfer_mxfp4" for n in (16, 17, 18)}}
