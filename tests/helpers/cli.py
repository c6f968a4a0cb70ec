"""The real console entry point, run in a child process as a user would run it."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`requant ARGS...` in a child process: exit code, stdout and stderr as the user sees them."""
    return subprocess.run([sys.executable, "-m", "requant", *args], capture_output=True, text=True, timeout=300)
