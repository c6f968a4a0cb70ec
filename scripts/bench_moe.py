"""Benchmark requant's fused-MoE kernel on one DeepSeek-V4-Flash routed-expert layer (GPU only).

hidden 4096, intermediate 2048, 256 experts, top-6, uniform random routing (other shapes with
--hidden/--intermediate/--experts/--top-k, e.g. gpt-oss-120b's 2880/2880/128/4). One run checks the
kernel against the torch reference (every format, the small- and large-batch configs), measures
the device's copy bandwidth and a BF16 grouped-GEMM baseline, then times the kernel over the token
counts and prints a table. Full results go to $OUT (or --out) as JSON.

    python3 scripts/bench_moe.py [--tokens 1,4,...] [--formats nvfp4,int4,mxfp4] [--sweep F1,F2]
                                 [--compare-with OLD/fused_moe.py] [--hidden H --intermediate I ...]

Formats: nvfp4, int4 (groups of 128), int4-g32, mxfp4 (and int4-asym in the checks).

--compare-with times another version of the kernel module (say, the previous commit's) on the same
inputs in the same run, with its own default configs, so that a change is judged against noise
from one device, not across runs, and says whether its output is bitwise the same as this one's.
--compare-formats picks its formats (default --formats); a "-fp16" suffix passes
compute_dtype=torch.float16, for modules that had NVFP4's FP16 route (before run 10).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from requant.formats import mxfp4, nvfp4  # noqa: E402
from requant.formats.engine_numerics import fake_quantize_activations  # noqa: E402
from requant.kernels import fused_moe as fm  # noqa: E402
from requant.moe import Activation, routed_experts  # noqa: E402

E, H, I, TOP_K, LIMIT = 256, 4096, 2048, 6, 10.0  # main() may change the shape
SWIGLU = Activation("swiglu_clamp", LIMIT)
OAI = Activation("swiglu_oai", 7.0, 1.702)  # gpt-oss's, checked with biases


def sweep_configs(tokens: int) -> list[fm.KernelConfig]:
    """Candidates around the default for this batch: split-K depths, deeper pipelines and wider N
    tiles at decode sizes, M/N tiles and stages at prefill sizes (configs that ran out of shared
    memory or lost everywhere in earlier runs are left out; N tiles are 16 rows per warp, the shape
    `_mma_tile` keeps in registers)."""
    if tokens <= 64:
        return [fm.KernelConfig(16, 64, 128, 4, 4, split_k=s) for s in (1, 2)] + [
            fm.KernelConfig(16, 64, 128, 4, 4, split_k=s, gate_up_apart=True, max_registers=r)
            for s in (1, 2) for r in (None, 80)] + [
            fm.KernelConfig(16, 64, 128, 4, 6, split_k=1, gate_up_apart=True, max_registers=80),
            fm.KernelConfig(16, 64, 128, 4, 4, split_k=2, max_registers=80)] + [
            # 128 weight rows for one warpgroup: two M tiles share each K step's descriptors,
            # addresses and scale loads (w1/w3 apart, else four tiles would not fit the registers)
            fm.KernelConfig(16, 128, 128, 4, st, split_k=s, gate_up_apart=True, max_registers=r)
            for s in (1, 2, 4) for st, r in ((4, None), (4, 128))]
    if tokens <= 1024:
        return [fm.KernelConfig(16, 64, 128, 4, 4), fm.KernelConfig(32, 64, 128, 4, 4),
                fm.KernelConfig(64, 128, 128, 8, 4)]
    return [fm.KernelConfig(128, 128, 128, 8, 3), fm.KernelConfig(128, 128, 128, 8, 4),
            fm.KernelConfig(64, 128, 128, 8, 4)]


def graph_time(fn) -> float:
    """Median ms of CUDA-graph replays of fn. do_bench_cudagraph first calls fn on a stream of its
    own, which does not wait for the default stream, so the device is synchronized first: else that
    call can read inputs made just before it unfinished (run 17: at 4096 tokens garbage routing,
    and a device-side assert in torch's align, after the previous format's weights were laid out)."""
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200, return_mode="median")


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
        kwargs = dict(activation=OAI.kind, swiglu_limit=OAI.limit, swiglu_alpha=OAI.alpha,
                      b1=biases[0], b3=biases[1], b2=biases[2])
    y = fm.fused_moe(x, ids, weights, w1, w3, w2, config=cfg, activation_scales=activation_scales, **kwargs)
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


def main():
    global E, H, I, TOP_K
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096,16384")
    ap.add_argument("--formats", default="nvfp4,int4,mxfp4")
    ap.add_argument("--sweep", default="", help="formats to sweep (sweep_configs) keeping the best; others use "
                    "the default config")
    ap.add_argument("--compare-with", help="path of another fused_moe.py to time side by side (full time only)")
    ap.add_argument("--compare-formats", help="formats to time with --compare-with (default: --formats)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--hidden", type=int, default=H)
    ap.add_argument("--intermediate", type=int, default=I)
    ap.add_argument("--experts", type=int, default=E)
    ap.add_argument("--top-k", type=int, default=TOP_K)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    E, H, I, TOP_K = args.experts, args.hidden, args.intermediate, args.top_k
    tokens_list = [int(t) for t in args.tokens.split(",")]
    formats = args.formats.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
               "triton": triton.__version__, "shape": {"experts": E, "hidden": H, "intermediate": I, "top_k": TOP_K},
               "correctness": [], "timings": []}
    print(results, flush=True)

    def save():  # after every row, so a run stopped at its time limit still leaves its numbers
        with open(os.path.join(args.out, f"bench_moe_{H}x{I}.json"), "w") as f:
            json.dump(results, f, indent=1)

    src = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_bw = 2 * src.numel() / (t * 1e-3)
    results["copy_bw_GBps"] = copy_bw / 1e9
    del src, dst
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)

    weights = {f: [random_weights(f, n, k, gen) for n, k in ((I, H), (I, H), (H, I))]
               for f in dict.fromkeys(formats + ["int4-asym"])}
    # The kernel's layout, made once as engines repack at load time (fused_moe would per call).
    prepared = {f: [fm.kernel_weights(w) for w in ws] for f, ws in weights.items()}
    cases = [(1, None, None), (64, None, None), (4096, None, None),
             (300, fm.KernelConfig(64, 128, 128, 4, 4), None), (1, fm.KernelConfig(16, 64, 128, 4, 4, split_k=8), None),
             (5, fm.KernelConfig(16, 128, 128, 8, 4, 2), None),
             (16, fm.KernelConfig(16, 128, 128, 4, 4, 2, gate_up_apart=True), None)]
    for f, ws in weights.items():
        extra = [(64, None, (0.002, 0.004)), (1, None, (1.0, 1.0))] if f == "nvfp4" else []
        for tokens, cfg, scales, oai in [(t, c, s, False) for t, c, s in cases + extra] + [(1, None, None, True),
                                                                                      (64, None, None, True)]:
            try:
                rel, finite = check(f, ws, gen, tokens, cfg, scales, oai)
            except Exception:  # report and go on: the timings are still worth having
                traceback.print_exc()
                continue
            results["correctness"].append({"format": f, "tokens": tokens, "config": str(cfg), "w4a4": scales,
                                           "oai": oai, "rel_err": rel, "finite": finite})
            print(f"check {f:9s} tokens {tokens:5d} cfg {cfg} w4a4 {scales} oai {oai}: rel err {rel:.2e} "
                  f"finite {finite}", flush=True)
    if "int4-asym" not in formats:
        del weights["int4-asym"]

    # Is the GEMM on wgmma? Look at the compiled kernel of the large-batch config.
    w1, w3, w2 = prepared[formats[0]]
    for cfg in (fm.KernelConfig(16, 64, 128, 4, 4), fm.default_config(6 * 16384, E)):
        try:
            ids, _ = routing(64, gen)
            x = torch.randn(64, H, device="cuda").bfloat16()
            a, sorted_ids, block_expert = fm.prepare(x, ids, E, cfg.block_m, torch.bfloat16)
            h = torch.empty(64 * TOP_K, I, device="cuda", dtype=torch.bfloat16)
            k = fm._launch(a, TOP_K, w1, w3, h, sorted_ids, block_expert, None, 64 * TOP_K, torch.bfloat16, cfg,
                           fm.SwiGLU(limit=LIMIT))
            ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
            dots = [ln.strip()[:200] for ln in ttgir.splitlines() if "warp_group_dot " in ln or "tt.dot " in ln]
            print(f"{cfg}: wgmma in ptx: {'wgmma.mma_async' in ptx}; regs {k.n_regs} spills {k.n_spills}; dots:",
                  *dots[:2], sep="\n  ", flush=True)
            results.setdefault("asm", []).append({"config": str(cfg), "wgmma": "wgmma.mma_async" in ptx,
                                                  "n_regs": k.n_regs, "n_spills": k.n_spills, "dots": dots})
            with open(os.path.join(args.out, f"ttgir_bm{cfg.block_m}.txt"), "w") as f:
                f.write(ttgir)
        except Exception:
            traceback.print_exc()

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
        results["timings"].append({"format": "bf16-grouped_mm", "tokens": tokens, "ms_full": t, "ms_gemms": t,
                                   "bytes": ids.unique().numel() * 3 * H * I * 2, "flops": 2 * tokens * TOP_K * 3 * H * I})
        save()
    del w13, w2d

    for f in formats:
        w1, w3, w2 = prepared[f]
        for tokens in tokens_list:
            ids, rw = routing(tokens)
            x = torch.randn(tokens, H, generator=gen, device="cuda").bfloat16()
            flops = 2 * tokens * TOP_K * 3 * H * I
            nbytes = layer_bytes(weights[f], ids)
            cfgs = sweep_configs(tokens) if f in args.sweep.split(",") else [fm.default_config(tokens * TOP_K, E, w1.kernel_code)]
            best = None
            for cfg in cfgs:
                try:
                    t_full = graph_time(lambda: fm.fused_moe(x, ids, rw, w1, w3, w2, config=cfg))
                except Exception as e:  # a config that does not compile or fit is skipped, not fatal
                    print(f"  {f} {tokens} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if len(cfgs) > 1:
                    print(f"  sweep {f} {tokens:5d} {cfg}: full {t_full * 1e3:.1f} us", flush=True)
                    results.setdefault("sweep", []).append({"format": f, "tokens": tokens, "config": str(cfg),
                                                            "ms_full": t_full})
                if best is None or t_full < best[0]:
                    best = (t_full, cfg)
            if best is None:
                continue
            t_full, cfg = best
            a, sorted_ids, block_expert = fm.prepare(x, ids, E, cfg.block_m, torch.bfloat16)
            rwf = rw.flatten().contiguous()
            pairs = tokens * TOP_K

            def gemms():  # the two GEMMs (with split-K's SwiGLU of the partials), no prologue, no top-k sum
                h = fm.gate_up(a, TOP_K, w1, w3, sorted_ids, block_expert, pairs, torch.bfloat16, cfg,
                               fm.SwiGLU(limit=LIMIT))
                fm.down(h, w2, sorted_ids, block_expert, rwf, pairs, torch.bfloat16, cfg)
            t_gemm = graph_time(gemms)
            row = {"format": f, "tokens": tokens, "config": str(cfg), "ms_full": t_full, "ms_gemms": t_gemm,
                   "bytes": nbytes, "flops": flops}
            results["timings"].append(row)
            save()
            print(f"{f} {tokens} {cfg}: full {t_full * 1e3:.1f} us, gemms {t_gemm * 1e3:.1f} us", flush=True)

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
                t_full = graph_time(lambda: other.fused_moe(x, ids, rw, w1, w3, w2, compute_dtype=compute))
                same = None if compute != torch.bfloat16 else bool(torch.equal(
                    other.fused_moe(x, ids, rw, w1, w3, w2), fm.fused_moe(x, ids, rw, *prepared[fmt])))
                results["timings"].append({"format": f"{f} (compared)", "tokens": tokens, "ms_full": t_full,
                                           "ms_gemms": None, "bytes": layer_bytes(weights[fmt], ids),
                                           "flops": 2 * tokens * TOP_K * 3 * H * I, "bitwise_equal": same})
                save()
                print(f"{f} (compared) {tokens}: full {t_full * 1e3:.1f} us; output bitwise equal to this "
                      f"kernel's: {same}", flush=True)

    save()
    print(f"\ndevice {props.name}, copy {copy_bw / 1e12:.2f} TB/s; time in us (CUDA graph replay, median)")
    print(f"{'format':16s} {'tokens':>6s} {'full us':>9s} {'gemm us':>9s} {'GB/s':>7s} {'%copy':>6s} {'TFLOP/s':>8s}")
    for r in results["timings"]:
        ms = r["ms_gemms"] or r["ms_full"]  # compared rows: full time only
        bw = r["bytes"] / (ms * 1e-3)
        print(f"{r['format']:16s} {r['tokens']:6d} {r['ms_full'] * 1e3:9.1f} {ms * 1e3:9.1f} "
              f"{bw / 1e9:7.0f} {100 * bw / copy_bw:5.0f}% {r['flops'] / (r['ms_full'] * 1e-3) / 1e12:8.1f}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f} s")
