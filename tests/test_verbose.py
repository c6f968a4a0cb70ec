"""-v/--verbose logs requant's own steps (plan, shards, timings) on stderr on every command, -vv
its debug lines; other libraries' loggers (matplotlib's font search, urllib3, filelock, the Hub
client) stay at WARNING whatever -v says; without -v no step is logged. Driven through the CLI
in-process (click's CliRunner), a sample as a real process."""

from __future__ import annotations

import logging
import re

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from tests.helpers.cli import run_cli

DIMS = synth.Dims(layers=2, experts=6, hidden=128, intermediate=128, vocab=64, hash_layers=1)
# requant: LEVEL: logger: message, as the CLI's handler formats a record
RECORD = re.compile(r"^requant: (DEBUG|INFO|WARNING|ERROR|CRITICAL): ([\w.]+): ", re.M)


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    base = tmp_path_factory.mktemp("verbose")
    paths = {"src": str(base / "src"), "dst": str(base / "dst"), "scratch": str(base)}
    synth.write_checkpoint(paths["src"], DIMS, seed=4)
    run = CliRunner().invoke(cli, ["convert", paths["src"], paths["dst"], "--out", "nvfp4", "-q"])
    assert run.exit_code == 0, run.output
    return paths


# command -> (arguments, the step loggers -v must show besides the CLI's own "finished in")
COMMANDS = {
    "convert": (["{src}", "{scratch}/c-{n}", "--out", "nvfp4"],
                {"requant.io.checkpoint", "requant.convert.pipeline"}),
    "verify": (["{dst}"], {"requant.verify"}),
    "inspect": (["{dst}"], {"requant.io.checkpoint"}),
    "report": (["{src}", "{dst}", "--out-dir", "{scratch}/r-{n}", "--layers", "1"], {"requant.report"}),
    "validate": (["{src}", "{dst}", "--layers", "1", "--tokens", "4", "--device", "cpu"],
                 {"requant.io.checkpoint", "requant.validate"}),
    "advise": (["{dst}", "--gpu", "sm_90"], {"requant.io.checkpoint"}),
    "synth": (["{scratch}/s-{n}", "--layers", "1", "--experts", "6", "--hidden", "128", "--intermediate", "128"],
              {"requant.synth"}),
}


def records(stderr: str) -> list[tuple[str, str]]:
    return RECORD.findall(stderr)


@pytest.fixture
def fresh_logging():
    """The CLI configures logging per command; leave the process as it was for the next test."""
    levels = {name: logging.getLogger(name).level for name in ("", "requant")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_verbose_logs_requants_steps_and_nothing_by_default(ck, command, fresh_logging):
    args, loggers = COMMANDS[command]

    def run(n: str, *flags: str):
        result = CliRunner().invoke(cli, [command, *(a.format(n=n, **ck) for a in args), *flags],
                                    env={"HF_HUB_OFFLINE": "1"})
        assert result.exit_code == 0, result.output
        return records(result.stderr)

    quiet = run("0")
    assert quiet == [], quiet   # no step logged without -v
    verbose = run("1", "-v")
    assert {level for level, _ in verbose} == {"INFO"}, verbose
    assert ("INFO", "requant.cli") in verbose   # "<command> finished in N s"
    assert loggers <= {name for _, name in verbose}, verbose
    debug = run("2", "-vv")
    assert {name.split(".")[0] for _, name in debug} == {"requant"}, debug   # no third-party lines at -vv


def test_vv_debug_lines_and_no_matplotlib_in_a_real_process(ck):
    """A real process, where matplotlib's font manager logs at DEBUG when it is asked to."""
    result = run_cli("report", ck["src"], ck["dst"], "--out-dir", ck["scratch"] + "/r-proc", "--layers", "1",
                     "--no-forward", "-vv")
    assert result.returncode == 0, result.stderr
    found = records(result.stderr)
    assert ("INFO", "requant.report") in found and not [n for _, n in found if not n.startswith("requant")], found
    assert "matplotlib" not in result.stderr and "findfont" not in result.stderr
