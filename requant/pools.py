"""Forked worker processes, for every command that spreads numeric work over processes: convert's
encoders (workers.py), verify --deep's and report's comparisons. A pool is forked once, from the
process that holds what its tasks need (`forked_pool`), and its processes find that in `inherited()`.

A worker process's reads and writes leave its core idle (a full-size expert's 25 MB of direct I/O
against ~160 ms of scale search; on a 2-vCPU machine the cores were idle 12-14% of a W4A16
conversion). So a CPU-heavy pool forks `io_spares` more processes than `workers` and lets only
`workers` of them encode at once (`compute_slot`): the others read and write meanwhile, and no
more processes compute than there are cores to run them, which would only trade caches (3
unthrottled processes on 2 cores were slower than 2). Memory is per process: 1.5x the workers'.

Worker processes die with their parent, whatever kills it (`die_with_parent`: the kernel's
parent-death signal on Linux, a watch on the parent elsewhere): a parent killed with SIGKILL (the
OOM killer) would otherwise leave them waiting on its task queue for good, holding files open. Nor
do they keep the target's lock (fsutil.DirLock drops it in every forked child), so a resume can
always take it once the parent is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import torch

_INHERITED: object = None   # what forked workers look their tasks up in (`forked_pool`)
_COMPUTE_SLOTS = None       # a semaphore shared by a forked pool's processes (`compute_slot`), or None


def io_spares(workers: int) -> int:
    """Processes forked beyond `workers` computing ones, to read and write while those compute:
    enough to cover I/O taking up to half of a unit's time."""
    return max(1, workers // 2)


def compute_slot():
    """Held while a unit computes: in a pool forked with spares, one of its `workers` shared
    slots (a process waits here for one); elsewhere nothing."""
    return _COMPUTE_SLOTS if _COMPUTE_SLOTS is not None else contextlib.nullcontext()


def forked_pool(workers: int, context: object, spares: int = 0) -> "_ForkedPool":
    """`workers` processes forked from this one now, each set up by `worker_settings`, whose tasks
    find `context` through `inherited()`: what they need that does not pickle (a plan's encoders
    are closures) or should not be sent with every task (open checkpoints, their indexes). With
    `spares`, that many more processes, and at most `workers` of them inside `compute_slot` at
    once. The pool's `processes` says how many. Fork before starting threads of your own."""
    global _INHERITED, _COMPUTE_SLOTS
    workers = max(1, workers)
    _INHERITED = context
    fork = multiprocessing.get_context("fork")
    _COMPUTE_SLOTS = fork.BoundedSemaphore(workers) if spares else None
    pool = _ForkedPool(workers + spares, mp_context=fork, initializer=_init_process, initargs=(os.getpid(),))
    pool.submit(int).result()   # a fork pool forks every worker on its first task: now
    return pool


class _ForkedPool(ProcessPoolExecutor):
    def __init__(self, processes: int, **kwargs):
        super().__init__(processes, **kwargs)
        self.processes = processes

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        global _INHERITED, _COMPUTE_SLOTS
        super().shutdown(wait=wait, cancel_futures=cancel_futures)
        _INHERITED = None   # the parent no longer holds the context (open checkpoints) for its workers
        _COMPUTE_SLOTS = None


def inherited() -> object:
    """The context of the `forked_pool` this process was forked into."""
    return _INHERITED


def _init_process(parent: int | None = None) -> None:
    if parent is not None:   # a forked worker (None: a stand-alone probe, benchmarks/bench_throughput.py)
        die_with_parent(parent)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # a stop is the parent's to handle, once
        signal.signal(signum, signal.SIG_IGN)
    worker_settings()


_PR_SET_PDEATHSIG = 1   # linux/prctl.h
PARENT_POLL_S = 0.5     # the portable watch's period


def die_with_parent(parent: int) -> None:
    """End this forked process when `parent` (the PID that forked it) dies, however it dies.

    On Linux the kernel sends SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG; it fires when
    the forking thread ends, and pools are made and shut down by the conversion's own thread).
    Elsewhere, or where prctl fails, a daemon thread polls for the parent. Either way, a parent
    that died before this ran is seen at once: this process was re-parented already."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            armed = prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="requant-parent-watch").start()
    if os.getppid() != parent:
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20   # glibc's ceiling on 64-bit


def worker_settings() -> None:
    """What a worker process encodes with: one torch thread (the workers are the parallelism) and
    freed memory kept for reuse (keep_freed_memory)."""
    torch.set_num_threads(1)
    keep_freed_memory()


def keep_freed_memory() -> None:
    """Keep freed memory for reuse in this process. By default glibc gives blocks above a size it
    adapts back to the kernel, and trims the heap, so an encoder allocating the same few-MiB
    tensors unit after unit takes each again as fresh pages, a page fault and a zero-fill apiece:
    W4A16's scale search spent 1.3-1.5x the CPU time (60k faults per full-size expert). A pool of
    threads pays it too: 16 NVFP4 threads on a full-size layer shard took 320k minor faults and
    1.2x `cp`, against 205k and 1.0x with this (benchmarks/results/2026-12-04-h200-convert-freed-
    memory.json). Memory then stays at the encoders' peak, which they reach on every unit anyway.
    Process-wide: it stays set after the conversion. Where the C library has no mallopt (not
    glibc), the defaults stay."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)
