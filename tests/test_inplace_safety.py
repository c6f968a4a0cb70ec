"""Nothing requant prints may lead to data loss (issue 41). An in-place conversion killed at seeded
durable steps is run again without --resume, as a user would, and every command requant's messages
offer is then run exactly as printed (each alternative from the same killed state, and whatever
those print in turn): every path ends in a checkpoint that opens and that `requant verify` passes,
either the finished conversion (byte-identical to an uninterrupted one) or the source as it was.
Also: `--abort` out of place, `--resume` after the end, and no message telling the user to delete
anything.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.io import fsutil, journal
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from tests.helpers.files import output_tree, tree
from tests.helpers.kills import (SEED, convert_args, kill_points, printed_commands, run_printed, run_stopped,
                                 steps_and_output)

DIMS = synth.Dims(layers=3, experts=6)
# Where a kill leaves an in-place conversion; each gets a seeded kill point of its own, and
# ANYWHERE more are drawn from the whole conversion.
PHASES = ("before the journal", "journaled, nothing converted", "some shards converted", "every shard converted")
ANYWHERE = 4
REQUANT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requant")


@pytest.fixture(scope="module")
def source(checkpoints):
    return checkpoints.source(DIMS, seed=11)


def phase(target: str) -> str:
    """Which of PHASES the in-place conversion in `target` is in."""
    if not journal.exists(target):
        return PHASES[0]
    record, snapshot = journal.load(target)
    if not any(not journal.still_source(target, e) for e in snapshot["shards"]):
        return PHASES[1]
    return PHASES[3] if all(s["done"] for s in record["shards"]) else PHASES[2]


@pytest.fixture(scope="module")
def clean(source, checkpoints, tmp_path_factory):
    """(durable steps, output tree, {phase: the steps a kill at which leaves it there}) of the
    uninterrupted in-place conversion to NVFP4: the phase is seen after each durable step, where
    the test hook kills."""
    target = checkpoints.copy(source, tmp_path_factory.mktemp("clean") / "k9")
    phases: dict[str, list[int]] = {p: [] for p in PHASES}
    hook = fsutil.fault_point

    def observed():
        hook()
        phases[phase(target)].append(fsutil._fault_steps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsutil, "fault_point", observed)
        steps, tree_after = steps_and_output(convert_args(target, None, "nvfp4"), target)
    assert all(phases.values()), phases
    return steps, tree_after, phases


def kill_point(clean, case: int) -> int:
    """A seeded step in each phase, then ANYWHERE seeded steps from the whole conversion."""
    steps, _, phases = clean
    if case < len(PHASES):
        return random.Random(SEED + case).choice(phases[PHASES[case]])
    return kill_points(41, steps, ANYWHERE)[case - len(PHASES)]


def follow(command: str, seen: set[str]) -> list[tuple[str, int, str]]:
    """Run `command` as printed, then every command its output prints, once each: (command, exit
    code, output) in order."""
    ran, queue = [], [command]
    while queue:
        cmd = queue.pop(0)
        if cmd in seen:
            continue
        seen.add(cmd)
        result = run_printed(cmd)
        said = result.stdout + result.stderr
        ran.append((cmd, result.exit_code, said))
        queue += printed_commands(said)
    return ran


def assert_usable(target: str) -> None:
    """A checkpoint that opens, with no journal, that `requant verify` passes."""
    assert not os.path.exists(journal.path_of(target)), os.listdir(target)
    with Checkpoint.open(target) as ck:
        assert ck.shard_names
    verified = CliRunner().invoke(cli, ["verify", target, "--quiet"])
    assert verified.exit_code == 0, verified.output


def assert_is_source(target: str, source: str) -> None:
    """Every file the source's bytes; config.json and the index its content (they come back from
    the journal, which keeps them as JSON)."""
    now, then = tree(target), tree(source)
    assert set(now) == set(then), set(now) ^ set(then)
    for name in then:
        if name in (CONFIG_NAME, INDEX_NAME):
            with open(os.path.join(target, name)) as a, open(os.path.join(source, name)) as b:
                assert json.load(a) == json.load(b), name
        else:
            assert now[name] == then[name], f"{name} differs from the source"


@pytest.mark.parametrize("case", range(len(PHASES) + ANYWHERE),
                         ids=[*PHASES, *(f"anywhere-{i}" for i in range(ANYWHERE))])
def test_killed_in_place_then_rerun_without_resume(source, clean, checkpoints, tmp_path, case):
    _, expected, phases = clean
    step = kill_point(clean, case)
    target = checkpoints.copy(source, tmp_path / "k9")
    args = convert_args(target, None, "nvfp4")
    proc, err = run_stopped(args, f"kill@{step}", str(tmp_path / "stderr"))
    assert proc.returncode < 0, f"kill@{step}: ended with {proc.returncode}: {err}"
    assert step in phases[phase(target)], f"kill@{step} left the conversion {phase(target)}, unlike the clean run"

    begun = journal.exists(target)
    rerun = CliRunner().invoke(cli, args)   # the same command, no --resume
    if not begun:   # killed before anything changed: this is a fresh start
        assert rerun.exit_code == 0, rerun.stderr
        assert output_tree(target) == expected
        assert_usable(target)
        return
    assert rerun.exit_code == 1, rerun.stderr
    message = rerun.stderr
    assert "unfinished conversion" in message and "delete" not in message, message
    commands = printed_commands(message)
    converted = [e["name"] for e in journal.load(target)[1]["shards"] if not journal.still_source(target, e)]
    resume = [c for c in commands if c.endswith(" --resume")]
    abort = [c for c in commands if c.endswith(" --abort")]
    assert len(resume) == 1 and len(abort) == (0 if converted else 1) and len(commands) == 1 + len(abort), message
    for name in converted:
        assert name in message, f"{name} is converted and the refusal does not say so: {message}"

    killed = str(tmp_path / "killed")   # the killed state, for each alternative in turn (copy2 keeps mtimes)
    shutil.copytree(target, killed)
    for choice in commands:
        shutil.rmtree(target)
        shutil.copytree(killed, target)
        ran = follow(choice, set())
        assert all(code == 0 for _, code, _ in ran), ran
        assert_usable(target)
        if choice in abort:
            assert_is_source(target, source)
        else:
            assert output_tree(target) == expected, f"kill@{step}: resumed output differs from an uninterrupted run"


def test_abort_refuses_once_a_shard_is_converted_and_changes_nothing(source, clean, checkpoints, tmp_path):
    steps, expected, _ = clean
    target = checkpoints.copy(source, tmp_path / "k9")
    args = convert_args(target, None, "nvfp4")
    run_stopped(args, f"kill@{3 * steps // 4}", str(tmp_path / "stderr"))
    lock = os.path.join(journal.JOURNAL_DIR, journal.LOCK)   # the killed run's lock record: taken over, then gone

    def state():
        return {k: v for k, v in tree(target).items() if k != lock}
    before = state()
    refused = CliRunner().invoke(cli, [*args, "--abort"])
    assert refused.exit_code == 1 and "already nvfp4" in refused.stderr, refused.stderr
    assert state() == before, "a refused abort changed the directory"
    [resume] = printed_commands(refused.stderr)
    assert run_printed(resume).exit_code == 0 and output_tree(target) == expected
    assert_usable(target)


def test_abort_out_of_place_removes_what_it_wrote(source, tmp_path):
    dst = str(tmp_path / "dst")
    args = convert_args(source, dst, "nvfp4")
    steps, expected = steps_and_output(convert_args(source, str(tmp_path / "clean"), "nvfp4"), str(tmp_path / "clean"))
    before = tree(source)
    run_stopped(args, f"kill@{steps // 2}", str(tmp_path / "stderr"))
    rerun = CliRunner().invoke(cli, args)
    assert rerun.exit_code == 1
    [abort] = [c for c in printed_commands(rerun.stderr) if c.endswith(" --abort")]
    aborted = run_printed(abort)
    assert aborted.exit_code == 0 and f"{dst} is empty" in aborted.stdout, aborted.output
    assert os.listdir(dst) == [] and tree(source) == before
    assert CliRunner().invoke(cli, args).exit_code == 0 and output_tree(dst) == expected
    for where in (dst, str(tmp_path / "nosuch")):
        nothing = CliRunner().invoke(cli, [*convert_args(source, where, "nvfp4"), "--abort"])
        assert nothing.exit_code == 1 and "nothing to abort" in nothing.stderr, nothing.stderr
    assert not os.path.exists(tmp_path / "nosuch")


def test_abort_of_a_lone_snapshot_removes_it_and_nothing_else(source, checkpoints, tmp_path):
    """A kill before the journal's first write (or while it is removed at the end) leaves its
    snapshot alone: no unfinished conversion, and --abort removes only that."""
    target = checkpoints.copy(source, tmp_path / "k9")
    before = tree(target)
    os.makedirs(journal.path_of(target))
    with open(journal.path_of(target, journal.SNAPSHOT), "w") as f:
        f.write("{}")
    result = CliRunner().invoke(cli, [*convert_args(target, None, "nvfp4"), "--abort", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["message"].startswith("nothing to abort"), result.output
    assert tree(target) == before


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in-place"])
def test_resume_after_the_end_says_finished(source, checkpoints, tmp_path, in_place):
    target = checkpoints.copy(source, tmp_path / "out") if in_place else str(tmp_path / "out")
    args = convert_args(target if in_place else source, None if in_place else target, "nvfp4")
    assert CliRunner().invoke(cli, args).exit_code == 0
    before = tree(target)
    again = CliRunner().invoke(cli, [*args, "--resume"])
    assert again.exit_code == 0, again.stderr
    assert "is a finished conversion of" in again.stdout and "nothing to resume" in again.stdout, again.output
    assert tree(target) == before
    if not in_place:   # another source into the same directory is no resume of it
        other = checkpoints.copy(source, tmp_path / "other")
        refused = CliRunner().invoke(cli, [*convert_args(other, target, "nvfp4"), "--resume"])
        assert refused.exit_code == 1 and "not an empty directory" in refused.stderr, refused.output
        assert tree(target) == before


ALLOWED = (   # what requant itself deletes, not what the user should
    "SRC as a Hub repository: fetch one shard at a time and delete it once converted",
)
TELLS_TO_DELETE = re.compile(r"\bdelete\b|\brm\s+-?\w", re.IGNORECASE)
BARE_START_OVER = re.compile(r"(?<!cannot )start over(?! with `)", re.IGNORECASE)   # with no requant command


def test_no_message_tells_the_user_to_delete_anything():
    """Every string literal in requant/ (an f-string as its text with {} for the values), docstrings
    aside: none says to delete or `rm` anything, nor to "start over" without the command that does."""
    found = []
    for root, _, files in os.walk(REQUANT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                module = ast.parse(f.read())
            docstrings = {id(owner.body[0].value) for owner in ast.walk(module)
                          if isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and owner.body and isinstance(owner.body[0], ast.Expr)}
            parts = set()
            for node in ast.walk(module):
                if isinstance(node, ast.JoinedStr):
                    parts |= {id(v) for v in node.values}
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    text = node.value
                else:
                    continue
                if id(node) not in parts and not text.startswith(ALLOWED) \
                        and (TELLS_TO_DELETE.search(text) or BARE_START_OVER.search(text)):
                    found.append(f"{os.path.relpath(path, REQUANT)}:{node.lineno}: {text.strip()[:100]}")
    assert not found, found


# --- a damaged state file (issue 41): journal.json, source.json or both, each way it can be damaged ---

DAMAGES = {
    "truncated": lambda data: data[:len(data) // 2],
    "not JSON": lambda data: b"\x00\xff not json",
    "wrong shape": lambda data: json.dumps({"format": 1, "shards": "none"}).encode(),
    "missing": None,
}
STATE_FILES = {"journal": (journal.JOURNAL,), "source": (journal.SNAPSHOT,),
               "both": (journal.JOURNAL, journal.SNAPSHOT)}
# where the kill leaves it: the last step before the first shard is replaced (config.json and the
# index set aside: source.json holds their only copy), and a seeded step with some shards converted
KILLED_AT = {"nothing converted": lambda phases: max(phases[PHASES[1]]),
             "some converted": lambda phases: random.Random(SEED + 2).choice(phases[PHASES[2]])}


@pytest.fixture(scope="module")
def killed(source, clean, checkpoints, tmp_path_factory):
    """{when: (where an in-place conversion was killed there, a copy of that state)}: a test puts
    the copy back in place (the journal names the path; copytree keeps mtimes)."""
    _, _, phases = clean
    found = {}
    for when, pick in KILLED_AT.items():
        base = tmp_path_factory.mktemp("killed")
        target = checkpoints.copy(source, base / "k9")
        proc, err = run_stopped(convert_args(target, None, "nvfp4"), f"kill@{pick(phases)}", str(base / "stderr"))
        assert proc.returncode < 0, err
        shutil.copytree(target, base / "saved")
        found[when] = target, str(base / "saved")
    return found


def restore(state: str, target: str) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(state, target)


def said_lines(result) -> list[str]:
    """What a command printed, but the line on taking over a killed run's lock."""
    return [line for line in (result.stdout + result.stderr).strip().splitlines() if "taking over the lock" not in line]


def damage(target: str, names: tuple[str, ...], how: str) -> list[str]:
    """Damage the state files `names` of `target` as DAMAGES[how] says; their paths."""
    paths = [journal.path_of(target, n) for n in names]
    for path in paths:
        if DAMAGES[how] is None:
            os.remove(path)
            continue
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(DAMAGES[how](data))
    return paths


def put_back(message: str, target: str, source: str) -> bool:
    """What a message asks to put back from the original, done as a user would (copies); whether
    it asked."""
    asked = re.search(r"put back (.+?) from the same revision of the original", message)
    if not asked:
        return False
    for name in re.split(r", | and ", asked.group(1)):
        if name == "every shard whose file differs from the original's":
            now, then = tree(target), tree(source)
            names = [n for n in then if n.endswith(".safetensors") and now.get(n) != then[n]]
        else:
            names = [name]
        for n in names:
            shutil.copy2(os.path.join(source, n), os.path.join(target, n))
    return True


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("which", STATE_FILES)
@pytest.mark.parametrize("when", KILLED_AT)
def test_damaged_state_file_then_every_printed_command(source, clean, killed, tmp_path, when, which, how):
    """Kill, damage, rerun as the user would: one line naming the damaged file, no deletion, and
    each command it prints (after putting back what it asks for from the original) ends in a
    checkpoint verify passes: the source as it was, or the finished conversion."""
    _, expected, _ = clean
    target, saved = killed[when]
    state = str(tmp_path / "damaged")
    restore(saved, target)
    record, snapshot = journal.load(target)
    converted = [e["name"] for e in snapshot["shards"] if not journal.still_source(target, e)]
    assert bool(converted) == (when == "some converted"), converted
    paths = damage(target, STATE_FILES[which], how)
    shutil.copytree(target, state)
    for cmd in (None, "--resume", "--abort"):   # each way in refuses or acts; refusals name the damaged file
        restore(state, target)
        result = CliRunner().invoke(cli, [*convert_args(target, None, "nvfp4"), *([cmd] if cmd else [])])
        said = "\n".join(said_lines(result))
        assert "delete" not in said.lower() and len(said_lines(result)) == 1, said
        if (which, how) == ("both", "missing"):   # no state left to tell a conversion: refused as no checkpoint, saying
            # what to put back from the original and the abort that then ends it
            assert result.exit_code != 0 and "config.json" in said, said
            lock = os.path.join(journal.JOURNAL_DIR, journal.LOCK)   # the killed run's: taken over, then gone
            assert tree(target) == {k: v for k, v in tree(state).items() if k != lock}, "a refusal changed it"
            assert put_back(said, target, source), f"{cmd}: {said}"   # a plain rerun and --resume as well as --abort
            assert all(code == 0 for _, code, _ in follow(printed_commands(said)[0], set()))
            assert_usable(target)
            assert_is_source(target, source)
            continue
        if result.exit_code == 0:   # an abort or resume that could act at once
            assert cmd is not None, said
            assert_usable(target)
            continue
        assert result.exit_code == 1 and any(p in said for p in paths), said
        commands = printed_commands(said)
        assert commands, said
        for choice in commands:
            restore(state, target)
            put_back(said, target, source)
            ran = follow(choice, set())
            assert all(code == 0 for _, code, _ in ran), ran
            assert_usable(target)
            if choice.endswith(" --abort"):
                assert_is_source(target, source)
            else:
                assert output_tree(target) == expected, f"{when}, {which} {how}: resumed output differs"
                with open(os.path.join(target, "requant.json")) as f:   # stats lost with the journal: named
                    unmeasured = json.load(f)["accuracy"].get("shards_not_measured", [])
                assert set(unmeasured) == set(converted), (unmeasured, converted)


@pytest.mark.parametrize("which", ["journal", "both"])
def test_damaged_state_out_of_place_then_every_printed_command(source, tmp_path, which):
    """Out of place the source is elsewhere: with journal.json damaged (resume rebuilds it) or both
    files (only the abort, by the source's own shard names), each printed command ends in the
    finished output or an empty destination, the source untouched."""
    dst = str(tmp_path / "dst")
    args = convert_args(source, dst, "nvfp4")
    steps, expected = steps_and_output(convert_args(source, str(tmp_path / "clean"), "nvfp4"), str(tmp_path / "clean"))
    before = tree(source)
    run_stopped(args, f"kill@{steps // 2}", str(tmp_path / "stderr"))
    damage(dst, STATE_FILES[which], "truncated")
    state = str(tmp_path / "damaged")
    shutil.copytree(dst, state)
    rerun = CliRunner().invoke(cli, args)
    said = "\n".join(said_lines(rerun))
    assert rerun.exit_code == 1 and len(said_lines(rerun)) == 1 and journal.path_of(dst) in said, said
    commands = printed_commands(said)
    assert [c.rsplit(" ", 1)[1] for c in commands] == (["--resume", "--abort"] if which == "journal" else ["--abort"])
    for choice in commands:
        restore(state, dst)
        ran = follow(choice, set())
        assert all(code == 0 for _, code, _ in ran), ran
        assert tree(source) == before
        if choice.endswith(" --abort"):
            assert os.listdir(dst) == [], os.listdir(dst)
        else:
            assert_usable(dst)
            assert output_tree(dst) == expected


def test_lost_journal_resume_with_other_options_is_refused(source, clean, killed):
    """Options that change bytes but not headers (--input-scale) could not be told apart by the
    shards: source.json's record of them refuses a resume asked for differently, changing nothing."""
    _, expected, _ = clean
    target, saved = killed["some converted"]
    restore(saved, target)
    os.remove(journal.path_of(target, journal.JOURNAL))
    lock = os.path.join(journal.JOURNAL_DIR, journal.LOCK)
    before = {k: v for k, v in tree(target).items() if k != lock}
    other = CliRunner().invoke(cli, [*convert_args(target, None, "nvfp4"), "--input-scale", "2.0", "--resume"])
    assert other.exit_code == 1 and "--input-scale" in other.stderr, other.output
    assert tree(target) == before, "a refused resume changed the directory"
    original = [c for c in printed_commands(other.stderr) if c.endswith(" --resume")][0]
    assert "--input-scale" not in original and run_printed(original).exit_code == 0
    assert_usable(target)
    assert output_tree(target) == expected
