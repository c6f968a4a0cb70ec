"""compare_paths: one MXFP4 source layer, on the same inputs, through every way an engine could run
it: the source as stored and its conversions made in memory by requant's own encoders, each in the
serving mode (serve.py) that applies to it.

Paths (name `weights:mode[:policy]`):
- `mxfp4:bf16`: the source decoded exactly, BF16 activations. This is the reference (error 0 by
  definition): Hopper's weight-only W4A16 on the source (SGLang sm_90, FlashInfer CUTLASS).
- `mxfp4:mxfp4-w4a8`: the source as stored, both GEMM inputs quantized to MXFP8 (SGLang on sm_120 /
  sm_100 through FlashInfer; numerics.fake_quantize_mxfp8).
- `nvfp4:bf16`: the NVFP4 cast (formats.nvfp4, w1/w3 sharing one global scale as convert writes
  them) decoded exactly: equal to the reference unless blocks fall below E4M3's window.
- `nvfp4:nvfp4-w4a4:<policy>`: the cast with NVFP4 activations under input_scale `written` (the
  data-free bound convert writes), `1.0` and `calibrated` (these tokens' amax / 2688; the w2
  input's from the reference pass: the best case for calibration).
- `nvfp4:marlin-w4a16`: the cast with vLLM 0.33.0's Marlin flush. requant's cast puts every expert's
  largest block scale at 2^8, so the layer's Marlin factor is marlin_factor(2^8) = 1 without
  reading the experts not computed here.
- `w4a16-g<G>-<scheme>:bf16`: INT4 (formats.int4's encoder) decoded exactly: Marlin takes INT4's
  BF16 scales unchanged.

Every path computes in FP32 through moe.expert_forward with the same routing (the source router's);
the shared expert (FP8 blocks, the same in every path) is added exactly; outputs are rounded to
BF16 as validate's are. Errors are of the layer output (routed + shared) and of the routed part.

Cost on a CPU: each expert the tokens choose is read, decoded and re-encoded five ways; a
full-size DeepSeek-V4-Flash expert took ~1.5 s of wall time on a 2-core machine (49 s for 32 experts,
scripts/measure_paths.py), so every expert of a layer would take minutes. Fewer
tokens, or `experts=N` (only the N experts most chosen by these tokens are computed, in every path
and the reference alike; the pairs routed elsewhere are dropped), bound it.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from requant.compute import default_workers, torch_threads
from requant.errors import RequantError, UnsupportedError
from requant.engines import numerics as en
from requant.formats import int4, int4_search, mxfp4, nvfp4
from requant.io.checkpoint import Checkpoint
from requant.moe import MoEConfig, expert_forward, route
from requant.engines.serve import calibrated_input_scale

MX, NV, W4 = mxfp4.CODEC.name, nvfp4.CODEC.name, int4.CODEC.name   # the weights each path stores

REFERENCE = "mxfp4:bf16"
POLICIES = ("written", "1.0", "calibrated")
INT4_DEFAULT = ((32, "sym"), (128, "sym"))
ENGINES = {
    "mxfp4:bf16": "reference; the MXFP4 source weight-only (SGLang sm_90 FlashInfer CUTLASS W4A16)",
    "mxfp4:mxfp4-w4a8": "the MXFP4 source with MXFP8 activations (SGLang sm_120 / sm_100 via FlashInfer)",
    "nvfp4:bf16": "NVFP4 conversion, weight-only, weights decoded exactly",
    "nvfp4:nvfp4-w4a4": "NVFP4 conversion on Blackwell FP4 tensor cores (NVFP4 activations)",
    "nvfp4:marlin-w4a16": "NVFP4 conversion through vLLM's Marlin (Hopper/Ampere)",
    W4: "INT4 W4A16 conversion through Marlin (BF16 activations)",
}


def path_names(int4_variants=INT4_DEFAULT) -> list[str]:
    return ([REFERENCE, "mxfp4:mxfp4-w4a8", "nvfp4:bf16"] + [f"nvfp4:nvfp4-w4a4:{p}" for p in POLICIES]
            + ["nvfp4:marlin-w4a16"] + [f"{_int4_name(g, s)}:bf16" for g, s in int4_variants])


def _int4_name(group: int, scheme: str) -> str:
    return f"w4a16-g{group}-{scheme}"


def compare_paths(checkpoint: str, layers: str | list[str] | None = None, tokens: int = 32, *,
                  experts: int | None = None, seed: int = 0, activations: str | None = None,
                  int4_variants=INT4_DEFAULT, workers: int | None = None) -> dict:
    """Every path (module doc) on each selected MoE layer of an MXFP4 `checkpoint`, on CPU torch.

    layers: --layers syntax ("3,5-7,mtp.0") or a list of block names; None: every MoE layer.
    tokens: random hidden states per layer (validate.hidden_states, seeded by `seed`), unless
    `activations` (validate's --activations file) gives real ones. experts: compute only the N
    experts these tokens choose most (None: all they choose). Returns plain data (see
    docs/report-schema.md, `paths`): per layer and overall, for each path, SQNR (dB, None when
    exact) and relative error of the layer output and of the routed part, and which path is closest
    to the reference and by how much."""
    from requant.validate import Side, hidden_states, kernel_format, load_activations, reference_layer, router

    acts = load_activations(activations) if activations else None
    names = path_names(int4_variants)
    started = time.monotonic()
    with Checkpoint.open(checkpoint) as ck:
        side = Side(ck, checkpoint)
        blocks = side.moe_blocks()
        blocks = ([b for b in layers if b in blocks] if isinstance(layers, list)
                  else side.model.select_blocks(layers, blocks))
        if not blocks:
            raise RequantError(f"{checkpoint}: no MoE layer selected")
        gen = torch.Generator().manual_seed(seed)
        out_layers = []
        for block in blocks:
            fmt = kernel_format(side, block)
            if fmt != MX:
                raise UnsupportedError(f"{block}: compare_paths starts from MXFP4 experts, not {fmt}")
            cfg = MoEConfig.from_model(side.model, block)
            x, token_ids = _inputs(ck, side, block, cfg, tokens, gen, acts, hidden_states)
            block_router = router(side, block, "cpu")
            if block_router.tid2eid is not None and token_ids is None:
                token_ids = torch.randint(0, block_router.tid2eid.shape[0], (x.shape[0],), generator=gen)
            out_layers.append(_layer(side, block, cfg, x, token_ids, block_router, experts, names, int4_variants,
                                     reference_layer(side, block, fmt), workers or default_workers()))
    return {"checkpoint": checkpoint, "device": "cpu (torch, FP32)", "seed": seed,
            "tokens": out_layers[0]["tokens"], "experts_limit": experts,
            "reference": REFERENCE + ": the source's experts decoded exactly, BF16 activations, FP32 compute, "
                                     "BF16 layer output",
            "paths": [{"path": n, "engines": ENGINES.get(n) or ENGINES.get(n.rsplit(":", 1)[0])
                       or ENGINES[W4]} for n in names],
            "layers": out_layers, "overall": _verdict(_totals(out_layers, names)),
            "seconds": time.monotonic() - started}


def _inputs(ck, side, block, cfg, tokens, gen, acts, hidden_states):
    if acts is None:
        return hidden_states(ck, block, tokens, gen), None
    from requant.validate import is_block_name
    shared_x = [v for k, v in acts.items() if k != "token_ids" and not is_block_name(side.model, k)]
    x = acts.get(block, shared_x[0] if shared_x else None)
    if x is None:
        raise RequantError(f"the activations file has no tensor for {block}")
    return x.reshape(-1, cfg.hidden_size).bfloat16(), acts.get("token_ids")


def _written_scales(side, block) -> tuple[float, float]:
    """(w1/w3, w2) input_scale as convert writes them by default (targets.Target.input_scales: the
    data-free bound / 2688), taken as engines load them: the largest over w1 and w3."""
    model = side.model
    norm = model.moe_input_norm(block)
    absmax = float(side.ck.tensor(norm).float().abs().max())
    bounds = model.activation_bounds(absmax)
    down = model.down_projection
    gate_up = max(b for p, b in bounds.items() if p != down)
    return calibrated_input_scale(gate_up), calibrated_input_scale(bounds[down])


def _chosen(ids: torch.Tensor, limit: int | None) -> list[int]:
    counts = torch.bincount(ids.reshape(-1))
    used = [int(e) for e in torch.nonzero(counts).reshape(-1)]
    if limit is None or limit >= len(used):
        return used
    # most chosen first, lower id on ties; computed in id order
    return sorted(sorted(used, key=lambda e: (-int(counts[e]), e))[:limit])


def _weights(stored, int4_variants, fused_max: bool = True) -> dict[str, tuple]:
    """path weights name -> float32 (gate, up, down[, biases]) of one expert (`stored`, a
    LayerExperts whose expert 0 is it, as stored in MXFP4)."""
    raw = [(w.packed[0].view(torch.uint8), w.scale[0].view(torch.uint8)) for w in stored.weights]
    biases = tuple(b[0].float() for b in stored.biases) if stored.biases else ()
    found = {MX: tuple(mxfp4.decode(w, s) for w, s in raw) + biases}
    k_max = [mxfp4.max_exponent(s.numpy()) for _, s in raw]
    pair = [k for k in k_max[:2] if k is not None]   # gate and up share one global scale (engines fuse them)
    nv, marlin = [], []
    factor = en.marlin_factor(2.0 ** nvfp4.DEFAULT_TOP)
    for i, (w, s) in enumerate(raw):
        k = (max(pair) if pair else None) if i < 2 else k_max[2]
        cast = nvfp4.cast_from_mxfp4(w.numpy(), s.numpy(), k)
        codes, scales = torch.from_numpy(cast.weight), torch.from_numpy(cast.weight_scale)
        nv.append(nvfp4.decode(codes, scales, cast.weight_scale_2))
        flushed, n = en.marlin_flush(scales, factor)
        marlin.append(nvfp4.decode(codes, flushed, cast.weight_scale_2) if n else nv[-1])
    found[NV], found[f"{NV}-marlin"] = tuple(nv) + biases, tuple(marlin) + biases
    for group, scheme in int4_variants:
        dense = []
        for w, s in raw:
            enc = int4_search.encode_mxfp4(w, s, group, scheme)
            dense.append(int4.decode(enc.packed, enc.scale, enc.zero_point))
        found[_int4_name(group, scheme)] = tuple(dense) + biases
    return found


def _layer(side, block, cfg, x, token_ids, router, limit, names, int4_variants, stored, workers) -> dict:
    started = time.monotonic()
    act = cfg.activation
    ids, weights = route(x, router, cfg, token_ids)
    chosen = _chosen(ids, limit)
    xf = x.float()
    written = _written_scales(side, block)
    # Calibrated: this batch's x amax, and the w2 input's amax over the reference pass (first pass,
    # gate and up only).
    def h_amax(e):
        rows = (ids == e).any(-1)
        gate, up = (en_decode(w) for w in stored(e).weights[:2])
        return float(act(xf[rows] @ gate.T, xf[rows] @ up.T).abs().max()) if rows.any() else 0.0

    def en_decode(w):
        return mxfp4.decode(w.packed[0].view(torch.uint8), w.scale[0].view(torch.uint8))

    with torch_threads(1), ThreadPoolExecutor(workers) as pool:
        h_max = max(pool.map(h_amax, chosen), default=0.0)
    scales = {"written": written, "1.0": (1.0, 1.0),
              "calibrated": (calibrated_input_scale(float(x.abs().max())), calibrated_input_scale(h_max))}
    x8 = en.fake_quantize_mxfp8(x)
    x4 = {p: en.fake_quantize_activations(x, s[0]).float() for p, s in scales.items()}
    # path -> (weights key, GEMM1 input, intermediate hook)
    plan = {REFERENCE: (MX, xf, None),
            "mxfp4:mxfp4-w4a8": (MX, x8, lambda h: en.fake_quantize_mxfp8(h.bfloat16())),
            "nvfp4:bf16": (NV, xf, None),
            "nvfp4:marlin-w4a16": (f"{NV}-marlin", xf, None)}
    for p, (_, a2) in scales.items():
        plan[f"nvfp4:nvfp4-w4a4:{p}"] = (NV, x4[p], lambda h, a2=a2: en.fake_quantize_activations(h.bfloat16(), a2).float())
    for g, s in int4_variants:
        plan[f"{_int4_name(g, s)}:bf16"] = (_int4_name(g, s), xf, None)
    ys = {n: torch.zeros_like(xf) for n in names}

    def contribution(e):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        found = _weights(stored(e), int4_variants)
        scale = weights[rows, slots, None]
        return rows, {n: expert_forward(xin[rows], found[key], act, hook) * scale for n, (key, xin, hook) in plan.items()}

    with torch_threads(1), ThreadPoolExecutor(workers) as pool:
        for rows, parts in pool.map(contribution, chosen):   # summed in expert order: thread count free
            for n, part in parts.items():
                ys[n].index_add_(0, rows, part)
    shared = expert_forward(xf, tuple(w.float() for w in router.shared), act) if router.shared else 0.0
    outs = {n: (y + shared).bfloat16() for n, y in ys.items()}
    results = {n: _errors(outs[REFERENCE], outs[n], ys[REFERENCE], ys[n]) for n in names}
    kept = sum(int((ids == e).sum()) for e in chosen)
    return {"block": block, "tokens": x.shape[0], "experts_computed": len(chosen), "pairs": kept,
            "pairs_dropped": ids.numel() - kept,
            "input_scales": {p: list(s) for p, s in scales.items()},
            "results": results, **_verdict(results), "seconds": time.monotonic() - started}


def _sums(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    ref, out = ref.double(), out.double()
    return float((ref * ref).sum()), float(((out - ref) ** 2).sum())


def _metrics(signal: float, error: float) -> dict:
    return {"sqnr_db": None if error == 0 else (10 * math.log10(signal / error) if signal > 0 else -math.inf),
            "rel_err": math.sqrt(error / signal) if signal > 0 else (0.0 if error == 0 else math.inf)}


def _errors(ref_out, out, ref_routed, routed) -> dict:
    s, e = _sums(ref_out, out)
    rs, re_ = _sums(ref_routed, routed)
    routed_m = _metrics(rs, re_)
    return {**_metrics(s, e), "routed_sqnr_db": routed_m["sqnr_db"], "routed_rel_err": routed_m["rel_err"],
            "_sums": (s, e, rs, re_)}


def _totals(layers: list[dict], names: list[str]) -> dict:
    """path -> metrics over every layer together (energy sums, as report's metrics add up)."""
    out = {}
    for n in names:
        s = [sum(layer["results"][n]["_sums"][i] for layer in layers) for i in range(4)]
        routed = _metrics(s[2], s[3])
        out[n] = {**_metrics(s[0], s[1]), "routed_sqnr_db": routed["sqnr_db"], "routed_rel_err": routed["rel_err"]}
    for layer in layers:   # internal sums leave the returned data
        for r in layer["results"].values():
            r.pop("_sums", None)
    return {"results": out}


def _verdict(results: dict) -> dict:
    """results plus the ranking (best first) of every path but the reference, the closest path and
    its margin over the next: in dB of SQNR, and as the ratio of their relative errors."""
    results = results.get("results", results)
    ranked = sorted((n for n in results if n != REFERENCE), key=lambda n: results[n]["rel_err"])
    exact = [n for n in ranked if results[n]["rel_err"] == 0]
    inexact = [n for n in ranked if results[n]["rel_err"] > 0]

    def closest(among):
        if not among:
            return None
        best = among[0]
        nxt = among[1] if len(among) > 1 else None
        r = results[best]
        out = {"path": best, "rel_err": r["rel_err"], "sqnr_db": r["sqnr_db"], "next": nxt, "margin_db": None,
               "error_ratio": None}
        if nxt is not None:
            n = results[nxt]
            if r["sqnr_db"] is not None and n["sqnr_db"] is not None:
                out["margin_db"] = r["sqnr_db"] - n["sqnr_db"]
            if r["rel_err"] > 0:
                out["error_ratio"] = n["rel_err"] / r["rel_err"]
        return out

    return {"results": results, "ranking": ranked, "exact": exact, "closest": closest(ranked),
            "closest_inexact": closest(inexact)}
