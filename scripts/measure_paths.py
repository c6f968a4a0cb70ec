"""Measure every serving path (requant.engines.serve_paths.compare_paths) on a synthetic full-size MoE layer, on
the CPU, and write the per-path errors as JSON.

    python3 scripts/measure_paths.py OUT.json [--model deepseek-v4-flash] [--tokens 16]
                                     [--experts 32] [--layers 1] [--seed 0] [--keep DIR]

A synthetic checkpoint of the named model at full scale, with only the first --layers layers
(requant.synth: MXFP4 experts whose block exponents spread as a trained model's do, an FP8 shared
expert, the real router shapes), is written to a temporary directory (--keep DIR keeps it there),
then compare_paths runs on its first --layers MoE layers with --tokens random hidden states
(DeepSeek-V4's first layers are hash-routed: random token ids choose their experts). --experts N computes only the N experts those tokens choose most, in every path alike
(a full-size expert took ~1.5 s on 2 cores: decoded, cast to NVFP4, encoded to INT4 twice).
Synthetic weights are not a trained model's: the numbers show the paths' relative order and
magnitude, not a model's accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from requant import synth  # noqa: E402
from requant.engines.serve_paths import compare_paths  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--experts", type=int, default=32, help="experts computed (0: every one the tokens choose)")
    ap.add_argument("--layers", type=int, default=1, help="MoE layers measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="write the synthetic checkpoint here and keep it")
    args = ap.parse_args(argv)

    base = synth.Dims(args.model, full_scale=True)
    dims = synth.dims_with(base, layers=args.layers)
    where = args.keep or tempfile.mkdtemp(prefix="measure_paths-")
    try:
        t0 = time.monotonic()
        if not os.path.exists(os.path.join(where, "config.json")):
            synth.write_checkpoint(where, dims, seed=args.seed)
        written = time.monotonic() - t0
        layers = [f"layers.{i}" for i in range(args.layers)]   # DeepSeek-V4's first are hash-routed: random token ids
        result = compare_paths(where, layers, tokens=args.tokens, experts=args.experts or None, seed=args.seed)
    finally:
        if not args.keep:
            shutil.rmtree(where, ignore_errors=True)
    result["synthetic"] = {"model": args.model, "dims": {k: v for k, v in dims.values.items()
                                                         if isinstance(v, (int, float, str))},
                           "write_seconds": written, "cpu_cores": os.cpu_count()}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"{'path':30s} {'SQNR dB':>9s} {'rel err':>10s} {'routed SQNR':>12s} {'routed rel':>11s}")
    for name, r in result["overall"]["results"].items():
        db = "inf" if r["sqnr_db"] is None else f"{r['sqnr_db']:.2f}"
        rdb = "inf" if r["routed_sqnr_db"] is None else f"{r['routed_sqnr_db']:.2f}"
        print(f"{name:30s} {db:>9s} {r['rel_err']:10.3e} {rdb:>12s} {r['routed_rel_err']:11.3e}")
    c = result["overall"]["closest_inexact"]
    print(f"closest inexact: {c['path']}, next {c['next']} ({c['margin_db']:.2f} dB behind); "
          f"{result['seconds']:.1f} s for compare_paths, {written:.1f} s to write the checkpoint -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
