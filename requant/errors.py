"""Error types. Every user-facing failure is a RequantError whose message is one line."""

from __future__ import annotations


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: the file it concerns, then the system's reason."""
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


class RequantError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits non-zero."""

    exit_code = 1

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = ", ".join(p for p in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if p)
        super().__init__(f"{where}: {message}" if where else message)


class FormatError(RequantError):
    """Tensor bytes or shapes that do not form a valid encoding of the declared format."""


class CheckpointError(RequantError):
    """A checkpoint directory, index, header or shard that cannot be read safely."""


class UnsupportedError(RequantError):
    """A model, format or option combination requant does not handle."""
    exit_code = 2
