"""Benchmark: `requant verify --deep` on the NVFP4 and the W4A16 output of one checkpoint, side by side.

Writes (once) a synthetic DeepSeek-V4-Flash checkpoint (default 64 experts, hidden 1024,
intermediate 512; full-size runs take --hidden 4096 --intermediate 2048 --experts 256) and its
NVFP4 and W4A16 conversions, then, round by round and in alternating order, times in a child
process each:
- `requant verify` (headers, structure, scale checks, engine rules: no weight decoded);
- `requant verify --deep` (every expert decoded on a worker pool besides);
- with --source, `requant verify --deep --source SRC` (each block compared with the source's).
Each step's wall time and its CPU time (user + sys of the child and its workers) are recorded;
the table gives the median over rounds and the NVFP4 / W4A16 ratio of each step, in one run.

    python3 benchmarks/bench_verify_deep.py --workdir /tmp/bench-verify [--rounds 3] [--source]

Writes benchmarks/results/<date>-<device>-verify-deep.json (--out to choose) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FORMATS = ("nvfp4", "w4a16")


def requant(*args: str) -> list[str]:
    return [sys.executable, "-m", "requant", *args]


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child and the processes it waited for) of one command,
    which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def prepare(workdir: str, dims: list[str]) -> tuple[str, dict[str, str]]:
    src = os.path.join(workdir, "src")
    if not os.path.exists(src):
        print(f"synth {src} {' '.join(dims)}", flush=True)
        timed(requant("synth", src, "--quiet", *dims))
    outs = {}
    for fmt in FORMATS:
        outs[fmt] = os.path.join(workdir, fmt)
        if not os.path.exists(outs[fmt]):
            print(f"convert {src} -> {outs[fmt]}", flush=True)
            timed(requant("convert", src, outs[fmt], "--out", fmt, "--quiet"))
    return src, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="where the checkpoints are written (and reused)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None, help="synth's default when left out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--source", action="store_true", help="also time --deep --source against the source")
    ap.add_argument("--device-name", default=platform.node() or "host")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dims = ["--experts", str(args.experts), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
    if args.layers:
        dims += ["--layers", str(args.layers)]
    os.makedirs(args.workdir, exist_ok=True)
    src, outs = prepare(args.workdir, dims)

    steps = {"verify": [], "verify --deep": ["--deep"]}
    if args.source:
        steps["verify --deep --source"] = ["--deep", "--source", src]
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {s: {f: [] for f in FORMATS} for s in steps}
    for r in range(args.rounds):
        order = FORMATS if r % 2 == 0 else FORMATS[::-1]
        for step, extra in steps.items():
            for fmt in order:
                wall, cpu = timed(requant("verify", outs[fmt], "--quiet", "--json", *extra))
                runs[step][fmt].append((wall, cpu))
                print(f"round {r + 1}: {step:<24} {fmt:<6} {wall:7.2f} s wall, {cpu:7.2f} s CPU", flush=True)

    table = {}
    for step in steps:
        med = {f: (statistics.median(w for w, _ in runs[step][f]), statistics.median(c for _, c in runs[step][f]))
               for f in FORMATS}
        table[step] = {**{f: {"wall_s": med[f][0], "cpu_s": med[f][1]} for f in FORMATS},
                       "ratio_wall": med["nvfp4"][0] / med["w4a16"][0], "ratio_cpu": med["nvfp4"][1] / med["w4a16"][1]}
    print(f"\n{'step':<24} {'NVFP4 s':>9} {'W4A16 s':>9} {'ratio':>6}   {'CPU s NVFP4':>11} {'W4A16':>7} {'ratio':>6}")
    for step, row in table.items():
        print(f"{step:<24} {row['nvfp4']['wall_s']:9.2f} {row['w4a16']['wall_s']:9.2f} {row['ratio_wall']:6.2f}   "
              f"{row['nvfp4']['cpu_s']:11.2f} {row['w4a16']['cpu_s']:7.2f} {row['ratio_cpu']:6.2f}")

    result = {"benchmark": "verify-deep", "date": datetime.date.today().isoformat(), "device": args.device_name,
              "cpus": os.cpu_count(), "checkpoint": {"model": "deepseek-v4-flash", "dims": dims},
              "rounds": args.rounds, "medians": table,
              "runs": {s: {f: [{"wall_s": w, "cpu_s": c} for w, c in v] for f, v in fs.items()} for s, fs in runs.items()}}
    out = args.out or os.path.join(HERE, "results", f"{result['date']}-{args.device_name}-verify-deep.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
