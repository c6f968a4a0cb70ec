"""Benchmark: conversion, report, verify --deep and validate throughput on a 2-layer full-size
checkpoint (DeepSeek-V4-Flash dimensions, 2 layers + MTP), every ratio measured in this one run.

Steps, each a `python -m requant ...` child with the source (and the outputs it reads) evicted from
the page cache first (posix_fadvise DONTNEED on those files only: a cold cache without root and
without disturbing other processes' caches):

- the I/O floor of a conversion: `cp -r` of the source, then sync;
- the W4A16 encoder alone on each device, experts from memory (its own floor for a conversion);
- convert --out nvfp4, then --out w4a16 (--group-size 32) on the CPU (worker processes) and, when
  CUDA is present, on the GPU; the W4A16 outputs must be byte-identical;
- the peak RSS of one W4A16 worker process (one full-size expert encoded in a fresh process);
- the time to read every expert tensor of both checkpoints (the same threads pread'ing them: the
  I/O floor a report cannot beat), then report (--no-forward) for the NVFP4 and the W4A16 output;
- verify --deep --source on the W4A16 output;
- validate of one full-size layer (64 tokens, every serving mode) on the device the CLI picks (the
  torch reference on a CPU).

    python benchmarks/bench_throughput.py --workdir /tmp/requant-throughput [--report-layers 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from requant.compute import default_workers
from requant.io.checkpoint import Checkpoint
from requant import sources
from requant.model import ModelSpec

WORKER_PROBE = """
import resource, sys, torch
from requant.io.checkpoint import Checkpoint
from requant.plan import make_plan
from requant.pools import _init_process
from requant.targets import Options
from requant.targets.w4a16 import W4A16Options
from requant.workers import encode_unit
_init_process()
plan = make_plan(Checkpoint.open(sys.argv[1]), "w4a16", Options(target=W4A16Options(group_size=32)))
unit = next(u for s in plan.shards for u in s.units if u.encode is not None and len(u.inputs) == 6)
reads = [(n, *plan.source.where(n)) for n in unit.inputs]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = sys.argv[2]
with open(out, "wb") as f:
    f.truncate(sum(s.nbytes for s in unit.outputs))
offsets, at = {}, 0
for spec in unit.outputs:
    offsets[spec.name], at = at, at + spec.nbytes
for _ in range(3):
    encode_unit(unit, reads, out, offsets)
print("RSS_KB", before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def evict(*paths: str) -> None:
    """Drop these files' pages from the page cache (written pages are synced first)."""
    for root in paths:
        files = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(*args: str, env: dict | None = None) -> tuple[float, str]:
    """Wall seconds of `python -m requant ARGS` (with `env` added to the environment), and its
    output; raises on failure."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "requant", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if done.returncode not in (0,):
        raise RuntimeError(f"requant {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds, done.stdout + done.stderr


def shard_digests(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors") or name == "config.json":
            h = hashlib.sha256()
            with open(os.path.join(path, name), "rb") as f:
                while chunk := f.read(64 << 20):
                    h.update(chunk)
            out[name] = h.hexdigest()
    return out


def expert_tensors(path: str, layers: list[str] | None) -> list[tuple[str, int, int]]:
    """(file, offset, bytes) of every routed-expert tensor (of the selected blocks)."""
    with Checkpoint.open(path) as ck:
        model = ModelSpec.for_config(ck.config, os.path.join(path, "config.json"))
        found = []
        for expert in sources.reader(model).experts(ck.names):
            if layers and expert.block not in layers:
                continue
            for parts in expert.parts.values():
                for name in parts.values():
                    path_, info = ck.where(name)
                    found.append((path_, info.start, info.nbytes))
    return found


def read_all(tensors: list[tuple[str, int, int]], workers: int) -> float:
    """Seconds to pread every listed tensor with `workers` threads (reused buffers)."""
    def read(chunk):
        buf = bytearray(max(n for _, _, n in chunk))
        view = memoryview(buf)
        fds = {}
        for path, offset, n in chunk:
            fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
            done = 0
            while done < n:
                done += os.preadv(fd, [view[done:n]], offset + done)
        for fd in fds.values():
            os.close(fd)

    chunks = [tensors[i::workers] for i in range(workers)]
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(read, chunks))
    return time.perf_counter() - start


def copy_seconds(src: str, dst: str) -> float:
    """Seconds to `cp -r` the source and sync it to disk (then the copy is removed)."""
    shutil.rmtree(dst, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def encoder_experts_per_second(device: str, group: int, threads: int, per_thread: int = 8) -> float:
    """Full-size experts (3 projections) per second through int4_search.encode_many on `device`, from
    memory (pinned for a GPU, as a conversion reads them), `threads` threads set up as a
    conversion's encoders are (the first expert of each, which readies tables and a GPU thread's
    CUDA graph, untimed)."""
    from requant import synth
    from requant.formats import int4_search
    from requant.pools import worker_settings
    from requant.workers import _init_gpu_thread

    hidden, inter = 4096, 2048
    values = synth._Values(3, synth.HardCases())
    expert = {}
    for name, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
        w, s = values.expert(*shape, pooled=False)
        expert[name] = tuple(t.view(torch.uint8).pin_memory() if device == "cuda" else t.view(torch.uint8)
                             for t in (w, s))

    def work(n):
        for _ in range(n):
            int4_search.encode_many(expert, group, "sym", device)

    if device == "cpu":
        worker_settings()   # as in a worker process
    gpu = device == "cuda"
    with ThreadPoolExecutor(threads, initializer=_init_gpu_thread if gpu else None, initargs=(device,) * gpu) as pool:
        list(pool.map(work, [1] * threads))   # warm-up: tables, streams, allocator pools
        start = time.perf_counter()
        list(pool.map(work, [per_thread] * threads))
        return threads * per_thread / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/requant-throughput")
    ap.add_argument("--group-size", default="32")
    ap.add_argument("--report-layers", default=None, help="--layers for report (default: every block)")
    ap.add_argument("--skip", default="", help="comma-separated: cpu-w4a16, report, verify, validate; convert: "
                    "no cp, encoder or conversion steps, the outputs of an earlier run in --workdir are read")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    cuda = torch.cuda.is_available()
    workers = default_workers()
    src = os.path.join(a.workdir, "src")
    if not os.path.exists(os.path.join(src, "config.json")):
        shutil.rmtree(src, ignore_errors=True)
        t, _ = run("synth", src, "--full-scale", "--layers", "2")
        print(f"synth: {t:.1f} s", flush=True)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    print(f"source {size / 1e9:.2f} GB, {workers} cores, "
          f"{torch.cuda.get_device_name() if cuda else 'no GPU'}, torch {torch.__version__}", flush=True)
    rows = []   # (what, seconds, note)
    if "convert" in skip:
        nv, w4_out = (os.path.join(a.workdir, n) for n in ("nvfp4", f"w4a16-{'cuda' if cuda else 'cpu'}"))
        for out in (nv, w4_out):
            if not os.path.exists(os.path.join(out, "config.json")):
                sys.exit(f"--skip convert: {out} is not a converted checkpoint")
    else:
        nv, w4_out = conversions(a, src, size, skip, cuda, workers, rows)
    measure(a, src, nv, w4_out, skip, cuda, workers, rows)


def conversions(a, src, size, skip, cuda, workers, rows):
    """cp, the encoder alone, the conversions and the worker probe; -> (NVFP4 output, W4A16 output)."""
    evict(src)
    t_cp = copy_seconds(src, os.path.join(a.workdir, "copy"))
    print(f"cp -r + sync (the I/O floor): {t_cp:.1f} s ({size / t_cp / 1e9:.2f} GB/s)", flush=True)
    # One CPU thread (a worker process's share); on a GPU, one thread (latency) and a conversion's many.
    for device, threads in ([("cpu", 1)] if "cpu-w4a16" not in skip or not cuda else []) + \
            ([("cuda", 1), ("cuda", workers)] if cuda else []):
        rate = encoder_experts_per_second(device, int(a.group_size), threads)
        memory = f"; GPU memory reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB" if device == "cuda" else ""
        print(f"W4A16 g{a.group_size} encoder alone ({device}, {threads} thread{'s' * (threads > 1)}): "
              f"{rate:.1f} full-size experts/s{memory}", flush=True)

    def convert(name, *args):
        out = os.path.join(a.workdir, name)
        shutil.rmtree(out, ignore_errors=True)
        evict(src)
        t, log = run("convert", src, out, "--quiet", *args)
        rows.append((f"convert {' '.join(args)}", t, f"{size / t / 1e9:.2f} GB/s of source"))
        print(f"{rows[-1][0]}: {t:.1f} s ({rows[-1][2]}); {log.strip().splitlines()[-1][:160]}", flush=True)
        return out, t

    nv, t_nv = convert("nvfp4", "--out", "nvfp4")
    w4 = {}
    devices = (["cpu"] if "cpu-w4a16" not in skip or not cuda else []) + (["cuda"] if cuda else [])
    for device in devices:
        w4[device] = convert(f"w4a16-{device}", "--out", "w4a16", "--group-size", a.group_size, "--device", device)
    if len(w4) == 2:
        same = shard_digests(w4["cpu"][0]) == shard_digests(w4["cuda"][0])
        print(f"W4A16 CPU vs CUDA output: {'byte-identical' if same else 'DIFFERENT'}", flush=True)
    print(f"RATIO NVFP4 conversion / cp: {t_nv / t_cp:.2f}x", flush=True)
    for device, (_, t) in w4.items():
        print(f"RATIO W4A16 ({device}) / NVFP4 conversion: {t / t_nv:.2f}x; / cp: {t / t_cp:.2f}x", flush=True)
    w4_out = w4["cuda" if cuda else "cpu"][0]

    probe = subprocess.run([sys.executable, "-c", WORKER_PROBE, src, os.path.join(a.workdir, "probe.bin")],
                           capture_output=True, text=True)
    m = re.search(r"RSS_KB (\d+) (\d+)", probe.stdout)
    if m:
        print(f"one W4A16 worker process: peak RSS {int(m[2]) / 1024:.0f} MiB "
              f"({int(m[1]) / 1024:.0f} MiB after imports and planning)", flush=True)
    else:
        print("worker probe failed:", probe.stderr[-400:], flush=True)
    return nv, w4_out


def measure(a, src, nv, w4_out, skip, cuda, workers, rows):
    """report, verify --deep and validate on the converted checkpoints."""
    if "report" not in skip:
        layers = [f"layers.{x}" if x.isdigit() else x for x in a.report_layers.split(",")] if a.report_layers else None
        # the W4A16 report once more with the torch passes (what runs where no C compiler is)
        for label, out, env in (("NVFP4", nv, {}), ("W4A16", w4_out, {}),
                                ("W4A16, torch passes", w4_out, {"REQUANT_NATIVE": "0"})):
            evict(src, out)
            floor = read_all(expert_tensors(src, layers) + expert_tensors(out, layers), workers)
            evict(src, out)
            extra = ["--layers", a.report_layers] if a.report_layers else []
            report_dir = os.path.join(a.workdir, f"report-{label.split(',')[0]}")
            t, _ = run("report", src, out, "--out", report_dir, "--no-forward", "--quiet", *extra, env=env)
            with open(os.path.join(report_dir, "report.json")) as f:
                timing = json.load(f)["timing"]
            rows.append((f"report {label}", t, f"read floor {floor:.1f} s"))
            print(f"report {label}: {t:.1f} s ({timing['weights_seconds']:.1f} s comparing, {timing['comparison']}); "
                  f"reading both checkpoints' experts: {floor:.1f} s; RATIO report / read {t / floor:.2f}x", flush=True)
        t_rn, t_rw, t_torch = rows[-3][1], rows[-2][1], rows[-1][1]
        print(f"RATIO report W4A16 / report NVFP4: {t_rw / t_rn:.2f}x; torch passes / C pass: {t_torch / t_rw:.2f}x",
              flush=True)

    if "verify" not in skip:
        evict(src, w4_out)
        t, log = run("verify", w4_out, "--deep", "--source", src, "--quiet", "--json")
        info = json.loads(log[log.index("{"):])
        print(f"verify --deep --source (W4A16): {t:.1f} s, ok={info['ok']}", flush=True)

    if "validate" not in skip:
        evict(src, nv)
        t, log = run("validate", src, nv, "--layers", "0", "--tokens", "64", "--serve", "all", "--quiet")
        print(f"validate one full-size layer, 64 tokens, every serving mode ({'cuda' if cuda else 'cpu'}): {t:.1f} s",
              flush=True)
        print("\n".join(line for line in log.splitlines() if "about" in line or "PASSED" in line or "FAILED" in line))


if __name__ == "__main__":
    main()
