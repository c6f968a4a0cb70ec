"""Why a path is not a checkpoint at all, in the one set of words every command uses: a missing
path, a file where a directory is wanted, or a directory holding an unfinished conversion (its
journal, journal.py). `inspect`, `verify` and `convert` say these the same way."""

from __future__ import annotations

import os

from requant.io import journal


def path_problem(path: str, unfinished: bool = False) -> str | None:
    """One line on why `path` cannot be read as a checkpoint yet; None when it might be one
    (`unfinished`: a conversion in progress aside)."""
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "not a directory"
    if journal.exists(path) and not unfinished:
        return journal.progress_message(path)
    return None


def path_problem_line(path: str) -> str | None:
    """path_problem as the one-line error requant prints (RequantError's `file X: ...` form)."""
    problem = path_problem(path)
    return f"file {path}: {problem}" if problem else None
