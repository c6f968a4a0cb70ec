"""A conversion whose parent process is killed with SIGKILL (as the OOM killer does): no requant
process may outlive it (W4A16 on a CPU encodes in forked worker processes), its lock must not
outlive it either, and `--resume` must end byte-identical to an uninterrupted conversion that
`requant verify` passes. Also the lock's record: a live holder is named in the refusal, a dead
one's lock is taken over with one line on stderr.

The kill points are durable steps (the REQUANT_TEST_FAULT hook: the process sends itself SIGKILL
there; tests/helpers/kills.py), drawn with a fixed seed from the middle of each conversion, where the workers are busy;
REQUANT_KILL_POINTS=N draws N points per case from the whole conversion instead. SIGTERM (`kill
PID`) and SIGHUP at such a step stop the conversion as Ctrl-C does: exit 130 and the resume line.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from requant import pools, synth
from requant.cli import cli
from requant.errors import EXIT_INTERRUPTED, RequantError
from requant.io import fsutil, journal
from requant.io.fsutil import DirLock
from tests.helpers.files import output_tree
from tests.helpers.kills import (REPO, convert_args, kill_points, printed_commands, run_printed, run_stopped,
                                 steps_and_output)

DIMS = synth.Dims(layers=3, experts=6)
POINTS = int(os.environ.get("REQUANT_KILL_POINTS", "0"))
GONE_WITHIN_S = 15   # a liveness deadline: the kernel kills the workers at once; this is slack for a busy host
CASES = [("w4a16", False), ("w4a16", True), ("nvfp4", False), ("nvfp4", True)]


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, process group) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[2])


def survivors(group: int, marker: str) -> list[int]:
    """Live processes of process group `group`, or whose command line holds `marker` (forked
    workers keep their parent's command line, which names the conversion's unique target)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = proc_stat(int(entry))
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if stat and stat[0] not in ("Z", "X") and (stat[2] == group or marker.encode() in cmdline):
            found.append(int(entry))
    return found


def wait_gone(group: int, marker: str) -> list[int]:
    """The survivors still there after GONE_WITHIN_S (killed then, so that none outlives the test)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := survivors(group, marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("kill") / "src")
    synth.write_checkpoint(src, DIMS, seed=7)
    return src


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory):
    """(out, in_place) -> (durable steps, tree of the uninterrupted conversion), made on demand."""
    base, made = tmp_path_factory.mktemp("clean"), {}

    def get(out: str, in_place: bool):
        if (out, in_place) not in made:
            target = str(base / f"{out}-{'ip' if in_place else 'oop'}")
            if in_place:
                shutil.copytree(source, target)
            made[out, in_place] = steps_and_output(convert_args(target if in_place else source,
                                                                None if in_place else target, out), target)
        return made[out, in_place]
    return get


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{o}-{'in-place' if p else 'copy'}" for o, p in CASES])
def test_sigkill_leaves_no_process_and_resumes(source, clean, tmp_path, case):
    out, in_place = CASES[case]
    steps, expected = clean(out, in_place)
    for step in kill_points(case, steps, POINTS):
        target = str(tmp_path / f"{out}-{step}")
        if in_place:
            shutil.copytree(source, target)
        args = convert_args(target if in_place else source, None if in_place else target, out)
        proc, err = run_stopped(args, f"kill@{step}", str(tmp_path / "stderr"))
        assert proc.returncode == -signal.SIGKILL, f"step {step}: ended with {proc.returncode}: {err}"
        left = wait_gone(proc.pid, target)
        assert not left, f"step {step}: requant processes {left} outlived their killed parent {proc.pid}"

        resumed = CliRunner().invoke(cli, [*args, "--resume"])
        assert resumed.exit_code == 0, f"step {step}: {resumed.stderr}"
        assert f"taking over the lock of requant PID {proc.pid} on " in resumed.stderr, resumed.stderr
        assert output_tree(target) == expected, f"step {step}: resumed output differs from an uninterrupted run"
        verified = CliRunner().invoke(cli, ["verify", target, "--quiet"])
        assert verified.exit_code == 0, verified.output
        shutil.rmtree(target)


STOPS = [("term", "w4a16", False), ("hup", "nvfp4", True), ("term", "nvfp4", True)]


@pytest.mark.parametrize("case", range(len(STOPS)), ids=[f"{k}-{o}-{'in-place' if p else 'copy'}" for k, o, p in STOPS])
def test_sigterm_and_sighup_stop_as_ctrl_c(source, clean, tmp_path, case):
    """`kill PID` (SIGTERM) and a closed terminal (SIGHUP) mid-conversion: exit 130 as for Ctrl-C,
    one line ending in the command that resumes, no process left; that command, run as printed,
    ends byte-identical to an uninterrupted conversion."""
    kind, out, in_place = STOPS[case]
    steps, expected = clean(out, in_place)
    step = kill_points(100 + case, steps)[0]
    target = str(tmp_path / "target")
    if in_place:
        shutil.copytree(source, target)
    args = convert_args(target if in_place else source, None if in_place else target, out)
    proc, err = run_stopped(args, f"{kind}@{step}", str(tmp_path / "stderr"))
    assert proc.returncode == EXIT_INTERRUPTED, f"{kind}@{step}: ended with {proc.returncode}: {err}"
    assert not wait_gone(proc.pid, target), f"{kind}@{step}: requant processes outlived the stop"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("requant: error: interrupted;"), err
    commands = printed_commands(lines[0])
    assert len(commands) == 1 and commands[0].endswith(" --resume"), lines[0]
    resumed = run_printed(commands[0])
    assert resumed.exit_code == 0, resumed.stderr
    assert output_tree(target) == expected, f"{kind}@{step}: resumed output differs from an uninterrupted run"
    assert CliRunner().invoke(cli, ["verify", target, "--quiet"]).exit_code == 0


# -- the workers' own guarantees ------------------------------------------------------------------

def _fork(child) -> int:
    """Run `child()` in a forked process that then exits with 0 (2 on an exception); its PID."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except BaseException:
            os._exit(2)
        os._exit(0)
    return pid


def test_a_worker_whose_parent_is_already_gone_exits():
    """The parent may die between the fork and prctl: the worker sees it is not its parent's."""
    pid = _fork(lambda: (pools.die_with_parent(os.getppid() + 10**6), time.sleep(30)))
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1


def test_portable_watch_ends_a_worker_with_its_parent():
    """Where prctl does not exist, a thread watching the parent ends the worker."""
    r, w = os.pipe()

    def worker():
        pools.sys.platform = "not-linux"     # no prctl: the portable watch
        pools.die_with_parent(os.getppid())
        os.write(w, f"{os.getpid()}\n".encode())
        time.sleep(30)
    mid = _fork(lambda: (_fork(worker), time.sleep(30)))   # forks the worker, then lives until killed
    os.close(w)
    ready, _, _ = select.select([r], [], [], GONE_WITHIN_S)
    line = os.read(r, 64) if ready else b""
    os.close(r)
    os.kill(mid, signal.SIGKILL)
    os.waitpid(mid, 0)
    assert line.endswith(b"\n"), "the worker did not arm its watch"
    worker_pid = int(line)
    deadline = time.monotonic() + GONE_WITHIN_S
    while (proc_stat(worker_pid) or ("Z",))[0] not in ("Z", "X") and time.monotonic() < deadline:
        time.sleep(0.05)
    still = (proc_stat(worker_pid) or ("Z",))[0] not in ("Z", "X")
    if still:
        os.kill(worker_pid, signal.SIGKILL)
    assert not still, "the worker outlived its parent"


def test_forked_workers_do_not_hold_the_lock(tmp_path):
    """A worker forked while the lock is held must not keep it once the parent lets go."""
    lock = DirLock(str(tmp_path), exclusive=True, what="test")
    pool = pools.forked_pool(1, None)
    try:
        lock.release()
        again = DirLock(str(tmp_path), exclusive=True, what="test")   # the workers are still alive here
        again.release()
        assert pool.submit(os.getpid).result() != os.getpid()
    finally:
        pool.shutdown()


# -- the lock's record ----------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time
    from requant.io import journal
    from requant.io.fsutil import DirLock
    target = sys.argv[1]
    lock = DirLock(target, exclusive=True, what="test", record=journal.path_of(target, journal.LOCK))
    if sys.argv[2] == "orphan":   # a child that inherited the lock's descriptor, as workers once did
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=[lock.fd])
        print(child.pid, flush=True)
        os._exit(0)   # dies holding the lock, without releasing it
    print(os.getpid(), flush=True)
    sys.stdin.read()   # holds the lock until the test closes stdin
""")


def hold(target: str, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, target, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": REPO})


def test_a_live_holder_is_named_and_a_dead_one_taken_over(source, tmp_path):
    dst = str(tmp_path / "dst")
    os.makedirs(dst)
    holder = hold(dst, "live")
    pid = int(holder.stdout.readline())
    try:
        result = CliRunner().invoke(cli, convert_args(source, dst, "nvfp4"))
        assert result.exit_code == 1
        assert "in use by another requant process" in result.stderr and f"PID {pid} on " in result.stderr \
            and "started " in result.stderr, result.stderr
    finally:
        holder.kill()   # SIGKILL: its record stays behind
        holder.wait()
    assert fsutil.read_holder(journal.path_of(dst, journal.LOCK))["pid"] == pid
    result = CliRunner().invoke(cli, convert_args(source, dst, "nvfp4"))
    assert result.exit_code == 0, result.stderr
    line = [x for x in result.stderr.splitlines() if "taking over" in x]
    assert len(line) == 1 and f"requant PID {pid} on " in line[0] and "which is gone" in line[0], result.stderr
    assert not os.path.exists(journal.path_of(dst)), "the lock's record outlived the conversion"


def test_a_lock_kept_by_leftover_processes_names_them(tmp_path):
    target = str(tmp_path)
    holder = hold(target, "orphan")
    orphan = int(holder.stdout.readline())
    holder.wait()
    try:
        with pytest.raises(RequantError) as e:
            DirLock(target, exclusive=True, what="a conversion writes there",
                    record=journal.path_of(target, journal.LOCK))
        message = str(e.value)
        assert f"requant PID {holder.pid} on " in message and "which is gone" in message, message
        assert f"PID {orphan}" in message and f"kill {orphan}" in message, message
    finally:
        os.kill(orphan, signal.SIGKILL)
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:   # the orphan's lock goes with it (once its parent, init, reaps it)
        try:
            DirLock(target, exclusive=True, what="test").release()
            break
        except RequantError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
