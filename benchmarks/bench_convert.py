"""Benchmark: NVFP4 conversion against `cp`, on full-size shards, measured side by side in one run.

Writes (once) a full-scale synthetic DeepSeek-V4-Flash checkpoint (--layers layers and the MTP
block, every shard with data), then, round by round and in rotating order, times:
- `cp shards`: `cp` of the layer shards (the routed experts), then fsync (requant fsyncs too);
- `requant shards`: the pipeline's own write_shard over the same shards to NVFP4, in a child
  process with the default workers, from the first shard to the last rename (the child's whole
  wall time, interpreter and torch import included, is recorded beside it);
- `cp -r`: the whole checkpoint, then sync;
- `requant convert`: `python -m requant convert SRC DST --out nvfp4`, the whole command.
The first pair is the steady state a large checkpoint sees; the second adds the command's fixed
costs, which a checkpoint of 46 shards spreads thin and this small one does not.
With --sparse, an all-zero (hole) layer shard is also converted to NVFP4 (--input-scale 1: zero
norms give no data-free bound) and W4A16, as MiB/s.

Cold cache: before every timed run the files it reads are dropped from the page cache, with
`echo 1 > /proc/sys/vm/drop_caches` where that is allowed (root on a real kernel), else
posix_fadvise(DONTNEED) on each file. Whether that made the reads cold is measured, not assumed:
a shard is read once after a drop and once again warm, and both rates are recorded; where they
are the same (a sandboxed kernel whose page cache the guest cannot drop) the result says "warm".

    python3 benchmarks/bench_convert.py --workdir /tmp/bench --device-name h200
    python3 benchmarks/bench_convert.py --src CHECKPOINT --shards 1,3   # layer shards of another one
    BENCH_WORKERS=4 python3 benchmarks/bench_convert.py ...   # the shard runs with 4 workers, not one per core

Writes benchmarks/results/<date>-<device>-convert.json (--out to choose) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = """
import json, os, sys, time
start_all = time.perf_counter()
from tqdm import tqdm
from requant.compute import default_workers
from requant.convert import write_shard
from requant.io.checkpoint import Checkpoint
from requant.plan import make_plan
from requant.targets import Options
from requant.workers import Encoders
src, dst, out, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
input_scale = float(sys.argv[5]) if len(sys.argv) > 5 else None
plan = make_plan(Checkpoint.open(src), out, Options(input_scale=input_scale))
shards = [s for s in plan.shards if s.name in names]
start = time.perf_counter()
exact = blocks = 0
workers = int(os.environ.get("BENCH_WORKERS") or 0) or default_workers()
with tqdm(disable=True) as bar, Encoders.for_plan(plan, workers) as encoders:
    for shard in shards:
        entry = {"size": os.path.getsize(plan.source.shard_path(shard.name)), "mtime_ns": None}
        stats = write_shard(plan, shard, dst, encoders, bar, entry)
        exact, blocks = exact + stats.exact_blocks, blocks + stats.blocks
end = time.perf_counter()
print("RESULT " + json.dumps({"workers": workers, "seconds": end - start, "wall": end - start_all,
                              "exact_blocks": exact, "blocks": blocks}))
"""


def drop_caches(paths: list[str]) -> str:
    """Drop `paths` from the page cache; the method that was used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def read_rate(path: str) -> float:
    """GiB/s of reading `path` once through the page cache."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(_READ_BUF):
            pass
    return os.path.getsize(path) / (time.perf_counter() - start) / 2**30


_READ_BUF = bytearray(64 << 20)


def copy_with_fsync(paths: list[str], out: str) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", *paths, out], check=True)
    for path in paths:
        fd = os.open(os.path.join(out, os.path.basename(path)), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def convert_in_child(src: str, out: str, fmt: str, names: list[str], input_scale: float | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", CHILD, src, out, fmt, ",".join(names),
                          *([str(input_scale)] if input_scale else [])], capture_output=True,
                         text=True, env=env)
    if run.returncode:
        raise SystemExit(f"converting {names} to {fmt} failed: {run.stderr.strip()[-2000:]}")
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def layer_shards(src: str) -> list[int]:
    """Indices of the shards holding routed experts (the layer and MTP shards)."""
    from requant.io.checkpoint import Checkpoint

    with Checkpoint.open(src) as ck:
        return [i for i, name in enumerate(ck.shard_names)
                if any(".experts." in t for t in ck.headers[name].tensors)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/requant-bench")
    ap.add_argument("--src", help="an existing checkpoint (default: a full-scale synthetic one under --workdir)")
    ap.add_argument("--layers", type=int, default=1, help="layers of the synthetic checkpoint (its MTP block too)")
    ap.add_argument("--shards", help="comma-separated shard indices to time (default: every layer shard)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sparse", action="store_true", help="also time an all-zero layer shard, NVFP4 and W4A16")
    ap.add_argument("--device-name", default=platform.node() or "host", help="names the results file")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/<date>-<device>-convert.json)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from requant import synth

    os.makedirs(args.workdir, exist_ok=True)
    src = args.src or os.path.join(args.workdir, "src")
    dims = synth.Dims(full_scale=True, layers=args.layers)
    made = 0.0
    if not os.path.exists(os.path.join(src, "config.json")):
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a full-scale synthetic checkpoint ({args.layers} layers)...", flush=True)
        start = time.perf_counter()
        synth.write_checkpoint(src, dims, seed=0)
        made = time.perf_counter() - start
    indices = [int(i) for i in args.shards.split(",")] if args.shards else layer_shards(src)
    all_names = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    names = [all_names[i] for i in indices]
    paths = [os.path.join(src, n) for n in names]
    size = sum(map(os.path.getsize, paths))
    out = os.path.join(args.workdir, "out")

    def fresh_out():
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        os.sync()
        time.sleep(2)   # the deleted output's discards must not land on the next run

    every = [os.path.join(src, n) for n in all_names]
    method = drop_caches(every)
    cold_rate = read_rate(paths[0])
    warm_rate = read_rate(paths[0])
    cold = cold_rate < 0.7 * warm_rate
    print(f"cache: {method}; reading {names[0]} after the drop {cold_rate:.2f} GiB/s, warm {warm_rate:.2f} GiB/s "
          f"-> runs are {'cold' if cold else 'warm (the drop did not empty the cache)'}", flush=True)

    def whole_copy() -> float:
        start = time.perf_counter()
        subprocess.run(["cp", "-r", src, os.path.join(out, "copy")], check=True)
        os.sync()
        return time.perf_counter() - start

    def whole_convert() -> float:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "requant", "convert", src, os.path.join(out, "nvfp4"), "--out", "nvfp4",
                        "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start

    walls: list[float] = []
    result: dict = {}

    def shards_convert() -> float:
        result.update(convert_in_child(src, out, "nvfp4", names))
        walls.append(result["wall"])
        return result["seconds"]

    methods = {"cp shards": lambda: copy_with_fsync(paths, out), "requant shards": shards_convert,
               "cp -r": whole_copy, "requant convert": whole_convert}
    times: dict[str, list[float]] = {label: [] for label in methods}
    for r in range(args.rounds):   # rotated, so that no method always runs first
        order = list(methods)[r % len(methods):] + list(methods)[:r % len(methods)]
        for label in order:
            fresh_out()
            drop_caches(every)
            times[label].append(methods[label]())
            print(f"round {r + 1} {label}: {times[label][-1]:.2f} s  (load {os.getloadavg()[0]:.1f})", flush=True)
    fresh_out()
    median = {label: statistics.median(t) for label, t in times.items()}
    whole = sum(os.path.getsize(os.path.join(src, n)) for n in all_names)

    sparse = {}
    if args.sparse:
        sparse_src = os.path.join(args.workdir, "sparse")
        if not os.path.exists(os.path.join(sparse_src, "config.json")):
            shutil.rmtree(sparse_src, ignore_errors=True)
            synth.write_checkpoint(sparse_src, synth.Dims(full_scale=True, layers=1), seed=0, sparse=True)
        name = sorted(f for f in os.listdir(sparse_src) if f.endswith(".safetensors"))[layer_shards(sparse_src)[0]]
        shard_bytes = os.path.getsize(os.path.join(sparse_src, name))
        for fmt in ("nvfp4", "w4a16"):
            fresh_out()
            drop_caches([os.path.join(sparse_src, name)])
            # all-zero norms give no data-free input_scale bound: NVFP4 takes a constant one
            got = convert_in_child(sparse_src, out, fmt, [name], 1.0 if fmt == "nvfp4" else None)
            sparse[fmt] = {"seconds": round(got["seconds"], 3),
                           "mib_per_s": round(shard_bytes / got["seconds"] / 2**20, 1)}
            print(f"all-zero shard {name} ({shard_bytes / 2**30:.2f} GiB) -> {fmt}: {got['seconds']:.2f} s, "
                  f"{sparse[fmt]['mib_per_s']:,.0f} MiB/s", flush=True)
        fresh_out()

    summary = {
        "benchmark": "convert",
        "date": datetime.date.today().isoformat(),
        "device": args.device_name,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "source": {"synthetic": args.src is None, "layers": args.layers, "made_seconds": round(made, 1)},
        "shards": names,
        "bytes": size,
        "cache": {"method": method, "cold": cold, "read_after_drop_gib_s": round(cold_rate, 2),
                  "read_warm_gib_s": round(warm_rate, 2)},
        "checkpoint_bytes": whole,
        "rounds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "requant_shards_child_wall_s": [round(t, 3) for t in walls],
        "median_s": {k: round(v, 3) for k, v in median.items()},
        # the pipeline over the layer shards against cp of those files; the whole command
        # (interpreter, torch import, planning, checks, metadata) against cp -r of the checkpoint
        "ratio_shards": round(median["requant shards"] / median["cp shards"], 3),
        "ratio_whole": round(median["requant convert"] / median["cp -r"], 3),
        "exact_blocks": result.get("exact_blocks"),
        "blocks": result.get("blocks"),
        "workers": result.get("workers"),
        "sparse_shard": sparse,
    }
    path = args.out or os.path.join(HERE, "results", f"{summary['date']}-{args.device_name}-convert.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(f"\nlayer shards {', '.join(names)}: {size / 2**30:.2f} GiB of a {whole / 2**30:.2f} GiB checkpoint, "
          f"{'cold' if cold else 'warm'} page cache, {summary['workers']} workers")
    print(f"{'method':<18}{'median s':>10}{'GiB/s':>8}{'x cp':>7}")
    for label, base, nbytes in (("cp shards", "cp shards", size), ("requant shards", "cp shards", size),
                                ("cp -r", "cp -r", whole), ("requant convert", "cp -r", whole)):
        t = median[label]
        print(f"{label:<18}{t:>10.2f}{nbytes / t / 2**30:>8.2f}{t / median[base]:>7.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
