"""Directories and tensors compared by their bytes, and what the filesystem under a directory supports."""

from __future__ import annotations

import hashlib
import os

import torch

# The model card and requant.json name the source as the user gave it (a path, or repo@commit), and
# the card the command as run (its destination too), so two conversions of the same bytes from or to
# different places differ in these two files only.
SOURCE_NAMING_FILES = ("README.md", "requant.json")


def output_tree(path: str) -> dict[str, str]:
    """tree() of a conversion's output without the files that name its source's and destination's location."""
    return {k: v for k, v in tree(path).items() if k not in SOURCE_NAMING_FILES}


def tree(path: str) -> dict[str, str]:
    """Every file below `path` by its sha256 (symlinks by their target): two trees compare equal
    exactly when their bytes do."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            p = os.path.join(root, name)
            if os.path.islink(p):
                out[os.path.relpath(p, path)] = "-> " + os.readlink(p)
            else:
                with open(p, "rb") as f:
                    out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def direct_writes_supported(directory: str) -> bool:
    """Whether files in `directory` open with O_DIRECT (no: macOS, older kernels' tmpfs)."""
    from requant.io.safetensors import open_direct

    probe = os.path.join(directory, ".direct-probe")
    open(probe, "wb").close()
    try:
        fd = open_direct(probe)
        if fd is not None:
            os.close(fd)
        return fd is not None
    finally:
        os.remove(probe)


def tensor_bytes(ck, name: str) -> bytes:
    """Tensor `name` of checkpoint `ck` as stored, byte for byte."""
    return ck.tensor(name).contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()
