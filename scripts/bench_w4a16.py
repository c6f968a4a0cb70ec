"""W4A16 accuracy and speed on synthetic experts at DeepSeek-V4-Flash size.

For each group size and scheme: SQNR vs the dequantized MXFP4 source, per tensor and overall,
for requant's encoder and, on the same tensors, compressed-tensors' own quantizer (its
calculate_qparams / quantize / dequantize with a symmetric int4 group scheme: scale = amax / 7.5,
stored as BF16). Speed: seconds per expert projection, extrapolated to a layer shard
(256 experts x 3 projections) and compared with the NVFP4 cast of the same tensors.

    python scripts/bench_w4a16.py [--experts 2] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams

from requant import synth
from requant.formats import int4, mxfp4, nvfp4

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=2, help="experts to encode (3 projections each)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    values = synth._Values(a.seed, synth.HardCases())
    tensors = [(f"e{e}.{p}", *(t.view(torch.uint8) for t in values.expert(*shape, pooled=False)))
               for e in range(a.experts) for p, shape in PROJ_SHAPES.items()]
    sources = [mxfp4.decode(w, s) for _, w, s in tensors]
    signals = [float(x.double().square().sum()) for x in sources]
    print(f"{len(tensors)} tensors ({a.experts} experts x 3 projections), hidden {HIDDEN}, "
          f"intermediate {INTER}, torch threads {torch.get_num_threads()}")

    start = time.perf_counter()
    for _, w, s in tensors:
        k_max = mxfp4.max_exponent(s.numpy())
        nvfp4.cast_from_mxfp4(w.numpy(), s.numpy(), k_max)
    nv = (time.perf_counter() - start) / len(tensors)

    print("| group | scheme | requant SQNR dB | compressed-tensors SQNR dB | gain dB | worst tensor dB |"
          " s / tensor | s / layer (768) | vs NVFP4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for group in int4.GROUP_SIZES:
        ct_err = [compressed_tensors_error(x, group) for x in sources]
        for scheme in int4.SCHEMES:
            start = time.perf_counter()
            encs = [int4.encode_mxfp4(w, s, group, scheme) for _, w, s in tensors]
            per = (time.perf_counter() - start) / len(tensors)
            ours = db(sum(signals), sum(e.error_energy for e in encs))
            ct = db(sum(signals), sum(ct_err))
            worst = min(db(sig, e.error_energy) for sig, e in zip(signals, encs))
            print(f"| {group} | {scheme} | {ours:.2f} | {ct:.2f} | {ours - ct:+.2f} | {worst:.2f} |"
                  f" {per:.3f} | {per * 768:.0f} | {per / nv:.0f}x |")
    print(f"NVFP4 cast of the same tensors: {nv * 1000:.1f} ms / tensor, {nv * 768:.1f} s / layer")


if __name__ == "__main__":
    main()
