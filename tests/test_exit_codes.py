"""The exit-status contract (README "Exit status", every command's --help epilog), driven through
every command: 1 bad input or I/O, 2 bad usage or a missing extra, 3 convert --dry-run short of
disk, 70 a bug, 130 interrupted; each failure one line on stderr, no traceback, and with --json
the error as {"error": {"code", "message"}} on stdout. Most cases run in-process (click's
CliRunner, the CLI's own entry), a sample as real processes."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil

import huggingface_hub.constants  # noqa: F401  (read the environment now: invoke() sets HF_HUB_OFFLINE per call)
import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import EXIT_STATUS_HELP, cli
from requant.errors import EXIT_BUG, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_SHORT_OF_SPACE, EXIT_USAGE
from requant.extras import MissingExtra
from requant.io.checkpoint import Checkpoint
from tests.helpers.cli import run_cli

DIMS = synth.Dims(layers=2, experts=6, hidden=128, intermediate=128, vocab=64, hash_layers=1)
GPT_OSS = synth.Dims("gpt-oss-20b", layers=1, experts=4, hidden=64, intermediate=64, vocab=64)
COMMANDS = ["convert", "inspect", "verify", "validate", "report", "synth", "upload", "advise"]
JSON_COMMANDS = {"convert", "inspect", "verify", "validate", "report", "advise"}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """Paths: a small DeepSeek source, a gpt-oss one, a copy with a truncated shard, one whose first
    shard's header is garbage, one whose config.json lacks model_type, a missing path, and a scratch
    directory."""
    base = tmp_path_factory.mktemp("exit")
    p = {k: str(base / k) for k in ("src", "gptoss", "trunc", "garbled", "nomt", "scratch")}
    synth.write_checkpoint(p["src"], DIMS, seed=2)
    synth.write_checkpoint(p["gptoss"], GPT_OSS, seed=2)
    shutil.copytree(p["src"], p["trunc"])
    shard = os.path.join(p["trunc"], sorted(f for f in os.listdir(p["trunc"]) if f.endswith(".safetensors"))[1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    shutil.copytree(p["src"], p["garbled"])
    shard = os.path.join(p["garbled"], sorted(f for f in os.listdir(p["garbled"]) if f.endswith(".safetensors"))[0])
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"{not json" + b"\xff" * 16)
    shutil.copytree(p["src"], p["nomt"])
    config = os.path.join(p["nomt"], "config.json")
    with open(config) as f:
        c = json.load(f)
    del c["model_type"]
    with open(config, "w") as f:
        json.dump(c, f)
    p["missing"] = str(base / "no-such-dir")
    os.makedirs(p["scratch"])
    return p


def invoke(*args: str, env: dict | None = None):
    result = CliRunner().invoke(cli, list(args), env={"HF_HUB_OFFLINE": "1", **(env or {})})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def assert_one_line_error(code: int, stderr: str, expected: int) -> str:
    assert code == expected, f"exit {code}, expected {expected}: {stderr!r}"
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("requant: error: "), stderr
    return lines[0]


# --- bad input / bad usage, per command -------------------------------------------------------------

CASES = [
    # (command, id, args with {placeholders}, expected code)
    ("convert", "missing-source", ["{missing}", "{scratch}/c1", "--out", "nvfp4"], EXIT_INPUT),
    ("convert", "truncated-shard", ["{trunc}", "{scratch}/c2", "--out", "nvfp4", "-q"], EXIT_INPUT),
    ("convert", "no-model-type", ["{nomt}", "{scratch}/c3", "--out", "nvfp4", "-q"], EXIT_INPUT),
    ("convert", "input-scale-negative", ["{src}", "{scratch}/c4", "--out", "nvfp4", "--input-scale", "-1"], EXIT_USAGE),
    ("convert", "input-scale-not-a-number", ["{src}", "{scratch}/c5", "--out", "nvfp4", "--input-scale", "abc"],
     EXIT_USAGE),
    ("convert", "no-dst", ["{src}", "--out", "nvfp4"], EXIT_USAGE),
    ("convert", "mtp-without-mtp-block", ["{gptoss}", "{scratch}/c6", "--out", "nvfp4", "--force", "--mtp", "convert"],
     EXIT_USAGE),
    ("convert", "unknown-engine", ["{src}", "{scratch}/c7", "--out", "nvfp4", "--engine", "nosuch"], EXIT_USAGE),
    ("inspect", "missing", ["{missing}"], EXIT_INPUT),
    ("inspect", "truncated-shard", ["{trunc}"], EXIT_INPUT),
    ("inspect", "unknown-option", ["{src}", "--bogus"], EXIT_USAGE),
    ("verify", "missing", ["{missing}"], EXIT_INPUT),
    ("verify", "unknown-engine", ["{src}", "--engine", "nosuch"], EXIT_USAGE),
    ("validate", "missing", ["{missing}", "{src}", "-q"], EXIT_INPUT),
    ("validate", "no-model-type", ["{nomt}", "{src}", "-q"], EXIT_INPUT),
    ("validate", "zero-tokens", ["{src}", "{src}", "--tokens", "0"], EXIT_USAGE),
    ("report", "missing", ["{missing}", "{src}", "--out-dir", "{scratch}/r1", "-q"], EXIT_INPUT),
    ("report", "no-shared-experts", ["{src}", "{gptoss}", "--out-dir", "{scratch}/r2", "-q"], EXIT_INPUT),
    ("report", "no-out-dir", ["{src}", "{src}", "-q"], EXIT_USAGE),
    ("synth", "dest-not-empty", ["{src}"], EXIT_INPUT),
    ("synth", "out-of-window-huge", ["{scratch}/s1", "--out-of-window", "100000"], EXIT_USAGE),
    ("synth", "zero-blocks-huge", ["{scratch}/s2", "--zero-blocks", "100000"], EXIT_USAGE),
    ("synth", "intermediate-negative", ["{scratch}/s3", "--intermediate", "-128"], EXIT_USAGE),
    ("upload", "missing-folder", ["{missing}", "someone/repo"], EXIT_INPUT),
    ("upload", "unknown-option", ["{src}", "someone/repo", "--bogus"], EXIT_USAGE),
    ("advise", "missing", ["{missing}", "--gpu", "sm_90"], EXIT_INPUT),
    ("advise", "no-gpu", ["{src}"], EXIT_USAGE),
    ("advise", "unknown-gpu", ["{src}", "--gpu", "sm_1"], EXIT_USAGE),
]


def _args(ck, command, args):
    return [command, *(a.format(**ck) for a in args)]


@pytest.mark.parametrize("command,case,args,code", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_input_and_usage_errors(ck, command, case, args, code):
    result = invoke(*_args(ck, command, args))
    assert_one_line_error(result.exit_code, result.stderr, code)
    if command in JSON_COMMANDS:
        result = invoke(*_args(ck, command, args), "--json")
        line = assert_one_line_error(result.exit_code, result.stderr, code)
        error = {"code": code, "message": line.removeprefix("requant: error: ")}
        document = json.loads(result.stdout)
        # verify's findings stay its output: they carry the error, as one document
        assert (document["error"] if command == "verify" and code == EXIT_INPUT else document) == \
            (error if command == "verify" and code == EXIT_INPUT else {"error": error})
    if command == "synth":   # nothing left behind that would block the rerun
        assert not any(n.startswith((".s", "s")) for n in os.listdir(ck["scratch"]))


def test_every_command_covered():
    assert {c[0] for c in CASES} == set(COMMANDS)
    for code in (EXIT_INPUT, EXIT_USAGE):
        assert {c[0] for c in CASES if c[3] == code} == set(COMMANDS), code


def test_verify_failing_checks_exit_1_with_the_findings(ck):
    """verify's findings are its output (stdout); the error line on stderr names the first ones."""
    result = invoke("verify", ck["trunc"], "-q")
    line = assert_one_line_error(result.exit_code, result.stderr, EXIT_INPUT)
    assert "FAILED" in result.stdout and "verify found 2 errors: shard-unreadable" in line


# --- --json: every command that takes it x each kind of failure --------------------------------------

JSON_FAILURES = {
    # command: {failure: (args, expected code)}; "damaged": a shard whose header is garbage
    "convert": {"missing": (["{missing}", "{scratch}/j1", "--out", "nvfp4"], EXIT_INPUT),
                "damaged": (["{garbled}", "{scratch}/j2", "--out", "nvfp4", "-q"], EXIT_INPUT),
                "bad-option": (["{src}", "{scratch}/j3", "--out", "nvfp4", "--group-size", "7"], EXIT_USAGE)},
    "inspect": {"missing": (["{missing}"], EXIT_INPUT),
                "damaged": (["{garbled}"], EXIT_INPUT),
                "bad-option": (["{src}", "--bogus", "1"], EXIT_USAGE)},
    "verify": {"missing": (["{missing}"], EXIT_INPUT),
               "damaged": (["{garbled}", "-q"], EXIT_INPUT),
               "bad-option": (["{src}", "--gpu", "sm_1"], EXIT_USAGE)},
    "validate": {"missing": (["{missing}", "{src}", "-q"], EXIT_INPUT),
                 "damaged": (["{garbled}", "{src}", "-q"], EXIT_INPUT),
                 "bad-option": (["{src}", "{src}", "--tokens", "0"], EXIT_USAGE)},
    "report": {"missing": (["{missing}", "{src}", "--out-dir", "{scratch}/j4", "-q"], EXIT_INPUT),
               "damaged": (["{src}", "{garbled}", "--out-dir", "{scratch}/j5", "-q"], EXIT_INPUT),
               "bad-option": (["{src}", "{src}", "--out-dir", "{scratch}/j6", "--workers", "0"], EXIT_USAGE)},
    "advise": {"missing": (["{missing}", "--gpu", "sm_90"], EXIT_INPUT),
               "damaged": (["{garbled}", "--gpu", "sm_90"], EXIT_INPUT),
               "bad-option": (["{src}", "--gpu", "sm_90", "--tp", "0"], EXIT_USAGE)},
}
JSON_GRID = [(command, failure, *case) for command, cases in JSON_FAILURES.items() for failure, case in cases.items()]


def test_json_grid_covers_every_json_command():
    assert set(JSON_FAILURES) == JSON_COMMANDS == {c.name for c in cli.commands.values()
                                                    if any("--json" in p.opts for p in c.params)}


@pytest.mark.parametrize("command,failure,args,code", JSON_GRID, ids=[f"{c[0]}-{c[1]}" for c in JSON_GRID])
def test_json_errors(ck, command, failure, args, code):
    """Exactly one JSON document on stdout whose error has the exit status as its code and the
    stderr line as its message; one line on stderr."""
    result = invoke(*_args(ck, command, args), "--json")
    line = assert_one_line_error(result.exit_code, result.stderr, code)
    document = json.loads(result.stdout)   # one document: a second would not parse
    assert document["error"] == {"code": code, "message": line.removeprefix("requant: error: ")}
    if command != "verify":   # verify's findings come with it
        assert list(document) == ["error"]


@pytest.mark.parametrize("args,code", [
    (["convert", "{trunc}", "{scratch}/p1", "--out", "nvfp4", "--quiet"], EXIT_INPUT),
    (["inspect", "{trunc}"], EXIT_INPUT),
    (["report", "{src}", "{gptoss}", "--out-dir", "{scratch}/p2", "--quiet"], EXIT_INPUT),
    (["convert", "{nomt}", "{scratch}/p3", "--out", "nvfp4"], EXIT_INPUT),
    (["convert", "{src}", "{scratch}/p4", "--out", "nvfp4", "--input-scale", "abc"], EXIT_USAGE),
    (["synth", "{scratch}/p5", "--out-of-window", "100000"], EXIT_USAGE),
    (["upload", "{missing}", "someone/repo"], EXIT_INPUT),
], ids=["convert-truncated", "inspect-truncated", "report-no-shared", "convert-no-model-type",
        "convert-bad-float", "synth-huge", "upload-missing"])
def test_real_processes(ck, args, code):
    result = run_cli(*[a.format(**ck) for a in args])
    assert_one_line_error(result.returncode, result.stderr, code)


# --- bugs, interrupts, I/O failures and missing extras, per command ---------------------------------

ENTRY = {   # command -> (args, the library function it calls, patched to fail)
    "convert": (["{src}", "{scratch}/e-convert", "--out", "nvfp4", "-q"], "requant.convert.convert"),
    "inspect": (["{src}"], "requant.describe.inspect_checkpoint"),
    "verify": (["{src}", "-q"], "requant.verify.verify"),
    "validate": (["{src}", "{src}", "-q"], "requant.validate.validate"),
    "report": (["{src}", "{src}", "--out-dir", "{scratch}/e-report", "-q"], "requant.report.make_report"),
    "synth": (["{scratch}/e-synth"], "requant.synth.write_new_checkpoint"),
    "upload": (["{src}", "someone/repo", "-q"], "requant.io.hub.upload"),
    "advise": (["{src}", "--gpu", "sm_90"], "requant.advise.advise"),
}
FAILURES = {
    "bug": (lambda: ZeroDivisionError("division by zero"), EXIT_BUG),
    "interrupt": (lambda: KeyboardInterrupt(), EXIT_INTERRUPTED),
    "io": (lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/some/file"), EXIT_INPUT),
    "missing-extra": (lambda: MissingExtra("plots need matplotlib: pip install 'requant[plots]'"), EXIT_USAGE),
}


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("command", COMMANDS)
def test_failure_classes(ck, monkeypatch, command, failure):
    args, target = ENTRY[command]
    make, code = FAILURES[failure]

    def fail(*_, **__):
        raise make()
    monkeypatch.setattr(target, fail)
    monkeypatch.delenv("REQUANT_DEBUG", raising=False)
    result = invoke(*_args(ck, command, args))
    line = assert_one_line_error(result.exit_code, result.stderr, code)
    if failure == "bug":
        assert "REQUANT_DEBUG=1" in line and "ZeroDivisionError" in line
    if command in JSON_COMMANDS:
        result = invoke(*_args(ck, command, args), "--json")
        assert_one_line_error(result.exit_code, result.stderr, code)
        assert json.loads(result.stdout)["error"]["code"] == code


def test_dry_run_short_of_disk_is_3_with_one_json_document(ck, monkeypatch):
    monkeypatch.setattr("requant.io.fsutil.free_bytes", lambda path: 0)
    args = ["convert", ck["src"], os.path.join(ck["scratch"], "dry"), "--out", "nvfp4", "--dry-run"]
    result = invoke(*args)
    assert_one_line_error(result.exit_code, result.stderr, EXIT_SHORT_OF_SPACE)
    assert "NOT ENOUGH" in result.stdout
    result = invoke(*args, "--json")
    assert_one_line_error(result.exit_code, result.stderr, EXIT_SHORT_OF_SPACE)
    plan = json.loads(result.stdout)   # the plan, with its error: one document
    assert plan["error"]["code"] == EXIT_SHORT_OF_SPACE and plan["free_bytes_needed"] > 0


# --- Ctrl-C around the end of a conversion ----------------------------------------------------------

def test_interrupt_after_a_finished_conversion_is_success(ck, tmp_path, monkeypatch):
    """A Ctrl-C landing after the last step (journal gone, config.json and index written) leaves a
    finished, valid output: exit 0 and a note that says so, not 130."""
    def late(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr("requant.convert.outputs.dir_tensor_bytes", late)
    dst = str(tmp_path / "dst")
    result = invoke("convert", ck["src"], dst, "--out", "nvfp4", "-q")
    assert result.exit_code == 0, result.stderr
    assert "finished" in result.stderr and "complete" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    with Checkpoint.open(dst) as out:
        assert out.config["quantization_config"] and out.shard_names
    assert not os.path.exists(os.path.join(dst, ".requant-convert"))


def test_interrupt_before_the_end_is_130_and_resumable(ck, tmp_path, monkeypatch):
    def early(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr("requant.convert.outputs.finish_metadata", early)
    result = invoke("convert", ck["src"], str(tmp_path / "dst"), "--out", "nvfp4", "-q")
    line = assert_one_line_error(result.exit_code, result.stderr, EXIT_INTERRUPTED)
    assert "--resume" in line


# --- help, options, progress ----------------------------------------------------------------------

@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_has_the_exit_table_and_verbosity(command):
    result = invoke(*([command] if command else []), "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert " ".join(EXIT_STATUS_HELP.replace("\b", "").split()) in text
    if command:
        assert "-q, --quiet" in result.stdout and "-v, --verbose" in result.stdout


def test_readme_states_the_same_table():
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        readme = f.read()
    for code, words in ((EXIT_INPUT, "bad input or I/O"), (EXIT_USAGE, "bad usage"),
                        (EXIT_SHORT_OF_SPACE, "--dry-run"), (EXIT_BUG, "a bug"), (EXIT_INTERRUPTED, "interrupted")):
        assert any(line.startswith(f"| {code} | ") and words in line for line in readme.splitlines()), code


def test_force_help_does_not_claim_w4a16_for_sglang_needs_it():
    assert "W4A16 for SGLang" not in invoke("convert", "--help").stdout


def test_no_progress_frames_in_a_log(ck, tmp_path):
    """stderr is a file here, not a terminal: no tqdm frames (carriage returns) in it."""
    result = run_cli("synth", str(tmp_path / "s"), "--layers", "1", "--experts", "6")
    assert result.returncode == 0 and "\r" not in result.stderr and "synth:" not in result.stderr, result.stderr
    result = run_cli("convert", str(tmp_path / "s"), str(tmp_path / "o"), "--out", "nvfp4")
    assert result.returncode == 0 and "\r" not in result.stderr and "converting" not in result.stderr, result.stderr


def test_synth_quiet_and_gpt_oss_default_layers_match_the_help(tmp_path):
    result = invoke("synth", str(tmp_path / "g"), "--model", "gpt-oss-20b", "-q")
    assert result.exit_code == 0, result.stderr
    layers = synth.Dims("gpt-oss-20b").layers
    assert f"{layers} layers" in result.stdout
    help_text = " ".join(invoke("synth", "--help").stdout.split()).replace("- ", "-")   # unwrapped
    assert f"gpt-oss-120b, gpt-oss-20b: {layers}" in help_text


def test_validate_never_estimates_zero_seconds():
    from requant.moe import MoEConfig  # noqa: F401  (the estimate's input type)
    from requant.validate import cpu_notice

    class Router:
        top_k = 2

    class Cfg:
        n_routed_experts, hidden_size, intermediate_size, router = 4, 32, 32, Router()
    line = cpu_notice([Cfg()], 1)
    assert "about 0 s" not in line and "about 1 s or less" in line


# --- numeric options at their extremes: never a bug, never a traceback ------------------------------

EXTREMES = ["0", "1", "-1", "-9223372036854775808", "2147483648", "1000000000000"]
SYNTH_BASE = ["--layers", "1", "--experts", "6", "--hidden", "128", "--intermediate", "128"]
SYNTH_OPTIONS = ["--layers", "--experts", "--hidden", "--intermediate", "--seed", "--out-of-window", "--zero-blocks",
                 "--neg-zero-blocks"]


@pytest.mark.parametrize("option", SYNTH_OPTIONS)
def test_synth_numeric_extremes(tmp_path, option):
    for i, value in enumerate(EXTREMES):
        dest = str(tmp_path / f"d{i}")
        args = list(SYNTH_BASE)
        if option in args:
            args[args.index(option) + 1] = value
        else:
            args += [option, value]
        if option in ("--layers", "--experts") and value == "1000000000000":
            continue   # out of IntRange: same path as 2147483648
        result = invoke("synth", dest, *args, "-q")
        what = f"{option} {value}: exit {result.exit_code}, {result.stderr!r}"
        assert result.exit_code in (0, EXIT_INPUT, EXIT_USAGE), what
        if result.exit_code:
            assert_one_line_error(result.exit_code, result.stderr, result.exit_code)
            assert not os.path.exists(dest), what
        else:
            with Checkpoint.open(dest):
                pass
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], f"{what}: debris left"


CONVERT_EXTREMES = {
    "--input-scale": ["0", "-0.0", "-1", "inf", "nan", "1e-45", "3.4e38", "1e308", "1"],
    "--scale-headroom": ["0", "-1", "8", "9", "2147483648"],
    "--workers": ["0", "1", "-1", "257", "2147483648"],
    "--group-size": ["0", "32", "-1", "2147483648"],
}


@pytest.mark.parametrize("option", list(CONVERT_EXTREMES))
def test_convert_numeric_extremes(ck, tmp_path, option):
    out = "w4a16" if option == "--group-size" else "nvfp4"
    for i, value in enumerate(CONVERT_EXTREMES[option]):
        dst = str(tmp_path / f"o{i}")
        extra = ["--dry-run"] if out == "w4a16" else []
        result = invoke("convert", ck["src"], dst, "--out", out, option, value, "-q", *extra)
        what = f"{option} {value}: exit {result.exit_code}, {result.stderr!r}"
        assert result.exit_code in (0, EXIT_INPUT, EXIT_USAGE), what
        if result.exit_code:
            assert_one_line_error(result.exit_code, result.stderr, result.exit_code)
            assert not os.path.exists(dst), what
        elif not extra:
            with Checkpoint.open(dst) as converted:
                scales = [n for n in converted.names if n.endswith("input_scale")]
                assert scales and all(math.isfinite(float(converted.tensor(n))) for n in scales[:4]), what
