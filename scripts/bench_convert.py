"""Benchmark: converting one full-size DeepSeek-V4-Flash layer shard vs copying it.

Writes (once) a full-scale synthetic checkpoint whose one layer shard holds real data (the rest are
holes), then times, alternating on the same disk: `cp` of that shard (+ fsync, as requant fsyncs),
`requant`'s conversion of it with 1 and 2 workers (in a child process under /usr/bin/time -v, for
peak RSS), the same with 2 workers writing through the page cache (as before direct writes), and
ModelOpt's reference cast on a few experts, extrapolated to the shard. With --cache cold (the
default) the shard is dropped from the page cache before every run (posix_fadvise DONTNEED on
that file: no root needed, other processes' caches untouched). The load average is printed with
each run: the machine may be shared.

    python scripts/bench_convert.py --workdir /tmp/requant-bench [--cache cold|warm]
    python scripts/bench_convert.py --src CHECKPOINT --shard-index 1   # a layer shard of another one
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

SHARD_INDEX = 4  # layers.3: a bias-routed layer with the ratio-128 compressor
REQUANT = {"requant w=1": (1, True), "requant w=2": (2, True),   # label: workers, direct writes
           "requant w=2 cached": (2, False)}                     # every write through the page cache

CHILD = """
import os, sys, time
from tqdm import tqdm
from requant.io.checkpoint import Checkpoint
from requant.plan import make_plan
from requant.convert import write_shard
from requant.targets import Options
from requant.workers import Encoders
from requant.io import safetensors
src, dst, index, workers, direct = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
if not direct:
    safetensors.DIRECT_MIN_BYTES = 1 << 62   # every write through the page cache
plan = make_plan(Checkpoint.open(src), "nvfp4", Options())
start = time.perf_counter()
shard = plan.shards[index]
entry = {"size": os.path.getsize(plan.source.shard_path(shard.name)), "mtime_ns": None}  # as the journal records it
with tqdm(disable=True) as bar, Encoders.for_plan(plan, workers) as encoders:
    stats = write_shard(plan, shard, dst, encoders, bar, entry)
print(f"SECONDS {time.perf_counter() - start:.3f} EXACT {stats.exact_blocks} BLOCKS {stats.blocks}")
"""


def timed(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - start, out.stdout + out.stderr


def copy_with_fsync(src: str, dst: str) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", src, dst], check=True)
    fd = os.open(dst, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def reference_seconds_per_expert(src_dir: str, experts: int, shard_index: int) -> float:
    import torch
    from modelopt.torch.export.shard_cast_utils import build_w13_kmax_overrides, quantize_mxfp4_to_nvfp4_lossless
    from requant.io.checkpoint import Checkpoint

    ck = Checkpoint.open(src_dir)
    block = f"layers.{shard_index - 1}.ffn.experts"   # shard 0 holds the embedding
    start = time.perf_counter()
    for e in range(experts):
        bases = [f"{block}.{e}.{p}" for p in ("w1", "w3", "w2")]
        kmax = build_w13_kmax_overrides(bases[:2], lambda b: ck.tensor(f"{b}.scale"), "cpu")
        from requant.formats import mxfp4
        kmax[bases[2]] = mxfp4.max_exponent(ck.tensor(f"{bases[2]}.scale").view(torch.uint8).numpy())
        for b in bases:
            quantize_mxfp4_to_nvfp4_lossless(ck.tensor(f"{b}.weight"), ck.tensor(f"{b}.scale"), kmax[b], "cpu")
    return (time.perf_counter() - start) / experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/requant-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reference-experts", type=int, default=2, help="0: skip ModelOpt's reference cast")
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold")
    ap.add_argument("--src", help="an existing synthetic checkpoint (default: write one under --workdir)")
    ap.add_argument("--shard-index", type=int, default=SHARD_INDEX, help="its layer shard to convert")
    args = ap.parse_args()

    from requant import synth

    src = args.src or os.path.join(args.workdir, "src")
    if not os.path.exists(os.path.join(src, "config.json")):
        shutil.rmtree(src, ignore_errors=True)
        print("writing a full-scale synthetic checkpoint (one layer shard with data)...", flush=True)
        synth.write_checkpoint(src, synth.Dims(full_scale=True), seed=0, data_shards={SHARD_INDEX})
    name = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[args.shard_index]
    shard = os.path.join(src, name)
    size = os.path.getsize(shard)
    out = os.path.join(args.workdir, "out")
    os.makedirs(out, exist_ok=True)
    subprocess.run(["cat", shard], stdout=subprocess.DEVNULL, check=True)  # same warm cache for all

    def drop_from_cache(path):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    rows = {"cp": [], **{label: [] for label in REQUANT}}
    rss = {}
    exact = ""

    def run(label):
        nonlocal exact
        if args.cache == "cold":
            drop_from_cache(shard)
        if label == "cp":
            rows["cp"].append(copy_with_fsync(shard, os.path.join(out, "copy.safetensors")))
            print(f"cp: {rows['cp'][-1]:.2f} s  (load {os.getloadavg()[0]:.1f})", flush=True)
            os.remove(os.path.join(out, "copy.safetensors"))
        else:
            workers, direct = REQUANT[label]
            cmd = ["/usr/bin/time", "-v", sys.executable, "-c", CHILD, src, out, str(args.shard_index), str(workers),
                   str(int(direct))]
            _, log = timed(cmd)
            rows[label].append(float(re.search(r"SECONDS ([\d.]+)", log).group(1)))
            print(f"{label}: {rows[label][-1]:.2f} s  (load {os.getloadavg()[0]:.1f})", flush=True)
            rss[label] = max(rss.get(label, 0),
                             int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1)))
            exact = re.search(r"EXACT (\d+) BLOCKS (\d+)", log).groups()
            os.remove(os.path.join(out, name))
        os.sync()       # the deleted output's writeback and discards must not land on the next run
        time.sleep(2)

    labels = list(rows)
    for r in range(args.rounds):   # rotate the order so no method always runs first
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            run(label)

    experts = synth.Dims(full_scale=True).experts
    cp_time = statistics.median(rows["cp"])
    print(f"\nshard {name}: {size / 2**30:.2f} GiB ({args.cache} page cache), {experts} experts x 3 projections; "
          f"exact blocks {int(exact[0]):,} / {int(exact[1]):,}")
    print(f"{'method':<20}{'median s':>10}{'GiB/s':>8}{'x cp':>7}{'peak RSS MiB':>14}")
    for label, times in rows.items():
        t = statistics.median(times)
        print(f"{label:<20}{t:>10.2f}{size / t / 2**30:>8.2f}{t / cp_time:>7.2f}"
              f"{rss[label] / 1024 if label in rss else float('nan'):>14.0f}")
    if not args.reference_experts:
        return
    ref = reference_seconds_per_expert(src, args.reference_experts, args.shard_index)
    best = min(statistics.median(rows["requant w=1"]), statistics.median(rows["requant w=2"]))
    print(f"ModelOpt reference: {ref:.2f} s per expert ({args.reference_experts} timed) -> "
          f"{ref * experts:.0f} s per shard, {ref * experts / best:.0f}x requant's best")


if __name__ == "__main__":
    main()
