"""The core install: with triton, ModelOpt, matplotlib, compressed-tensors and pytest impossible to
import (a child process whose import system refuses them, as a venv without the extras would), synth,
convert to both targets, inspect, verify, report and validate on a CPU (the torch reference) work;
the kernel and report's plots name the extra to install, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BLOCKED = ("triton", "modelopt", "matplotlib", "compressed_tensors", "pytest")
# Runs each command line given as JSON through the CLI in this one process (one torch import), and
# prints every exit status and output as JSON, then the blocked modules that got imported anyway.
LAUNCHER = f"""
import json, sys

# As a venv without them: importing one raises ModuleNotFoundError, and importlib.util.find_spec
# (torch's CUDA start-up probes for triton with it) answers None.
for name in {BLOCKED!r}:
    sys.modules[name] = None
from click.testing import CliRunner
from requant.cli import cli

results = []
for argv in json.loads(sys.argv[1]):
    r = CliRunner().invoke(cli, argv)
    results.append({{"argv": argv, "code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                     "exception": None if r.exception is None or isinstance(r.exception, SystemExit)
                     else repr(r.exception)}})
from requant.errors import RequantError
from requant.validate import validate
try:   # the kernel itself, as a GPU machine without triton would ask for it
    validate(*sys.argv[2:4], layers="0", tokens=4, device="cpu", progress=False, kernel=True)
    kernel_error = None
except RequantError as e:
    kernel_error = str(e)
leaked = sorted(m for m, module in sys.modules.items() if module is not None and m.split(".")[0] in {BLOCKED!r})
print(json.dumps({{"results": results, "kernel_error": kernel_error, "leaked": leaked}}))
"""


def test_core_commands_work_without_the_extras_and_validate_names_it(tmp_path):
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([checkout] + [p for p in [env.get("PYTHONPATH")] if p])  # this requant
    src, nv, w4, r = (str(tmp_path / n) for n in ("src", "nvfp4", "w4a16", "r"))
    commands = [["synth", src, "--layers", "2", "--experts", "6", "--hidden", "128", "--intermediate", "128"],
                ["convert", src, nv, "--out", "nvfp4", "--quiet"], ["convert", src, w4, "--out", "w4a16", "--quiet"],
                ["inspect", nv, "--json"], ["inspect", w4, "--json"], ["verify", nv, "--quiet"], ["verify", w4, "--quiet"],
                ["report", src, nv, "--out-dir", r, "--quiet"], ["validate", src, nv, "--device", "cpu"]]
    launcher = tmp_path / "lean_requant.py"
    launcher.write_text(LAUNCHER)
    child = subprocess.run([sys.executable, str(launcher), json.dumps(commands), src, nv], capture_output=True,
                           text=True, timeout=300, env=env)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    assert out["leaked"] == []
    synth, *conversions, inspect_nv, inspect_w4, verify_nv, verify_w4, report, validate = out["results"]
    for step in [synth, *conversions, inspect_nv, inspect_w4, verify_nv, verify_w4, report, validate]:
        assert step["code"] == 0 and step["exception"] is None, step
    assert json.loads(inspect_nv["stdout"])["expert_format"] == "nvfp4"
    assert json.loads(inspect_w4["stdout"])["expert_format"] == "w4a16"
    assert "OK:" in verify_nv["stdout"] and "OK:" in verify_w4["stdout"]
    assert "no plots: report plotting needs matplotlib, which is not installed: pip install 'requant[plots]'" \
        in report["stdout"]
    assert "MoE forward on cpu (torch reference, kernel not run): passed" in report["stdout"]
    assert sorted(os.listdir(r)) == ["report.html", "report.json", "report.md"]
    assert "PASSED on cpu" in validate["stdout"] and "torch reference" in validate["stderr"]
    assert out["kernel_error"] == ("requant's fused-MoE kernel (validate, report's forward comparison) "
                                   "needs triton, which is not installed: pip install 'requant[gpu]'")


def _setuptools():
    """(the repository root, pyproject.toml's [tool.setuptools] table)."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    return root, tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_in_the_wheel():
    """pyproject lists its packages by hand: a new subpackage left out would be missing from a
    wheel install while an editable one still imports it."""
    root, setuptools = _setuptools()
    listed = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "requant").rglob("__init__.py")}
    assert found - listed == set()


def test_every_c_source_is_in_the_wheel():
    """The C helpers are compiled on the user's machine from the installed sources: each one's
    package must ship its *.c files (package-data), or a wheel install silently runs the torch
    passes."""
    root, setuptools = _setuptools()
    data = setuptools["package-data"]
    sources = list((root / "requant").rglob("*.c"))
    assert sources
    for source in sources:
        package = ".".join(source.parent.relative_to(root).parts)
        assert "*.c" in data.get(package, []), f"{source.name}: add \"{package}\" = [\"*.c\"] to package-data"
