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

Processes are forked once (pools.forked_pool), when the pool is made (after planning, before any shard is opened for
writing or copying), and look their unit up in the inherited plan (an encoder is a closure, which
does not pickle). They open files by path per task and keep no descriptor: a source shard that an
in-place conversion replaces is freed at once, not held open by a worker.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from requant.formats import int4_search
from requant.io.safetensors import PAGE, TensorInfo, open_direct, read_buffer_bytes, read_tensor, write_tensors
from requant.plan import Plan
from requant.pools import compute_slot, forked_pool, inherited, io_spares, keep_freed_memory
from requant.targets import Stats, Unit

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


def _init_gpu_thread(device: str) -> None:
    """A thread encoding on the GPU gets a stream of its own, so that threads' copies and kernels
    overlap instead of queueing on the default stream, and reads into pinned memory, which the GPU
    copies from while the thread goes on launching."""
    torch.cuda.set_stream(torch.cuda.Stream(device))
    _scratch.pinned = True


class Encoders:
    """A pool of `workers` threads, or of forked processes when `processes` (`workers` of them
    encoding at once, and `io_spares` more reading and writing meanwhile); threads set up for
    encoding on `gpu` (a CUDA device) when given."""

    def __init__(self, plan: Plan, workers: int, processes: bool, gpu: str | None = None):
        self.workers, self.processes, self.gpu = max(1, workers), processes, gpu
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
        if self.gpu:
            int4_search.release_graphs()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
