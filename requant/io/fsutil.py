"""Durable file operations: a reader never sees a half-written file under its final name."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal

from requant.errors import RequantError


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write to a temporary sibling, fsync it, rename it over `path`, fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            fault_point()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    fault_point()


def atomic_write_json(path: str, obj) -> None:
    atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode())


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def free_bytes(path: str) -> int:
    """Free space on the filesystem holding `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


class DirLock:
    """An flock on a directory itself: no lock file is left behind, and the kernel drops the
    lock when the process dies, so a killed conversion never blocks its resume."""

    def __init__(self, path: str, exclusive: bool, what: str):
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RequantError(f"{path} is in use by another requant process ({what}); wait for it to finish") from None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_fault_steps = 0


def fault_point() -> None:
    """Test hook for the crash tests: REQUANT_TEST_FAULT=kill@N (SIGKILL) or enospc@N (a
    disk-full OSError) at this process's Nth durable step. Unset, it is one dict lookup."""
    spec = os.environ.get("REQUANT_TEST_FAULT")
    if not spec:
        return
    global _fault_steps
    _fault_steps += 1
    kind, _, at = spec.partition("@")
    if _fault_steps == int(at):
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
