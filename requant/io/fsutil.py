"""Durable file operations: a reader never sees a half-written file under its final name."""

from __future__ import annotations

import json
import os
import shutil


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write to a temporary sibling, fsync it, rename it over `path`, fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, obj) -> None:
    atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode())


def free_bytes(path: str) -> int:
    """Free space on the filesystem holding `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free
