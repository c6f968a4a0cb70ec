"""Run requant's fused-MoE kernel a few times on one DeepSeek-V4-Flash routed-expert layer, for a
profiler to look at (GPU only). bench_moe.py times; this only runs, so that Nsight Compute's
per-kernel replay sees the same launches the benchmark times:

    ncu --clock-control none -k regex:moe_gemm --launch-skip 2 --launch-count 2 --set full \
        -o prof python3 benchmarks/profile_moe.py --format nvfp4 --tokens 1

Each iteration is one `fused_moe` call with the config it picks for the batch on this device (weights in the
kernel's layout, made once); --iters calls in all.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import bench_moe  # noqa: E402
from requant.kernels import fused_moe as fm  # noqa: E402
from requant.kernels._details import configs  # noqa: E402
from requant.kernels._details.device import device_config_name  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "int4", "mxfp4"])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, I = bench_moe.H, bench_moe.I
    w1, w3, w2 = (fm.kernel_weights(bench_moe.random_weights(args.format, n, k, gen))
                  for n, k in ((I, H), (I, H), (H, I)))
    ids, rw = bench_moe.routing(args.tokens)
    x = torch.randn(args.tokens, H, generator=gen, device="cuda").bfloat16()
    cfg = configs.launch_config(bench_moe.problem(args.format), args.tokens, device_config_name(x.device))
    print(f"{args.format} {args.tokens} tokens: {cfg}", flush=True)
    for _ in range(args.iters):
        fm.fused_moe(x, ids, rw, w1, w3, w2, activation=bench_moe.SWIGLU, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
