"""Crash safety: kill -9 at every durable step, in place and out of place, then resume; the result
must be byte-identical to an uninterrupted run, and at every kill point every tensor must exist in
its old or its new form while nothing in the target looks like a finished checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal

import pytest

from requant import synth
from requant.convert import convert
from requant.io import fsutil, journal
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from requant.errors import CheckpointError, RequantError
from requant.targets import Options
from tests.helpers.files import output_tree, tree

DIMS = synth.Dims(layers=3, experts=6)
_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["requant.convert"])   # each child forks with torch already imported


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(source, tree of an uninterrupted conversion)."""
    base = tmp_path_factory.mktemp("resume")
    src = str(base / "src")
    synth.write_checkpoint(src, DIMS, seed=3, hard=synth.HardCases(out_of_window=1, zero_blocks=1, neg_zero_blocks=1))
    convert(src, str(base / "clean"), "nvfp4", Options(), progress=False)
    return src, output_tree(str(base / "clean"))


def count_steps(monkeypatch, *args) -> int:
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"kill@{10**9}")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    convert(*args, "nvfp4", Options(), progress=False)
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    return fsutil._fault_steps


def _child(src, dst, fault):
    os.environ["REQUANT_TEST_FAULT"] = fault
    convert(src, dst, "nvfp4", Options(), progress=False, resume=True)


def run_killed(src, dst, step: int) -> None:
    p = _ctx.Process(target=_child, args=(src, dst, f"kill@{step}"))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"step {step}: child ended with {p.exitcode}"


def check_intermediate(target: str, src_tree: dict, clean: dict, in_place: bool, step: int) -> None:
    """Every shard is its old or its new self; an unfinished target never opens as a checkpoint."""
    now = tree(target)
    shards = [n for n in clean if n.endswith(".safetensors")]
    for name in shards:
        allowed = {clean[name]} | ({src_tree[name]} if in_place else set())
        assert now.get(name) in allowed | ({None} if not in_place else set()), f"step {step}: {name} is neither"
    if not journal.exists(target):   # stopped before anything changed
        rest = {n: d for n, d in now.items() if not n.startswith(journal.JOURNAL_DIR + "/")}
        assert rest == (src_tree if in_place else {}), f"step {step}: changed before the journal existed"
        return
    with pytest.raises(CheckpointError, match="conversion in progress"):
        Checkpoint.open(target)
    if all(now.get(n) == clean[n] for n in shards):
        return
    if in_place and all(now[n] == src_tree[n] for n in shards):   # nothing converted yet: still the source
        assert all(now.get(m) in (None, src_tree[m]) for m in (INDEX_NAME, CONFIG_NAME)), f"step {step}"
    else:
        assert INDEX_NAME not in now, f"step {step}: an index beside unconverted shards"
        assert not in_place or CONFIG_NAME not in now, f"step {step}: config.json beside unconverted shards"


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_kill_at_every_step_then_resume(tiny, tmp_path, monkeypatch, in_place):
    src, clean = tiny
    src_tree = tree(src)

    def fresh(name):
        if not in_place:
            return src, str(tmp_path / name)
        shutil.copytree(src, tmp_path / name)
        return str(tmp_path / name), None

    steps = count_steps(monkeypatch, *fresh("count"))
    assert steps >= 20
    for step in range(1, steps + 1):
        a, b = fresh(f"k{step}")
        target = b or a
        run_killed(a, b, step)
        check_intermediate(target, src_tree, clean, in_place, step)
        convert(a, b, "nvfp4", Options(), progress=False, resume=True)
        assert output_tree(target) == clean, f"step {step}: resumed output differs from an uninterrupted run"
        shutil.rmtree(target)
    print(f"{'in place' if in_place else 'out of place'}: killed at {steps} steps, all resumed byte-identical")


def test_killed_twice_resumes(tiny, tmp_path):
    """A resume that is itself killed resumes again."""
    src, clean = tiny
    dst = str(tmp_path / "dst")
    run_killed(src, dst, 12)
    run_killed(src, dst, 9)
    convert(src, dst, "nvfp4", Options(), progress=False, resume=True)
    assert output_tree(dst) == clean


def test_w4a16_resume_records_the_whole_conversion(tmp_path, monkeypatch):
    """A resumed W4A16 run's config.json (its SQNR summary included) equals an uninterrupted run's."""
    src = str(tmp_path / "src")
    synth.write_checkpoint(src, synth.Dims(layers=2, experts=6), seed=5)
    clean, dst = str(tmp_path / "clean"), str(tmp_path / "dst")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"kill@{10**9}")   # counts the durable steps only
    convert(src, clean, "w4a16", Options(), progress=False)
    steps = fsutil._fault_steps
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"enospc@{steps // 2}")
    with pytest.raises(RequantError, match="No space left"):
        convert(src, dst, "w4a16", Options(), progress=False)
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    done = [s for s in journal.load(dst)[0]["shards"] if s["done"]]
    assert 0 < len(done) < len(journal.load(dst)[0]["shards"]), "the fault should fall between shards"
    convert(src, dst, "w4a16", Options(), progress=False, resume=True)
    assert output_tree(dst) == output_tree(clean)


def test_resumed_summary_counts_kept_and_converted_shards(tiny, tmp_path, monkeypatch):
    """After --resume the summary says how many shards the earlier run left and how many this one
    converted, and its rate is over the bytes converted now, not the skipped shards'."""
    from requant.convert import describe_result, format_result

    src, clean = tiny
    dst = str(tmp_path / "dst")
    fresh = describe_result(convert(src, str(tmp_path / "fresh"), "nvfp4", Options(), progress=False))
    shards = fresh["shards_converted"]
    assert fresh["shards_kept"] == 0 and fresh["bytes_converted"] == fresh["bytes_out"]
    assert "kept" not in format_result(fresh)

    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@20")   # a few shards in
    with pytest.raises(RequantError, match="No space left"):
        convert(src, dst, "nvfp4", Options(), progress=False)
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    states = journal.load(dst)[0]["shards"]
    kept = [s["name"] for s in states if s["done"]]
    assert 0 < len(kept) < shards
    d = describe_result(convert(src, dst, "nvfp4", Options(), progress=False, resume=True))
    assert output_tree(dst) == clean
    now = sum(os.path.getsize(os.path.join(dst, s["name"])) for s in states if not s["done"])
    assert (d["shards_kept"], d["shards_converted"], d["bytes_converted"]) == (len(kept), shards - len(kept), now)
    assert now < d["bytes_out"]
    line = format_result({**d, "seconds": 2**-10})   # rates far apart: bytes now vs all
    assert f"{len(kept)} shards kept from the earlier run, {shards - len(kept)} converted now" in line, line
    assert f"({now * 2**10 / 2**20:,.0f} MiB/s over the shards converted now)" in line, line


def test_resume_with_other_options_names_their_flags(tmp_path, monkeypatch):
    """The refusal names each differing option by the flag that sets it, target options included."""
    from requant.targets.w4a16 import W4A16Options

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    synth.write_checkpoint(src, synth.Dims(layers=2, experts=6), seed=5)
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"kill@{10**9}")   # counts the durable steps only
    convert(src, str(tmp_path / "clean"), "w4a16", Options(target=W4A16Options(32, "sym")), progress=False)
    steps = fsutil._fault_steps
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"enospc@{steps // 2}")
    with pytest.raises(RequantError, match="No space left"):
        convert(src, dst, "w4a16", Options(target=W4A16Options(32, "sym")), progress=False)
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    with pytest.raises(RequantError, match="started differently") as refused:
        convert(src, dst, "w4a16", Options(target=W4A16Options(128, "asym"), mtp="keep"), progress=False, resume=True)
    message = str(refused.value)
    for said in ("--group-size 32 then, 128 now", "--scheme sym then, asym now", "--mtp default then, keep now"):
        assert said in message, message


def test_every_journaled_option_is_named_by_a_flag_convert_takes():
    """The flags a refused resume names come from the option dataclasses the CLI fills: each
    journaled option of every target has one, and `requant convert` accepts it."""
    import dataclasses

    from requant.cli import cli
    from requant.convert.resume import OPTION_FLAGS, journaled_options
    from requant.targets import TARGETS

    taken = {opt for param in cli.commands["convert"].params for opt in param.opts}
    assert set(OPTION_FLAGS.values()) <= taken, set(OPTION_FLAGS.values()) - taken
    for name, target in TARGETS.items():
        journaled = journaled_options(Options(target=target.options_type()), None, name)
        paths = {f"target.{k}" for k in journaled.pop("target")} | set(journaled)
        assert paths <= set(OPTION_FLAGS), paths - set(OPTION_FLAGS)
        assert {f"target.{f.name}" for f in dataclasses.fields(target.options_type)} <= paths


def test_resume_with_another_scale_headroom_names_it(tiny, tmp_path, monkeypatch):
    """Through the CLI, as a user meets it: --scale-headroom differs, and the line names that flag."""
    from click.testing import CliRunner

    from requant.cli import cli

    src, clean = tiny
    dst = str(tmp_path / "dst")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@20")
    args = ["convert", src, dst, "--out", "nvfp4", "-q"]
    assert CliRunner().invoke(cli, args).exit_code == 1
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    refused = CliRunner().invoke(cli, [*args, "--resume", "--scale-headroom", "2"])
    assert refused.exit_code == 1 and "--scale-headroom 0 then, 2 now" in refused.stderr, refused.stderr
    assert CliRunner().invoke(cli, [*args, "--resume"]).exit_code == 0
    assert output_tree(dst) == clean
