"""One MoE layer of the two checkpoints through the same hidden states: the comparison itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from requant import formats
from requant.engines import serve
from requant.compute import default_workers
from requant.errors import RequantError
from requant.moe import MoEConfig, expert_forward, route, routed_experts_variants
from requant.validate.results import KERNEL_VS_REFERENCE, LOSSLESS, LOSSY, LayerResult, ServingResult, metrics
from requant.validate.serving import Runner, kernel_layout, run_kernel, w4a4_inputs, w4a4_policies, w4a8_inputs
from requant.validate.side import Side, hidden_states, is_block_name, kernel_format, load_layer, reference_experts, \
    router


@dataclass
class Comparison:
    """What every layer's comparison shares: the two sides and how to run them."""

    fm: object                      # the kernel module; None: the torch reference alone
    a: Side                         # the source
    b: Side                         # the candidate
    cfg: MoEConfig                  # the main layers' (each block runs its own: MoEConfig.from_model(model, block))
    tokens: int                     # random hidden states per layer, without `acts`
    device: str
    gen: torch.Generator
    acts: dict | None               # --activations: tensors by block (or one for all), token_ids
    serve_modes: list[str] | None   # None: chosen from each layer's format and the GPU
    capability: tuple[int, int] | None   # the GPU's compute capability; None on a CPU


def _inputs(run: Comparison, block: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden states [T, H] in BF16, token ids or None) the layer sees."""
    if run.acts is None:
        return hidden_states(run.a.ck, block, run.tokens, run.gen), None
    shared_x = [v for k, v in run.acts.items() if k != "token_ids" and not is_block_name(run.a.model, k)]
    x = run.acts.get(block, shared_x[0] if shared_x else None)
    if x is None:
        raise RequantError(f"the activations file has no tensor for {block}")
    return x.reshape(-1, run.cfg.hidden_size).bfloat16(), run.acts.get("token_ids")


def validate_block(run: Comparison, block: str) -> LayerResult:
    fm, a, b = run.fm, run.a, run.b
    cfg = MoEConfig.from_model(a.model, block)
    x, token_ids = _inputs(run, block)
    x = x.to(run.device)
    ra, rb = router(a, block, run.device), router(b, block, run.device)
    if ra.tid2eid is not None and token_ids is None:
        token_ids = torch.randint(0, ra.tid2eid.shape[0], (x.shape[0],), generator=run.gen)
    token_ids = None if token_ids is None else token_ids.to(run.device)

    dst_fmt = kernel_format(b, block)
    modes = [m for m in (run.serve_modes or serve.default_modes(dst_fmt, run.capability)) if serve.applies(m, dst_fmt)]
    # A block the conversion kept in the source's format (MXFP4 MTP experts for SGLang): the
    # candidate's rows are the source's, so the source side runs none of them again.
    src_fmt = kernel_format(a, block)
    src_modes = [m for m in serve.source_modes(run.serve_modes, src_fmt, run.capability)
                 if not (src_fmt == dst_fmt and m in modes)]
    h_amax = []   # the source's intermediate (w2 input) range, for the calibrated input_scale

    def observe(h):
        h_amax.append(float(h.abs().max()) if h.numel() else 0.0)
        return h

    outputs, routed, fmts, serving, kernel_rel = [], [], [], [], None
    reference = None   # (source output, its routed part) by the torch reference: what W4A8 is judged against
    source_served = []
    for side, side_router in ((a, ra), (b, rb)):
        fmt = kernel_format(side, block)
        ids, weights = route(x, side_router, cfg, token_ids)
        calibrated = None if run.acts is None else (float(x.abs().max()), max(h_amax, default=0.0))
        w4a8 = bool(src_modes) if side is a else serve.W4A8 in modes
        w4a4, y_w4a8 = {}, None   # input scales -> W4A4 output; the MXFP8-activation output
        shared = expert_forward(x.float(), side_router.shared, cfg.activation) if side_router.shared else 0.0
        if fm is None:
            scales = []
            if side is b and "nvfp4-w4a4" in modes:
                scales = list(dict.fromkeys(w4a4_policies(side, block, calibrated).values()))
            variants = ([(x, observe if side is a else None)] + [w4a4_inputs(x, s) for s in scales]
                        + ([w4a8_inputs(x)] if w4a8 else []))
            ys = routed_experts_variants(variants, ids, weights, reference_experts(side, block, fmt),
                                         cfg.activation, workers=default_workers())
            y, ws, kernel_layer = ys[0], None, None
            w4a4 = dict(zip(scales, ys[1:1 + len(scales)]))
            y_w4a8 = ys[-1] if w4a8 else None
            if side is a:
                reference = ((y + shared).bfloat16(), y)
        else:
            ws = load_layer(side, block, fmt, cfg.n_routed_experts, run.device)
            kernel_layer = kernel_layout(fm, ws)
            y = run_kernel(fm, x, ids, weights, kernel_layer, cfg).float()
            if side is a or w4a8:
                variants = ([(x, observe)] if side is a else []) + ([w4a8_inputs(x)] if w4a8 else [])
                ys = routed_experts_variants(variants, ids, weights, ws.dense, cfg.activation)
                y_w4a8 = ys[-1] if w4a8 else None
                if side is a:
                    kernel_rel = metrics(ys[0], y)[0]
                    reference = ((ys[0] + shared).bfloat16(), ys[0])
        outputs.append((y + shared).bfloat16())
        routed.append(y)
        fmts.append((fmt, ids))

        def result(mode, policy, scales, flushed, y_mode, against, side_name="candidate"):
            out = (y_mode + shared).bfloat16()
            rel_m, cos_m, max_m = metrics(against[0], out)
            return ServingResult(mode, policy, scales, rel_m, cos_m, max_m, metrics(against[1], y_mode)[0], flushed,
                                 side_name)

        if side is a and y_w4a8 is not None:
            source_served.append(result(serve.W4A8, None, None, 0, y_w4a8, reference, "source"))
        if side is b:
            runner = Runner(fm=fm, side=side, block=block, fmt=fmt, cfg=cfg, x=x, ids=ids, weights=weights, y_bf16=y,
                            ws=ws, kernel_layer=kernel_layer, w4a4_outputs=w4a4, w4a8_output=y_w4a8)
            for mode, policy, scales, flushed, y_mode in runner.served(modes, calibrated):
                # MXFP8 runs are torch's: judged against the source's torch reference, not its kernel run
                against = reference if mode == serve.W4A8 else (outputs[0], routed[0])
                serving.append(result(mode, policy, scales, flushed, y_mode, against))
        del ws, kernel_layer
    serving += source_served
    (fa, ids_a), (fb, ids_b) = fmts
    agreement = float((ids_a.sort(-1).values == ids_b.sort(-1).values).all(-1).float().mean())
    rel, cos, max_abs = metrics(*outputs)
    routed_rel = metrics(*routed)[0]
    lossless = formats.get(fa).elements == formats.get(fb).elements
    max_rel, min_cos = LOSSLESS if lossless else LOSSY
    kernel_ok = kernel_rel is None or (math.isfinite(kernel_rel) and kernel_rel <= KERNEL_VS_REFERENCE)
    passed = (rel <= max_rel and cos >= min_cos and agreement == 1.0 and kernel_ok
              and all(math.isfinite(v) for v in (rel, cos, max_abs))
              and all(math.isfinite(s.rel_err) and math.isfinite(s.max_abs_err) for s in serving))
    return LayerResult(block, fa, fb, x.shape[0], ra.tid2eid is not None, rel, cos, max_abs, routed_rel, agreement,
                       kernel_rel, max_rel, min_cos, passed, serving)
