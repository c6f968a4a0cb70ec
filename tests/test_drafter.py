"""convert --drafter keep|convert (--mtp is the same option): per DSpark model x loader-scope engine
release x output format, each mode is planned as asked or refused in one line, as the release's
drafter rules (formats.<fmt>.mtp_experts / mtp_by_ignore) say. The tier (tests/engines/*_dspark.py)
holds the modes against the engines' own loaders; this holds the choice and the refusal."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from requant import engines, synth
from requant.cli import cli
from requant.convert import plan_conversion
from requant.errors import EXIT_USAGE, UnsupportedError
from requant.targets import Options

MODELS = {"v4-0731": synth.Dims("deepseek-v4-flash-0731", layers=3, experts=6),
          "v41": synth.Dims("deepseek-v4.1-flash")}
RELEASES = [(e, v) for e in ("vllm", "sglang") for v in engines.releases(e, scope="loader")]
MODES = ("keep", "convert")


@pytest.fixture(scope="module", params=sorted(MODELS))
def dspark_source(request, checkpoints) -> tuple[synth.Dims, str]:
    return MODELS[request.param], checkpoints.source(MODELS[request.param], seed=5)


def test_dspark_releases_are_covered():
    engines_seen = {e for e, _ in RELEASES}
    assert engines_seen == {"vllm", "sglang"}, RELEASES


@pytest.mark.parametrize("fmt", ["nvfp4", "w4a16"])
@pytest.mark.parametrize("engine,version", RELEASES)
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_is_planned_or_refused_as_the_release_rules_say(dspark_source, engine, version, fmt, mode):
    dims, src = dspark_source
    rules = dims.spec.engine(engine, version)
    options = Options(engine=f"{engine}=={version}", mtp=mode)
    written = fmt if mode == "convert" else "mxfp4"
    if rules.refusal(fmt):
        with pytest.raises(UnsupportedError) as refused:
            plan_conversion(src, fmt, options)
        assert "\n" not in str(refused.value) and "cannot serve" in str(refused.value)
        return
    if not rules.mtp_loads(fmt, written):
        with pytest.raises(UnsupportedError) as refused:
            plan_conversion(src, fmt, options)
        message = str(refused.value)
        other = "keep" if mode == "convert" else "convert"
        assert "\n" not in message and f"--mtp {other}" in message and "--force" in message, message
        return
    plan = plan_conversion(src, fmt, options)
    assert plan.target.mtp == mode and not plan.target.forced_problems
    stages = plan.experts.drafter_blocks()
    assert stages and (set(stages) <= set(plan.blocks)) == (mode == "convert")
    ignore = json.loads(json.dumps(plan.target.model.quantization_ignore(fmt, mode == "convert")))
    for stage in stages:
        assert rules.mtp_format_for(fmt, stage, ignore) == written, (stage, ignore)


def test_drafter_and_mtp_are_one_option(checkpoints, tmp_path):
    src = checkpoints.source(MODELS["v4-0731"], seed=5)
    plans = []
    for flag in ("--drafter", "--mtp"):
        run = CliRunner().invoke(cli, ["convert", src, str(tmp_path / flag), "--out", "nvfp4", "--engine", "vllm",
                                       flag, "convert", "--dry-run", "--json"])
        assert run.exit_code == 0, run.output
        plans.append({k: v for k, v in json.loads(run.output).items() if k != "free_bytes_available"})
    assert plans[0] == plans[1] and plans[0]["mtp"] == "convert"
    default = CliRunner().invoke(cli, ["convert", src, str(tmp_path / "d"), "--out", "nvfp4", "--engine", "vllm",
                                       "--dry-run", "--json"])
    assert json.loads(default.output)["mtp"] == "keep"   # vLLM's rule for NVFP4: the stages stay MXFP4


def test_a_refused_mode_is_one_line_and_exit_2(checkpoints, tmp_path):
    src = checkpoints.source(MODELS["v4-0731"], seed=5)
    dst = tmp_path / "out"
    run = CliRunner().invoke(cli, ["convert", src, str(dst), "--out", "nvfp4", "--engine", "sglang",
                                   "--drafter", "convert", "-q"])
    assert run.exit_code == EXIT_USAGE and len(run.output.strip().splitlines()) == 1, run.output
    assert "--mtp keep" in run.output and not dst.exists()


def test_no_drafter_refuses_the_option(checkpoints, tmp_path):
    src = checkpoints.source(synth.Dims("gpt-oss-20b", layers=1, experts=4, hidden=64, intermediate=64, vocab=64), seed=5)
    run = CliRunner().invoke(cli, ["convert", src, str(tmp_path / "o"), "--out", "nvfp4", "--drafter", "keep", "-q"])
    assert run.exit_code == EXIT_USAGE and "has no drafter" in run.output and "--drafter" in run.output, run.output
