"""Error types. Every user-facing failure is a RequantError whose message is one line.

Exit statuses (README "Exit status", every command's --help):
  1  bad input or I/O: a checkpoint, file or directory requant cannot use (missing, damaged, a
     model or layout it has no recipe for), a failed read or write; verify and validate also exit
     1 when their checks fail
  2  bad usage: an option value or combination requant refuses, or a missing pip extra
  3  convert --dry-run: the plan is fine, the target's disk lacks the free space it needs
  70 a bug in requant (REQUANT_DEBUG=1 prints the traceback)
  130 interrupted (Ctrl-C, SIGTERM, SIGHUP) before the command finished
"""

from __future__ import annotations

EXIT_INPUT = 1
EXIT_USAGE = 2
EXIT_SHORT_OF_SPACE = 3
EXIT_BUG = 70
EXIT_INTERRUPTED = 130


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: the file it concerns, then the system's reason."""
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


class RequantError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits non-zero (1: bad
    input or I/O, unless a subclass says otherwise)."""

    exit_code = EXIT_INPUT

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = ", ".join(p for p in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if p)
        super().__init__(f"{where}: {message}" if where else message)


class FormatError(RequantError):
    """Tensor bytes or shapes that do not form a valid encoding of the declared format."""


class CheckpointError(RequantError):
    """A checkpoint directory, index, header or shard that cannot be read safely."""


class UsageError(RequantError):
    """An option value or a combination of options requant refuses (exit 2, as click's own)."""
    exit_code = EXIT_USAGE


class UnsupportedError(RequantError):
    """A model, format or option combination requant does not handle (exit 2: the options asked
    for it)."""
    exit_code = EXIT_USAGE


class UnsupportedCheckpoint(UnsupportedError):
    """A checkpoint requant cannot work on whatever the options: no recipe for its model_type, no
    routed experts in a known format, two checkpoints with nothing to compare. Bad input (exit 1)."""
    exit_code = EXIT_INPUT
