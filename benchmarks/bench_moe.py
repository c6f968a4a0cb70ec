"""Benchmark requant's fused-MoE kernel on one DeepSeek-V4-Flash routed-expert layer (GPU only).

hidden 4096, intermediate 2048, 256 experts, top-6, uniform random routing (other shapes with
--hidden/--intermediate/--experts/--top-k, e.g. gpt-oss-120b's 2880/2880/128/4). One run checks the
kernel against the torch reference (every format, at decode and prefill sizes, gpt-oss's activation
with biases, NVFP4 as a W4A4 engine runs it), measures the device's copy bandwidth and a BF16
grouped-GEMM baseline, then times the kernel over the token counts with the configs `fused_moe`
picks (`requant/kernels/_details/configs.py`) and prints a table. The results go to
`<out>/<YYYY-MM-DD>-<device>.json` (default out: benchmarks/results).

    python3 benchmarks/bench_moe.py [--tokens 1,4,...] [--formats nvfp4,int4,mxfp4] [--tune]
                                    [--compare-with OLD/fused_moe.py] [--hidden H --intermediate I ...]

Formats: nvfp4, int4 (groups of 128), int4-g32, mxfp4 (and int4-asym in the checks).

--tune times the candidates of `tune_configs` for every format and token count instead (no checks),
and merges the fastest of each into the device's launch-config file
(requant/kernels/configs/<device>.json, or --config-out), which later runs and `fused_moe` read.

--compare-with times another version of the kernel module (say, the previous commit's) on the same
inputs in the same run, with its own default configs, so that a change is judged against noise
from one device, not across runs, and says whether its output is bitwise the same as this one's.
--compare-formats picks its formats (default --formats); a "-fp16" suffix passes
compute_dtype=torch.float16, for modules that had NVFP4's FP16 route.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from requant.formats import mxfp4, nvfp4  # noqa: E402
from requant.engines.numerics import fake_quantize_activations  # noqa: E402
from requant.kernels import fused_moe as fm  # noqa: E402
from requant.kernels._details import configs  # noqa: E402
from requant.kernels._details.device import config_name  # noqa: E402
from requant.kernels._details.launch import launch  # noqa: E402
from requant.moe import Activation, routed_experts  # noqa: E402

E, H, I, TOP_K, LIMIT = 256, 4096, 2048, 6, 10.0  # main() may change the shape
SWIGLU = Activation("swiglu_clamp", LIMIT)
OAI = Activation("swiglu_oai", 7.0, 1.702)  # gpt-oss's, checked with biases
FORMAT_GROUPS = {"nvfp4": ("nvfp4", 16), "mxfp4": ("mxfp4", 32), "int4": ("w4a16", 128), "int4-g32": ("w4a16", 32),
                 "int4-asym": ("w4a16", 128)}


def problem(fmt: str) -> configs.Problem:
    """The launch-config key of a benchmark format on this run's shape (INT4's group: `random_weights`)."""
    name, group = FORMAT_GROUPS[fmt]
    if name == "w4a16" and H % 128:
        group = 32
    return configs.Problem(name, group, E, H, I, TOP_K)


def tune_configs(tokens: int, kernel_code: int) -> list[fm.KernelConfig]:
    """Candidates around the built-in config for this batch (`configs.default_config`): split-K
    depth, pipeline depth and the down GEMM's rows at decode sizes; M/N tiles and stages at prefill
    sizes. N tiles are 16 rows per warp, the shape `_decode.mma_tile` keeps in registers; configs
    that ran out of shared memory or lost everywhere on the H200 are left out (docs/kernel-notes.md)."""
    base = configs.default_config(tokens * TOP_K, E, kernel_code)
    if tokens * TOP_K / E <= 16:
        down = base.down or base
        out = [base]
        for split in (1, 2):
            for stages in (3, 4):
                d = dataclasses.replace(down, split_k=split, num_stages=stages)
                out.append(dataclasses.replace(base, split_k=split, num_stages=stages, down=d))
        out.append(dataclasses.replace(base, down=None))  # the down GEMM in 64-row programs
        return list(dict.fromkeys(out))
    return list(dict.fromkeys([base, fm.KernelConfig(128, 128, 128, 8, 3), fm.KernelConfig(128, 128, 128, 8, 4),
                               fm.KernelConfig(64, 128, 128, 8, 4), fm.KernelConfig(32, 64, 128, 4, 4)]))


def graph_time(fn, rep: int = 200) -> float:
    """Median ms of CUDA-graph replays of fn. do_bench_cudagraph first calls fn on a stream of its
    own, which does not wait for the default stream, so the device is synchronized first: else that
    call can read inputs made just before it unfinished (at 4096 tokens: garbage routing, and a
    device-side assert in torch's align, after the previous format's weights were laid out)."""
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def random_weights(fmt: str, n: int, k: int, gen: torch.Generator) -> fm.ExpertWeights:
    """Random codes with scales that keep gate/up values around the SwiGLU limit."""
    dev = "cuda"
    # INT4's group: 128, or 32 for K off whole 128s (gpt-oss's 2880) and "int4-g32" (requant's W4A16 default)
    group = 128 if k % 128 == 0 and fmt != "int4-g32" else 32
    if fmt in ("int4", "int4-g32"):
        packed = torch.randint(-2**31, 2**31 - 1, (E, n, k // 8), generator=gen, device=dev, dtype=torch.int32)
        scale = (torch.rand(E, n, k // group, generator=gen, device=dev) * 0.004 + 0.002).bfloat16()
        return fm.ExpertWeights("w4a16", packed, scale)
    if fmt == "int4-asym":
        w = random_weights("int4", n, k, gen)
        w.zero_point = torch.randint(-2**31, 2**31 - 1, (E, n // 8, k // group), generator=gen, device=dev,
                                     dtype=torch.int32)
        return w
    packed = torch.randint(0, 256, (E, n, k // 2), generator=gen, device=dev, dtype=torch.uint8)
    if fmt == "mxfp4":
        return fm.ExpertWeights("mxfp4", packed, torch.randint(118, 122, (E, n, k // 32), generator=gen, device=dev,
                                                               dtype=torch.uint8))
    e4m3 = torch.tensor([nvfp4.e4m3_power_of_two(e) for e in range(2, 9)], dtype=torch.uint8, device=dev)
    scale = e4m3[torch.randint(0, 7, (E, n, k // 16), generator=gen, device=dev)]
    return fm.ExpertWeights("nvfp4", packed, scale, torch.rand(E, generator=gen, device=dev) * 2**-9 + 2**-10)


def dense(w: fm.ExpertWeights, e: int) -> torch.Tensor:
    """Float32 decoding of expert e by requant's plain torch decoders (independent of the kernel)."""
    if w.format == "nvfp4":
        return nvfp4.decode(w.packed[e], w.scale[e], w.global_scale[e])
    if w.format == "mxfp4":
        return mxfp4.decode(w.packed[e], w.scale[e])
    q = ((w.packed[e][..., None] >> torch.arange(0, 32, 4, device="cuda")) & 15).flatten(-2).float()
    z = 8.0 if w.zero_point is None else (
        (w.zero_point[e][:, None, :] >> torch.arange(0, 32, 4, device="cuda")[None, :, None]) & 15
    ).flatten(0, 1).float().repeat_interleave(w.group, -1)
    return (q - z) * w.scale[e].float().repeat_interleave(w.group, -1)


def routing(tokens: int, gen: torch.Generator | None = None):
    """Random top-k routing; without gen, the same draw for a token count in every run and table row
    (the experts touched, so the bytes, vary with the draw: ~77 or ~82 of 256 at 16 tokens)."""
    gen = gen or torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, E, generator=gen, device="cuda").topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, generator=gen, device="cuda") * 0.5
    return ids, weights


def layer_bytes(ws, ids) -> int:
    used = ids.unique().numel()
    per_expert = sum(sum(t[0].numel() * t.element_size() for t in (w.packed, w.scale, w.global_scale, w.zero_point)
                         if t is not None) for w in ws)
    return used * per_expert


def split_format(f: str) -> tuple[str, torch.dtype]:
    """A compared module's format name: "-fp16" computes in FP16 (NVFP4's former FP16 route)."""
    return (f[:-5], torch.float16) if f.endswith("-fp16") else (f, torch.bfloat16)


def check(fmt, ws, gen, tokens, cfg=None, activation_scales=None, oai=False):
    """Kernel vs FP32 torch reference; with activation_scales (W4A4) the reference gets the same
    NVFP4-quantized GEMM inputs; oai: gpt-oss's activation with BF16 biases on all three GEMMs.
    Returns the relative error and whether every output was finite."""
    w1, w3, w2 = ws
    ids, weights = routing(tokens, gen)
    x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
    act, kwargs, biases = SWIGLU, {}, ()
    if oai:
        biases = tuple((torch.randn(E, n, generator=gen, device="cuda") * 0.3).bfloat16() for n in (I, I, H))
        act = OAI
        kwargs = dict(b1=biases[0], b3=biases[1], b2=biases[2])
    y = fm.fused_moe(x, ids, weights, w1, w3, w2, activation=act, config=cfg, activation_scales=activation_scales,
                     **kwargs)
    expert = lambda e: (dense(w1, e), dense(w3, e), dense(w2, e), *(b[e] for b in biases))  # noqa: E731
    if activation_scales:
        a13, a2 = activation_scales
        ref = routed_experts(fake_quantize_activations(x, a13), ids, weights, expert, act,
                             intermediate=lambda h: fake_quantize_activations(h.bfloat16(), a2).float())
    else:
        ref = routed_experts(x, ids, weights, expert, act)
    return float((y.float() - ref).norm() / ref.norm()), bool(torch.isfinite(y).all())


def bf16_baseline(w13, w2d, x, ids, weights):
    """The same routed computation with BF16 weights through torch's grouped GEMM."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[order // TOP_K]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    h = torch.nn.functional.silu(gu[:, :I].clamp(max=LIMIT)) * gu[:, I:].clamp(-LIMIT, LIMIT)
    o = torch._grouped_mm(h, w2d.transpose(1, 2), offs=offs)
    out = torch.empty(o.shape, dtype=torch.float32, device=o.device)
    out[order] = o * weights.flatten()[order, None]
    return out.view(-1, TOP_K, H).sum(1).bfloat16()


def measure_copy() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second: the ceiling quoted as %copy."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (t * 1e-3)


def run_checks(weights, gen, results):
    """The kernel against the FP32 torch reference with the configs `fused_moe` picks, at decode and
    prefill sizes, plus a split-K depth and a wide N tile no default takes."""
    cases = [(1, None), (64, None), (4096, None), (1, fm.KernelConfig(16, 64, 128, 4, 4, split_k=8)),
             (16, fm.KernelConfig(16, 128, 128, 4, 4, 2, gate_up_apart=True))]
    for f, ws in weights.items():
        extra = [(64, None, (0.002, 0.004)), (1, None, (1.0, 1.0))] if f == "nvfp4" else []
        for tokens, cfg, scales, oai in ([(t, c, None, False) for t, c in cases] + [(t, c, s, False) for t, c, s in extra]
                                         + [(1, None, None, True), (64, None, None, True)]):
            try:
                rel, finite = check(f, ws, gen, tokens, cfg, scales, oai)
            except Exception:  # report and go on: the timings are still worth having
                traceback.print_exc()
                results["correctness"].append({"format": f, "tokens": tokens, "error": traceback.format_exc(limit=1)})
                continue
            results["correctness"].append({"format": f, "tokens": tokens, "config": cfg and cfg.to_dict(),
                                           "w4a4": scales, "oai": oai, "rel_err": rel, "finite": finite})
            print(f"check {f:9s} tokens {tokens:5d} cfg {cfg} w4a4 {scales} oai {oai}: rel err {rel:.2e} "
                  f"finite {finite}", flush=True)


def inspect_asm(prepared, fmt, gen, results):
    """Whether the GEMM runs on wgmma, and its registers and spills, for a decode and a prefill config."""
    w1, w3, w2 = prepared[fmt]
    for cfg in (fm.KernelConfig(16, 64, 128, 4, 4), fm.default_config(6 * 16384, E)):
        try:
            ids, _ = routing(64, gen)
            x = torch.randn(64, H, device="cuda").bfloat16()
            a, sorted_ids, block_expert = fm.prepare(x, ids, E, cfg.block_m, torch.bfloat16)
            h = torch.empty(64 * TOP_K, I, device="cuda", dtype=torch.bfloat16)
            k = launch(a, TOP_K, w1, w3, h, sorted_ids, block_expert, None, 64 * TOP_K, torch.bfloat16, cfg,
                       SWIGLU)
            ptx = k.asm["ptx"]
            print(f"{cfg}: wgmma in ptx: {'wgmma.mma_async' in ptx}; regs {k.n_regs} spills {k.n_spills}", flush=True)
            results["asm"].append({"config": cfg.to_dict(), "wgmma": "wgmma.mma_async" in ptx, "n_regs": k.n_regs,
                                   "n_spills": k.n_spills})
        except Exception:
            traceback.print_exc()


def tune(formats, tokens_list, prepared, device, path):
    """Time `tune_configs` for every format and token count; merge the fastest into `path`."""
    for f in formats:
        w1, w3, w2 = prepared[f]
        best = {}
        for tokens in tokens_list:
            ids, rw = routing(tokens)
            x = torch.randn(tokens, H, device="cuda").bfloat16()
            for cfg in tune_configs(tokens, w1.kernel_code):
                try:
                    t = graph_time(lambda: fm.fused_moe(x, ids, rw, w1, w3, w2, activation=SWIGLU, config=cfg), rep=100)
                except Exception as e:  # a config that does not compile or fit is skipped, not fatal
                    print(f"  {f} {tokens} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                print(f"  tune {f} {tokens:5d} {cfg.to_dict()}: {t * 1e3:.1f} us", flush=True)
                if tokens not in best or t < best[tokens][0]:
                    best[tokens] = (t, cfg)
        configs.save_tuned(path, device, problem(f), {t: c for t, (_, c) in best.items()},
                           "benchmarks/bench_moe.py --tune")
        print(f"{f}: tuned configs for {sorted(best)} tokens written to {path}", flush=True)


def main():
    global E, H, I, TOP_K
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096,16384")
    ap.add_argument("--formats", default="nvfp4,int4,mxfp4")
    ap.add_argument("--tune", action="store_true", help="tune the launch configs instead of measuring")
    ap.add_argument("--config-out", help="launch-config file --tune merges into (default: the device's file in "
                    "requant/kernels/configs/)")
    ap.add_argument("--compare-with", help="path of another fused_moe.py to time side by side (full time only)")
    ap.add_argument("--compare-formats", help="formats to time with --compare-with (default: --formats)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--hidden", type=int, default=H)
    ap.add_argument("--intermediate", type=int, default=I)
    ap.add_argument("--experts", type=int, default=E)
    ap.add_argument("--top-k", type=int, default=TOP_K)
    args = ap.parse_args()
    E, H, I, TOP_K = args.experts, args.hidden, args.intermediate, args.top_k
    tokens_list = [int(t) for t in args.tokens.split(",")]
    formats = args.formats.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    device = config_name(props.name)
    checked = [] if args.tune else ["int4-asym"]
    weights = {f: [random_weights(f, n, k, gen) for n, k in ((I, H), (I, H), (H, I))]
               for f in dict.fromkeys(formats + checked)}
    # The kernel's layout, made once as engines repack at load time (fused_moe would per call).
    prepared = {f: [fm.kernel_weights(w) for w in ws] for f, ws in weights.items()}
    if args.tune:
        tune(formats, tokens_list, prepared, props.name, args.config_out or configs.config_path(device))
        return

    os.makedirs(args.out, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out_path = os.path.join(args.out, f"{date}-{device}.json")
    tuned_file = configs.config_path(device)
    results = {"benchmark": "benchmarks/bench_moe.py", "date": date, "device": props.name,
               "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
               "shape": {"experts": E, "hidden": H, "intermediate": I, "top_k": TOP_K},
               "configs": f"requant/kernels/configs/{device}.json" if os.path.exists(tuned_file) else "built-in",
               "timing": "median of CUDA-graph replays; gemm = both GEMM launches (and split-K's SwiGLU), "
                         "full = prologue + GEMMs + top-k sum; bytes = weights and scales of the experts touched",
               "correctness": [], "asm": [], "timings": []}
    print({k: v for k, v in results.items() if not isinstance(v, list)}, flush=True)

    def save():  # after every row, so a run stopped at its time limit still leaves its numbers
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)

    copy_bw = measure_copy()
    results["copy_GBps"] = round(copy_bw / 1e9, 1)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    run_checks({f: weights[f] for f in weights}, gen, results)
    for f in checked:
        del weights[f]
    inspect_asm(prepared, formats[0], gen, results)
    save()

    def row(fmt, tokens, cfg, t_full, t_gemm, nbytes, **more):
        ms = t_gemm or t_full
        r = {"format": fmt, "tokens": tokens, "config": cfg, "us_full": round(t_full * 1e3, 2),
             "us_gemms": t_gemm and round(t_gemm * 1e3, 2), "bytes": nbytes,
             "pct_copy": round(100 * nbytes / (ms * 1e-3) / copy_bw, 1),
             "tflops": round(2 * tokens * TOP_K * 3 * H * I / (t_full * 1e-3) / 1e12, 2), **more}
        results["timings"].append(r)
        save()
        print(f"{fmt:16s} {tokens:6d} full {r['us_full']:9.1f} us  gemms {ms * 1e3:9.1f} us  "
              f"{r['pct_copy']:5.1f}% copy  {r['tflops']:6.1f} TFLOP/s", flush=True)

    # BF16 baseline first (same run), dequantized from the first format's weights (the values do not change the time).
    w1, w3, w2 = weights[formats[0]]
    w13 = torch.stack([torch.cat([dense(w1, e), dense(w3, e)]).bfloat16() for e in range(E)])
    w2d = torch.stack([dense(w2, e).bfloat16() for e in range(E)])
    for tokens in tokens_list:
        ids, rw = routing(tokens)
        x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
        try:
            t = do_bench(lambda: bf16_baseline(w13, w2d, x, ids, rw), warmup=25, rep=200, return_mode="median")
        except Exception as e:
            print(f"bf16 baseline failed at {tokens}: {e}", flush=True)
            continue
        row("bf16-grouped_mm", tokens, None, t, None, ids.unique().numel() * 3 * H * I * 2)
    del w13, w2d

    for f in formats:
        w1, w3, w2 = prepared[f]
        for tokens in tokens_list:
            ids, rw = routing(tokens)
            x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
            cfg = configs.launch_config(problem(f), tokens, device)  # what fused_moe picks on this device
            t_full = graph_time(lambda: fm.fused_moe(x, ids, rw, w1, w3, w2, activation=SWIGLU, config=cfg))
            a, sorted_ids, block_expert = fm.prepare(x, ids, E, cfg.block_m, torch.bfloat16)
            rwf = rw.flatten().contiguous()
            pairs = tokens * TOP_K

            def gemms():  # the two GEMMs (with split-K's SwiGLU of the partials), no prologue, no top-k sum
                h = fm.gate_up(a, TOP_K, w1, w3, sorted_ids, block_expert, pairs, torch.bfloat16, cfg,
                               SWIGLU)
                fm.down(h, w2, sorted_ids, block_expert, rwf, pairs, torch.bfloat16, cfg)
            row(f, tokens, cfg.to_dict(), t_full, graph_time(gemms), layer_bytes(weights[f], ids))

    if args.compare_with:
        spec = importlib.util.spec_from_file_location("fused_moe_compared", args.compare_with)
        other = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = other  # its dataclasses look their module up
        spec.loader.exec_module(other)
        for f in (args.compare_formats or args.formats).split(","):
            fmt, compute = split_format(f)
            w1, w3, w2 = weights[fmt]
            if hasattr(other, "kernel_weights"):  # its layout made once too, not on every call
                w1, w3, w2 = (other.kernel_weights(w) for w in (w1, w3, w2))
            for tokens in tokens_list:
                ids, rw = routing(tokens)
                x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
                # the compared file is an earlier fused_moe, whose activation defaulted to SWIGLU
                t_full = graph_time(lambda: other.fused_moe(x, ids, rw, w1, w3, w2, compute_dtype=compute))
                same = None if compute != torch.bfloat16 else bool(torch.equal(
                    other.fused_moe(x, ids, rw, w1, w3, w2), fm.fused_moe(x, ids, rw, *prepared[fmt], activation=SWIGLU)))
                row(f"{f} (compared)", tokens, None, t_full, None, layer_bytes(weights[fmt], ids), bitwise_equal=same)
    save()
    print(f"results: {out_path}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f} s")
