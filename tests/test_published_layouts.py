"""NVIDIA's published NVFP4 repacks of the DeepSeek-V4 family, as small synthetic fixtures, and what
`verify --engine` and `advise` say about each per engine release (issue 42, item 2).

What is published and what is inferred (docs/models/deepseek-v4-family.md, section 8):
- nvidia/DeepSeek-V4-Flash-NVFP4: the layout of ../shared/docs/formats.md section 2 (routed experts
  of the main layers NVFP4, MTP experts left MXFP4, ignore ["*.attn.*", "*.ffn.shared_experts.*",
  "head", "mtp.*"]): requant's default `--out nvfp4` writes it.
- nvidia/DeepSeek-V4-Pro-0813-NVFP4 (and 0731): the card says the draft head stays in its source
  MXFP4; the ignore list is inferred to be the one above (the files were not found).
- nvidia/DeepSeek-V4-Pro-0813-nvfp4-DSpark: the card says the draft experts are losslessly cast to
  NVFP4; that their ignore list stops naming them (requant's `ignore_mtp_converted`) is inferred.
- nvidia/DeepSeek-V4.1-Flash-NVFP4 (and -1017-NVFP4): card only; the fixture is requant's default
  V4.1 output (drafter kept), inferred.
Fixtures are at the recipes' reduced dimensions (0731 stands for 0813: the same recipe)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from requant import synth
from requant.advise import DRAFTS_GARBAGE, advise
from requant.convert import convert
from requant.engines import RUNS, WRONG_RESULT
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.targets import Options
from requant.verify import verify

NVIDIA_IGNORE = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]   # formats.md, section 2

# name: (model synthesized, what the drafter's experts become)
LAYOUTS = {
    "V4-Flash-NVFP4": ("deepseek-v4-flash", "keep"),
    "0813-NVFP4": ("deepseek-v4-flash-0731", "keep"),
    "0813-nvfp4-DSpark": ("deepseek-v4-flash-0731", "convert"),
    "V4.1-Flash-NVFP4": ("deepseek-v4.1-flash", "keep"),
}
RELEASES = ["vllm==0.34.0", "vllm==0.33.0", "sglang==0.5.23"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """name -> (source, repack) directories."""
    root = tmp_path_factory.mktemp("published")
    sources, out = {}, {}
    for name, (model, drafter) in LAYOUTS.items():
        if model not in sources:
            sources[model] = str(root / model)
            synth.write_checkpoint(sources[model], synth.Dims(model), seed=11)
        out[name] = (sources[model], str(root / name))
        convert(sources[model], out[name][1], "nvfp4", Options(mtp=drafter, force=True), progress=False)
    return out


def _quantization(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config.get("quantization_config") or config["text_config"]["quantization_config"]


def _drafter(path: str) -> dict[str, bytes]:
    with Checkpoint.open(path) as ck:
        return {n: ck.tensor(n).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for n in ck.names if n.startswith("mtp.") and ".ffn.experts." in n}


def _drafter_format(path: str) -> str:
    with Checkpoint.open(path) as ck:
        names = [n for n in ck.names if n.startswith("mtp.") and ".ffn.experts." in n]
    return "nvfp4" if any(n.endswith(".weight_scale_2") for n in names) else "mxfp4"


def test_nvidia_v4_flash_nvfp4_is_requants_default_layout(published):
    src, dst = published["V4-Flash-NVFP4"]
    q = _quantization(dst)
    assert q["ignore"] == NVIDIA_IGNORE and q["quant_method"] == "fp8" and q["moe_quant_algo"] == "NVFP4"
    with open(os.path.join(dst, "hf_quant_config.json"), encoding="utf-8") as f:
        assert json.load(f)["quantization"]["exclude_modules"] == NVIDIA_IGNORE
    assert _drafter(dst) == _drafter(src)   # the MTP experts stay the source's MXFP4, byte for byte


def test_the_drafter_variants_differ_only_as_the_cards_say(published):
    """-NVFP4 keeps the DSpark drafter's MXFP4 bytes and lists mtp.*; -nvfp4-DSpark casts its experts
    to NVFP4 and leaves them out of ignore."""
    src, kept = published["0813-NVFP4"]
    _, cast = published["0813-nvfp4-DSpark"]
    assert _drafter(kept) == _drafter(src) and _drafter_format(kept) == "mxfp4"
    assert _drafter_format(cast) == "nvfp4"
    assert "mtp.*" in _quantization(kept)["ignore"]
    assert not any(p.startswith("mtp.") and "experts" in p or p == "mtp.*" for p in _quantization(cast)["ignore"])


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_verify_judges_each_layout_by_the_release_s_drafter_rule(published, name, release):
    """The verdict is the release's rule for the drafter's experts under this ignore list: what the
    engine loads them as against what they are."""
    _, dst = published[name]
    with Checkpoint.open(dst) as ck:
        spec = ModelSpec.for_checkpoint(ck)
        blocks = sorted({n.rsplit(".ffn.experts.", 1)[0] for n in ck.names
                         if n.startswith("mtp.") and ".ffn.experts." in n})
    rules = spec.engine(*release.split("=="))
    loads_as = {rules.mtp_format_for("nvfp4", b, _quantization(dst)["ignore"]) for b in blocks}
    result = verify(dst, engine=release, progress=False)
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    assert result["ok"] == (loads_as == {_drafter_format(dst)}), result["findings"]
    assert [f["code"] for f in errors] == ([] if result["ok"] else ["mtp-format"])


def test_what_each_release_does_with_each_layout(published):
    """The table docs/models/deepseek-v4-family.md section 8 states, from the rules (engine code,
    not run): only SGLang refuses the cast drafter (it always loads the stages as MXFP4)."""
    table = {(name, release): verify(published[name][1], engine=release, progress=False)["ok"]
             for name in LAYOUTS for release in RELEASES}
    refused = {key for key, ok in table.items() if not ok}
    assert refused == {("0813-nvfp4-DSpark", "sglang==0.5.23")}
    message = next(f["message"] for f in verify(published["0813-nvfp4-DSpark"][1], engine="sglang==0.5.23",
                                                 progress=False)["findings"] if f["severity"] == "error")
    assert message.startswith("SGLang 0.5.23: loads the MTP block's experts as MXFP4 but they are NVFP4")


def test_an_older_release_without_dspark_rules_is_not_checked_not_passed(published):
    """vllm #52447 (KeyError ...w13_input_scale in a DSpark draft loader on an NVFP4 0731 with an MXFP4
    drafter) was a fork's loader, not a release; requant's rules for selection-scope releases such as
    vLLM 0.27.1 carry no DSpark family, so verify says 'not checked' and asserts nothing about it. The
    V4 family's rule for 0.27.1 does judge NVIDIA's V4-Flash repack: its MXFP4 MTP experts would be
    given the NVFP4 method there."""
    for name, family in (("0813-NVFP4", "deepseek_v4_dspark"), ("0813-nvfp4-DSpark", "deepseek_v4_dspark"),
                         ("V4.1-Flash-NVFP4", "deepseek_v41")):
        result = verify(published[name][1], engine="vllm==0.27.1", progress=False)
        assert [(f["severity"], f["code"]) for f in result["findings"]] == [("warning", "no-engine-rules")]
        assert f"requant has no rules for {family} models" in result["findings"][0]["message"]
    result = verify(published["V4-Flash-NVFP4"][1], engine="vllm==0.27.1", progress=False)
    assert not result["ok"] and [f["code"] for f in result["findings"] if f["severity"] == "error"] == ["mtp-format"]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_advise_judges_the_drafter_as_verify_does(published, name, release):
    """advise on each repack as it is: the drafter's method is the one for the format verify's rule
    says the release loads it in (vLLM: quantization_config.ignore; SGLang: always MXFP4), and where
    that is not the stored format (verify's mtp-format error) the drafter starts with a wrong result
    and the costs say so; the main layers run either way."""
    _, dst = published[name]
    with Checkpoint.open(dst) as ck:
        answer = advise(ck, [release], "sm_100")
        rules = ModelSpec.for_checkpoint(ck).engine(*release.split("=="))
    (engine,) = answer["answers"]
    assert answer["source_format"] == "nvfp4" and answer["mtp_format"] == _drafter_format(dst)
    as_is = next(p for p in engine["paths"] if p["path"] == "as it is (nvfp4)")
    garbage = "mtp-format" in [f["code"] for f in verify(dst, engine=release, progress=False)["findings"]]
    loaded = {rules.mtp_format_for("nvfp4", b, _quantization(dst)["ignore"]) for b in ("mtp.0",)}
    assert engine["status"] == "checked" and as_is["outcome"] == RUNS, as_is
    assert as_is["mtp"]["method"].startswith("Mxfp4" if loaded == {"mxfp4"} else "ModelOptNvFp4"), as_is["mtp"]
    assert (as_is["mtp"]["outcome"] == WRONG_RESULT) == garbage and as_is["drafter_kept"] == (not garbage)
    assert (DRAFTS_GARBAGE in as_is["gives_up"]) == garbage, as_is["gives_up"]


def test_advise_names_the_two_drafters_section_8_3_found(published):
    """docs/models/deepseek-v4-family.md 8.3: V4-Flash-NVFP4 lists mtp.* in ignore, so vLLM 0.34.0
    gives its MTP experts Mxfp4MoEMethod; SGLang loads the cast DSpark drafter as MXFP4."""
    with Checkpoint.open(published["V4-Flash-NVFP4"][1]) as ck:
        (vllm,) = advise(ck, ["vllm==0.34.0"], "sm_100")["answers"]
    as_is = next(p for p in vllm["paths"] if p["path"] == "as it is (nvfp4)")
    assert as_is["mtp"]["method"] == "Mxfp4MoEMethod" and as_is["drafter_kept"]
    with Checkpoint.open(published["0813-nvfp4-DSpark"][1]) as ck:
        (sglang,) = advise(ck, ["sglang==0.5.23"], "sm_100")["answers"]
    as_is = next(p for p in sglang["paths"] if p["path"] == "as it is (nvfp4)")
    assert as_is["mtp"]["outcome"] == WRONG_RESULT and "loads them as MXFP4" in as_is["mtp"]["note"]
    if sglang["recommendation"]["choice"] == as_is["path"]:
        assert DRAFTS_GARBAGE in sglang["recommendation"]["verdict"]
