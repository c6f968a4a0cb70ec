"""Where a conversion's units are encoded: threads of this process, or forked worker processes.

A task reads its unit's input tensors, encodes them and writes the outputs at their planned
offsets in the shard being written (an expert's outputs mostly straight to the disk, past the
page cache: write_tensors); only the unit's Stats come back, so no tensor crosses a process
boundary. Threads suit targets whose encoding is cheap (NVFP4's bit cast) or runs on a GPU;
a CPU-heavy target (W4A16's scale search) on a CPU device gets processes: real parallelism,
whatever the GIL. A process worker holds one expert's inputs and outputs plus the encoder's
scratch: a full-size W4A16 worker peaks at about 400 MiB RSS, 240 MiB of it torch and the plan
(benchmarks/bench_throughput.py measures it). At most `2 * processes` units are in flight, so memory
stays bounded whatever the checkpoint size.

A worker process's reads and writes leave its core idle (a full-size expert's 25 MB of direct I/O
against ~160 ms of scale search; on a 2-vCPU machine the cores were idle 12-14% of a W4A16
conversion). So a CPU-heavy pool forks `io_spares` more processes than `workers` and lets only
`workers` of them encode at once (`compute_slot`): the others read and write meanwhile, and no
more processes compute than there are cores to run them, which would only trade caches (3
unthrottled processes on 2 cores were slower than 2). Memory is per process: 1.5x the workers'.

Processes are forked once, when the pool is made (after planning, before any shard is opened for
writing or copying), and look their unit up in the inherited plan (an encoder is a closure, which
does not pickle). They open files by path per task and keep no descriptor: a source shard that an
in-place conversion replaces is freed at once, not held open by a worker.

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
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from requant.io.safetensors import PAGE, TensorInfo, open_direct, read_buffer_bytes, read_tensor, write_tensors
from requant.targets import Stats, Unit

if TYPE_CHECKING:   # a plan builds on verify, whose deep pass forks its workers here
    from requant.plan import Plan

_INHERITED: object = None   # what forked workers look their tasks up in (`forked_pool`)
_COMPUTE_SLOTS = None       # a semaphore shared by a forked pool's processes (`compute_slot`), or None


_ALIGN = 64
_scratch = threading.local()   # per worker thread (or process): the buffers its inputs and outputs pass through


def _input_buffer(nbytes: int) -> torch.Tensor:
    """This thread's read buffer, grown to `nbytes`: reused from unit to unit, so reading costs no
    fresh pages (each new one a page fault and a zero-fill by the kernel). Pinned in a GPU thread."""
    buf = getattr(_scratch, "inputs", None)
    if buf is None or buf.numel() < nbytes:
        buf = _scratch.inputs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=getattr(_scratch, "pinned", False))
    return buf


def _staging_buffer(nbytes: int) -> torch.Tensor:
    """This thread's page-aligned buffer for direct writes (write_tensors), grown to `nbytes`."""
    buf = getattr(_scratch, "staging", None)
    if buf is None or buf.numel() < nbytes:
        whole = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = -whole.data_ptr() % PAGE
        buf = _scratch.staging = whole[start: start + nbytes]
    return buf


def encode_unit(unit: Unit, reads: list[tuple[str, str, TensorInfo]], out_path: str,
                offsets: dict[str, int]) -> Stats:
    """Read (name, file, byte range) inputs, encode them, write the outputs into `out_path`.
    Inputs live in this thread's reused buffer until the outputs are written; an encoder may
    overwrite them (NVFP4 fixes -0 codes in place)."""
    starts, total = [], 0
    for _, _, info in reads:
        starts.append(total)
        total += -(-read_buffer_bytes(info) // _ALIGN) * _ALIGN
    buffer = _input_buffer(total)
    tensors, fds, directs = {}, {}, {}   # path -> descriptor, O_DIRECT descriptor (None: refused)
    try:
        for (name, path, info), start in zip(reads, starts):
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
                directs[path] = open_direct(path, os.O_RDONLY)
            tensors[name] = read_tensor(fds[path], info, path, out=buffer[start:], direct=directs[path])
    finally:
        for fd in [*fds.values(), *directs.values()]:
            if fd is not None:
                os.close(fd)
    with compute_slot():
        outputs, stats = unit.encode(tensors)
    fd = os.open(out_path, os.O_WRONLY)
    direct = None
    try:
        direct = open_direct(out_path)
        write_tensors(fd, [(spec, outputs[spec.name], offsets[spec.name]) for spec in unit.outputs],
                      direct, _staging_buffer)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)
    return stats


def _encode_planned(shard: int, unit: int, reads, out_path: str, offsets: dict[str, int]) -> Stats:
    return encode_unit(inherited().shards[shard].units[unit], reads, out_path, offsets)


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


def _init_gpu_thread(device: str) -> None:
    """A thread encoding on the GPU gets a stream of its own, so that threads' copies and kernels
    overlap instead of queueing on the default stream, and reads into pinned memory, which the GPU
    copies from while the thread goes on launching."""
    torch.cuda.set_stream(torch.cuda.Stream(device))
    _scratch.pinned = True


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


class Encoders:
    """A pool of `workers` threads, or of forked processes when `processes` (`workers` of them
    encoding at once, and `io_spares` more reading and writing meanwhile); threads set up for
    encoding on `gpu` (a CUDA device) when given."""

    def __init__(self, plan: Plan, workers: int, processes: bool, gpu: str | None = None):
        self.workers, self.processes = max(1, workers), processes
        if processes:
            plan.target.ready_workers()
            self.pool = forked_pool(self.workers, plan, spares=io_spares(self.workers))
        else:
            keep_freed_memory()   # the threads' temporaries, as in a worker process
            initializer = {"initializer": _init_gpu_thread, "initargs": (gpu,)} if gpu else {}
            self.pool = ThreadPoolExecutor(self.workers, **initializer)

    @classmethod
    def for_plan(cls, plan: Plan, workers: int) -> "Encoders":
        # One worker process too: single-threaded torch there, where a thread would pay intra-op
        # threading on every small tensor.
        device = plan.target.options.device
        heavy = plan.target.cpu_heavy
        return cls(plan, workers, processes=heavy and device == "cpu",
                   gpu=device if heavy and device.startswith("cuda") else None)

    @property
    def window(self) -> int:
        """Units in flight at most."""
        return 2 * (self.pool.processes if self.processes else self.workers)

    def submit(self, shard_index: int, unit_index: int, unit: Unit, reads, out_path: str,
               offsets: dict[str, int]) -> Future:
        if self.processes:
            return self.pool.submit(_encode_planned, shard_index, unit_index, reads, out_path, offsets)
        return self.pool.submit(encode_unit, unit, reads, out_path, offsets)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
