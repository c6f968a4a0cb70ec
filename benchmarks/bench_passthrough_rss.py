"""Benchmark: peak memory of converting a checkpoint that holds a pass-through tensor larger than
the memory budget (an Engram embedding table), out of place and in place.

Two ways to build the source checkpoint:
- generic (default): a small synthetic DeepSeek-V4-Flash checkpoint, then one big F8_E4M3 tensor
  (default 2.5 GiB) added to its first shard, which holds no routed experts, and one to its first
  layer shard, which does, with the index updated;
- `--model deepseek-v4.1-flash` (any named model with Engram tables): that model's own small
  synthetic checkpoint (requant synth, reduced dimensions) with every Engram table sized to about
  --gib: its real tensors (`layers.{L}.engram.embed.weight`, F8_E4M3 [rows, engram_head_dim], and
  its 1x32-block F8_E8M0 `.scale`), written by synth a band of rows at a time. V4.1 keeps each
  table alone in a shard of its own (its last two), so no table shares a shard with routed experts
  there; the generic mode covers that case.
Then `python -m requant convert` runs in a child process twice:
- copy: SRC -> DST --copy-all, the big tensors copied (without --copy-all a shard with nothing to
  convert would be a hard link to the source's, and nothing of it copied);
- in place: every shard with a big tensor and no routed experts has nothing to convert and must be
  left as it is (same inode, same modification time, same size, same bytes); a shard with routed
  experts is rewritten, its big tensor copied;
and each child's peak RSS is read from wait4's resource usage. That peak is at least this process's
own (Linux carries a parent's high-water mark into the children it starts), so the source is built
and hashed in separate interpreters and this one stays at ~20 MiB (bench_process_peak_rss_mib in
the results). Every case must stay under --budget (1 GiB) and the big tensors (with an Engram
table's scale) must come out byte-identical (compared in pieces, by hash).

    python3 benchmarks/bench_passthrough_rss.py --workdir /tmp/rss [--model deepseek-v4.1-flash] [--gib 2.5]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
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
    with tempfile.TemporaryFile("w+") as stderr:   # a file, not a pipe: a long error cannot block the child
        child = subprocess.Popen([sys.executable, "-m", "requant", "convert", *args, "--out", "nvfp4", "-q"], env=env,
                                 stderr=stderr, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        stderr.seek(0)
        err = stderr.read()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"convert {' '.join(args)} failed ({child.returncode}): {err.strip()}")
    return seconds, usage.ru_maxrss * 1024   # kilobytes on Linux


def weight_map(root: str) -> dict[str, str]:
    with open(os.path.join(root, INDEX)) as f:
        return json.load(f)["weight_map"]


def holds_experts(header) -> bool:
    return any(".experts." in t for t in header.tensors)


def generic_source(src: str, nbytes: int) -> dict[str, str]:
    """A small V4-Flash checkpoint with two big F8_E4M3 tensors spliced in, one in a shard without
    routed experts and one in a shard with them; returns the big tensors' names -> shard."""
    from requant import synth
    from requant.io.checkpoint import Checkpoint

    synth.write_checkpoint(src, synth.Dims(layers=2, experts=6), seed=1)
    with Checkpoint.open(src) as ck:
        no_experts = next(n for n in ck.shard_names if not holds_experts(ck.headers[n]))
        with_experts = next(n for n in ck.shard_names if holds_experts(ck.headers[n]))
    big = {"engram.0.table": no_experts, "engram.1.table": with_experts}
    for seed, (name, shard) in enumerate(big.items()):
        add_big_tensor(src, shard, name, nbytes, seed)
    return big


def engram_source(src: str, model: str, nbytes: int) -> dict[str, str]:
    """`model`'s own small synthetic checkpoint with every Engram table's weight about `nbytes` (synth
    writes it in bands of rows); returns the tables' tensors (weight and scale) -> shard."""
    from requant import synth
    from requant.io.checkpoint import Checkpoint

    base = synth.Dims(model)
    if "engram_rows" not in base.values:
        raise SystemExit(f"{model} has no Engram tables (its recipe has no engram_rows dimension)")
    rows = -(-nbytes // base.engram_head_dim)   # F8_E4M3: a byte an element
    synth.write_checkpoint(src, synth.dims_with(base, engram_rows=[rows] * len(base.engram_rows)), seed=1)
    with Checkpoint.open(src) as ck:
        # the tables are the tensors with engram_rows rows: each one's weight and its 1x32-block scale
        tables = {name: shard for shard in ck.shard_names for name, info in ck.headers[shard].tensors.items()
                  if info.spec.shape[:1] == (rows,)}
    if len(tables) != 2 * len(base.engram_rows):
        raise SystemExit(f"expected a weight and a scale per Engram table in {src}, found {sorted(tables)}")
    return tables


def build_source(src: str, model: str | None, nbytes: int) -> dict:
    """The source checkpoint (generic or `model`'s own), and what the checks need to know of it."""
    from requant import model as model_lib
    from requant.io.checkpoint import Checkpoint

    big = engram_source(src, model, nbytes) if model else generic_source(src, nbytes)
    with Checkpoint.open(src) as ck:
        specs = {name: ck.headers[shard].tensors[name].spec for name, shard in big.items()}
        # nothing to convert there: an in-place conversion must leave these shards as they are
        untouched = sorted({shard for shard in big.values() if not holds_experts(ck.headers[shard])})
    return {"model": model or model_lib.default_model_name(), "big": big, "untouched": untouched,
            "shared": sorted(set(big.values()) - set(untouched)),
            "specs": {name: {"dtype": s.dtype, "shape": list(s.shape), "bytes": s.nbytes} for name, s in specs.items()},
            "digests": digests(src, list(big))}


def digests(root: str, names: list[str]) -> dict[str, str]:
    shards = weight_map(root)
    return {name: tensor_digest(os.path.join(root, shards[name]), name) for name in names}


def in_own_process(fn, *args):
    """fn(*args) in a fresh interpreter. Linux carries a process's memory high-water mark into every
    child it starts (exec keeps the old address space's peak as the child's maxrss), so wait4's peak
    for a convert child is at least this process's own: this one imports no torch and holds no tensor
    data, or the peaks it measures would be its own (a V4.1 synth here: ~950 MiB)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/requant-rss")
    ap.add_argument("--model", help="a named model with Engram tables (deepseek-v4.1-flash): its own synthetic "
                                    "checkpoint, tables of --gib each (default: generic big tensors in V4-Flash)")
    ap.add_argument("--gib", type=float, default=2.5, help="size of each big tensor (Engram table weight)")
    ap.add_argument("--budget", type=float, default=1.0, help="peak RSS allowed, GiB")
    ap.add_argument("--device-name", default=platform.node() or "host")
    ap.add_argument("--out", help="results JSON (default benchmarks/results/<date>-<device>-passthrough-rss.json)")
    args = ap.parse_args()
    if args.gib <= args.budget:
        raise SystemExit(f"--gib {args.gib} must exceed --budget {args.budget}: the point is a tensor larger than it")
    sys.path.insert(0, ROOT)

    shutil.rmtree(args.workdir, ignore_errors=True)
    src, dst, inplace = (os.path.join(args.workdir, d) for d in ("src", "dst", "inplace"))
    nbytes = int(args.gib * 2**30)
    start = time.perf_counter()
    source = in_own_process(build_source, src, args.model, nbytes)
    source_seconds = time.perf_counter() - start
    big, untouched = source["big"], source["untouched"]
    shutil.copytree(src, inplace)
    kept = {shard: os.stat(os.path.join(inplace, shard)) for shard in untouched}
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # kilobytes on Linux

    rows = {}
    seconds, rss = convert_child(src, dst, "--copy-all")
    rows["copy"] = {"seconds": round(seconds, 2), "peak_rss_mib": round(rss / 2**20, 1)}
    seconds, rss = convert_child(inplace, "--in-place")
    rows["in_place"] = {"seconds": round(seconds, 2), "peak_rss_mib": round(rss / 2**20, 1)}

    def identity(st: os.stat_result) -> tuple[int, int, int]:
        return st.st_ino, st.st_mtime_ns, st.st_size

    left_alone = all(identity(os.stat(os.path.join(inplace, shard))) == identity(kept[shard]) for shard in untouched)
    same = all(in_own_process(digests, root, list(big)) == source["digests"] for root in (dst, inplace))
    budget = args.budget * 2**30
    ok = left_alone and same and all(r["peak_rss_mib"] * 2**20 < budget for r in rows.values())
    summary = {
        "benchmark": "passthrough_rss",
        "date": datetime.date.today().isoformat(),
        "device": args.device_name,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "model": source["model"],
        "source": f"{args.model}'s own synthetic checkpoint, Engram tables resized" if args.model
                  else "synthetic checkpoint with generic big tensors spliced in",
        "big_tensor_bytes": nbytes,
        "big_tensors": big,
        "big_tensor_specs": source["specs"],
        "shards_with_big_tensors_and_experts": source["shared"],
        "budget_mib": args.budget * 1024,
        "source_seconds": round(source_seconds, 2),
        "bench_process_peak_rss_mib": round(parent_peak / 2**20, 1),
        "runs": rows,
        "in_place_untouched_shards": untouched,
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
    print(f"(this process's own peak, a floor under those: {parent_peak / 2**20:,.0f} MiB)")
    for name, spec in source["specs"].items():
        print(f"{name}: {spec['dtype']} {spec['shape']}, {spec['bytes'] / 2**30:.2f} GiB, in {big[name]}")
    print(f"in place, {', '.join(untouched) or 'no shard'} left alone: {left_alone}; big tensors byte-identical: "
          f"{same}; shards with big tensors and experts: {', '.join(source['shared']) or 'none'}; "
          f"budget {args.budget} GiB: {'met' if ok else 'NOT MET'}")
    print(f"wrote {path}")
    shutil.rmtree(args.workdir, ignore_errors=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
