"""Durable file operations: a reader never sees a half-written file under its final name."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import sys

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


# Why os.link refuses where a copy still works: another filesystem, a filesystem without hard links
# (or fs.protected_hardlinks: a file this user does not own), the inode's link limit.
_LINK_REFUSED = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
_COPY_PIECE = 64 << 20


def link_or_copy(src: str, dst: str, copy: bool = False, progress=None) -> bool:
    """Give the new name `dst` the bytes of file `src` (a symlink is followed): a hard link, which
    shares `src`'s inode and takes no space, where the filesystem allows one and not `copy`; else a
    copy (copy_file). True when linked. Nothing may write into `dst` afterwards, since that would
    write into `src`: requant only ever replaces a file, by renaming a new one over it."""
    if not copy:
        try:
            os.link(os.path.realpath(src), dst)   # link(2) links a symlink itself, not what it names
            return True
        except OSError as e:
            if e.errno not in _LINK_REFUSED:
                raise
    copy_file(src, dst, progress)
    return False


def copy_file(src: str, dst: str, progress=None) -> None:
    """Copy `src` to the new file `dst` inside the kernel (copy_file_range, which lets a filesystem
    such as XFS or btrfs share the extents instead), in pieces, then fsync. `progress(n)` after
    each piece."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        size, done = os.fstat(fin.fileno()).st_size, 0
        while done < size:
            step = min(size - done, _COPY_PIECE)
            try:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), step, done, done)
            except OSError:
                n = 0
            if n <= 0:   # not across these filesystems: by hand
                chunk = os.pread(fin.fileno(), step, done)
                if not chunk:
                    raise OSError(errno.EIO, f"{src} ended while it was copied")
                n = os.pwrite(fout.fileno(), chunk, done)
            done += n
            if progress is not None:
                progress(n)
        fault_point()
        os.fsync(fout.fileno())


def can_link(src: str, folder: str) -> bool:
    """Whether a hard link to file `src` can be made in `folder` (or, while it does not exist, its
    nearest existing parent, where it would be made): tried, and the link removed again."""
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    probe = os.path.join(folder, f".requant-link-probe-{os.getpid()}")
    try:
        os.link(os.path.realpath(src), probe)
    except OSError:
        return False
    remove_quietly(probe)
    return True


class DirLock:
    """An flock on a directory itself: the kernel drops the lock when the last descriptor of it
    closes, so a killed conversion never blocks its resume. No process forked while a lock is
    held keeps it (`_close_in_child`): a worker process surviving its parent would otherwise
    hold the lock for as long as it lives.

    With `record` (a file path), an exclusive lock also writes its holder there (PID, host, when
    it took the lock; a small JSON, renamed into place) and removes it on release. A record found
    on taking the lock is a holder that died without releasing it: it is taken over, with one line
    on stderr naming it. A refusal names the holder: from the record, else from the processes that
    have the directory open (Linux /proc)."""

    def __init__(self, path: str, exclusive: bool, what: str, record: str | None = None):
        self.path, self.record, self.fd, self._made_dir = path, record if exclusive else None, -1, False
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RequantError(_refusal(path, what, read_holder(record) if record else None)) from None
        self.fd, self.owner = fd, os.getpid()
        _HELD.add(self)
        if self.record:
            try:
                self._write_record()
            except BaseException:
                self.release()
                raise

    def _write_record(self) -> None:
        previous = read_holder(self.record)
        me = holder_identity()
        if previous and any(previous.get(k) != me.get(k) for k in ("pid", "host", "proc_start")):
            gone = "which is gone" if process_alive(previous) is False else "which no longer holds it"
            sys.stderr.write(f"requant: {self.path}: taking over the lock of {describe_holder(previous)}, {gone}\n")
            sys.stderr.flush()
        folder = os.path.dirname(self.record)
        if not os.path.isdir(folder):
            os.makedirs(folder)
            self._made_dir = True
        tmp = f"{self.record}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(me, f)
        os.replace(tmp, self.record)   # atomic: a reader sees the old record or this one

    def release(self) -> None:
        if self.fd < 0:
            return
        if self.record and os.getpid() == self.owner:   # still held: nobody else writes the record now
            with contextlib.suppress(OSError):
                if (read_holder(self.record) or {}).get("pid") == self.owner:
                    os.remove(self.record)
            if self._made_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(self.record))   # only if empty: a journal keeps it
        _HELD.discard(self)
        os.close(self.fd)
        self.fd = -1

    def _close_in_child(self) -> None:
        """In a forked child: drop the inherited descriptor (the parent's lock stays the parent's)."""
        _HELD.discard(self)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


_HELD: set = set()   # locks held by this process (`DirLock._close_in_child`)


def _close_locks_in_child() -> None:
    for lock in list(_HELD):
        lock._close_in_child()


os.register_at_fork(after_in_child=_close_locks_in_child)


def holder_identity() -> dict:
    """Who takes a lock: this process, its host, when (and the kernel's start time of the process,
    so that a reused PID is not taken for the holder)."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "proc_start": _proc_start(os.getpid()), "command": " ".join(sys.argv)[:300]}


def read_holder(record: str | None) -> dict | None:
    try:
        with open(record) as f:
            found = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("pid"), int) else None


def describe_holder(h: dict) -> str:
    host, started = h.get("host") or "an unknown host", h.get("started") or "at an unknown time"
    return f"requant PID {h['pid']} on {host} (started {started})"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _proc_start(pid: int) -> int | None:
    found = _proc_stat(pid)
    return found[1] if found else None


def process_alive(h: dict) -> bool | None:
    """Whether the recorded holder still runs: None when it is on another host."""
    if h.get("host") != socket.gethostname():
        return None
    try:
        os.kill(h["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    found = _proc_stat(h["pid"])
    if found is None:
        return True
    return found[0] not in ("Z", "X") and h.get("proc_start") in (None, found[1])   # dead, or its PID reused


def processes_holding(path: str) -> list[tuple[int, str]]:
    """(PID, command line) of the other processes with `path` open (Linux /proc; [] elsewhere)."""
    real, found = os.path.realpath(path), []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(_readlink(f"/proc/{pid}/fd/{fd}") == real for fd in fds):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((pid, cmd[:120]))
    return found


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _refusal(path: str, what: str, holder: dict | None) -> str:
    others = processes_holding(path)
    pids = " ".join(str(p) for p, _ in others)
    if holder and process_alive(holder) is not False:
        return (f"{path} is in use by another requant process ({what}): {describe_holder(holder)}; "
                f"wait for it to finish, or stop it (kill {holder['pid']})")
    if holder and others:   # the holder died, but processes it left behind still hold the lock
        return (f"{path} is locked by processes left behind by {describe_holder(holder)}, which is gone: "
                f"PID {pids} ({others[0][1]}) still hold it; stop them (kill {pids}) and run this again")
    if others:
        return (f"{path} is in use by another requant process ({what}): PID {pids} ({others[0][1]}); "
                "wait for it to finish")
    return f"{path} is in use by another requant process ({what}; its PID could not be found); wait for it to finish"


_fault_steps = 0


_FAULT_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "hup": signal.SIGHUP}


def fault_point() -> None:
    """Test hook for the crash tests: REQUANT_TEST_FAULT=kill@N (SIGKILL), term@N (SIGTERM),
    hup@N (SIGHUP) or enospc@N (a disk-full OSError) at this process's Nth durable step. Unset, it
    is one dict lookup."""
    spec = os.environ.get("REQUANT_TEST_FAULT")
    if not spec:
        return
    global _fault_steps
    _fault_steps += 1
    kind, _, at = spec.partition("@")
    if _fault_steps == int(at):
        if kind in _FAULT_SIGNALS:
            os.kill(os.getpid(), _FAULT_SIGNALS[kind])   # a handled signal acts once this returns
            return
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
