"""`requant advise` answering the user where they are: releases named loosely or as builds, an
older release against the first one where the source runs faster with its drafter (computed over
the release files), releases requant has no data for, opt-in MoE backends, verdicts that weigh and
state their costs, and verdicts that depend on a reduced checkpoint's dimensions.

Release histories are written into a temporary releases directory (copies of the real loader files plus
what a test adds), so these hold whatever older releases the real data holds; the last test reads the
real files as they are."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from requant import engines, synth
from requant.advise import TP_CONDITIONS, advise, format_advice
from requant.engines import DOES_NOT_START, NOT_CHECKED, RUNS, WRONG_RESULT
from requant.io.checkpoint import Checkpoint
from requant.paths import measured_errors
from requant.targets import Options
from tests.helpers.cli import run_cli

FLASH_FULL = synth.Dims("deepseek-v4-flash", full_scale=True)


def _clear_caches():
    engines.reread_release_files()


@pytest.fixture
def releases(tmp_path, monkeypatch):
    """A releases directory holding copies of the real loader-scope files; `releases.write(engine, version,
    data)` adds one, `releases.real(engine, version)` reads a real one (its own keys only)."""
    folder = tmp_path / "releases"
    folder.mkdir()
    for path in engines._RELEASES.glob("*.json"):   # the tier-held releases: no test version collides with them
        if json.loads(path.read_text()).get("scope", "loader") == "loader":
            shutil.copy(path, folder)

    class Releases:
        @staticmethod
        def write(engine: str, version: str, data: dict) -> None:
            (folder / f"{engine}-{version}.json").write_text(json.dumps({"engine": engine, "version": version, **data}))
            _clear_caches()

        @staticmethod
        def real(engine: str, version: str) -> dict:
            return json.loads((folder / f"{engine}-{version}.json").read_text())

    monkeypatch.setattr(engines, "_RELEASES", folder)
    _clear_caches()
    yield Releases
    _clear_caches()


def cell(method, backend, arithmetic, speed, mode, mtp_runs, **extra) -> dict:
    """A kernel cell replacing the base release's whole cell (its other keys removed)."""
    gone = {k: None for k in ("fix", "fix_flags", "fix_kernel", "engine_answer", "selects", "note", "opt_in")}
    return {**gone, "method": method, "backend": backend, "runs": speed != "none", "arithmetic": arithmetic,
            "speed": speed, "mode": mode, "evidence": [f"sglang test: {method}.py:1-2"],
            "mtp": {"method": method, "backend": backend, "runs": mtp_runs}, **extra}


CUDA_CORES = cell("Mxfp4TritonMoEMethod", "Triton MXFP4 on CUDA cores", "W4A16: MXFP4 weights dequantized to BF16",
                  "fallback", "bf16", True)
W4A8_NO_DRAFTER = cell("Mxfp4FlashinferCutlassMoEMethod", "flashinfer_mxfp4", "W4A8: MXFP4 weights x MXFP8 activations",
                       "fp4-tensor-cores", "mxfp4-w4a8", False)
W4A8 = cell("Mxfp4FlashinferCutlassMoEMethod", "flashinfer_mxfp4", "W4A8: MXFP4 weights x MXFP8 activations",
            "fp4-tensor-cores", "mxfp4-w4a8", True)


def sglang_release(releases, version: str, sm120_mxfp4: dict, scope: str = "selection") -> None:
    """An SGLang release on top of 0.5.23's rules, its sm_120 MXFP4 cell replaced."""
    releases.write("sglang", version, {
        "label": "SGLang", "base": "0.5.23", "scope": scope, "checked": [f"kernel selection of {version} (test data)"],
        "models": {"deepseek_v4": {"kernels": {"mxfp4": {"sm_120": sm120_mxfp4}}}}})


@pytest.fixture(scope="module")
def flash(checkpoints):
    """DeepSeek-V4-Flash at its released dimensions, headers over holes."""
    return checkpoints.source(FLASH_FULL, sparse=True)


def answer(path, spec, gpu="sm_120", tp=8, **kw) -> dict:
    with Checkpoint.open(path) as ck:
        result = advise(ck, [spec], gpu, tp=tp, errors=measured_errors(), **kw)
    return result["answers"][0]


def path_named(a: dict, label: str) -> dict:
    return next(p for p in a["paths"] if p["path"] == label)


# ------------------------------------------------------------------------------ naming a release

@pytest.mark.parametrize("spec, version", [("vllm==0.33", "0.33.0"), ("SGLang==0.5.23", "0.5.23"),
                                           ("vllm==1", "1.0.0"), ("vllm==0.34.0+cu130", "0.34.0+cu130"),
                                           ("sglang==0.5.24.dev3+gabc", "0.5.24.dev3+gabc")])
def test_a_release_named_with_fewer_numbers_is_its_dot_zero(spec, version):
    assert engines.parse_spec(spec)[1] == version


@pytest.mark.parametrize("build, release, words", [
    ("0.34.0+cu130", "0.34.0", "local build (+cu130)"),
    ("0.5.24.dev3+gabc", "0.5.24", "pre-release build (dev3) made before 0.5.24"),
    ("0.34.0.post1", "0.34.0", "post-release"),
    ("0.34.0", "0.34.0", "")])
def test_a_build_maps_to_its_release_with_a_note(build, release, words):
    mapped, note = engines.release_of(build)
    assert mapped == release and words in note and (note == "") == (words == "")


def test_a_build_of_a_release_with_rules_gets_that_release_s_verdict(flash):
    a = answer(flash, "sglang==0.5.23+cu130")
    assert a["checked"] and a["rules_release"] == "0.5.23" and "local build" in a["build_note"]
    assert a["recommendation"]["verdict"].startswith("do not convert")


# --------------------------------------------------------------- a release against the others

def test_an_older_release_leads_with_the_first_upgrade_that_runs_the_source_faster_with_mtp(releases, flash):
    """The first release whose default path runs the source on FP4 tensor cores with the MTP block
    drafting is found over the files: 0.5.21 runs W4A8 without a drafter kernel, 0.5.22 with one."""
    sglang_release(releases, "0.5.20", CUDA_CORES)
    sglang_release(releases, "0.5.21", W4A8_NO_DRAFTER)
    sglang_release(releases, "0.5.22", W4A8)
    a = answer(flash, "sglang==0.5.20")
    assert a["upgrade"]["release"] == "0.5.22" and a["upgrade"]["evidence"] == ["sglang test: Mxfp4FlashinferCutlassMoEMethod.py:1-2"]
    verdict = a["recommendation"]["verdict"]
    assert verdict.startswith("upgrade SGLang to 0.5.22: the source then runs W4A8 on FP4 tensor cores with MTP, no "
                              "conversion; on 0.5.20 itself: ")
    assert a["what_was_checked"] == "kernel selection from SGLang 0.5.20's files, loader not run"
    as_is = a["paths"][0]
    assert as_is["main"]["backend"] == "Triton MXFP4 on CUDA cores" and as_is["speed"] == "fallback"
    # the drafter's kernel decides: with 0.5.22 drafting too without one, nothing beats 0.5.23
    sglang_release(releases, "0.5.22", W4A8_NO_DRAFTER)
    assert answer(flash, "sglang==0.5.20")["upgrade"]["release"] == "0.5.23"


def test_the_upgrade_names_the_first_release_that_runs_it_on_request(releases, flash):
    """0.5.21 runs W4A8 with MTP only with a flag; 0.5.22 by default: the upgrade is to 0.5.22, and
    says 0.5.21 does it when asked."""
    kernel = {k: v for k, v in W4A8.items() if v is not None}
    sglang_release(releases, "0.5.20", CUDA_CORES)
    sglang_release(releases, "0.5.21", {**cell("Fp8MoEMethod", "auto: no FP4 path", "", "none", "bf16", False),
                                        "fix_flags": "--moe-runner-backend flashinfer_mxfp4", "fix_kernel": kernel})
    sglang_release(releases, "0.5.22", W4A8)
    lead = answer(flash, "sglang==0.5.20")["upgrade"]
    assert lead["release"] == "0.5.22" and lead["opt_in_from"]["release"] == "0.5.21"
    assert lead["text"].endswith("no conversion (from 0.5.21 on, with --moe-runner-backend flashinfer_mxfp4)")


def test_the_release_that_runs_the_source_best_gets_no_upgrade(releases, flash):
    sglang_release(releases, "0.5.20", CUDA_CORES)
    a = answer(flash, "sglang==0.5.23")
    assert a["upgrade"] is None and a["scope"] == "loader"
    assert a["recommendation"]["verdict"].startswith(f"do not convert: {flash} runs as it is")
    assert a["recommendation"]["choice"].startswith("as it is (mxfp4)") and a["recommendation"]["command"] == ""


def test_a_release_before_the_first_that_serves_the_model(releases, flash):
    sglang_release(releases, "0.5.20", CUDA_CORES)
    sglang_release(releases, "0.5.22", W4A8)
    a = answer(flash, "sglang==0.5.9")
    assert a["paths"] == [] and a["status"] == "does not serve"
    assert a["recommendation"]["verdict"] == ("SGLang 0.5.9 does not serve deepseek-v4-flash models (first release that does: "
                                              "0.5.20); upgrade SGLang to 0.5.22: the source then runs W4A8 on FP4 "
                                              "tensor cores with MTP, no conversion")


@pytest.mark.parametrize("version", ["0.5.99", "0.5.22"])
def test_a_release_without_rules_is_hedged_never_the_bare_verdict(releases, flash, version):
    """Newer than any release with rules, or between two: the nearest older rules, said to be so."""
    sglang_release(releases, "0.5.20", CUDA_CORES)
    a = answer(flash, f"sglang=={version}")
    nearest = "0.5.23" if version == "0.5.99" else "0.5.20"
    assert not a["checked"] and a["rules_release"] == nearest
    assert a["recommendation"]["verdict"].startswith(f"not checked against SGLang {version} (rules from SGLang {nearest}")
    assert "by those rules, hedged: " in a["recommendation"]["verdict"]


# ------------------------------------------------------------------------ opt-in MoE backends

B12X = {"method": "Mxfp4MoEMethod", "backend": "b12x MXFP4 x MXFP8 grouped GEMM", "runs": True,
        "arithmetic": "W4A8: MXFP4 weights x MXFP8 activations", "speed": "fp4-tensor-cores", "mode": "mxfp4-w4a8",
        "flags": "--moe-backend b12x", "env": "", "evidence": ["vllm test: oracle/mxfp4.py:1"],
        "packages": [{"name": "b12x", "spec": "==0.3.1", "in_requirements": False}]}
CUTLASS = {**B12X, "backend": "FlashInfer CUTLASS MXFP4 x MXFP8", "flags": "--moe-backend flashinfer_cutlass",
           "packages": [{"name": "flashinfer-python", "spec": "==0.7.2", "in_requirements": True}]}


def vllm_with_opt_ins(releases, entries) -> None:
    data = releases.real("vllm", "0.34.0")
    cells = data.setdefault("models", {}).setdefault("deepseek_v4", {}).setdefault("kernels", {})
    cells.setdefault("mxfp4", {}).setdefault("sm_120", {})["opt_in"] = entries
    releases.write("vllm", "0.34.0", {k: v for k, v in data.items() if k not in ("engine", "version")})


def test_opt_in_backends_are_listed_with_flags_and_packages_and_weighed_like_paths(releases, flash):
    vllm_with_opt_ins(releases, [B12X, CUTLASS])
    a = answer(flash, "vllm==0.34.0")
    b12x = path_named(a, "as it is (mxfp4), with --moe-backend b12x")
    assert b12x["opt_in"] and b12x["runs"] and b12x["flags"] == "--moe-backend b12x"
    assert b12x["packages"] == B12X["packages"] and "needs package b12x==0.3.1, not in vLLM's requirements" in b12x["gives_up"]
    # the source's weights kept and 8-bit activations either way: the faster class wins, and among the two
    # W4A8 backends the one whose packages the engine's requirements bring; no conversion
    r = a["recommendation"]
    assert r["choice"] == "as it is (mxfp4), with --moe-backend flashinfer_cutlass" and r["command"] == ""
    assert r["verdict"].startswith(f"do not convert: {flash} runs as it is, serve with --moe-backend flashinfer_cutlass")
    assert "W4A8: activations in FP8" in r["gives_up"]
    # the measured error first: the exact weight-only default stays, and the verdict names the faster way
    exact = answer(flash, "vllm==0.34.0", prefer="accuracy")["recommendation"]
    assert exact["choice"] == "as it is (mxfp4)" and "; faster: as it is (mxfp4), with --moe-backend" in exact["verdict"]
    text = format_advice({"checkpoint": flash, "model": "m", "source_format": "mxfp4", "mtp_format": None,
                          "basis": "b", "dims": {"intermediate": 2048, "experts": {"n": 256}}, "answers": [a]})
    assert "b12x==0.3.1 (NOT in the engine's requirements)" in text


# ---------------------------------------------------------------------- costs and vocabulary

def test_convert_verdicts_use_the_user_s_paths_and_name_what_they_give_up(checkpoints):
    small = checkpoints.source(synth.Dims())   # 16 a rank at TP=8: only NVFP4's 16-element blocks split
    a = answer(small, "sglang==0.5.23")
    r = a["recommendation"]
    assert r["choice"].startswith("nvfp4") and r["command"] == (f"requant convert {small} {small}-nvfp4 --out nvfp4 "
                                                                "--engine sglang==0.5.23")
    assert "SRC" not in json.dumps(a) and "DST" not in json.dumps(a)
    assert r["verdict"].startswith(f"convert to nvfp4 and serve with {r['flags']} (") and r["flags"]
    assert r["gives_up"][0] == "loses MTP drafting" and "gives up: loses MTP drafting" in r["verdict"]


@pytest.fixture(scope="module")
def dspark_nvfp4(checkpoints):
    """A small DeepSeek-V4-Flash-0731 (DSpark drafter) and its NVFP4 conversion for SGLang."""
    source = checkpoints.source(synth.Dims("deepseek-v4-flash-0731", intermediate=256))
    return source, checkpoints.converted(source, "nvfp4", Options(engine="sglang"))


def test_sglang_nvfp4_with_a_dspark_drafter_says_the_drafter_is_lost(dspark_nvfp4):
    source, out = dspark_nvfp4
    nvfp4 = path_named(answer(source, "sglang==0.5.23", tp=1), "nvfp4")
    assert nvfp4["drafter_kept"] is False and nvfp4["gives_up"][0] == "loses DSpark drafting"
    served = answer(out, "sglang==0.5.23", tp=1)["recommendation"]
    assert served["choice"].startswith("as it is (nvfp4)") and "gives up: loses DSpark drafting" in served["verdict"]
    kept = answer(source, "sglang==0.5.23", tp=1)["recommendation"]   # the source as it is keeps its drafter
    assert kept["choice"].startswith("as it is (mxfp4)") and not any("drafting" in c for c in kept["gives_up"])


def test_marlin_w13_ordering_at_tp8_is_a_wrong_result_not_a_refusal(checkpoints):
    """W4A16 g128 at 1024/8 = 128 per rank: vLLM starts and computes with misordered w13 scales."""
    src = checkpoints.source(synth.Dims(intermediate=1024))
    a = answer(src, "vllm==0.34.0")
    g128, g32 = path_named(a, "w4a16 g128 sym"), path_named(a, "w4a16 g32 sym")
    assert g128["outcome"] == WRONG_RESULT and g128["starts"] and not g128["runs"]
    assert "orders the w13 group scales as per-channel ones" in g128["problems"][0]
    assert g32["outcome"] == RUNS


def test_sglang_cutlass_per_rank_condition(releases, flash):
    """SGLang's MXFP4 CUTLASS method refuses a rank share of moe_intermediate_size off a multiple of
    128 (a `tp` rule naming TP_CONDITIONS' intermediate_per_rank_not_multiple_of_128)."""
    _, applies = TP_CONDITIONS["intermediate_per_rank_not_multiple_of_128"]
    assert applies(2048, 8, 32) is False and applies(2048, 32, 32) is True and applies(3072, 16, 32) is True
    data = releases.real("sglang", "0.5.23")
    data["models"]["deepseek_v4"]["tp"] = [{"format": "mxfp4", "when": "intermediate_per_rank_not_multiple_of_128",
                                           "gpus": ["sm_120"], "problem": "create_weights raises", "works": "use EP"}]
    releases.write("sglang", "0.5.23", {k: v for k, v in data.items() if k not in ("engine", "version")})
    assert answer(flash, "sglang==0.5.23", tp=8)["paths"][0]["outcome"] == RUNS
    assert answer(flash, "sglang==0.5.23", tp=32)["paths"][0]["outcome"] == DOES_NOT_START


def test_no_rules_for_a_model_is_not_checked(checkpoints):
    gptoss = checkpoints.source(synth.Dims("gpt-oss-20b"))
    for spec in ("vllm==0.34.0", "sglang==0.5.23"):
        a = answer(gptoss, spec, tp=1)
        assert a["recommendation"]["outcome"] == NOT_CHECKED, spec
        assert a["recommendation"]["verdict"].startswith(NOT_CHECKED) and "does not start" not in json.dumps(a), spec


# ------------------------------------------------------------------------- dimensions

def test_a_reduced_checkpoint_says_when_the_full_model_would_be_answered_otherwise(checkpoints, flash):
    small = checkpoints.source(synth.Dims())   # moe_intermediate_size 128: 16 a rank at TP=8
    a = answer(small, "sglang==0.5.23")
    assert a["paths"][0]["outcome"] == DOES_NOT_START and a["recommendation"]["choice"].startswith("nvfp4")
    full = a["at_full_scale"]["deepseek-v4-flash"]
    assert full["dims"]["intermediate"] == 2048 and full["verdict"].startswith("do not convert")
    assert answer(flash, "sglang==0.5.23")["at_full_scale"] == {}


# ---------------------------------------------------------------------------- the command

def test_cli_json_carries_the_fields_the_text_shows(flash):
    done = run_cli("advise", flash, "--engine", "sglang==0.5.23", "--gpu", "sm_120", "--tp", "8", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    a = result["answers"][0]
    assert {"outcome", "runs", "drafter_kept", "gives_up", "packages", "opt_in"} <= set(a["paths"][0])
    assert {"upgrade", "scope", "what_was_checked", "at_full_scale", "published"} <= set(a)
    assert a["recommendation"]["outcome"] == RUNS and a["recommendation"]["weighed"] == ["runs", "drafter", "tier", "speed", "error"]
    fig = a["published"][0]
    assert fig["source"].startswith("https://github.com/sgl-project/sglang/issues/40877")
    text = format_advice(result)
    assert f"=> {a['recommendation']['verdict']}" in text
    assert "published for deepseek-v4.1-flash (not requant's measurement)" in text


def test_unknown_published_families_are_never_quoted():
    from requant.advise import published
    assert published("sglang", "gpt_oss", "sm_120") == [] and published("vllm", "deepseek_v4", "sm_120") == []


def test_the_real_release_history_answers(flash):
    """Whatever release files exist: each release's answer is its own, an upgrade it leads with is
    to a later release, and a release older than every file does not serve the model."""
    specs = [f"{name}=={version}" for name in engines.engine_names() for version in engines.releases(name)]
    with Checkpoint.open(flash) as ck:
        answers = advise(ck, specs + [f"{name}==0.0.1" for name in engines.engine_names()], "sm_120", tp=8,
                         errors=measured_errors())["answers"]
    for spec, a in zip(specs, answers):
        name, version = engines.parse_spec(spec)
        assert a["checked"] and a["rules_release"] == version, spec
        if a["upgrade"]:
            assert engines.version_key(a["upgrade"]["release"]) > engines.version_key(version), spec
            assert a["recommendation"]["verdict"].startswith(f"upgrade {engines.release_data(name, version)['label']}")
    assert all(a["status"] == "does not serve" for a in answers[len(specs):])


def test_the_readme_example_is_what_advise_prints(flash):
    """README's advise example, on the real layout, is advise's own output for each command shown."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("$ requant advise v4-layout", 1)[1].split("```", 1)[0]
    runs = [("requant advise v4-layout" + chunk).split("\n", 1) for chunk in block.split("$ requant advise v4-layout")]
    assert len(runs) >= 3
    for command, shown in runs:
        args = shlex.split(command)[3:]
        with Checkpoint.open(flash) as ck:
            result = advise(ck, [args[args.index("--engine") + 1]], args[args.index("--gpu") + 1],
                            tp=int(args[args.index("--tp") + 1]), errors=measured_errors())
        printed = format_advice(result).replace(flash, "v4-layout").splitlines()
        for line in shown.strip("\n").splitlines():
            assert line in printed, (command, line)
