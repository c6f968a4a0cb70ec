"""One set of checks before and after a conversion, verify speaking once, and cards and reports
that never contradict themselves (the issue's cases, one test each)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from requant.formats.int4 import CODEC as _INT4
from requant import card, synth
from requant.cli import cli
from requant.convert import convert
from requant.errors import RequantError
from requant.io.checkpoint import Checkpoint
from requant.plan import make_plan
from requant.report.render import verdict
from requant.targets import Options
from requant.verify import OutputRejected, check_conversion_plan, check_written, verify

DIMS = synth.Dims(layers=2, experts=8, hidden=256, intermediate=128, hash_layers=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("consistency") / "src")
    synth.write_checkpoint(src, DIMS, seed=4)
    return src


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("gptoss") / "g20")
    synth.write_checkpoint(src, synth.Dims("gpt-oss-20b", layers=2, experts=8, hidden=256, intermediate=128))
    return src


def edited_copy(source, tmp_path, fn, name="src"):
    dst = str(tmp_path / name)
    shutil.copytree(source, dst)
    path = os.path.join(dst, "config.json")
    config = json.load(open(path))
    fn(config)
    json.dump(config, open(path, "w"))
    return dst


def invoke(*args):
    return CliRunner().invoke(cli, [*args])


# 1. convert refuses up front what verify would reject -----------------------------------------

def test_source_without_quantization_config_is_refused_before_writing(source, tmp_path):
    src = edited_copy(source, tmp_path, lambda c: c.pop("quantization_config"))
    dst = tmp_path / "out"
    result = invoke("convert", src, str(dst), "--out", "nvfp4", "--quiet")
    assert result.exit_code == 1, result.output
    message = result.output.strip()
    assert "\n" not in message and "refused before writing anything" in message and "quant_method" in message
    assert not dst.exists()


def test_more_experts_in_config_than_stored_is_refused_before_writing(source, tmp_path):
    src = edited_copy(source, tmp_path, lambda c: c.update(n_routed_experts=16))
    dst = tmp_path / "out"
    result = invoke("convert", src, str(dst), "--out", "nvfp4", "--quiet")
    assert result.exit_code == 1, result.output
    assert "missing-expert" in result.output and "n_routed_experts is 16" in result.output
    assert "\n" not in result.output.strip() and not dst.exists()
    # the dry run applies the same checks
    assert invoke("convert", src, str(dst), "--out", "nvfp4", "--dry-run", "--quiet").exit_code == 1


def test_the_preflight_is_verifys_checks(source, tmp_path):
    """On a clean conversion the plan's checks pass and so does verify afterwards; check_written
    rejects the same output once its config.json disagrees with its experts."""
    with Checkpoint.open(source) as ck:
        plan = make_plan(ck, "nvfp4", Options())
        assert check_conversion_plan(plan)["ok"]
    dst = str(tmp_path / "out")
    convert(source, dst, "nvfp4", Options(), progress=False)
    assert verify(dst, progress=False)["ok"] and check_written(dst)["ok"]
    config = json.load(open(os.path.join(dst, "config.json")))
    config["n_routed_experts"] = 16
    with pytest.raises(OutputRejected, match="missing-expert"):
        check_written(dst, {"config.json": config})


def test_an_output_verify_rejects_is_never_finished(source, tmp_path, monkeypatch):
    """A gap in the pre-flight (simulated: turned off) is caught after writing: convert fails and
    leaves no config.json or index, so nothing loads the output. Needs convert.py to call
    check_written before it writes the metadata."""
    import requant.verify
    monkeypatch.setattr(requant.verify, "check_conversion_plan", lambda plan: None)
    src = edited_copy(source, tmp_path, lambda c: c.update(n_routed_experts=16))
    dst = str(tmp_path / "out")
    with pytest.raises(RequantError, match="fails `requant verify`"):
        convert(src, dst, "nvfp4", Options(), progress=False)
    assert not os.path.exists(os.path.join(dst, "config.json"))
    assert not os.path.exists(os.path.join(dst, "model.safetensors.index.json"))


# 2. verify speaks once -------------------------------------------------------------------------

def test_missing_path_and_unfinished_conversion_have_one_line_each(tmp_path):
    missing = str(tmp_path / "nothere")
    v, i = invoke("verify", missing, "--quiet"), invoke("inspect", missing)
    assert v.exit_code == 1 and i.exit_code == 1
    assert v.output.strip().count("\n") == 0 and "no such directory" in v.output
    assert f"file {missing}: no such directory" in v.output and f"file {missing}: no such directory" in i.output
    target = tmp_path / "half"
    os.makedirs(target / ".requant-convert")
    (target / ".requant-convert" / "journal.json").write_text(json.dumps(
        {"format": 1, "options": {}, "resume": "requant convert a half --resume",
         "shards": [{"name": "a.safetensors", "done": True}, {"name": "b.safetensors", "done": False}]}))
    v, i = invoke("verify", str(target), "--quiet"), invoke("inspect", str(target))
    line = f"file {target}: conversion in progress: 1 of 2 shards, resume with `requant convert a half --resume`"
    assert v.exit_code == 1 and v.output.strip() == f"requant: error: {line}"
    assert line in i.output
    result = verify(str(target), progress=False)
    assert result["diagnosis"] == line and result["findings"][0]["code"] == "conversion-in-progress"


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("conv") / "nv")
    convert(source, dst, "nvfp4", Options(), progress=False)
    return dst


def _truncate(path):
    with Checkpoint.open(path) as ck:
        shard = ck.locations[next(n for n in ck.names if ".experts.0.w1.weight" in n)]
    os.truncate(os.path.join(path, shard), os.path.getsize(os.path.join(path, shard)) - 100)


def _remove_shard(path):
    with Checkpoint.open(path) as ck:
        shard = ck.locations[next(n for n in ck.names if ".experts.0.w1.weight" in n)]
    os.remove(os.path.join(path, shard))


def _nan_scale(path):
    with Checkpoint.open(path) as ck:
        name = next(n for n in ck.names if n.endswith(".experts.0.w1.weight_scale"))
        info, file = ck.info(name), ck.shard_path(ck.locations[name])
    with open(file, "r+b") as f:
        f.seek(info.start)
        f.write(b"\x7f")


@pytest.mark.parametrize("damage", [_truncate, _remove_shard, _nan_scale])
def test_no_engine_verdict_above_errors(converted, tmp_path, damage):
    path = str(tmp_path / "ck")
    shutil.copytree(converted, path)
    damage(path)
    text = invoke("verify", path, "--quiet")
    assert text.exit_code == 1 and "ERROR" in text.output
    assert "loads it correctly" not in text.output and "not judged" in text.output
    result = verify(path, progress=False)
    assert all(v["judged"] is False and v["loads"] is None for v in result["engines"].values()), result["engines"]


# 3. gpt-oss: no dead end, a card that agrees with itself, verify --gpu reports ----------------

def test_gptoss_refusal_points_nowhere_requant_cannot_go(gptoss, tmp_path):
    result = invoke("convert", gptoss, str(tmp_path / "out"), "--out", "nvfp4")
    assert result.exit_code != 0 and "use --out w4a16" not in result.output
    assert "serve the MXFP4 source as it is" in result.output


def test_forced_gptoss_card_does_not_contradict_itself(gptoss, tmp_path):
    dst = str(tmp_path / "forced")
    result = invoke("convert", gptoss, dst, "--out", "nvfp4", "--force", "--quiet")
    assert result.exit_code == 0, result.output
    text = open(os.path.join(dst, "README.md")).read()
    assert "every tensor of this directory loads there" not in text
    assert "does **not** load it correctly" in text
    command = next(line for line in text.splitlines() if line.startswith("Command:"))
    assert command.endswith("--force`") and "--mtp" not in command
    assert "```bash" not in text   # no serve command for an engine that cannot serve it


def test_card_says_a_small_model_fits_on_one_gpu(gptoss):
    record = {"source": "g20", "source_format": "mxfp4", "target_format": "nvfp4", "options": {},
              "producer": {"version": "x"}, "engine": {"forced": []}, "tensor_groups": {},
              "accuracy": {}, "tensor_bytes": 13_761_264_768}
    with Checkpoint.open(gptoss) as ck:
        from requant.model import ModelSpec
        rules = ModelSpec.for_config(ck.config).engine("vllm")
    text = card.model_card(record, rules)
    assert "does not fit on one" not in text and "13.8 GB of weights fit on one 80 GB GPU" in text
    big = card.model_card({**record, "tensor_bytes": 168_500_000_000}, rules)
    assert "do not fit on one 80 GB GPU" in big


@pytest.mark.parametrize("engine", [[], ["--engine", "sglang"]])
def test_verify_gpu_on_gptoss_reports(gptoss, engine):
    result = invoke("verify", gptoss, "--gpu", "sm_120", "--quiet", *engine)
    assert result.exit_code == 0, result.output
    assert "no MoE kernel rules" in result.output or "requant has no rules for gpt_oss" in result.output


# 4. the report headline fits the format ---------------------------------------------------------

W4A16 = _INT4.name


def _report(fmt, sqnr, group=None, scheme=None):
    metrics = {"blocks": 100, "exact_blocks": 1, "nonfinite": 0, "sqnr_db": sqnr, "max_abs_error": 0.1}
    cand = {"format": fmt} | ({"group_size": group, "scheme": scheme} if group else {})
    return {"overall": metrics, "candidate": cand, "selection": {"experts_compared": 8},
            "by_layer": [{"block": "layers.0", "metrics": metrics}]}


def test_w4a16_headline_is_against_the_formats_best():
    text = verdict(_report(W4A16, 17.5, 128, "sym"))
    assert not text.startswith("Not exact") and "lossy by design" in text and "17.52 dB at best" in text
    assert text.startswith("As expected")
    assert verdict(_report(W4A16, 12.0, 128, "sym")).startswith("Below what the format reaches")
    assert verdict(_report("nvfp4", 40.0)).startswith("Not exact")   # lossless target: exactness first


# 5. the card carries the source's license and the command as run -------------------------------

UPSTREAM = "---\nlicense: mit\nbase_model: deepseek-ai/DeepSeek-V4-Flash\n---\n# upstream\n"


def test_card_carries_license_and_base_model(source, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(source, src)
    open(os.path.join(src, "README.md"), "w").write(UPSTREAM)
    dst = str(tmp_path / "out")
    assert invoke("convert", src, dst, "--out", "nvfp4", "--quiet").exit_code == 0
    front = open(os.path.join(dst, "README.md")).read().split("---")[1]
    assert 'license: "mit"' in front and 'base_model: "deepseek-ai/DeepSeek-V4-Flash"' in front


def test_card_command_is_the_command_run(source, tmp_path):
    """Needs convert.py to record how it was run (plan.run)."""
    src = str(tmp_path / "src")
    shutil.copytree(source, src)
    dst = str(tmp_path / "out")
    assert invoke("convert", src, dst, "--out", "nvfp4", "--quiet").exit_code == 0
    text = open(os.path.join(dst, "README.md")).read()
    assert f"Command: `requant convert {src} {dst} " in text and "SRC" not in text and " DST " not in text
    assert invoke("convert", src, "--in-place", "--out", "nvfp4", "--quiet").exit_code == 0
    text = open(os.path.join(src, "README.md")).read()
    assert f"Command: `requant convert {src} --in-place " in text
