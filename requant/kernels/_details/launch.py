"""One GEMM launch of `_kernels.moe_gemm_kernel` from `layout.KernelWeights` and a `KernelConfig`:
the checks a launch needs, the scale layout it reads, the grid and the launch options."""

from __future__ import annotations

import torch
import triton.language as tl

from requant.errors import FormatError
from requant.kernels._details import _kernels
from requant.kernels._details.configs import ACTIVATION_CODES, KernelConfig
from requant.kernels._details.device import chains_launches, interpreting
from requant.kernels._details.layout import (K_STEP, K_TILE, ROW_PAD, SCALES_BLOCKS, SCALES_ROWS, SCALES_WORDS,
                                             TILE_ROWS, KernelWeights, cdiv, padded_k, row_scaled, scale_layout,
                                             scale_words)
from requant.moe import Activation

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


def activation_args(act: Activation | None) -> dict:
    """The kernels' activation constants for `act`; None (w2's launch, which gates nothing): zeros."""
    if act is None:
        return dict(ACTIVATION=0, LIMIT=0.0, ALPHA=0.0)
    return dict(ACTIVATION=ACTIVATION_CODES[act.kind], LIMIT=float(act.limit),
                ALPHA=0.0 if act.alpha is None else float(act.alpha))


def chains(t: torch.Tensor) -> bool:
    """Whether the launches on t's device chain by programmatic dependent launch: each starts its
    programs while the one before finishes, and they wait (`_kernels.wait_for_inputs`) before
    reading its output (docs/kernel-notes.md, "Launches chained by programmatic dependent launch")."""
    return _kernels.HAS_GDC and t.is_cuda and not interpreting() and chains_launches(t.device.index or 0)


def chained(t: torch.Tensor) -> dict:
    """A launch's PDL argument (its waits compiled in) and the launch option that lets it start
    before the previous launch ends, on t's device (`chains`)."""
    return {"PDL": True, "launch_pdl": True} if chains(t) else {"PDL": False}


def split(cfg: KernelConfig, k: int) -> int:
    """K slices for a GEMM of depth k: the most, up to cfg.split_k, that divide its K tiles."""
    return max(s for s in range(1, cfg.split_k + 1) if cdiv(k, cfg.block_k) % s == 0)


def launch_scales(cfg: KernelConfig, w: KernelWeights, w3: KernelWeights):
    """(SCALE_LAYOUT, w's scales, w3's) as the launch passes them (`layout.scale_layout`); as stored
    where the int32 views do not exist."""
    if w.scale.dim() == 5:  # `kernel_weights` put them in blocks
        return SCALES_BLOCKS, w.scale, w3.scale
    if scale_layout(cfg, w.group, w.scale.element_size(), w.k) == SCALES_WORDS:
        words, words3 = scale_words(w.scale), scale_words(w3.scale)
        if words is not None and words3 is not None and words.stride() == words3.stride():
            return SCALES_WORDS, words, words3
    return SCALES_ROWS, w.scale, w3.scale


def launch(a, a_row_div, w, w3, out, sorted_ids, block_expert, route_w, num_pairs, compute, cfg, act,
           bias=None, bias3=None, perm_out=False, routing_ready=False):
    """One GEMM launch; `out` is [pairs, N], or when split (`split`) or w1/w3 apart FP32 partials
    [S, pairs, N] ([S, 2, pairs, N] for w1/w3). `act` (requant.moe.Activation) is fused after w1/w3 unless
    split or apart. routing_ready: sorted_ids, block_expert and route_w were written before the
    launch that precedes this one, so under programmatic dependent launch its programs read them
    (and the global scales) before they wait for that launch: w2's, after w1/w3."""
    if w.k % K_STEP or cfg.block_k != K_TILE or w.group % 8:
        raise ValueError(f"K={w.k}, group {w.group} do not fit block_k={cfg.block_k} (the kernel takes K tiles of "
                         f"{K_TILE}, the 16 words that `mma_tile` lays out, K a multiple of {K_STEP} and groups of "
                         "whole words)")
    if w.words.shape[1] * TILE_ROWS % cfg.block_n:
        raise ValueError(f"block_n={cfg.block_n} does not divide the weights' {ROW_PAD}-row blocks")
    if a.shape[1] != padded_k(w.k):
        raise ValueError(f"A has {a.shape[1]} columns, not K={w.k} padded to whole tiles (`permute_k`)")
    gated = w3 is not None
    if gated and (w3.format != w.format or (w3.n, w3.k) != (w.n, w.k) or w3.scale.shape != w.scale.shape
                  or (w3.zero_point is None) != (w.zero_point is None)):
        raise FormatError("w1 and w3 must share format and shapes")
    w3 = w3 if gated else w
    words, words3 = w.words, w3.words
    if words3.stride() != words.stride() or w3.scale.stride() != w.scale.stride():
        raise FormatError("w1 and w3 must share strides")
    dummy = words
    zp, zp3 = (w.zero_point, w3.zero_point) if w.zero_point is not None else (dummy, dummy)
    gs, gs3 = (w.global_scale, w3.global_scale) if w.global_scale is not None else (dummy, dummy)
    b, b3 = (bias, bias3 if gated else bias) if bias is not None else (dummy, dummy)
    slices = split(cfg, w.k)
    apart = gated and cfg.gate_up_apart
    partials = slices > 1 or apart   # FP32 partials [S, pairs, N] ([S, 2, pairs, N] for w1/w3)
    n_tiles = cdiv(padded_k(w.n) if perm_out else w.n, cfg.block_n)  # PERM_OUT pads the next GEMM's K
    layout, scale, scale3 = launch_scales(cfg, w, w3)
    grid = (n_tiles, block_expert.numel(), slices * (2 if apart else 1))
    return _kernels.moe_gemm_kernel[grid](
        a, a.stride(0),
        words, scale, gs, zp,
        words3, scale3, gs3, zp3,
        words.stride(0), words.stride(1), scale.stride(0), scale.stride(1),  # with blocks: 64-row blocks
        zp.stride(0), zp.stride(1),
        b, b3, b.stride(0), b.stride(1),
        out, out.stride(-2), out.stride(0) if partials else 0, out.stride(1) if gated and partials else 0,
        sorted_ids, block_expert, route_w if route_w is not None else out,
        num_pairs, w.n, w.k,
        A_ROW_DIV=a_row_div, FMT=w.kernel_code, GROUP=w.group, HAS_ZP=w.zero_point is not None,
        HAS_GLOBAL=w.global_scale is not None, HAS_BIAS=bias is not None, GATED=gated and not apart,
        ROUTE_WEIGHT=route_w is not None, **activation_args(act), COMPUTE=TL_DTYPES[compute], ASM=compute != torch.float32,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32", PERM_OUT=perm_out,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=slices,
        EVEN_K=w.k % cfg.block_k == 0, APART=apart,
        PIPELINED_SCALES=cfg.pipelined_scales and layout != SCALES_ROWS, ROUTING_READY=routing_ready,
        SCALE_LAYOUT=layout, ROW_SCALES=row_scaled(cfg, w.kernel_code, w.group, layout), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **chained(a), **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
