"""Engine releases as data (requant/engines): naming a release, one requant has not checked, the
cards' commands and the README table built from the same data, and `advise`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_cli
from requant import engines
from requant.card import serve_lines
from requant.engines import table
from requant.errors import UnsupportedError
from requant.model import ModelSpec, default_model_name, load_recipes, named_models

README = Path(__file__).resolve().parent.parent / "README.md"
DSV4 = next(r for r in load_recipes() if r.name == "deepseek_v4")


def test_engine_spec_parses_name_and_release():
    assert engines.parse_spec("vllm") == ("vllm", None)
    assert engines.parse_spec("SGLang==0.5.23") == ("sglang", "0.5.23")
    for bad in ("tensorrt", "vllm==", "vllm==next"):
        with pytest.raises(UnsupportedError):
            engines.parse_spec(bad)


def test_every_release_file_loads_with_rules_for_each_gpu():
    for name in engines.engine_names():
        assert engines.releases(name), name
        for version in engines.releases(name):
            rules = engines.rules_for(DSV4, name, version)
            assert rules.checked and rules.version == version and not rules.caveat
            assert rules.data["kernels"], (name, version)
            for fmt in rules.data["kernels"]:
                for gpu in engines.GPU_FAMILIES:
                    kernel = rules.kernel(fmt, gpu)
                    assert kernel.speed in engines.SPEED_CLASSES, (name, version, fmt, gpu)
                    if kernel.runs:
                        assert kernel.arithmetic and kernel.mode and kernel.speed != "none", (name, version, fmt, gpu)
                    if kernel.engine_answer:   # requant's reading agrees with the engine's recorded answer
                        answer = kernel.engine_answer
                        assert kernel.method == answer["method"] and kernel.mtp["method"] == answer["nextn_method"]
                        assert kernel.runs == (answer["starts"] and answer["kernel_built_for_gpu"] is not False
                                               and kernel.speed != "fallback")


def test_an_unchecked_release_borrows_the_nearest_rules_and_says_so():
    newest = engines.releases("vllm")[-1]
    rules = engines.rules_for(DSV4, "vllm==0.99.0")
    assert not rules.checked and rules.checked_version == newest
    assert "not checked against vLLM 0.99.0" in rules.caveat and "not checked" in rules.label
    local = engines.rules_for(DSV4, "vllm", newest + "+cu130")   # a local build of a checked release
    assert local.checked and local.version == newest


def test_verify_names_the_release_and_never_vouches_for_an_unchecked_one(tmp_path, small_source):
    from requant.convert import convert
    from requant.targets import Options

    out = str(tmp_path / "nvfp4")
    convert(small_source, out, "nvfp4", Options(), progress=False)
    newest = engines.releases("vllm")[-1]
    named = run_cli("verify", out, "--engine", f"vllm=={newest}", "--quiet")
    assert named.returncode == 0, named.stderr
    assert f"vllm {newest}: loads it correctly" in named.stdout
    unknown = run_cli("verify", out, "--engine", "vllm==0.99.0", "--quiet")
    assert "not checked against vLLM 0.99.0" in unknown.stdout
    assert "loads it correctly" not in unknown.stdout
    bad = run_cli("verify", out, "--engine", "vllm==x", "--quiet")
    assert bad.returncode == 2 and "give a release as NAME==VERSION" in bad.stderr


def test_readme_engine_table_is_generated_from_the_release_data():
    text = README.read_text()
    start, end = text.index(table.BEGIN), text.index(table.END) + len(table.END)
    assert text[start:end] == table.markdown(named_models()[default_model_name()][0]), "README's engine table is stale: python -m requant.engines.table"


def test_card_drafts_only_where_the_mtp_block_has_a_kernel():
    for name in engines.engine_names():
        for version in engines.releases(name):
            rules = engines.rules_for(DSV4, name, version)
            for fmt in ("nvfp4", "w4a16"):
                for gpu in engines.GPU_FAMILIES if rules.has_kernel_rules(fmt) else ():   # older releases: not all formats
                    how = rules.serving(fmt, gpu)
                    if not how.starts:
                        continue
                    mtp = how.kernel.mtp or {}
                    assert how.speculative == mtp.get("runs", True), (name, version, fmt, gpu)
                    assert (rules.data["serve"]["speculative"] in how.command) == how.speculative
                    assert how.flags in how.command
            no_mtp = "\n".join(serve_lines(rules, "nvfp4", has_mtp=False))
            assert rules.data["serve"]["speculative"] not in no_mtp


@pytest.fixture(scope="module")
def sglang_pair(tmp_path_factory):
    """A small synthetic DeepSeek-V4-Flash (MXFP4) and its NVFP4 conversion for SGLang."""
    from requant import synth
    from requant.convert import convert
    from requant.targets import Options

    root = tmp_path_factory.mktemp("advise")
    src, out = str(root / "src"), str(root / "nvfp4")
    synth.write_checkpoint(src, synth.dims_with(synth.Dims(), intermediate=256), seed=5)   # 32 a rank at TP=8
    convert(src, out, "nvfp4", Options(engine="sglang"), progress=False)
    return src, out


def advise_json(*args) -> dict:
    done = run_cli("advise", *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_advise_sglang_sm120_keeps_the_mxfp4_source(sglang_pair):
    """The first user's case: SGLang 0.5.23 on RTX PRO 6000 runs the unconverted source as MXFP8 x
    MXFP4 on the tensor cores, so the answer is not to convert."""
    src, _ = sglang_pair
    answer = advise_json(src, "--engine", "sglang==0.5.23", "--gpu", "sm_120", "--tp", "2")["answers"][0]   # 128 a rank
    as_is = answer["paths"][0]
    assert as_is["starts"] and as_is["main"]["method"] == "Mxfp4FlashinferCutlassMoEMethod"
    assert as_is["main"]["selects"] == {"default": "flashinfer_mxfp4"} and "W4A8" in as_is["main"]["arithmetic"]
    assert answer["recommendation"]["verdict"].startswith(f"do not convert: {src} runs as it is")
    nvfp4 = next(p for p in answer["paths"] if p["path"] == "nvfp4")
    assert nvfp4["flags"] == "--moe-runner-backend flashinfer_cutlass" and not nvfp4["mtp"]["runs"]
    assert as_is["layer_error"]["rel_error"] < nvfp4["layer_error"]["rel_error"]   # W4A8 beats W4A4 here


def test_advise_and_verify_agree_on_the_nvfp4_output_on_sm120(sglang_pair):
    _, out = sglang_pair
    answer = advise_json(out, "--engine", "sglang==0.5.23", "--gpu", "sm_120")["answers"][0]
    as_is = answer["paths"][0]
    assert as_is["auto"]["selects"] == {"default": "flashinfer_trtllm_routed"} and not as_is["auto"]["runs"]
    assert as_is["flags"] == "--moe-runner-backend flashinfer_cutlass"
    assert "flashinfer_trtllm_routed" not in as_is["main"]["backend"]
    verified = run_cli("verify", out, "--engine", "sglang==0.5.23", "--gpu", "sm_120", "--json", "--quiet")
    verdict = json.loads(verified.stdout)["engines"]["sglang"]
    assert verdict["kernel"]["flags"] == as_is["flags"] and verdict["kernel"]["backend"] == as_is["main"]["backend"]
    assert not verdict["kernel"]["speculative"]


def test_advise_names_an_unchecked_release_and_the_tp_limit(sglang_pair):
    src, _ = sglang_pair
    text = run_cli("advise", src, "--engine", "vllm==0.99.0", "--gpu", "sm_90", "--tp", "64")
    assert text.returncode == 0, text.stderr
    assert "not checked against vLLM 0.99.0" in text.stdout
    assert "over TP=64 leaves" in text.stdout
    bad = run_cli("advise", src, "--gpu", "sm_75")
    assert bad.returncode == 2


def test_the_installed_release_is_the_one_judged(monkeypatch):
    """With an engine importable here, a bare --engine NAME means its installed release (a local
    build's +suffix included); without one, the newest release requant has checked."""
    newest = engines.releases("vllm")[-1]
    monkeypatch.setattr(engines.metadata, "version", lambda dist: {"vllm": newest + "+cu130"}[dist])
    assert engines.resolve("vllm") == ("vllm", newest + "+cu130", "installed")
    rules = engines.rules_for(DSV4, "vllm")
    assert rules.checked and rules.version == newest
    monkeypatch.setattr(engines.metadata, "version", lambda dist: "0.99.1")
    assert not engines.rules_for(DSV4, "vllm").checked

    def missing(dist):
        raise engines.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(engines.metadata, "version", missing)
    assert engines.resolve("sglang") == ("sglang", engines.releases("sglang")[-1], "newest checked")


# --------------------------------------------------------------- DeepSeek models with a DSpark drafter
DSPARK_FAMILIES = ("deepseek_v4_dspark", "deepseek_v41")


def family(name: str):
    return next(r for r in load_recipes() if r.name == name)


def test_every_family_resolves_in_every_release():
    """A family naming a `base` family repeats its rules where it says nothing (the V4 kernel cells)."""
    for engine in engines.engine_names():
        for version in engines.releases(engine, scope="loader"):
            data = engines.release_data(engine, version)
            assert not any("base" in rules for rules in data["models"].values()), (engine, version)
            for name in DSPARK_FAMILIES:
                rules = engines.rules_for(family(name), engine, version)
                assert rules.data["kernels"]["nvfp4"]["sm_100"]["method"] == \
                    engines.rules_for(DSV4, engine, version).kernel("nvfp4", "sm_100").method


def test_a_family_added_in_one_release_follows_the_next_releases_base_family():
    """vLLM 0.34.0 says nothing of Vision-Exp, which 0.33.0 added on the DSpark family: its cells
    are 0.34.0's DSpark cells (which are 0.34.0's V4 cells), never 0.33.0's."""
    newer = engines.release_data("vllm", "0.34.0")["models"]
    assert newer["deepseek_v4_vision"]["kernels"] == newer["deepseek_v4_dspark"]["kernels"]
    cited = [e for cells in newer["deepseek_v4_vision"]["kernels"].values() for cell in cells.values()
             for backend in cell.get("opt_in") or [] for e in backend["evidence"]]
    assert cited and all(e.startswith("vllm 0.34.0: ") for e in cited), cited


def test_a_selection_scope_release_has_rules_for_deepseek_v4_alone():
    """Its selection code was run for DeepSeek-V4's experts only: every other family (drafters,
    Vision-Exp, gpt-oss) is 'not checked' there, never its base release's rules by inheritance."""
    for engine in engines.engine_names():
        for version in engines.releases(engine, scope="selection"):
            assert set(engines.release_data(engine, version)["models"]) == {"deepseek_v4"}, (engine, version)


def test_release_files_repeat_nothing_they_inherit(tmp_path, monkeypatch):
    """A release file holds only what differs from its base release and base family: deleting any
    family's key from any file changes that release's data (a repeated table goes stale silently
    when the base is regenerated)."""
    monkeypatch.setattr(engines, "_RELEASES", tmp_path)
    for path in Path(engines.__file__).parent.joinpath("releases").glob("*.json"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    engines.reread_release_files()
    repeated = []
    try:
        for path in sorted(tmp_path.glob("*.json")):
            own = json.loads(path.read_text())
            if not own.get("base"):
                continue
            engine, version = own["engine"], own["version"]
            whole = engines.release_data(engine, version)
            for family, rules in (own.get("models") or {}).items():
                for key in rules or {}:
                    trial = json.loads(path.read_text())
                    del trial["models"][family][key]
                    path.write_text(json.dumps(trial))
                    engines.reread_release_files()
                    if engines.release_data(engine, version) == whole:
                        repeated.append(f"{path.name}: models.{family}.{key}")
                    path.write_text(json.dumps(own))
            engines.reread_release_files()
    finally:
        engines.reread_release_files()
    assert repeated == []


@pytest.mark.parametrize("name", DSPARK_FAMILIES)
def test_dspark_drafter_rules(name):
    """The drafter passes through (MXFP4) for NVFP4 output in every checked release; vLLM's CUDA
    quant config reads `ignore`, so a converted drafter outside it loads too, while SGLang always
    keeps the stages MXFP4; under W4A16 the drafter's experts are INT4 (both engines give the stages
    the INT4 group), and V4.1 W4A16 is refused as not established; the serve flags are DSpark's."""
    recipe = family(name)
    for engine in engines.engine_names():
        for version in engines.releases(engine, scope="loader"):
            rules = engines.rules_for(recipe, engine, version)
            assert rules.drafter["kind"] == "dspark" and rules.drafter["evidence"]
            assert rules.mtp_format("nvfp4") == "mxfp4" and rules.mtp_evidence("nvfp4")
            if name == "deepseek_v41":
                assert rules.refusal("w4a16").startswith("not established") and not rules.has_kernel_rules("w4a16")
            else:
                assert rules.refusal("w4a16") is None and rules.has_kernel_rules("w4a16")
                assert rules.mtp_format("w4a16") == "w4a16" and rules.mtp_evidence("w4a16")
            kept, converted = ["*.attn.*", "mtp.*"], ["*.attn.*", "mtp.*.main_proj"]
            assert rules.mtp_format_for("nvfp4", "mtp.2", kept) == "mxfp4"
            speculative = rules.data["serve"]["speculative"]
            if engine == "vllm":
                assert rules.mtp_format_for("nvfp4", "mtp.2", converted) == "nvfp4"
                assert rules.mtp_loads("nvfp4", "nvfp4") and '"method": "dspark"' in speculative
            else:
                assert rules.mtp_format_for("nvfp4", "mtp.2", converted) == "mxfp4"
                assert not rules.mtp_loads("nvfp4", "nvfp4") and speculative == "--speculative-algorithm DSPARK"
            for gpu in engines.GPU_FAMILIES:
                how = rules.serving("nvfp4", gpu)
                assert not how.starts or (speculative in how.command) == how.speculative
            assert "EAGLE" not in "\n".join(serve_lines(rules, "nvfp4", has_mtp=True))


@pytest.fixture(scope="module")
def dspark_source(tmp_path_factory):
    from requant import synth
    path = str(tmp_path_factory.mktemp("dspark") / "src")
    synth.write_checkpoint(path, synth.Dims("deepseek-v4-flash-0731", layers=3, experts=6), seed=4)
    return path


def drafter_bytes(path: str) -> dict[str, bytes]:
    from safetensors import safe_open
    index = json.loads(Path(path, "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        if name.startswith("mtp."):
            with safe_open(str(Path(path, shard)), "pt") as f:
                out[name] = f.get_tensor(name).view(-1).view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_convert_passes_the_dspark_drafter_through(dspark_source, tmp_path, engine):
    """By default the drafter's bytes, experts included, equal the source's for either engine, and
    the output's ignore lists mtp.* (what vLLM's CUDA config needs to give them the MXFP4 method)."""
    from requant.convert import convert
    from requant.targets import Options

    out = str(tmp_path / "out")
    convert(dspark_source, out, "nvfp4", Options(engine=engine), progress=False)
    assert drafter_bytes(out) == drafter_bytes(dspark_source)
    assert "mtp.*" in json.loads(Path(out, "config.json").read_text())["quantization_config"]["ignore"]


def test_convert_refuses_what_the_rules_refuse(dspark_source, tmp_path):
    from requant.convert import convert
    from requant.targets import Options

    with pytest.raises(UnsupportedError, match="SGLang 0.5.23 loads the MTP block's experts as MXFP4"):
        convert(dspark_source, str(tmp_path / "sglang-convert"), "nvfp4", Options(engine="sglang==0.5.23", mtp="convert"),
                progress=False)


def test_vllm_drafter_converted_on_request_verifies(dspark_source, tmp_path):
    """--mtp convert for vLLM: the stages become NVFP4 and the ignore leaves them out, which vLLM's
    rules accept (verify), while SGLang's say its stages load as MXFP4."""
    from requant.convert import convert
    from requant.targets import Options

    out = str(tmp_path / "converted")
    convert(dspark_source, out, "nvfp4", Options(engine="vllm", mtp="convert"), progress=False)
    assert "mtp.*" not in json.loads(Path(out, "config.json").read_text())["quantization_config"]["ignore"]
    vllm_verdict = run_cli("verify", out, "--engine", "vllm", "--quiet")
    assert vllm_verdict.returncode == 0 and "loads it correctly" in vllm_verdict.stdout, vllm_verdict.stdout
    sglang_verdict = run_cli("verify", out, "--engine", "sglang", "--quiet")
    assert sglang_verdict.returncode != 0 and "loads the MTP block's experts as MXFP4" in sglang_verdict.stdout
