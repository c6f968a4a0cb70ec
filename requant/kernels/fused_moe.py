"""Fused-MoE grouped GEMM over 4-bit expert weights as requant reads and writes them.

Weights stay packed in device memory as int32 words of 8 nibbles, their bits moved once into the
kernel's layout and stored in 4 KB blocks of 64 rows by one K tile (`kernel_weights`); each
program dequantizes its weight tile in registers (on the GPU with packed bf16x2 PTX, about 2
instructions per weight) and feeds it to the tensor cores (`tl.dot`, wgmma) against BF16
activations, accumulating in FP32. K is padded to whole 128-wide tiles, the last one masked
(`padded_k`).
The tile is built in the order of wgmma's register operand (`_decode.mma_tile`), so the dequantized
weights never pass through shared memory.

The GEMM is computed transposed (weights x activations^T): the token count per expert (often tiny
when decoding) becomes the MMA's N dimension, which may be as small as 8-16, while the weight rows
fill the 64-row M dimension.

Pairs (token, k) are sorted by expert and padded per expert to the M tile (`moe_align`), as
serving engines do. Four launches: one prepares the GEMMs' inputs (`prepare`: the align and the
activations' cast and column order), then w1/w3 with their biases and the gated activation fused
(the recipe's, a `requant.moe.Activation`), w2 with its bias and the routing weight, and
the top-k sum (`topk_sum`). Where K is split (one token's default) or w1 and w3 are computed by
separate programs (`KernelConfig.gate_up_apart`), a fifth launch gates their FP32 partials. On
Hopper and later the launches are chained by programmatic dependent launch (`launch.chains`), so each
starts while the one before ends.

Under TRITON_INTERPRET=1 (CPU) bf16 dots and arithmetic are wrong, so everything takes a compute
dtype: float32 there, bfloat16 on the GPU.

Internals, one job a module, are in `requant.kernels._details` (its docstring lists them); this
module is the op and the names other modules use.
"""

from __future__ import annotations

import torch
import triton

from requant.errors import FormatError, UnsupportedError
from requant.engines.numerics import fake_quantize_activations
from requant.kernels._details import _kernels
from requant.kernels._details.align import ALIGN_PAIRS, align_torch, max_blocks
from requant.kernels._details.configs import ACTIVATION_CODES, KernelConfig, Problem, launch_config
from requant.kernels._details.configs import default_config  # noqa: F401 (callers' name for the built-in rule)
from requant.kernels._details.device import device_config_name, interpreting
from requant.kernels._details.launch import TL_DTYPES, activation_args, chained, chains, launch, split
from requant.kernels._details.layout import K_STEP, K_TILE, kernel_weights, padded_k, permute_k
from requant.kernels._details.layout import KernelWeights  # noqa: F401 (what kernel_weights makes)
from requant.kernels.weights import ExpertWeights
from requant.moe import Activation


def fits(hidden_size: int, intermediate_size: int) -> bool:
    """Whether the kernel takes a layer's two K dimensions (gate/up: hidden, down: intermediate)."""
    return hidden_size % K_STEP == 0 and intermediate_size % K_STEP == 0


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, k) pairs by expert, padding each expert's run to a multiple of block_m.

    Returns `sorted_ids` (pair index = token * top_k + k, or the pair count as padding) and
    `block_expert` (expert of each block of block_m rows, -1 for unused blocks). Sizes are upper
    bounds known on the host, so nothing waits for the device. One launch up to ALIGN_PAIRS pairs
    (`prepare`), a dozen torch operations beyond (`align.align_torch`, the same result).
    """
    _, sorted_ids, block_expert = prepare(None, topk_ids, num_experts, block_m, None)
    return sorted_ids, block_expert


def prepare(x: torch.Tensor | None, topk_ids: torch.Tensor, num_experts: int, block_m: int,
            compute: torch.dtype | None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The GEMMs' inputs: A = x in the compute dtype, permuted and padded as `permute_k` does (None
    without x), and `moe_align`'s sorted_ids and block_expert. One launch (`_kernels.prologue_kernel`)
    at decode sizes, where the launches, not the work, took the time."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    blocks = max_blocks(pairs, num_experts, block_m)
    align = pairs <= ALIGN_PAIRS
    if align:
        sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    else:
        sorted_ids, block_expert = align_torch(topk_ids, num_experts, block_m)
    rows, a = 0, None
    if x is not None:
        rows = x.shape[0]
        a = torch.empty(rows, padded_k(x.shape[1]), dtype=compute, device=device)
    if align or rows:
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        xa = a if x is None else x  # (unused without x)
        _kernels.prologue_kernel[(int(align) + rows,)](
            ids, sorted_ids, block_expert, pairs, num_experts, blocks,
            xa, 0 if x is None else x.stride(0), 0 if x is None else x.stride(1), 0 if x is None else x.shape[1],
            a if a is not None else sorted_ids, 0 if a is None else a.stride(0),
            ALIGN=align, BLOCK_M=block_m, PAIRS=triton.next_power_of_2(max(pairs, 2)) if align else 2,
            EXPERTS=triton.next_power_of_2(num_experts + 1), BLOCKS=min(32, triton.next_power_of_2(blocks)),
            BLOCK_K=K_TILE, CHUNK=1024, PDL=chains(topk_ids), num_warps=4)
    return a, sorted_ids, block_expert


def gate_up(a, top_k, w1, w3, sorted_ids, block_expert, pairs, compute, cfg, act, b1=None, b3=None,
            perm_out=True) -> torch.Tensor:
    """The intermediate h [pairs, I] (compute dtype) = act(a W1.T + b1, a W3.T + b3) for a's rows,
    its columns permuted for `down` when perm_out (and then zero-padded to whole K tiles)."""
    h = torch.empty(pairs, padded_k(w1.n) if perm_out else w1.n, dtype=compute, device=a.device)
    slices = split(cfg, w1.k)
    if slices == 1 and not cfg.gate_up_apart:
        launch(a, top_k, w1, w3, h, sorted_ids, block_expert, None, pairs, compute, cfg, act, b1, b3,
                perm_out=perm_out)
        return h
    part = torch.empty(slices, 2, pairs, w1.n, dtype=torch.float32, device=a.device)
    launch(a, top_k, w1, w3, part, sorted_ids, block_expert, None, pairs, compute, cfg, act, b1, b3)
    block = 1024
    _kernels.swiglu_partials_kernel[(pairs, triton.cdiv(h.shape[1], block))](
        part, part.stride(0), part.stride(1), h, h.stride(0), w1.n, **activation_args(act),
        SPLIT_K=slices, PERM_OUT=perm_out, BLOCK_K=cfg.block_k,
        BLOCK=block, num_warps=4, **chained(part))
    return h


def down(h, w2, sorted_ids, block_expert, route_w, pairs, compute, cfg, b2=None) -> torch.Tensor:
    """Per-pair outputs (h W2.T + b2) * routing weight (route_w: [pairs], any float dtype): [S, pairs,
    H], FP32 partials when split (S slices), else the compute dtype (BF16 on the GPU halves this
    buffer's traffic). cfg: the layer's config, whose `down` applies where it has one."""
    cfg = cfg.down or cfg
    slices = split(cfg, w2.k)
    dtype = torch.float32 if slices > 1 else compute
    y = torch.empty(slices, pairs, w2.n, dtype=dtype, device=h.device)
    launch(h, 1, w2, None, y if slices > 1 else y[0], sorted_ids, block_expert, route_w, pairs, compute, cfg, None,
            b2, routing_ready=True)
    return y


def _check_biases(b1, b3, b2, w1, w2):
    if (b1 is None) != (b3 is None):
        raise FormatError("gate and up biases come together: give both b1 and b3 or neither")
    for name, b, n in (("b1", b1, w1.n), ("b3", b3, w1.n), ("b2", b2, w2.n)):
        if b is not None and tuple(b.shape) != (w1.experts, n):
            raise FormatError(f"{name} must be [E, N]=[{w1.experts}, {n}], got {list(b.shape)}")
    if b1 is not None and b1.stride() != b3.stride():
        raise FormatError("b1 and b3 must share strides")


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w1: ExpertWeights, w3: ExpertWeights, w2: ExpertWeights, *, activation: Activation,
              b1: torch.Tensor | None = None, b3: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              compute_dtype: torch.dtype | None = None, config: KernelConfig | None = None,
              activation_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] (BF16): sum_k w_k * (act(x W1_e.T + b1_e, x W3_e.T + b3_e) W2_e.T + b2_e).

    x: [T, H] activations; topk_ids: [T, top_k] expert indices; topk_weights: [T, top_k] routing
    weights. w1 (gate), w3 (up): N = intermediate, K = H; w2 (down): N = H, K = intermediate.
    activation: the model's gated activation as its recipe defines it (model.ModelSpec.activation(),
    built by requant.moe.activation), no default: kind "swiglu_clamp" (silu(min(g, L)) * clamp(u, -L, L))
    or "swiglu_oai" ((clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g'), g' = min(g, L)), L = its limit.
    b1, b3: [E, I] and b2: [E, H] per-expert biases (any float dtype, any strides), optional; b2 is
    added before the routing weight multiplies the expert's output.
    gpt-oss's fused, interleaved gate/up (rows 2i gate, 2i+1 up): pass row views,
    w1 = ExpertWeights(fmt, packed[:, 0::2], scale[:, 0::2]), w3 the same with 1::2, and likewise
    b1 = bias[:, 0::2], b3 = bias[:, 1::2] (INT4 zero points, packed 8 rows to a word, cannot be
    split so: de-interleave those first); scales and biases are read through the views, the
    weights' kernel layout is a contiguous copy.
    activation_scales: (input_scale of w1/w3, of w2) to emulate a W4A4 engine: each GEMM's input
    (x, then the BF16 intermediate) is quantized to NVFP4 and decoded before the weights meet it.
    w1, w3, w2: ExpertWeights as stored (put into the kernel's layout on every call, one pass over
    them) or KernelWeights (`kernel_weights`, made once).
    compute_dtype: the GEMM inputs' dtype: BF16 on the GPU by default, FP32 under the interpreter.
    """
    compute = compute_dtype or (torch.float32 if interpreting() else torch.bfloat16)
    if compute not in TL_DTYPES:
        raise ValueError(f"compute dtype {compute} is not one of {sorted(map(str, TL_DTYPES))}")
    w1, w3, w2 = (kernel_weights(w) for w in (w1, w3, w2))
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if (w1.k, w2.n, w2.k) != (hidden, hidden, w1.n) or w1.experts != w2.experts:
        raise FormatError(f"expert shapes w1 [{w1.experts}, {w1.n}, {w1.k}] w2 [{w2.experts}, {w2.n}, {w2.k}] "
                          f"do not fit hidden size {hidden}")
    _check_biases(b1, b3, b2, w1, w2)
    if activation.kind not in ACTIVATION_CODES:
        raise UnsupportedError(f"the kernel fuses no activation {activation.kind!r} (it has: {', '.join(ACTIVATION_CODES)})")
    problem = Problem(w1.format, w1.group, w1.experts, hidden, w1.n, top_k)
    cfg = config or launch_config(problem, tokens, device_config_name(x.device))
    if activation_scales is not None:
        x = fake_quantize_activations(x.bfloat16(), activation_scales[0])
    a, sorted_ids, block_expert = prepare(x, topk_ids, w1.experts, cfg.block_m, compute)
    quantize_h = activation_scales is not None  # in the natural column order, then permuted here
    h = gate_up(a, top_k, w1, w3, sorted_ids, block_expert, pairs, compute, cfg, activation, b1, b3,
                perm_out=not quantize_h)
    if quantize_h:
        h = permute_k(fake_quantize_activations(h.bfloat16(), activation_scales[1]).to(compute), cfg.block_k)
    y = down(h, w2, sorted_ids, block_expert, topk_weights.contiguous(), pairs, compute, cfg, b2)
    return topk_sum(y, top_k)


def topk_sum(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, H] BF16 from `down`'s [S, T * top_k, H]: the sum over slices and top-k in FP32, one launch."""
    slices, pairs, hidden = y.shape
    # Triton's interpreter truncates to BF16 (the GPU rounds): there torch rounds the FP32 sums.
    out = torch.empty(pairs // top_k, hidden, dtype=torch.float32 if interpreting() else torch.bfloat16,
                      device=y.device)
    block = 1024
    _kernels.topk_sum_kernel[(pairs // top_k, triton.cdiv(hidden, block))](
        y, y.stride(0), y.stride(1), out, hidden, SLICES=slices, TOP_K=top_k, BLOCK=block, num_warps=4, **chained(y))
    return out.to(torch.bfloat16)
