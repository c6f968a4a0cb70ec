"""Time `requant validate` on one full-size DeepSeek-V4-Flash MoE layer in every serving mode.

Writes a one-layer synthetic checkpoint at the release's expert dimensions (256 experts, hidden
4096, intermediate 2048: 3.2 GB of MXFP4 experts), converts it to NVFP4, then times validate of
that layer (64 tokens) once per serving mode and once with all modes and --activations (so the
calibrated input_scale policy runs too), each on a warm kernel cache (a first untimed run
compiles the kernels). Prints the served-numerics table of the last run.

    python3 benchmarks/bench_serving.py [--work DIR] [--small] [--device cuda|cpu] [--out DIR]

--small uses the default synthetic dimensions (a CPU smoke test of this script). The timings go to
`<out>/<YYYY-MM-DD>-<device>-serving.json` (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from requant import synth  # noqa: E402
from requant.kernels._details.device import config_name  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None, help="Directory for the checkpoints (default: a temporary one).")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from requant.convert import convert
    from requant.io.checkpoint import Checkpoint
    from requant.targets import Options
    from requant.validate import format_table, hidden_states, validate

    work = args.work or tempfile.mkdtemp(prefix="bench_serving_")
    src, dst = os.path.join(work, "src"), os.path.join(work, "nvfp4")
    dims = synth.Dims(layers=1, hash_layers=0, mtp_layers=0) if args.small else synth.Dims(
        layers=1, experts=256, hidden=4096, intermediate=2048, hash_layers=0, mtp_layers=0)
    t0 = time.perf_counter()
    synth.write_checkpoint(src, dims, seed=0)
    t_synth = time.perf_counter() - t0
    t0 = time.perf_counter()
    convert(src, dst, "nvfp4", Options(), workers=min(8, os.cpu_count() or 1), progress=False)
    t_convert = time.perf_counter() - t0
    print(f"synth {t_synth:.1f} s, convert {t_convert:.1f} s ({dims})", flush=True)

    acts = os.path.join(work, "acts.safetensors")
    with Checkpoint.open(src) as ck:
        save_file({"hidden_states": hidden_states(ck, "layers.0", args.tokens,
                                                  torch.Generator().manual_seed(1)).float()}, acts)

    runs = [("nvfp4-w4a4",), ("marlin-w4a16",), ("bf16",)]
    validate(src, dst, layers="0", tokens=args.tokens, device=args.device, progress=False,
             serve_modes=["nvfp4-w4a4", "marlin-w4a16", "bf16"])   # compiles every kernel variant
    timings = []
    for modes in runs:
        t0 = time.perf_counter()
        validate(src, dst, layers="0", tokens=args.tokens, device=args.device, progress=False, serve_modes=list(modes))
        timings.append({"modes": list(modes), "activations": False, "seconds": time.perf_counter() - t0})
        print(f"validate --serve {','.join(modes)}: {timings[-1]['seconds']:.2f} s", flush=True)
    t0 = time.perf_counter()
    result = validate(src, dst, layers="0", tokens=args.tokens, device=args.device, progress=False,
                      serve_modes=["nvfp4-w4a4", "marlin-w4a16", "bf16"], activations=acts)
    timings.append({"modes": "all", "activations": True, "seconds": time.perf_counter() - t0})
    print(f"validate --serve all --activations: {timings[-1]['seconds']:.2f} s", flush=True)
    print(format_table(result))
    name = config_name(torch.cuda.get_device_name()) if args.device.startswith("cuda") else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{date}-{name}-serving.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "benchmarks/bench_serving.py", "date": date, "device": name, "dims": str(dims),
                   "synth_s": t_synth, "convert_s": t_convert, "timings": timings, "result": result.to_dict()},
                  f, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
