"""The same bytes whatever encodes them: W4A16 encoding on the CPU and on CUDA, its two refinement
strategies, and conversions with one or several worker processes. Imports neither ModelOpt nor
compressed-tensors, so the GPU machine runs it as it is (the CUDA cases skip elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from requant import synth
from requant.formats import int4, int4_search, int4_search_c
from tests.helpers.cli import run_cli
from tests.helpers.encodings import same_encoding
from tests.helpers.files import output_tree


def _mxfp4(rows, k, seed, hard=synth.HardCases()):
    w, s = synth._Values(seed, hard).expert(rows, k, pooled=False)
    return w.view(torch.uint8), s.view(torch.uint8)


@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_gpu_refinement_picks_what_the_cpu_one_picks(scheme, monkeypatch):
    """The GPU's refinement (every group's own table columns) against the CPU's (one product per
    coarse winner), both run here on the CPU: exact arithmetic, so the same bytes."""
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    w, s = _mxfp4(128, 1024, seed, synth.HardCases(out_of_window=2, zero_blocks=3, neg_zero_blocks=1))
    monkeypatch.setattr(int4_search_c, "encode", lambda *a, **k: None)   # the torch passes (not the C one)
    by_centre = int4_search.encode_mxfp4(w, s, 32, scheme)
    monkeypatch.setattr(int4_search._Tables, "_best_by_centre", int4_search._Tables._best_each)
    assert same_encoding(int4_search.encode_mxfp4(w, s, 32, scheme), by_centre), f"seed {seed}"


def _expert(rows, k, seed, pin=False):
    """An expert's gate, up and down projections ([rows, k], [rows, k], [k, rows]), by name."""
    hard = synth.HardCases(out_of_window=2, zero_blocks=3, neg_zero_blocks=1)
    shapes = {"gate": (rows, k), "up": (rows, k), "down": (k, rows)}
    return {name: tuple(t.pin_memory() if pin else t for t in _mxfp4(*shape, seed + i, hard))
            for i, (name, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_tensors_encoded_in_one_run_as_apart(scheme, monkeypatch):
    """The GPU's way (an expert's projections as one run of groups), run here on the CPU, against
    the CPU's (one tensor at a time): the same bytes and per-tensor energies."""
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    sources = _expert(64, 512, seed)
    apart = int4_search.encode_many(sources, 32, scheme, "cpu")
    # _on_gpu's one run of groups, here on the CPU (the CPU's own path goes tensor by tensor)
    monkeypatch.setattr(int4_search, "_search_on_cpu", lambda srcs, args: int4_search._search(
        torch.cat([w.reshape(-1) for w, _ in srcs.values()]), torch.cat([s.reshape(-1) for _, s in srcs.values()]),
        *args))
    together = int4_search._encode({name: (w.view(torch.uint8), s.view(torch.uint8)) for name, (w, s) in sources.items()},
                            32, scheme, "cpu", exhaustive=False)
    assert all(same_encoding(together[name], apart[name]) for name in sources), f"seed {seed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: runs on the GPU machine")
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("scheme", int4.SCHEMES)
def test_cuda_encodes_the_bytes_the_cpu_encodes(group, scheme):
    """Full-size experts encoded on the GPU (from pinned memory, as conversions do: the first one
    run as it is, the next ones replaying the CUDA graph captured then, on new inputs; and one
    projection from GPU memory) and on the CPU: identical tensors and energies."""
    for seed in (7, 8, 9):
        sources = _expert(2048, 4096, seed, pin=True)
        on_cpu = int4_search.encode_many(sources, group, scheme, "cpu")
        on_gpu = int4_search.encode_many(sources, group, scheme, "cuda")
        assert all(same_encoding(on_gpu[name], on_cpu[name]) for name in sources), seed
    w, s = sources["down"]
    assert same_encoding(int4_search.encode_mxfp4(w.cuda(), s.cuda(), group, scheme), on_cpu["down"])


def test_worker_counts_and_devices_write_the_same_bytes(small_source, tmp_path):
    """One worker process, three, and (on a GPU machine) the GPU: byte-identical outputs."""
    runs = [["--workers", "1", "--device", "cpu"], ["--workers", "3", "--device", "cpu"]]
    if torch.cuda.is_available():
        runs.append(["--workers", "2", "--device", "cuda"])
    trees = []
    for i, args in enumerate(runs):
        dst = str(tmp_path / f"out{i}")
        result = run_cli("convert", small_source, dst, "--out", "w4a16", "--group-size", "32", "--scheme", "asym",
                         "--quiet", *args)
        assert result.returncode == 0, result.stderr
        trees.append(output_tree(dst))   # the card names its destination, out0 .. out2
    assert all(t == trees[0] for t in trees[1:])


def _inside_compute_slot(seconds: float) -> tuple[float, float]:
    """(enter, leave) times of a task's stay in the pool's compute slot."""
    import time

    from requant import pools

    with pools.compute_slot():
        start = time.monotonic()
        time.sleep(seconds)
        return start, time.monotonic()


def test_a_forked_pool_computes_in_at_most_its_slots():
    """Two workers and a spare: three processes, two compute slots. No three tasks are ever inside
    a slot together, and two are (the slots are shared, not one per process)."""
    from requant import pools

    with pools.forked_pool(2, None, spares=1) as pool:
        assert pool.processes == 3
        spans = list(pool.map(_inside_compute_slot, [0.2] * 8))

    def inside(t):
        return sum(a <= t < b for a, b in spans)
    starts = [a for a, _ in spans]
    assert max(inside(t) for t in starts) == 2
    assert pools.compute_slot().__class__.__name__ == "nullcontext"   # the pool's slots went with it


def test_the_kernel_runs_where_triton_can_run_it(monkeypatch):
    """Under Triton's interpreter the kernel runs on host tensors only: the CPU by default, and a
    clear refusal of --device cuda (an interpreted kernel fed CUDA tensors fails deep in Triton).
    Without triton a GPU machine's default is the CPU's torch reference too (report ran nothing
    there: the kernel's refusal)."""
    import importlib.util

    from requant.compute import kernel_device
    from requant.errors import UnsupportedError

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_device(None) == "cpu" and kernel_device("cpu") == "cpu"
    with pytest.raises(UnsupportedError, match="TRITON_INTERPRET=1"):
        kernel_device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernel_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_device(None) == "cuda"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    assert kernel_device(None) == "cpu" and kernel_device("cuda") == "cuda"
