"""Conversions stopped at a seeded durable step (the REQUANT_TEST_FAULT hook in io/fsutil.py: the
process sends itself SIGKILL, SIGTERM or SIGHUP there), run as the console command in a child
process, and the commands requant's messages tell the user to run, followed literally."""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner

from requant.cli import cli
from requant.io import fsutil
from tests.helpers.files import output_tree

SEED = 20261204
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def options(out: str) -> list[str]:
    return ["--out", out, "--workers", "2", "--quiet"] + (["--device", "cpu"] if out == "w4a16" else [])


def convert_args(src: str, dst: str | None, out: str) -> list[str]:
    return ["convert", src, *([dst] if dst else ["--in-place"]), *options(out)]


def steps_and_output(args: list[str], target: str) -> tuple[int, dict]:
    """(durable steps, output tree) of the uninterrupted conversion `args` into `target`."""
    mp = pytest.MonkeyPatch()
    mp.setattr(fsutil, "_fault_steps", 0)
    try:
        result = CliRunner().invoke(cli, args, env={"REQUANT_TEST_FAULT": f"kill@{10**9}"})   # counts the steps
        assert result.exit_code == 0, result.output + result.stderr
        return fsutil._fault_steps, output_tree(target)
    finally:
        mp.undo()


def kill_points(case: int, steps: int, count: int = 0) -> list[int]:
    """One step from the middle half of a conversion (where the workers are busy), or `count`
    from the whole of it; the same for the same case every run."""
    rng = random.Random(SEED + case)
    if count:
        return sorted(rng.sample(range(1, steps + 1), min(count, steps)))
    return [rng.randrange(steps // 4, 3 * steps // 4)]


def run_stopped(args: list[str], fault: str, log: str) -> tuple[subprocess.Popen, str]:
    """`requant ARGS` as a child process (its own process group) with REQUANT_TEST_FAULT=`fault`;
    the ended process and its stderr (through the file `log`: a pipe would stay open while a
    surviving worker holds it)."""
    env = {**os.environ, "REQUANT_TEST_FAULT": fault, "PYTHONPATH": REPO}
    with open(log, "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "requant", *args], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err)
        proc.wait(timeout=300)
        err.seek(0)
        return proc, err.read()


def printed_commands(message: str) -> list[str]:
    """The requant commands a message tells the user to run (each in backquotes)."""
    return re.findall(r"`(requant [^`]+)`", message)


def run_printed(command: str):
    """A printed command, run exactly as printed (CliRunner's result)."""
    words = shlex.split(command)
    assert words[0] == "requant", command
    return CliRunner().invoke(cli, words[1:])
