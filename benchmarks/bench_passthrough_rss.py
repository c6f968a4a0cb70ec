"""Benchmark: peak memory of converting a checkpoint that holds a pass-through tensor larger than
the memory budget (an Engram-like embedding table), out of place and in place.

Writes a small synthetic checkpoint, then adds one big F8_E4M3 tensor (default 2.5 GiB) to its
first shard, which holds no routed experts, and one to its first layer shard, which does, with
the index updated. Then `python -m requant convert` runs in a child process three times:
- copy: SRC -> DST, both big tensors copied;
- in place: the first shard has nothing to convert and must be left as it is (same inode, same
  modification time, same bytes); the layer shard is rewritten, its big tensor copied;
and each child's peak RSS is read from wait4's resource usage. Every case must stay under --budget
(1 GiB) and the big tensors must come out byte-identical (compared in pieces, by hash).

    python3 benchmarks/bench_passthrough_rss.py --workdir /tmp/rss [--gib 2.5] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INDEX = "model.safetensors.index.json"
WIDTH = 4096
PIECE = 64 << 20


def add_big_tensor(src: str, shard: str, name: str, nbytes: int, seed: int) -> None:
    """Rewrite `shard` of checkpoint `src` with tensor `name` (F8_E4M3 [rows, WIDTH], about `nbytes`)
    appended, its data written piece by piece (never whole in memory), and the index updated."""
    from requant.io.safetensors import ShardWriter, TensorSpec, read_header

    path = os.path.join(src, shard)
    header = read_header(path)
    big = TensorSpec(name, "F8_E4M3", (-(-nbytes // WIDTH), WIDTH))
    specs = [info.spec for info in header.tensors.values()] + [big]
    tmp = path + ".tmp"
    # metadata of another writer: the header is not the one requant would write, as in real checkpoints
    writer = ShardWriter(tmp, specs, {**header.metadata, "written_by": "bench_passthrough_rss"})
    with open(path, "rb") as f:
        for info in header.tensors.values():
            f.seek(info.start)
            writer.write(info.spec.name, f.read(info.nbytes))
    fill = bytes((seed * 131 + i * 7) % 251 for i in range(1 << 16)) * (PIECE >> 16)
    offset, left = writer.offsets[name], big.nbytes
    while left:
        n = min(left, PIECE)
        os.pwrite(writer.fd, memoryview(fill)[:n], offset)
        offset, left = offset + n, left - n
    writer.close()
    os.replace(tmp, path)
    with open(os.path.join(src, INDEX)) as f:
        index = json.load(f)
    index["weight_map"][name] = shard
    index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + big.nbytes
    with open(os.path.join(src, INDEX), "w") as f:
        json.dump(index, f, indent=2)


def tensor_digest(path: str, name: str) -> str:
    from requant.io.safetensors import read_header

    info = read_header(path).tensors[name]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(info.start)
        left = info.nbytes
        while left:
            chunk = f.read(min(left, PIECE))
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def convert_child(*args: str) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of `python -m requant convert ARGS` in a child process."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "requant", "convert", *args, "--out", "nvfp4", "-q"], env=env,
                             stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    err = child.stderr.read()
    child.stderr.close()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"convert {' '.join(args)} failed ({child.returncode}): {err.strip()}")
    return seconds, usage.ru_maxrss * 1024   # kilobytes on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/requant-rss")
    ap.add_argument("--gib", type=float, default=2.5, help="size of each big tensor")
    ap.add_argument("--budget", type=float, default=1.0, help="peak RSS allowed, GiB")
    ap.add_argument("--device-name", default=platform.node() or "host")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/<date>-<device>-passthrough-rss.json)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from requant import synth
    from requant.io.checkpoint import Checkpoint

    shutil.rmtree(args.workdir, ignore_errors=True)
    src, dst, inplace = (os.path.join(args.workdir, d) for d in ("src", "dst", "inplace"))
    synth.write_checkpoint(src, synth.Dims(layers=2, experts=6), seed=1)
    with Checkpoint.open(src) as ck:
        shards = ck.shard_names
        no_experts = next(n for n in shards if not any(".experts." in t for t in ck.headers[n].tensors))
        with_experts = next(n for n in shards if any(".experts." in t for t in ck.headers[n].tensors))
    nbytes = int(args.gib * 2**30)
    big = {no_experts: "engram.0.table", with_experts: "engram.1.table"}
    for i, (shard, name) in enumerate(big.items()):
        add_big_tensor(src, shard, name, nbytes, seed=i)
    digests = {name: tensor_digest(os.path.join(src, shard), name) for shard, name in big.items()}
    shutil.copytree(src, inplace)
    kept = os.stat(os.path.join(inplace, no_experts))

    rows = {}
    seconds, rss = convert_child(src, dst)
    rows["copy"] = {"seconds": round(seconds, 2), "peak_rss_mib": round(rss / 2**20, 1)}
    seconds, rss = convert_child(inplace, "--in-place")
    rows["in_place"] = {"seconds": round(seconds, 2), "peak_rss_mib": round(rss / 2**20, 1)}

    after = os.stat(os.path.join(inplace, no_experts))
    left_alone = (after.st_ino, after.st_mtime_ns, after.st_size) == (kept.st_ino, kept.st_mtime_ns, kept.st_size)
    same = all(tensor_digest(os.path.join(root, shard), name) == digests[name]
               for root in (dst, inplace) for shard, name in big.items())
    budget = args.budget * 2**30
    ok = left_alone and same and all(r["peak_rss_mib"] * 2**20 < budget for r in rows.values())
    summary = {
        "benchmark": "passthrough_rss",
        "date": datetime.date.today().isoformat(),
        "device": args.device_name,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "big_tensor_bytes": nbytes,
        "big_tensors": {name: shard for shard, name in big.items()},
        "budget_mib": args.budget * 1024,
        "runs": rows,
        "in_place_untouched_shard_left_alone": left_alone,
        "big_tensors_byte_identical": same,
        "ok": ok,
    }
    path = args.out or os.path.join(HERE, "results", f"{summary['date']}-{args.device_name}-passthrough-rss.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    for label, r in rows.items():
        print(f"{label:<10} {r['seconds']:>7.1f} s  peak RSS {r['peak_rss_mib']:,.0f} MiB")
    print(f"two {nbytes / 2**30:.2f} GiB tensors; in place, {no_experts} left alone: {left_alone}; "
          f"big tensors byte-identical: {same}; budget {args.budget} GiB: {'met' if ok else 'NOT MET'}")
    print(f"wrote {path}")
    shutil.rmtree(args.workdir, ignore_errors=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
