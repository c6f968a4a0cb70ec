"""Benchmark: SIGKILL a conversion's parent mid-shard, at full-size shards; how long until no requant
process remains, and whether `--resume` ends byte-identical to an uninterrupted conversion.

tests/test_kill.py asserts the same on tiny shards in CI. Here a synthetic DeepSeek-V4-Flash
checkpoint of the model's own dimensions (`--layers` layers, by default 1: an embedding shard, a
3.3 GB layer shard, the head and the 3.3 GB MTP shard) is written once under --workdir (`--data`
fills the expert shards with encoded data, by default they are holes: reading them costs no disk,
and the encoders do the same work on zeros), converted once uninterrupted per case (the
reference), then per kill point: converted in a child process that the REQUANT_TEST_FAULT hook
kills with SIGKILL at that durable step (it sends the signal to itself, as the OOM killer would),
the time from the kill until no process of the child's process group or naming its target
remains, then `--resume` and a byte comparison with the reference (README.md and requant.json,
which name the source's path, left out), then `requant verify`.

    python benchmarks/bench_kill.py --workdir /tmp/requant-kill [--formats w4a16,nvfp4] [--modes copy,in-place]
        [--layers 1] [--experts 256] [--workers 2] [--points 2] [--seed 0] [--data]

Smaller shards for a quick run: `--experts 16` (the layer's other tensors stay full size).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

SOURCE_NAMING = ("README.md", "requant.json")
GONE_DEADLINE_S = 60


def tree(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel in SOURCE_NAMING:
                continue
            h = hashlib.sha256()
            with open(os.path.join(root, name), "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            out[rel] = h.hexdigest()
    return out


def survivors(group: int, marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] not in (b"Z", b"X") and (int(fields[2]) == group or marker.encode() in cmdline):
            found.append(int(entry))
    return found


def requant(*args: str, env: dict | None = None, group: bool = False, log: str | None = None) -> subprocess.Popen:
    with open(log or os.devnull, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "requant", *args], env=env, start_new_session=group,
                                stdout=subprocess.DEVNULL if log is None else err, stderr=err)


def run(*args: str) -> tuple[int, str, float]:
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "requant", *args], capture_output=True, text=True)
    return p.returncode, (p.stdout + p.stderr).strip(), time.perf_counter() - start


def convert_args(src: str, target: str, fmt: str, in_place: bool, workers: int, sparse: bool) -> list[str]:
    # Holes make all-zero norms, which give NVFP4's data-free input_scale bound nothing to go on.
    return ["convert", *([target, "--in-place"] if in_place else [src, target]), "--out", fmt, "--workers",
            str(workers), "--quiet", *(["--device", "cpu"] if fmt == "w4a16" else []),
            *(["--input-scale", "1.0"] if fmt == "nvfp4" and sparse else [])]


def count_steps(args: list[str]) -> tuple[int, float]:
    """Durable steps of an uninterrupted run (the hook counts them in the child; reported on exit)."""
    code = ("import atexit, os, sys\nfrom requant.io import fsutil\n"
            "atexit.register(lambda: print('STEPS', fsutil._fault_steps, file=sys.stderr))\n"
            "from requant.cli import main\nsys.argv = ['requant'] + sys.argv[1:]\nmain()\n")
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env={**os.environ, "REQUANT_TEST_FAULT": f"kill@{10**9}"})
    seconds = time.perf_counter() - start
    if p.returncode:
        sys.exit(f"reference conversion failed: {p.stderr.strip()}")
    return int(re.search(r"STEPS (\d+)", p.stderr).group(1)), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/requant-kill")
    ap.add_argument("--formats", default="w4a16,nvfp4")
    ap.add_argument("--modes", default="copy,in-place")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, help="routed experts per layer (default: the model's 256)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--points", type=int, default=2, help="kill points per case, drawn from the middle half")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", action="store_true", help="encoded data in the expert shards (default: holes)")
    args = ap.parse_args()

    from requant import synth

    overrides = {"layers": args.layers, **({"experts": args.experts} if args.experts else {})}
    dims = synth.Dims(full_scale=True, **overrides)
    src = os.path.join(args.workdir, "src-" + "-".join(f"{k}{v}" for k, v in overrides.items())
                       + ("-data" if args.data else ""))
    if not os.path.exists(os.path.join(src, "config.json")):
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a full-scale synthetic checkpoint ({overrides})...", flush=True)
        synth.write_checkpoint(src, dims, seed=0, sparse=not args.data)
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    sizes = [os.path.getsize(os.path.join(src, s)) for s in shards]
    print(f"source {src}: {len(shards)} shards, largest {max(sizes) / 2**30:.2f} GiB, "
          f"{sum(sizes) / 2**30:.2f} GiB in all; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)

    rng = random.Random(args.seed)
    rows = []
    for fmt in args.formats.split(","):
        for mode in args.modes.split(","):
            in_place = mode == "in-place"
            ref = os.path.join(args.workdir, f"ref-{fmt}-{mode}")
            shutil.rmtree(ref, ignore_errors=True)
            if in_place:
                shutil.copytree(src, ref)
            steps, seconds = count_steps(convert_args(src, ref, fmt, in_place, args.workers, not args.data))
            expected = tree(ref)
            shutil.rmtree(ref)
            print(f"\n{fmt} {mode}: uninterrupted {seconds:.1f} s, {steps} durable steps", flush=True)
            for step in sorted(rng.sample(range(steps // 4, 3 * steps // 4 + 1), min(args.points, steps // 2 + 1))):
                target = os.path.join(args.workdir, f"kill-{fmt}-{mode}-{step}")
                shutil.rmtree(target, ignore_errors=True)
                if in_place:
                    shutil.copytree(src, target)
                cmd = convert_args(src, target, fmt, in_place, args.workers, not args.data)
                start = time.perf_counter()
                p = requant(*cmd, env={**os.environ, "REQUANT_TEST_FAULT": f"kill@{step}"}, group=True)
                p.wait()
                killed = time.perf_counter()
                others = survivors(p.pid, target)
                peak = len(others)
                while others and time.perf_counter() - killed < GONE_DEADLINE_S:
                    time.sleep(0.01)
                    others = survivors(p.pid, target)
                gone = time.perf_counter() - killed
                for pid in others:   # never left behind by the benchmark itself
                    os.kill(pid, signal.SIGKILL)
                code, out, resume_s = run(*cmd, "--resume")
                same = code == 0 and tree(target) == expected
                vcode, vout, _ = run("verify", target, "--quiet") if code == 0 else (1, "", 0.0)
                took_over = re.search(r"taking over the lock of requant PID (\d+)", out)
                lock = f"took over the lock of PID {took_over.group(1)}" if took_over else "no takeover line"
                print(f"  kill@{step}: parent ran {killed - start:.1f} s, exit {p.returncode}; "
                      f"{peak} processes left at the kill, none after {gone:.2f} s"
                      + (f" ({len(others)} STILL ALIVE, killed)" if others else "")
                      + f"; resume {lock}, "
                      f"exit {code} in {resume_s:.1f} s, {'byte-identical' if same else 'DIFFERS'}, "
                      f"verify {'OK' if vcode == 0 else 'FAILED'}", flush=True)
                if code:
                    print(f"    {out.splitlines()[-1] if out else ''}")
                else:
                    print(f"    {[x for x in out.splitlines() if x.startswith('converted')][-1]}")
                rows.append((fmt, mode, step, gone, bool(others), same and vcode == 0))
                shutil.rmtree(target, ignore_errors=True)
    print(f"\n{'case':<20}{'step':>6}{'gone after s':>14}{'resume':>10}")
    for fmt, mode, step, gone, left, ok in rows:
        print(f"{fmt + ' ' + mode:<20}{step:>6}{gone:>14.2f}{'ok' if ok else 'FAILED':>10}"
              + ("  processes were left" if left else ""))
    if any(left or not ok for *_, left, ok in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
