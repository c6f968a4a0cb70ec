"""Where numeric work runs: the device and the number of workers, chosen the same way by every
command (convert, report, verify)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

from requant.errors import UnsupportedError


def compute_device(requested: str | None) -> str:
    """The device encoders and decoders run on: as requested, else CUDA when present."""
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError("--device cuda: no CUDA device is available")
    return requested


def kernel_device(requested: str | None) -> str:
    """The device requant's Triton kernel and the MoE forward around it (validate, report) run
    on: compute_device's choice, except under Triton's interpreter (TRITON_INTERPRET=1), which runs
    kernels on host tensors only, and where triton is not installed (the torch reference then): the
    CPU. Asking for cuda without triton is the kernel's own one-line refusal."""
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if requested == "cuda" and interpreter:
        raise UnsupportedError("--device cuda: TRITON_INTERPRET=1 is set, and Triton's interpreter runs kernels "
                               "on the CPU only; unset it to run on the GPU")
    no_kernel = interpreter or importlib.util.find_spec("triton") is None
    return "cpu" if requested is None and no_kernel else compute_device(requested)


MAX_DEFAULT_WORKERS = 32   # W4A16: 48 processes (pools.io_spares) of ~400 MiB peak, under ~19 GiB


def default_workers() -> int:
    """One per core this process may run on, at most MAX_DEFAULT_WORKERS (--workers goes higher)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_DEFAULT_WORKERS)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n while the block runs. Where requant spreads experts over
    its own threads, torch's pool on top of them oversubscribes the cores: a full-size projection's
    comparison took 6x the CPU time with 2 intra-op threads on 2 vCPUs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
