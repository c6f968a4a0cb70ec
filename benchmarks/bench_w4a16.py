"""W4A16 accuracy and speed on synthetic experts at DeepSeek-V4-Flash size.

For each group size and scheme, on the same projections (4096x2048 / 2048x4096 MXFP4 from
requant.synth): SQNR vs the dequantized MXFP4 source of requant's default (coarse-to-fine) search,
of its exhaustive search (the exact optimum, kept as the test oracle) and of compressed-tensors'
own quantizer (calculate_qparams / quantize / dequantize, symmetric int4 groups: scale = amax / 7.5,
stored as BF16); seconds per projection of each search; the NVFP4 cast of the same projections.
Times are the best of --repeat runs per projection (the machine may be busy); the exhaustive
search runs once. --baseline FILE also times another int4.py (e.g. an older encoder:
`git show 519ff3a:requant/formats/int4.py > old_int4.py`).

    python benchmarks/bench_w4a16.py [--experts 1] [--threads N] [--repeat 3] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams

from requant import synth
from requant.formats import int4, int4_search, mxfp4, nvfp4

HIDDEN, INTER = 4096, 2048
PROJ_SHAPES = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}


def db(signal: float, error: float) -> float:
    return 10 * math.log10(signal / error)


def compressed_tensors_error(x: torch.Tensor, group: int) -> float:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    g = x.view(x.shape[0], -1, group)
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
    scale = scale.to(torch.bfloat16)
    q = quantize(x, scale, zero, args, dtype=torch.int8)
    return float((dequantize(q, scale, zero, args).double() - x).square().sum())


def timed(fn, repeat: int):
    """(result, best time in seconds of `repeat` runs)."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("baseline_int4", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=1, help="experts to encode (3 projections each)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per projection for the timed paths")
    ap.add_argument("--baseline", help="another int4.py to time and score on the same projections")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    baseline = load_module(a.baseline) if a.baseline else None
    values = synth._Values(a.seed, synth.HardCases())
    tensors = [(f"e{e}.{p}", *(t.view(torch.uint8) for t in values.expert(*shape, pooled=False)))
               for e in range(a.experts) for p, shape in PROJ_SHAPES.items()]
    sources = [mxfp4.decode(w, s) for _, w, s in tensors]
    signals = [float(x.double().square().sum()) for x in sources]
    n = len(tensors)
    print(f"{n} projections ({a.experts} experts x 3), hidden {HIDDEN}, intermediate {INTER}, "
          f"torch threads {torch.get_num_threads()}, best of {a.repeat} runs")

    nv = sum(timed(lambda: nvfp4.cast_from_mxfp4(w.numpy(), s.numpy(), mxfp4.max_exponent(s.numpy())), a.repeat)[1]
             for _, w, s in tensors) / n

    cols = ["group", "scheme", "SQNR fast dB", "SQNR exhaustive dB", "fast loss dB", "compressed-tensors dB"]
    cols += ["baseline s", "baseline dB"] if baseline else []
    cols += ["exhaustive s", "fast s"] + (["baseline / fast"] if baseline else [])
    cols += ["exhaustive / fast", "fast / NVFP4", "fast s / layer (768)"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for group in int4.GROUP_SIZES:
        ct = db(sum(signals), sum(compressed_tensors_error(x, group) for x in sources))
        for scheme in int4.SCHEMES:
            runs = {}
            for name, encode, repeat in (
                    ("fast", lambda w, s: int4_search.encode_mxfp4(w, s, group, scheme), a.repeat),
                    ("exhaustive", lambda w, s: int4_search.encode_mxfp4(w, s, group, scheme, exhaustive=True), 1),
                    ("baseline", baseline and (lambda w, s: baseline.encode_mxfp4(w, s, group, scheme)), 1)):
                if encode:
                    done = [timed(lambda: encode(w, s), repeat) for _, w, s in tensors]
                    runs[name] = (db(sum(signals), sum(e.error_energy for e, _ in done)), sum(t for _, t in done) / n)
            (fast_db, fast_s), (ex_db, ex_s) = runs["fast"], runs["exhaustive"]
            row = [group, scheme, f"{fast_db:.3f}", f"{ex_db:.3f}", f"{fast_db - ex_db:+.4f}", f"{ct:.2f}"]
            row += [f"{runs['baseline'][1]:.3f}", f"{runs['baseline'][0]:.3f}"] if baseline else []
            row += [f"{ex_s:.3f}", f"{fast_s:.3f}"] + ([f"{runs['baseline'][1] / fast_s:.1f}x"] if baseline else [])
            row += [f"{ex_s / fast_s:.1f}x", f"{fast_s / nv:.0f}x", f"{fast_s * 768:.0f} s"]
            print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    print(f"NVFP4 cast of the same projections: {nv * 1000:.1f} ms / projection, {nv * 768:.1f} s / layer")


if __name__ == "__main__":
    main()
