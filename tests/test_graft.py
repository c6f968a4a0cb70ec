"""convert --drafter graft PATH: the drafter of another checkpoint of the same model replaces the
source's own (or is attached to a source without one), its tensors byte for byte; every check is a
one-line refusal before anything is written; the output verifies, names its donor, and resumes only
with the same donor. The tier (tests/engines/*_dspark.py) loads grafted outputs with the engines'
own drafter loaders."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.convert import convert
from requant.errors import EXIT_USAGE, RequantError
from requant.io import fsutil, journal
from requant.io.checkpoint import Checkpoint
from requant.targets import Options
from tests.helpers.files import output_tree, tensor_bytes

DIMS = {"layers": 3, "experts": 6}
DONOR = synth.Dims("deepseek-v4-flash-0731", **DIMS)          # a DSpark drafter, 3 stages
WITH_MTP = synth.Dims("deepseek-v4-flash", **DIMS)            # the one-layer MTP block
WITHOUT = synth.Dims("deepseek-v4-flash", mtp_layers=0, **DIMS)   # no drafter at all


def run(*args: str):
    return CliRunner().invoke(cli, ["convert", *args, "-q"])


def graft_args(src: str, dst, donor: str, *more: str) -> list[str]:
    return [src, str(dst), "--out", "nvfp4", "--engine", "vllm", "--drafter", "graft", donor, *more]


@pytest.mark.parametrize("base", [WITHOUT, WITH_MTP], ids=["no-drafter", "mtp"])
def test_the_donors_drafter_is_grafted_byte_for_byte(checkpoints, tmp_path, base):
    src, donor = checkpoints.source(base, seed=3), checkpoints.source(DONOR, seed=4)
    dst = tmp_path / "out"
    result = run(*graft_args(src, dst, donor))
    assert result.exit_code == 0, result.output
    with Checkpoint.open(str(dst)) as out, Checkpoint.open(donor) as given, Checkpoint.open(src) as source:
        drafter = [n for n in given.names if n.startswith("mtp.")]
        assert drafter and {n for n in out.names if n.startswith("mtp.")} == set(drafter)
        for name in drafter:
            assert out.info(name).spec == given.info(name).spec, name
            assert tensor_bytes(out, name) == tensor_bytes(given, name), name
        # the drafter's shards are written, never links to the donor's files; the source's own MTP shard is gone
        for shard in {out.locations[n] for n in drafter}:
            assert shard.startswith("model-drafter-")
            assert all(not os.path.samefile(dst / shard, given.shard_path(s)) for s in given.shard_names)
        assert not set(source.shard_names) - set(out.shard_names) - {source.locations[n] for n in source.names
                                                                       if n.startswith("mtp.")}
    config, donor_config = (json.loads((p / "config.json").read_text()) for p in (dst, Path(donor)))
    for key in ("num_nextn_predict_layers", "dspark_target_layer_ids", "dspark_block_size", "compress_ratios"):
        assert config[key] == donor_config[key], key
    record = json.loads((dst / "requant.json").read_text())
    assert record["drafter_donor"] == donor and record["options"]["mtp"] == f"graft {donor}"
    assert record["drafter_donor_resolved"] == os.path.realpath(donor)
    assert f"grafted from `{donor}` (`{os.path.realpath(donor)}`)" in (dst / "README.md").read_text()
    verified = CliRunner().invoke(cli, ["verify", str(dst), "--engine", "vllm"])
    assert verified.exit_code == 0 and "0 errors" in verified.output, verified.output


def test_an_nvfp4_dspark_donor_gives_its_kept_drafter(checkpoints, tmp_path):
    """NVIDIA's -nvfp4-DSpark layout: the drafter kept MXFP4 beside NVFP4 main experts; grafting it
    onto an MXFP4 source without a drafter gives the same drafter bytes."""
    donor = checkpoints.converted(checkpoints.source(DONOR, seed=4), "nvfp4", Options(engine="vllm", mtp="keep"))
    dst = tmp_path / "out"
    result = run(*graft_args(checkpoints.source(WITHOUT, seed=3), dst, donor))
    assert result.exit_code == 0, result.output
    with Checkpoint.open(str(dst)) as out, Checkpoint.open(donor) as given:
        drafter = [n for n in given.names if n.startswith("mtp.")]
        assert all(tensor_bytes(out, n) == tensor_bytes(given, n) for n in drafter)


def refusal(args: list[str], dst) -> str:
    result = run(*args)
    assert result.exit_code == EXIT_USAGE and len(result.output.strip().splitlines()) == 1, result.output
    assert not os.path.exists(dst) or not os.listdir(dst), os.listdir(dst)
    return result.output


def test_refusals_are_one_line_before_anything_is_written(checkpoints, tmp_path):
    src, dst = checkpoints.source(WITHOUT, seed=3), tmp_path / "out"
    donor = checkpoints.source(DONOR, seed=4)
    gpt = checkpoints.source(synth.Dims("gpt-oss-20b", layers=1, experts=4, hidden=64, intermediate=64, vocab=64))
    assert "a drafter is grafted within one model family" in refusal(graft_args(src, dst, gpt), dst)
    wider = checkpoints.source(synth.Dims("deepseek-v4-flash-0731", layers=3, experts=8), seed=4)
    assert "config.json field n_routed_experts is 6" in refusal(graft_args(src, dst, wider), dst)
    assert "the donor has no drafter" in refusal(graft_args(src, dst, checkpoints.source(WITHOUT, seed=5)), dst)
    assert "give DST" in refusal([src, "--in-place", "--out", "nvfp4", "--drafter", "graft", donor], dst)
    assert "--drafter graft PATH" in refusal([src, str(dst), "--out", "nvfp4", "--drafter", "graft"], dst)
    converted = checkpoints.converted(donor, "nvfp4", Options(engine="vllm", mtp="convert"))
    message = refusal(graft_args(src, dst, converted), dst)
    assert "mtp.0" in message and "stored as NVFP4" in message and "MXFP4" in message, message


def test_the_rules_of_the_release_hold_for_a_grafted_drafter(checkpoints, tmp_path):
    """vLLM 0.34.0 converts a DSpark drafter for W4A16: one kept as the donor stores it (MXFP4) is
    refused as --drafter keep is, with the reason."""
    src, donor = checkpoints.source(WITHOUT, seed=3), checkpoints.source(DONOR, seed=4)
    dst = tmp_path / "out"
    message = refusal([src, str(dst), "--out", "w4a16", "--engine", "vllm==0.34.0", "--drafter", "graft", donor], dst)
    assert "draft garbage" in message and "graft one stored as W4A16" in message, message


def test_resume_takes_the_same_donor_only_and_equals_an_uninterrupted_graft(checkpoints, tmp_path, monkeypatch):
    src, donor = checkpoints.source(WITH_MTP, seed=3), checkpoints.source(DONOR, seed=4)
    other = checkpoints.source(DONOR, seed=6)
    clean, dst = str(tmp_path / "clean"), str(tmp_path / "dst")
    options = Options(engine="vllm", mtp="graft", donor=donor)
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"kill@{10**9}")   # counts the durable steps only
    convert(src, clean, "nvfp4", options, progress=False)
    steps = fsutil._fault_steps
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"enospc@{steps // 2}")
    with pytest.raises(RequantError, match="No space left"):
        convert(src, dst, "nvfp4", options, progress=False)
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    shards = journal.load(dst)[0]["shards"]
    assert 0 < sum(s["done"] for s in shards) < len(shards)
    with pytest.raises(RequantError, match="drafter donor") as refused:
        convert(src, dst, "nvfp4", Options(engine="vllm", mtp="graft", donor=other), progress=False, resume=True)
    assert "\n" not in str(refused.value)
    convert(src, dst, "nvfp4", options, progress=False, resume=True)
    assert output_tree(dst) == output_tree(clean)


def test_the_printed_resume_command_resumes_the_graft(checkpoints, tmp_path, monkeypatch):
    src, donor, dst = checkpoints.source(WITH_MTP, seed=3), checkpoints.source(DONOR, seed=4), tmp_path / "out"
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@20")
    stopped = run(*graft_args(src, dst, donor))
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    assert stopped.exit_code != 0 and f"--drafter graft={donor}" in stopped.output, stopped.output
    command = shlex.split(stopped.output.split("resume with `")[1].split("`")[0])
    assert command[:2] == ["requant", "convert"]
    resumed = run(*command[2:])
    assert resumed.exit_code == 0 and "kept from the earlier run" in resumed.output, resumed.output
    assert CliRunner().invoke(cli, ["verify", str(dst)]).exit_code == 0
