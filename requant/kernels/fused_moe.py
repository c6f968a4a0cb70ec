"""Fused-MoE grouped GEMM over 4-bit expert weights as requant reads and writes them.

Weights stay packed in device memory as int32 words of 8 nibbles, their bits moved once into the
kernel's layout and stored in 4 KB blocks of 64 rows by one K tile (`kernel_weights`); each
program dequantizes its weight tile in registers (on the GPU with packed bf16x2 PTX, about 2
instructions per weight) and feeds it to the tensor cores (`tl.dot`, wgmma) against BF16
activations, accumulating in FP32. K is padded to whole 128-wide tiles, the last one masked
(`padded_k`).
The tile is built in the order of wgmma's register operand (`_mma_tile`), so the dequantized
weights never pass through shared memory.

The GEMM is computed transposed (weights x activations^T): the token count per expert (often tiny
when decoding) becomes the MMA's N dimension, which may be as small as 8-16, while the weight rows
fill the 64-row M dimension.

Pairs (token, k) are sorted by expert and padded per expert to the M tile (`moe_align`), as
serving engines do. Four launches: one prepares the GEMMs' inputs (`prepare`: the align and the
activations' cast and column order), then w1/w3 with their biases and the gated activation fused
(`SwiGLU`: DeepSeek's clamped SwiGLU or gpt-oss's), w2 with its bias and the routing weight, and
the top-k sum (`topk_sum`). Where K is split (one token's default) or w1 and w3 are computed by
separate programs (`KernelConfig.gate_up_apart`), a fifth launch gates their FP32 partials. On
Hopper and later the launches are chained by programmatic dependent launch (`_pdl`), so each
starts while the one before ends.

Under TRITON_INTERPRET=1 (CPU) bf16 dots and arithmetic are wrong, so everything takes a compute
dtype: float32 there, bfloat16 on the GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
try:  # Triton >= 3.4: grid dependency control, for programmatic dependent launch (Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

from requant import formats
from requant.errors import FormatError
from requant.formats import int4, mxfp4, nvfp4
from requant.formats.engine_numerics import fake_quantize_activations
from requant.kernels.weights import ExpertWeights  # noqa: F401 (callers build it from here too)

NVFP4 = tl.constexpr(nvfp4.CODEC.kernel_code)
MXFP4 = tl.constexpr(mxfp4.CODEC.kernel_code)
INT4 = tl.constexpr(int4.CODEC.kernel_code)

# NVFP4's BF16 route ("e2m1_folded"): E4M3 block scales come times 2^119 (`_scale_bf16_bits`), the
# decoded weights 2^(126 - 119) = 2^7 below the true ones, which the accumulator takes back.
_SCALE_FOLD = 119
_SCALE_FOLD_BITS = tl.constexpr(_SCALE_FOLD << 7)              # added to a BF16 exponent field
_FOLDED_WEIGHT_FACTOR = tl.constexpr(2.0 ** (126 - _SCALE_FOLD))

# The weights' and scales' block layout (`tile_blocks`): 64 rows (one wgmma M tile) by one K tile.
TILE_ROWS = 64
ROW_PAD = 128  # rows padded to whole blocks of the widest N tile a config takes
W_TILE_ROWS = tl.constexpr(TILE_ROWS)
# How a launch reads the block scales (`scale_layout`): as stored, in `tile_blocks`' blocks, or
# as stored through an int32 view
SCALES_ROWS = tl.constexpr(0)
SCALES_BLOCKS = tl.constexpr(1)
SCALES_WORDS = tl.constexpr(2)

SWIGLU_CLAMP = tl.constexpr(0)
SWIGLU_OAI = tl.constexpr(1)
_ACTIVATION_CODES = {"swiglu_clamp": 0, "swiglu_oai": 1}


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _pdl(t: torch.Tensor) -> bool:
    """Whether the launches on t's device chain by programmatic dependent launch: each starts its
    programs while the one before finishes, and they wait (`_wait_for_inputs`) before reading its
    output. On the H200 that took 3 us off a one-token step's 52 (scripts/bench_moe_results.md, run 11)."""
    return gdc_wait is not None and t.is_cuda and not interpreting() and _pdl_device(t.device.index or 0)


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """Under programmatic dependent launch (`_pdl`): wait until the previous launch has finished and
    its writes are visible, then (TRIGGER) let the next launch start its programs."""
    if PDL:
        gdc_wait()
        if TRIGGER:
            gdc_launch_dependents()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class KernelConfig:
    block_m: int      # pairs per program (the MMA's N dimension)
    block_n: int      # weight rows per program (the MMA's M dimension: 64 per warpgroup on Hopper)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs per output tile along K, FP32 partial sums combined afterwards
    # w1 and w3 by separate programs, their FP32 outputs gated afterwards: half the registers of
    # a program holding both, so more programs fit an SM
    gate_up_apart: bool = False
    max_registers: int | None = None  # per thread (ptxas's maxnreg): fewer let more programs share an SM
    # Block scales fetched stages ahead with the words, where a row's scales per K tile are 4 bytes
    # or more (`scale_layout`); off, they are loaded one tile ahead by hand
    pipelined_scales: bool = True
    # Where a group spans the K tile (INT4 g128): the tile's codes go to the MMA unscaled and each
    # row's scale multiplies the tile's FP32 product, one FFMA per accumulator element instead of
    # one HMUL2 per pair of weights. Fewer instructions at 16 pairs a program; at prefill sizes
    # more, and the MMA could no longer run ahead of the next tile's dequantization
    scale_after_dot: bool = False
    # The down GEMM's own config, where it differs (`down`); the same block_m, since both GEMMs
    # take one alignment of the pairs
    down: KernelConfig | None = None

    def __post_init__(self):
        if self.down is not None and (self.down.block_m != self.block_m or self.down.down is not None):
            raise ValueError(f"the down GEMM's config must have block_m={self.block_m} and no down config of its own")


@dataclass(frozen=True)
class SwiGLU:
    """The gated activation between the two GEMMs, gate g and up u clamped by `limit` first
    (g from above, u on both sides):
    "swiglu_clamp" (DeepSeek-V4): silu(g) * u;
    "swiglu_oai" (gpt-oss): (u + 1) * g * sigmoid(alpha * g)."""

    kind: str = "swiglu_clamp"
    limit: float = 10.0
    alpha: float = 1.0  # swiglu_oai only

    def __post_init__(self):
        if self.kind not in _ACTIVATION_CODES:
            raise ValueError(f"unknown activation {self.kind!r}; expected one of {sorted(_ACTIVATION_CODES)}")


def default_config(pairs: int, experts: int, kernel_code: int | None = None) -> KernelConfig:
    """The config for `pairs` (token, expert) pairs over `experts` experts, in the format with this
    kernel code (None: any)."""
    if interpreting():
        # Few, large programs: the interpreter's cost is per program and per op, not per element.
        return KernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=1)
    per_expert = pairs / experts
    # From the H200 sweep (scripts/bench_moe_results.md): BLOCK_K 128 beat 256 at decode sizes.
    if per_expert <= 16:
        if pairs <= 8:
            # One token touches top_k experts only: two K slices give every SM weights to stream.
            # With the weights in blocks w1 and w3 in one program beat them apart (and apart with
            # 80 registers, the default of runs 12-14) by 2-5% (scripts/bench_moe_results.md, run 15).
            # Three stages, and 128 rows a program for the down GEMM (its 384 programs one wave, at
            # 3 an SM): INT4 4% faster than four stages and 64 rows, NVFP4 the same (run 16).
            # INT4 g128's scales after the MMA in w2 only: 4% faster; in w1/w3 too, 2% slower than
            # that, each tile's MMA waited for with few programs to cover the wait (run 17).
            return KernelConfig(16, 64, 128, num_warps=4, num_stages=3, split_k=2,
                                down=KernelConfig(16, 128, 128, num_warps=4, num_stages=3, split_k=2,
                                                  scale_after_dot=True))
        # From 4 tokens on no split is best (run 4b). With the weights in blocks, w1 and w3 in one
        # program and the down GEMM in 128-row programs were 2-7% faster at 16 and 64 tokens
        # than w1 and w3 apart (run 12's choice) and 64 rows (scripts/bench_moe_results.md, run 16).
        # INT4 g128's scales after the MMA: 8-10% faster at 16 and 64 tokens (run 17).
        return KernelConfig(16, 64, 128, num_warps=4, num_stages=4, scale_after_dot=True,
                            down=KernelConfig(16, 128, 128, num_warps=4, num_stages=4, scale_after_dot=True))
    # NVFP4's scales in the pipeline were 3% slower at 4096-16384 tokens (run 14; not measured at
    # 256-1024), INT4's with groups of 32 faster at every size; no format named: by hand, as before.
    pipelined = kernel_code is not None and kernel_code != nvfp4.CODEC.kernel_code
    if per_expert <= 32:
        return KernelConfig(32, 64, 128, num_warps=4, num_stages=4, pipelined_scales=pipelined)
    if per_expert <= 64:
        return KernelConfig(64, 128, 128, num_warps=8, num_stages=4, pipelined_scales=pipelined)
    return KernelConfig(128, 128, 128, num_warps=8, num_stages=3, pipelined_scales=pipelined)


ALIGN_PAIRS = 2048  # pairs up to which one program aligns them (`_align`); beyond, torch's sort


def _max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """The most M blocks `pairs` pairs can fill: at most n = min(num_experts, pairs) experts get
    pairs, expert e takes ceil(c_e / block_m) <= (c_e + block_m - 1) / block_m blocks, and the sum is
    a whole number <= (pairs + n (block_m - 1)) / block_m. Reached when every expert but one has one
    pair. (cdiv(pairs, block_m) + n, as before, gave a block to spare at one token: 7 for 6 pairs,
    so 128 of each GEMM's 896 programs found no expert.)"""
    n = min(num_experts, pairs)
    return n + (pairs - n) // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, k) pairs by expert, padding each expert's run to a multiple of block_m.

    Returns `sorted_ids` (pair index = token * top_k + k, or the pair count as padding) and
    `block_expert` (expert of each block of block_m rows, -1 for unused blocks). Sizes are upper
    bounds known on the host, so nothing waits for the device. One launch up to ALIGN_PAIRS pairs
    (`prepare`), a dozen torch operations beyond.
    """
    _, sorted_ids, block_expert = prepare(None, topk_ids, num_experts, block_m, None)
    return sorted_ids, block_expert


def _moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (block_end - blocks)[expert_of] * block_m + rank
    max_blocks = _max_blocks(pairs, num_experts, block_m)
    sorted_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def prepare(x: torch.Tensor | None, topk_ids: torch.Tensor, num_experts: int, block_m: int,
            compute: torch.dtype | None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The GEMMs' inputs: A = x in the compute dtype, permuted and padded as `permute_k` does (None
    without x), and `moe_align`'s sorted_ids and block_expert. One launch (`_prologue_kernel`) at
    decode sizes, where the launches, not the work, took the time."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = _max_blocks(pairs, num_experts, block_m)
    align = pairs <= ALIGN_PAIRS
    if align:
        sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    else:
        sorted_ids, block_expert = _moe_align_torch(topk_ids, num_experts, block_m)
    rows, a = 0, None
    if x is not None:
        rows = x.shape[0]
        a = torch.empty(rows, padded_k(x.shape[1]), dtype=compute, device=device)
    if align or rows:
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        xa = a if x is None else x  # (unused without x)
        _prologue_kernel[(int(align) + rows,)](
            ids, sorted_ids, block_expert, pairs, num_experts, max_blocks,
            xa, 0 if x is None else x.stride(0), 0 if x is None else x.stride(1), 0 if x is None else x.shape[1],
            a if a is not None else sorted_ids, 0 if a is None else a.stride(0),
            ALIGN=align, BLOCK_M=block_m, PAIRS=triton.next_power_of_2(max(pairs, 2)) if align else 2,
            EXPERTS=triton.next_power_of_2(num_experts + 1), BLOCKS=min(32, triton.next_power_of_2(max_blocks)),
            BLOCK_K=K_TILE, CHUNK=1024, PDL=_pdl(topk_ids), num_warps=4)
    return a, sorted_ids, block_expert


@triton.jit
def _prologue_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks,
                     x_ptr, stride_xm, stride_xk, K, a_ptr, stride_am,
                     ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
                     BLOCKS: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program 0 (if ALIGN) aligns the pairs (`_align`); each further program writes one row of A
    (`_permute_row`). Without ALIGN `_align` is not compiled: its sort would not fit PAIRS there."""
    pid = tl.program_id(0)
    if PDL:  # launched as usual; the GEMM after it may start its programs now, they wait for it
        gdc_launch_dependents()
    if ALIGN:
        if pid == 0:
            _align(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks, BLOCK_M, PAIRS,
                   EXPERTS, BLOCKS)
        else:
            _permute_row(x_ptr, stride_xm, stride_xk, K, a_ptr, stride_am, pid - 1, BLOCK_K, CHUNK)
    else:
        _permute_row(x_ptr, stride_xm, stride_xk, K, a_ptr, stride_am, pid, BLOCK_K, CHUNK)


@triton.jit
def _permute_row(x_ptr, stride_xm, stride_xk, K, a_ptr, stride_am, row, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """A's row: x's row cast, its columns in `permute_k`'s order, zeros up to whole K tiles."""
    row = row.to(tl.int64)
    width = tl.cdiv(K, BLOCK_K) * BLOCK_K
    for c0 in range(0, width, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        t = p % BLOCK_K  # column 32q + 8m + 2l + n0 of a tile holds x's 32l + 8q + 2m + n0
        col = p - t + ((t >> 1) & 3) * 32 + (t >> 5) * 8 + ((t >> 3) & 3) * 2 + (t & 1)
        v = tl.load(x_ptr + row * stride_xm + col * stride_xk, mask=col < K, other=0.0)
        tl.store(a_ptr + row * stride_am + p, v.to(a_ptr.dtype.element_ty), mask=p < width)


@triton.jit
def _align(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks, BLOCK_M: tl.constexpr,
           PAIRS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr):
    """`moe_align` in one program, for up to PAIRS pairs and EXPERTS - 1 experts (the last bin
    counts the padding): a histogram and its prefix sums give each expert's first block and first
    place in the pairs sorted by expert; each slot of each block then looks its pair up."""
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
    e = tl.arange(0, EXPERTS)
    counts = tl.where(e < num_experts, tl.histogram(ids, EXPERTS), 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    block_start = block_end - blocks
    pair_start = tl.cumsum(counts, 0) - counts
    order = tl.sort(ids * PAIRS + offs) % PAIRS  # pair indices by expert, in pair order within one
    slot = tl.arange(0, BLOCK_M)
    for b0 in range(0, max_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)  # searchsorted, right
        used = expert < num_experts
        tl.store(block_expert_ptr + b, tl.where(used, expert, -1), mask=b < max_blocks)
        ex = tl.minimum(expert, num_experts - 1)
        rank = (b - tl.gather(block_start, ex, 0))[:, None] * BLOCK_M + slot[None, :]
        real = used[:, None] & (rank < tl.gather(counts, ex, 0)[:, None])
        src = tl.where(real, tl.gather(pair_start, ex, 0)[:, None] + rank, 0)
        pair = tl.reshape(tl.gather(order, tl.reshape(src, (BLOCKS * BLOCK_M,)), 0), (BLOCKS, BLOCK_M))
        dest = b[:, None] * BLOCK_M + slot[None, :]
        tl.store(sorted_ids_ptr + dest, tl.where(real, pair, num_pairs), mask=(b < max_blocks)[:, None])


@triton.jit
def _e4m3_to_f32(b):
    b = b.to(tl.int32)
    normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = (b & 7).to(tl.float32) * 0.001953125  # mantissa/8 * 2^-6
    v = tl.where(((b >> 3) & 15) == 0, subnormal, normal)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _e8m0_to_f32(b):
    b = b.to(tl.int32)
    # Byte 0 is 2^-127, an FP32 subnormal; 0xFF (NaN) is rejected on the host.
    return tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_f32(raw, FMT: tl.constexpr):
    if FMT == NVFP4:
        v = _e4m3_to_f32(raw)
    elif FMT == MXFP4:
        v = _e8m0_to_f32(raw)
    else:
        v = raw.to(tl.float32)
    return v


@triton.jit
def _scale_bf16_bits(raw, FMT: tl.constexpr):
    """Block scales as BF16 bit patterns (int16); exact for E4M3, E8M0 and BF16 alike. E4M3 comes
    times 2^119 (`_pair_asm`'s "e2m1_folded"): every nonzero E4M3 value is a normal BF16, so that is
    119 more in the exponent field, at most 135 + 119 = 254 (448)."""
    if FMT == NVFP4:
        b = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where((b & 0x7FFF) == 0, b, b + _SCALE_FOLD_BITS).to(tl.int16)
    elif FMT == MXFP4:
        b = raw.to(tl.int32)
        bits = tl.where(b == 0, 0x40, b << 7).to(tl.int16)  # byte 0 = 2^-127, a BF16 subnormal
    else:
        bits = raw.to(tl.int16, bitcast=True)
    return bits


@triton.jit
def _nibble_f32(nib, zero, FMT: tl.constexpr):
    """FP32 value of 4-bit codes: E2M1, or INT4 minus its zero point (8 when symmetric)."""
    if FMT == INT4:
        return (nib - zero).to(tl.float32)
    # E2M1 -> FP32 bits: magnitude eem (ee > 0) is 2^(ee-1) * (1 + m/2), i.e. exponent ee + 126
    # with m as the top mantissa bit; magnitude 1 is the subnormal 0.5, magnitude 0 is zero.
    mag = nib & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 0x3F000000, 0))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


# The kernel's word layout. Byte pair m of a word (nibbles 2m and 2m + 1: the two adjacent K
# columns that one bf16x2 register of the MMA operand holds) is decoded from a 32-bit register
# holding nibble 2m's bits in its low half and nibble 2m + 1's 16 bits up, each bit of a nibble
# (mantissa or value bit 0 first, sign or bit 3 last) at `NIBBLE_BITS` of its half:
# - E2M1: mantissa and exponent at BF16 bits 6-8 (exponent LSBs and top mantissa bit), sign at 15:
#   that is the code times 2^-126 (exponent 0 gives the subnormal 0.5);
# - INT4: bits 0-3, OR-ed into 128.0's mantissa, then 128 + zero subtracted.
# In stored order a pair takes a byte permute, a shift and two masks. `kernel_words` moves every
# bit once, when the weights are loaded (as engines repack theirs), to where each pair is the OR
# of `PAIR_TERMS`' (left rotation, mask) terms of the word: one term for 3 of E2M1's 4 pairs and
# all of INT4's, two for E2M1's last (no rotations place all four pairs with one term each: an
# exhaustive search over 32-bit rotations, and over funnel shifts of two words, found none).
NIBBLE_BITS = {"e2m1": (6, 7, 8, 15), "integer": (0, 1, 2, 3)}
PAIR_TERMS = {
    "e2m1": (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((10, 0x81C081C0),), ((6, 0x80C080C0), (14, 0x01000100))),
    "integer": tuple((((32 - 4 * m) % 32, 0x000F000F),) for m in range(4)),
}
_LAYOUTS = {nvfp4.CODEC.kernel_code: "e2m1", mxfp4.CODEC.kernel_code: "e2m1", int4.CODEC.kernel_code: "integer"}


def _signed(bits: int) -> int:
    """A 32-bit pattern as the int32 holding it."""
    return bits - (1 << 32) if bits >> 31 else bits


def _bit_moves(layout: str) -> list[tuple[int, int]]:
    """(mask of stored bits, left rotation) pairs that take a stored word to the kernel's layout:
    bit b of nibble 2m + h goes to the register bit NIBBLE_BITS[b] + 16h of pair m, which its term
    (r, mask) reads from word bit (that - r) mod 32."""
    moves: dict[int, int] = {}
    for m, terms in enumerate(PAIR_TERMS[layout]):
        for h in range(2):
            for b, bit in enumerate(NIBBLE_BITS[layout]):
                target = bit + 16 * h
                r = next(r for r, mask in terms if mask >> target & 1)
                stored = 4 * (2 * m + h) + b
                rotation = ((target - r) - stored) % 32
                moves[rotation] = moves.get(rotation, 0) | 1 << stored
    return sorted((mask, r) for r, mask in moves.items())


def _rotl_torch(x: torch.Tensor, r: int) -> torch.Tensor:
    # int32 shifts: << wraps, >> is arithmetic, so the bits shifted in from the left are masked off.
    return x if r == 0 else (x << r) | ((x >> (32 - r)) & ((1 << r) - 1))


def kernel_words(words: torch.Tensor, kernel_code: int) -> torch.Tensor:
    """int32 words (8 nibbles, element 8w + j in bits 4j) with their bits in the kernel's layout for
    the format with this kernel code: a fixed permutation of each word's 32 bits, same size."""
    out = torch.zeros_like(words)
    for mask, r in _bit_moves(_LAYOUTS[kernel_code]):
        out |= _rotl_torch(words & _signed(mask), r)
    return out


def tile_blocks(x: torch.Tensor, group: int) -> torch.Tensor:
    """[E, N, C], each column `group` elements of K (int32 words: 8; block scales: their group),
    as [E, N', K'/128, 64, P]: blocks of 64 rows by one K tile, each contiguous (4 KB of words), a
    row block's K tiles one after another. A block holds its tile's P = 128 / group columns (one,
    repeated per tile, where a group spans tiles). N is padded to N' (whole ROW_PAD rows) and K to
    whole K tiles, with zeros. A program then streams whole blocks instead of 64-byte pieces of
    rows 2 KB apart (rows of 4096 FP4 weights): 8-10% faster at 16 and 64 tokens on the H200,
    where the rows had held it near 60% of copy bandwidth (scripts/bench_moe_results.md, run 15)."""
    experts, n, c = x.shape
    per_tile, tiles = max(1, K_TILE // group), triton.cdiv(c * group, K_TILE)
    rows = triton.cdiv(n, ROW_PAD) * ROW_PAD
    out = x.new_zeros(experts, rows, tiles * per_tile)
    if group <= K_TILE:  # whole groups to a tile: the columns in order, zeros after them
        out[:, :n, :c] = x
    else:  # tile t takes group t * 128 // group
        out[:, :n] = x[:, :, torch.arange(tiles, device=x.device) * K_TILE // group]
    return out.view(experts, rows // TILE_ROWS, TILE_ROWS, tiles, per_tile).transpose(2, 3).contiguous()


def _rotation_asm(dst: str, r: int, mask: int) -> str:
    """PTX for a term's rotation of the word ($2) into dst: a funnel shift where the term keeps
    bits that the rotation wraps around, else a plain left shift, which ptxas issues as IMAD.SHL on
    the FMA pipe instead of SHF on the integer pipe. E2M1's loop had 9 integer-pipe instructions
    per word against 4 on the FMA pipe; with two of its four shifts moved, NVFP4's decode GEMMs
    were 2.5-5% faster on the H200 (scripts/bench_moe_results.md, run 16)."""
    if mask & ((1 << r) - 1):
        return f"shf.l.wrap.b32 {dst}, $2, $2, {r};"
    return f"shl.b32 {dst}, $2, {r};"


def _pair_asm(kind: str, m: int, scaled: bool = True) -> str:
    """PTX turning byte pair m of a kernel word ($2) into its two weights, nibble 2m ($0) and
    2m + 1 ($1), as one bf16x2 (the pair of adjacent K columns that a thread holds of the wgmma
    register operand).

    Inputs after the word: its block scale's BF16 bits where scaled, then -(128 + zero) as BF16
    bits for "integer_zero_point". The pair's `PAIR_TERMS`: a rotation (`_rotation_asm`) and a mask
    each, the second OR-ed in by one lop3; the mask of INT4's term and the OR with 128.0's bits
    are one lop3 too.
    E2M1 ("e2m1", "e2m1_folded"): the pair's register is then two BF16s worth code x 2^-126; "e2m1"
    multiplies by 2^126, then by the block scale (exact both, E8M0 scales span all of BF16's
    range); "e2m1_folded" takes a scale already times 2^119 (`_scale_bf16_bits`: E4M3's 448 x 2^119
    still fits BF16) and multiplies once, leaving the weights 2^-7 times the true ones for the
    accumulator to take back. Every product is exact: at most 2 x 4 significant bits.
    INT4 ("integer", "integer_zero_point"): 128 + n; minus (128 + zero) is exact, then times the
    scale, or not at all where not scaled (`KernelConfig.scale_after_dot`: the code minus its zero
    point, exact). 3.25 (E2M1 folded) and 4 (INT4) instructions per pair; at decode sizes that issue
    rate, not DRAM, is the limit (scripts/bench_moe_results.md, runs 5-10).
    """
    integer = kind.startswith("integer")
    (r, mask), *more = PAIR_TERMS["integer" if integer else "e2m1"][m]
    lines = ["{", ".reg .b32 s, k, z, t, u;", "mov.b32 z, 0x80008000;"]
    if scaled:
        lines.append("mov.b32 s, {$3, $3};")
    src = "$2"
    if r:
        lines.append(_rotation_asm("t", r, mask))
        src = "t"
    if integer:
        zero = "$4" if scaled else "$3"  # -(128 + zero)'s bits, after the scale's where scaled
        lines += [f"lop3.b32 t, {src}, {mask:#x}, 0x43004300, 0xEA;",  # (src & mask) | 0x43004300
                  "mov.b32 u, 0x3F803F80;",
                  f"mov.b32 k, {{{zero}, {zero}}};" if kind == "integer_zero_point" else "mov.b32 k, 0xC308C308;",
                  "fma.rn.bf16x2 t, t, u, k;"]
    else:
        lines.append(f"and.b32 t, {src}, {mask:#x};")
        for r2, mask2 in more:
            lines += [_rotation_asm("u", r2, mask2), f"lop3.b32 t, t, u, {mask2:#x}, 0xF8;"]  # t | (u & mask2)
        if kind == "e2m1":
            lines += ["mov.b32 k, 0x7E807E80;", "fma.rn.bf16x2 t, t, k, z;"]  # x 2^126
    if scaled:
        lines.append("fma.rn.bf16x2 t, t, s, z;")
    return "\n".join(lines + ["mov.b32 {$0, $1}, t;", "}"])


# Indexed by the byte pair m.
_ASM_FP4 = tl.constexpr(tuple(_pair_asm("e2m1", m) for m in range(4)))
_ASM_FP4_FOLDED = tl.constexpr(tuple(_pair_asm("e2m1_folded", m) for m in range(4)))
_ASM_INT4 = tl.constexpr(tuple(_pair_asm("integer", m) for m in range(4)))
_ASM_INT4_ZP = tl.constexpr(tuple(_pair_asm("integer_zero_point", m) for m in range(4)))
_ASM_INT4_UNSCALED = tl.constexpr(tuple(_pair_asm("integer", m, scaled=False) for m in range(4)))
_ASM_INT4_ZP_UNSCALED = tl.constexpr(tuple(_pair_asm("integer_zero_point", m, scaled=False) for m in range(4)))
# The same terms for the FP32 route, two per pair (a zero mask where there is one).
_TERMS = {layout: tuple(tuple(t[i] if i < len(t) else (0, 0) for t in terms) for i in range(2))
          for layout, terms in PAIR_TERMS.items()}
_E2M1_ROT = tl.constexpr(tuple(r for r, _ in _TERMS["e2m1"][0]))
_E2M1_MASK = tl.constexpr(tuple(_signed(m) for _, m in _TERMS["e2m1"][0]))
_E2M1_ROT2 = tl.constexpr(tuple(r for r, _ in _TERMS["e2m1"][1]))
_E2M1_MASK2 = tl.constexpr(tuple(_signed(m) for _, m in _TERMS["e2m1"][1]))
_INT4_ROT = tl.constexpr(tuple(r for r, _ in _TERMS["integer"][0]))
_E2M1_BITS = tl.constexpr(NIBBLE_BITS["e2m1"])


@triton.jit
def _asm_pair(words, s, nz, M: tl.constexpr, FMT: tl.constexpr, HAS_ZP: tl.constexpr, SCALED: tl.constexpr):
    """Nibbles 2M and 2M + 1 of each kernel word as two BF16 tiles (INT4 not SCALED: s unused)."""
    if FMT == INT4:
        if not SCALED:
            if HAS_ZP:
                lo, hi = tl.inline_asm_elementwise(_ASM_INT4_ZP_UNSCALED[M], "=h,=h,r,h", [words, nz],
                                                   (tl.bfloat16, tl.bfloat16), True, 1)
            else:
                lo, hi = tl.inline_asm_elementwise(_ASM_INT4_UNSCALED[M], "=h,=h,r", [words],
                                                   (tl.bfloat16, tl.bfloat16), True, 1)
        elif HAS_ZP:
            lo, hi = tl.inline_asm_elementwise(_ASM_INT4_ZP[M], "=h,=h,r,h,h", [words, s, nz],
                                               (tl.bfloat16, tl.bfloat16), True, 1)
        else:
            lo, hi = tl.inline_asm_elementwise(_ASM_INT4[M], "=h,=h,r,h", [words, s], (tl.bfloat16, tl.bfloat16),
                                               True, 1)
    elif FMT == NVFP4:
        lo, hi = tl.inline_asm_elementwise(_ASM_FP4_FOLDED[M], "=h,=h,r,h", [words, s], (tl.bfloat16, tl.bfloat16),
                                           True, 1)
    else:
        lo, hi = tl.inline_asm_elementwise(_ASM_FP4[M], "=h,=h,r,h", [words, s], (tl.bfloat16, tl.bfloat16), True,
                                           1)
    return lo, hi


@triton.jit
def _rotl(x, R: tl.constexpr):
    if R == 0:
        return x
    return (x << R) | ((x >> (32 - R)) & ((1 << R) - 1))


@triton.jit
def _pair_nibbles(words, M: tl.constexpr, FMT: tl.constexpr):
    """The FP32 route's reading of the layout: nibbles 2M and 2M + 1 of each kernel word, as codes
    0-15, through the same terms as the PTX."""
    if FMT == INT4:
        t = _rotl(words, _INT4_ROT[M])
        lo = t & 15
        hi = (t >> 16) & 15
    else:
        t = _rotl(words, _E2M1_ROT[M]) & _E2M1_MASK[M]
        if _E2M1_MASK2[M] != 0:
            t = t | (_rotl(words, _E2M1_ROT2[M]) & _E2M1_MASK2[M])
        lo = ((t >> _E2M1_BITS[0]) & 7) | ((t >> (_E2M1_BITS[3] - 3)) & 8)
        hi = ((t >> (_E2M1_BITS[0] + 16)) & 7) | ((t >> (_E2M1_BITS[3] + 13)) & 8)
    return lo, hi


@triton.jit
def _per_word(t, words):
    """[BLOCK_N, G] per-group values broadcast to the [BLOCK_N, KW] words of their groups."""
    G: tl.constexpr = t.shape[1]
    return tl.reshape(tl.broadcast_to(t[:, :, None], (t.shape[0], G, words.shape[1] // G)), words.shape)


@triton.jit
def _f32_pair(words, s, zero, M: tl.constexpr, FMT: tl.constexpr, COMPUTE: tl.constexpr, SCALED: tl.constexpr):
    lo, hi = _pair_nibbles(words, M, FMT)
    lo, hi = _nibble_f32(lo, zero, FMT), _nibble_f32(hi, zero, FMT)
    if SCALED:
        lo, hi = lo * s, hi * s
    return lo.to(COMPUTE), hi.to(COMPUTE)


@triton.jit
def _dequant(words, scale_raw, zero, FMT: tl.constexpr, HAS_ZP: tl.constexpr, COMPUTE: tl.constexpr,
             ASM: tl.constexpr, SCALED: tl.constexpr):
    """The 8 nibble planes of a tile of kernel words as COMPUTE tiles: plane j holds nibble j of
    each word. scale_raw and zero are per group (`_load_scales`), converted before they are
    broadcast to the words: once per group instead of once per word. Not SCALED (INT4 only):
    the codes minus their zero points, scale_raw unused (`KernelConfig.scale_after_dot`).
    On the GPU NVFP4's planes are 2^-7 times the weights ("e2m1_folded")."""
    s = 1.0
    if ASM:
        if SCALED:
            s = _per_word(_scale_bf16_bits(scale_raw, FMT), words)
        nz = 0
        if HAS_ZP:
            nz = _per_word((zero | 0xC300).to(tl.int16), words)  # BF16 bits of -(128 + zero)
        p0, p1 = _asm_pair(words, s, nz, 0, FMT, HAS_ZP, SCALED)
        p2, p3 = _asm_pair(words, s, nz, 1, FMT, HAS_ZP, SCALED)
        p4, p5 = _asm_pair(words, s, nz, 2, FMT, HAS_ZP, SCALED)
        p6, p7 = _asm_pair(words, s, nz, 3, FMT, HAS_ZP, SCALED)
    else:
        if SCALED:
            s = _per_word(_scale_f32(scale_raw, FMT), words)
        if HAS_ZP:
            zero = _per_word(zero, words)
        p0, p1 = _f32_pair(words, s, zero, 0, FMT, COMPUTE, SCALED)
        p2, p3 = _f32_pair(words, s, zero, 1, FMT, COMPUTE, SCALED)
        p4, p5 = _f32_pair(words, s, zero, 2, FMT, COMPUTE, SCALED)
        p6, p7 = _f32_pair(words, s, zero, 3, FMT, COMPUTE, SCALED)
    return (p0, p1, p2, p3, p4, p5, p6, p7)


@triton.jit
def _mma_tile(p, BLOCK_N: tl.constexpr):
    """The 8 planes [BLOCK_N, 16 words] of a K tile as one [BLOCK_N, 128] MMA operand, its rows and
    columns ordered so that every thread already holds its share of the wgmma register operand.

    A thread holds 4 consecutive words (one 16-byte load) of a row: words 4l..4l+3 in lane l of its
    quad; the MMA wants lane l at columns 2l, 2l + 1 (+ multiples of 8). Column d = 32q + 8m + 2l +
    n0 therefore takes nibble 2m + n0 of word 4l + q (`permute_k` orders the activations the same
    way). Rows: the load spreads warps over 8-row groups and repeats at BLOCK_N / 2; the MMA wants
    16-row groups per warp with the 8-row halves in registers, so tile row 16w + 8h + i holds
    weight row h * BLOCK_N / 2 + 8w + i (`_mma_rows`). Planned with Triton 3.6's layouts for
    16-word tiles and BLOCK_N = 16 * num_warps; otherwise Triton converts through shared memory.
    """
    G: tl.constexpr = BLOCK_N // 16
    j0 = tl.join(tl.reshape(p[0], (2, G, 8, 4, 4)), tl.reshape(p[1], (2, G, 8, 4, 4)))  # [h, w, i, l, q, n0]
    j1 = tl.join(tl.reshape(p[2], (2, G, 8, 4, 4)), tl.reshape(p[3], (2, G, 8, 4, 4)))
    j2 = tl.join(tl.reshape(p[4], (2, G, 8, 4, 4)), tl.reshape(p[5], (2, G, 8, 4, 4)))
    j3 = tl.join(tl.reshape(p[6], (2, G, 8, 4, 4)), tl.reshape(p[7], (2, G, 8, 4, 4)))
    tile = tl.join(tl.join(j0, j1), tl.join(j2, j3))  # [h, w, i, l, q, n0, m0, m1]
    return tl.reshape(tl.permute(tile, (1, 0, 2, 4, 7, 6, 3, 5)), (BLOCK_N, 128))


@triton.jit
def _mma_rows(BLOCK_N: tl.constexpr):
    """Weight row (within the N tile) of each row of `_mma_tile`."""
    r = tl.arange(0, BLOCK_N)
    return ((r >> 3) & 1) * (BLOCK_N // 2) + (r >> 4) * 8 + (r & 7)


@triton.jit
def _load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, kw, K, BLOCK_N: tl.constexpr,
                 KW: tl.constexpr, GROUP: tl.constexpr, FMT: tl.constexpr, HAS_ZP: tl.constexpr,
                 EVEN_K: tl.constexpr, PIPELINED: tl.constexpr, LAYOUT: tl.constexpr):
    """Scales (raw) and zero points [BLOCK_N, G] of the groups of the tile starting at word column
    kw (G = 1 when a group spans more than the tile); zero for groups at or beyond K (the last tile
    when not EVEN_K): in SCALES_BLOCKS the scales' padding in their block layout (`tile_blocks`,
    blocks stride_sn apart), otherwise (scales as stored, rows stride_sn apart) and for the zero
    points by a mask. SCALES_WORDS: the rows as stored, read through an int32 view (`scale_layout`:
    K whole tiles, a tile's scales 4 bytes a row).

    One load per group, broadcast to its words by `_dequant`: the tile's layout then follows the
    weight words (vector stores of the dequantized planes) instead of a per-word gather of
    repeated bytes.
    PIPELINED (the caller's PIPELINED_SCALES): a plain load of the tile's row, which Triton's
    pipeliner fetches stages ahead with the words, through shared memory: it copies 4 bytes or more
    a thread with cp.async, so 4-byte rows come as int32 words (SCALES_WORDS).
    Otherwise the caller issues the load one K tile ahead, the loop waiting for it; NVFP4's are then
    loaded in the layout the words' groups have in registers (2 bytes per row and thread), so they
    need no trip through shared memory (scripts/bench_moe_results.md, run 9). Under Nsight
    Compute that wait was the largest stall of the decode GEMMs (run 14).
    """
    WPG: tl.constexpr = GROUP // 8
    G: tl.constexpr = KW // WPG if KW >= WPG else 1
    groups = kw // WPG + tl.arange(0, G)
    mask = n_mask[:, None]
    if not EVEN_K:
        mask = mask & (groups < K // GROUP)[None, :]
    if LAYOUT == SCALES_WORDS:  # one int32 word per row and tile, its G scales split here
        RAW_BITS: tl.constexpr = 32 // G
        word = tl.load(s_ptr + (offs_n * stride_sn + kw // KW)[:, None], mask=n_mask[:, None], other=0)
        bits = (word >> (tl.arange(0, G) * RAW_BITS)[None, :]) & ((1 << RAW_BITS) - 1)
        if FMT == INT4:
            scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            scale = bits.to(tl.uint8)
    else:
        if LAYOUT == SCALES_BLOCKS:
            offs = (((offs_n // W_TILE_ROWS) * stride_sn + (offs_n % W_TILE_ROWS) * G)[:, None]
                    + (kw // KW * (W_TILE_ROWS * G) + tl.arange(0, G))[None, :])
            # Without saying that a row starts on G, Triton loaded these a byte or element per thread,
            # not pipelined, converted through shared memory (sm_90 SASS).
            offs = tl.multiple_of(offs, [1, G])
        else:
            offs = offs_n[:, None] * stride_sn + groups[None, :]
        if GROUP < 32 and not PIPELINED:  # NVFP4: 2 groups per thread's 4 words, so 2 contiguous at most
            offs = tl.max_contiguous(offs, [1, 32 // GROUP])
        if LAYOUT == SCALES_BLOCKS:
            scale = tl.load(s_ptr + offs)  # no mask: the layout pads N and K with zeros
        else:
            scale = tl.load(s_ptr + offs, mask=mask, other=0)
    zero = 8
    if HAS_ZP:
        zw = tl.load(z_ptr + (offs_n // 8)[:, None] * stride_zn + groups[None, :], mask=mask, other=0)
        zero = (zw >> ((offs_n % 8) * 4)[:, None]) & 15
    return scale, zero


@triton.jit
def _row_scales(s_ptr, stride_sn, rows, N, k0, GROUP: tl.constexpr):
    """FP32 scales [len(rows)] of the given rows for the group holding K column k0 (scales as
    stored, one group a K tile or more); zero beyond N."""
    return tl.load(s_ptr + rows * stride_sn + k0 // GROUP, mask=rows < N, other=0.0).to(tl.float32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, s_ptr, gs_ptr, z_ptr,
    w3_ptr, s3_ptr, gs3_ptr, z3_ptr,
    stride_we, stride_wt, stride_se, stride_sn, stride_ze, stride_zn,
    b_ptr, b3_ptr, stride_be, stride_bn,
    out_ptr, stride_om, stride_os, stride_og,
    sorted_ids_ptr, block_expert_ptr, route_w_ptr,
    num_pairs, N, K,
    A_ROW_DIV: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZP: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ROUTE_WEIGHT: tl.constexpr, ACTIVATION: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    COMPUTE: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERM_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, APART: tl.constexpr,
    PDL: tl.constexpr, PIPELINED_SCALES: tl.constexpr, ROUTING_READY: tl.constexpr, SCALE_LAYOUT: tl.constexpr,
    ROW_SCALES: tl.constexpr,
):
    """out[pair, n] for the pairs of one M block (one expert) and one N tile.

    GATED: out = act(x@w1.T + b1, x@w3.T + b3) (`SwiGLU`), with A row = pair // top_k.
    Otherwise: out = (h @ w2.T + b2) * routing weight, with A row = pair.
    Biases (HAS_BIAS) are per expert and output row, at b + e * stride_be + n * stride_bn.

    Weights are int32 words of 8 nibbles (FP4 bytes viewed as int32 have the INT4 nibble order:
    element 8w + j in bits 4j), in `tile_blocks`' blocks of 64 rows x one K tile: the block of rows
    64b.. and K tile t at w_ptr + b * stride_wt + t * 1024; the block scales likewise where
    `scales_in_blocks`, G a tile, otherwise as stored (SCALE_LAYOUT: `scale_layout`). The 8 nibble
    planes of each K tile are arranged into one MMA operand in the order the tensor cores take it
    from registers (`_mma_tile`); A's columns come permuted to match (`permute_k`), and with
    PERM_OUT the output is stored in that order for the next GEMM.

    SPLIT_K > 1: program (n, m, s) sums the s-th K slice only and stores FP32 partials at
    out + s * stride_os (w1's at +0, w3's at + stride_og when GATED, before the SwiGLU, which
    needs the whole sum: `_swiglu_partials_kernel`). Decode batches touch few experts, and
    slicing K gives every SM weights to stream.
    APART: w1 (the w_ parts) and w3 (the w3_ parts) by separate programs, not GATED: program
    (n, m, 2s + j) stores the FP32 partial of slice s of w1 (j = 0) or w3 (j = 1) where GATED
    would store it.

    K need not be whole tiles (not EVEN_K: gpt-oss's 2880 is 22.5): the last tile's words beyond K
    are the layout's zero padding and its scales there load as zero, and A's columns beyond K are
    zero too (`permute_k` pads x; with PERM_OUT the output's padding columns, up to whole tiles,
    are stored as zeros for the next GEMM).
    ROUTING_READY (`_launch`'s routing_ready): the programs wait for the previous launch (PDL) only
    after reading the routing, the global scales and the routing weights, which it did not write.
    ROW_SCALES (`KernelConfig.scale_after_dot`; INT4, one group a K tile or more, scales as stored):
    each tile's product with the unscaled codes is multiplied by its rows' scales, loaded in the
    accumulator's row order one tile ahead, and added to the accumulator.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    if APART:
        if pid_k % 2 == 1:
            w_ptr, s_ptr, gs_ptr, z_ptr, b_ptr = w3_ptr, s3_ptr, gs3_ptr, z3_ptr, b3_ptr
            out_ptr += stride_og
        pid_k = pid_k // 2
    if not ROUTING_READY:
        _wait_for_inputs(PDL, True)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc_rows = pid_n * BLOCK_N + _mma_rows(BLOCK_N)  # the accumulator's rows
    KW: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, KW)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[None, :] * stride_am + tl.arange(0, BLOCK_K)[:, None]
    # A row's words within its 64-row block; K tile kw // KW is 64 * KW words further per tile.
    w_offs = ((offs_n // W_TILE_ROWS) * stride_wt + (offs_n % W_TILE_ROWS) * KW)[:, None] + offs_w[None, :]

    e = expert.to(tl.int64)
    w_ptr += e * stride_we
    s_ptr += e * stride_se
    z_ptr += e * stride_ze
    # The host splits K on tile boundaries; saying so keeps the weight loads 16 bytes wide (the
    # compiler cannot see it through the division, and 4-byte copies made split-K 2.5x slower).
    slice_k = tl.cdiv(K, BLOCK_K) // SPLIT_K * BLOCK_K
    k_begin = tl.multiple_of(pid_k * slice_k, BLOCK_K)
    k_end = k_begin + slice_k
    if pid_n * BLOCK_N >= N:  # a tile of PERM_OUT's padding only: no weights, its zeros are stored
        k_end = k_begin
    if not PIPELINED_SCALES:  # the first tile's; the loop loads each next one
        s1, z1 = _load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, k_begin // 8, K, BLOCK_N, KW,
                              GROUP, FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
    if ROW_SCALES:  # `_load_scales`' scales then go unused (the compiler drops those loads); its zero points do not
        r1 = _row_scales(s_ptr, stride_sn, acc_rows, N, k_begin, GROUP)
    if GATED:
        w3_ptr += e * stride_we
        s3_ptr += e * stride_se
        z3_ptr += e * stride_ze
        if not PIPELINED_SCALES:
            s3, z3 = _load_scales(s3_ptr, z3_ptr, stride_sn, stride_zn, offs_n, n_mask, k_begin // 8, K, BLOCK_N, KW,
                                  GROUP, FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
        if ROW_SCALES:
            r3 = _row_scales(s3_ptr, stride_sn, acc_rows, N, k_begin, GROUP)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The epilogue's scalars now, not after the loop: a program's last load was a wait of its own.
    # On the GPU NVFP4's weights come 2^-7 times the true ones ("e2m1_folded"); the global scale,
    # which NVFP4 always has, takes it back.
    gs_factor: tl.constexpr = _FOLDED_WEIGHT_FACTOR if ASM and FMT == NVFP4 else 1.0
    if HAS_GLOBAL:
        gs = tl.load(gs_ptr + e) * gs_factor
        if GATED:
            gs3 = tl.load(gs3_ptr + e) * gs_factor  # w3's own global scale, never w1's
    if ROUTE_WEIGHT:
        route = tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    if ROUTING_READY:  # the routing and weights were read while the launch before this one ran
        _wait_for_inputs(PDL, True)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kw = k0 // 8
        kw_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K) // 8  # the last tile reloads itself
        if ROW_SCALES:  # the next tile's, a whole tile before they are used
            r1_next = _row_scales(s_ptr, stride_sn, acc_rows, N, kw_next * 8, GROUP)
            if GATED:
                r3_next = _row_scales(s3_ptr, stride_sn, acc_rows, N, kw_next * 8, GROUP)
        if PIPELINED_SCALES:  # this tile's, fetched stages ahead with its words by the pipeliner
            s1, z1 = _load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, kw, K, BLOCK_N, KW, GROUP,
                                  FMT, HAS_ZP, EVEN_K, True, SCALE_LAYOUT)
        words = tl.load(w_ptr + w_offs + kw * W_TILE_ROWS)  # no mask: the layout pads N and K with zeros
        w_tile = _mma_tile(_dequant(words, s1, z1, FMT, HAS_ZP, COMPUTE, ASM, not ROW_SCALES), BLOCK_N)
        if not PIPELINED_SCALES:
            s1, z1 = _load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, kw_next, K, BLOCK_N, KW, GROUP,
                                  FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
        if GATED:
            if PIPELINED_SCALES:
                s3, z3 = _load_scales(s3_ptr, z3_ptr, stride_sn, stride_zn, offs_n, n_mask, kw, K, BLOCK_N, KW, GROUP,
                                      FMT, HAS_ZP, EVEN_K, True, SCALE_LAYOUT)
            words3 = tl.load(w3_ptr + w_offs + kw * W_TILE_ROWS)
            w3_tile = _mma_tile(_dequant(words3, s3, z3, FMT, HAS_ZP, COMPUTE, ASM, not ROW_SCALES), BLOCK_N)
            if not PIPELINED_SCALES:
                s3, z3 = _load_scales(s3_ptr, z3_ptr, stride_sn, stride_zn, offs_n, n_mask, kw_next, K, BLOCK_N, KW,
                                      GROUP, FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
        a = tl.load(a_ptrs + k0, mask=row_mask[None, :], other=0.0)
        if ROW_SCALES:
            if GATED:  # one MMA of both tiles: Triton waits for each dot's product before the next dot
                both = tl.reshape(tl.permute(tl.join(w_tile, w3_tile), (2, 0, 1)), (2 * BLOCK_N, BLOCK_K))
                t1, t3 = tl.split(tl.permute(tl.reshape(tl.dot(both, a, input_precision=DOT_PRECISION),
                                                        (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
                acc3 += t3 * r3[:, None]
                r3 = r3_next
            else:
                t1 = tl.dot(w_tile, a, input_precision=DOT_PRECISION)
            acc += t1 * r1[:, None]
            r1 = r1_next
        else:
            acc = tl.dot(w_tile, a, acc, input_precision=DOT_PRECISION)
            if GATED:
                acc3 = tl.dot(w3_tile, a, acc3, input_precision=DOT_PRECISION)

    offs_n = acc_rows
    n_mask = offs_n < N
    n_store = tl.cdiv(N, BLOCK_K) * BLOCK_K if PERM_OUT else N  # the zeros of a padded last tile too
    if HAS_GLOBAL:
        acc *= gs
    if HAS_BIAS:
        acc += _bias(b_ptr, e, stride_be, stride_bn, offs_n, n_mask, pid_k, SPLIT_K)
    out_ptr += pid_k * stride_os
    out_mask = row_mask[None, :] & (offs_n < n_store)[:, None]
    if GATED:
        if HAS_GLOBAL:
            acc3 *= gs3
        if HAS_BIAS:
            acc3 += _bias(b3_ptr, e, stride_be, stride_bn, offs_n, n_mask, pid_k, SPLIT_K)
        if SPLIT_K > 1:
            tl.store(out_ptr + stride_og + pairs.to(tl.int64)[None, :] * stride_om + offs_n[:, None], acc3,
                     mask=out_mask)
        else:
            acc = _swiglu(acc, acc3, ACTIVATION, LIMIT, ALPHA)
    if ROUTE_WEIGHT:
        acc *= route[None, :]
    cols = _out_columns(offs_n, PERM_OUT and SPLIT_K == 1, BLOCK_K)
    out_ptrs = out_ptr + pairs.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _bias(b_ptr, e, stride_be, stride_bn, offs_n, n_mask, pid_k, SPLIT_K: tl.constexpr):
    """FP32 bias column [BLOCK_N, 1] of expert e; under split-K only slice 0 adds it, since the
    slices' partial sums are added up afterwards."""
    b = tl.load(b_ptr + e * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0).to(tl.float32)
    if SPLIT_K > 1:
        b = tl.where(pid_k == 0, b, 0.0)
    return b[:, None]


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) without exp of a large positive number: exp(-|x|) never overflows (the
    plain form overflows for x below about -88, which Triton's interpreter reports as a
    RuntimeWarning; the value is the same)."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1 / (1 + e), e / (1 + e))


@triton.jit
def _swiglu(g, u, ACTIVATION: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    g = tl.minimum(g, LIMIT)
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    if ACTIVATION == SWIGLU_OAI:
        h = (u + 1) * (g * _sigmoid(ALPHA * g))
    else:
        h = g * _sigmoid(g) * u
    return h


@triton.jit
def _out_columns(offs_n, PERM_OUT: tl.constexpr, BLOCK_K: tl.constexpr):
    if PERM_OUT:  # column 32l + 8q + n of a tile (nibble n of word 4l + q) goes to 32q + 8(n // 2) + 2l + n % 2
        t = offs_n % BLOCK_K
        cols = (offs_n - t) + ((t >> 3) & 3) * 32 + ((t >> 1) & 3) * 8 + (t >> 5) * 2 + (t & 1)
    else:
        cols = offs_n
    return cols


@triton.jit
def _swiglu_partials_kernel(part_ptr, stride_ps, stride_pg, h_ptr, stride_hm, N, ACTIVATION: tl.constexpr,
                            LIMIT: tl.constexpr, ALPHA: tl.constexpr, SPLIT_K: tl.constexpr,
                            PERM_OUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
    """h[pair] = the gated activation of the summed split-K partials of w1 and w3 (row `pair` of
    each; their biases are already in slice 0). With PERM_OUT, h's columns up to whole K tiles,
    zeros beyond N, as `_moe_gemm_kernel` stores them. Under PDL it lets the down GEMM start its
    programs before it waits for w1/w3: they wait for this launch before they read h, and so take
    SMs as w1/w3's programs end (one token 0.6-0.8 us faster on the H200; scripts/bench_moe_results.md,
    run 17)."""
    if PDL:
        gdc_launch_dependents()
    _wait_for_inputs(PDL, False)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    n_store = tl.cdiv(N, BLOCK_K) * BLOCK_K if PERM_OUT else N
    ptrs = part_ptr + row * N + offs
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        g += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
        u += tl.load(ptrs + s * stride_ps + stride_pg, mask=mask, other=0.0)
    h = _swiglu(g, u, ACTIVATION, LIMIT, ALPHA)
    tl.store(h_ptr + row * stride_hm + _out_columns(offs, PERM_OUT, BLOCK_K), h.to(h_ptr.dtype.element_ty),
             mask=offs < n_store)


def permute_k(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """Columns of x reordered within each 128-column tile as `_mma_tile` orders the weights: new
    column 32q + 8m + 2l + n0 holds old column 32l + 8q + 2m + n0; zero columns pad the last tile."""
    rows, k = x.shape
    padded = padded_k(k)
    if padded != k:
        x = torch.nn.functional.pad(x, (0, padded - k))
    return x.view(rows, padded // block_k, 4, 4, 4, 2).permute(0, 1, 3, 4, 2, 5).reshape(rows, padded)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


def _words(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes as int32 words: little-endian, so nibble j of word w is element 8w + j, as for INT4."""
    if packed.dtype == torch.int32:
        return packed
    if packed.shape[-1] % 4:
        raise FormatError(f"K/2={packed.shape[-1]} bytes is not a whole number of int32 words")
    return (packed if packed.stride(-1) == 1 else packed.contiguous()).view(torch.int32)


@dataclass(frozen=True)
class KernelWeights:
    """One projection of every expert as the kernel reads it: the weights as int32 words in the
    kernel's bit layout (`kernel_words`) and block layout (`tile_blocks`), the block scales so too
    where `scales_in_blocks`, the other parts as stored. `kernel_weights` makes it once, as
    engines repack weights when they load them; `fused_moe` makes it on every call when given
    ExpertWeights (one pass over the weights)."""

    format: str
    words: torch.Tensor                # int32 [E, N', K'/128, 64, 16] (`tile_blocks`), contiguous
    scale: torch.Tensor                # [E, N', K'/128, 64, 128 / group] or as stored (`scales_in_blocks`)
    global_scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    group: int
    n: int
    k: int

    @property
    def kernel_code(self) -> int:
        return formats.get(self.format).kernel_code

    @property
    def experts(self) -> int:
        return self.words.shape[0]


def kernel_weights(w: "ExpertWeights | KernelWeights") -> KernelWeights:
    """w with its weights in the kernel's layout (a copy; row views such as gpt-oss's interleaved
    gate/up rows come out contiguous). KernelWeights pass through."""
    if isinstance(w, KernelWeights):
        return w
    words = kernel_words(_words(w.packed), w.codec.kernel_code)
    scale = tile_blocks(w.scale, w.group) if scales_in_blocks(w.group, w.scale.element_size()) else w.scale
    return KernelWeights(w.format, tile_blocks(words, 8), scale, w.global_scale, w.zero_point, w.group,
                         words.shape[1], words.shape[2] * 8)


def scales_in_blocks(group: int, scale_bytes: int) -> bool:
    """Whether block scales are stored in `tile_blocks`' layout: where a row's scales per K tile are
    8 bytes or more (NVFP4, INT4 g32), 4-8% faster at 1-64 tokens on the H200. Narrower rows,
    loaded one K tile ahead by hand or as int32 words (`scale_layout`), stay as stored: in a row
    one 32-byte sector serves many tiles, so most of those loads hit L2, where in blocks each went
    to DRAM (INT4 g128: 5% slower at one token; scripts/bench_moe_results.md, run 15)."""
    return _tile_scale_bytes(group, scale_bytes) >= 8


def _tile_scale_bytes(group: int, scale_bytes: int) -> int:
    """Bytes of one row's block scales per K tile (one scale where a group spans tiles)."""
    return max(1, K_TILE // group) * scale_bytes


K_TILE = 128   # the kernel's K step: the 16 words `_mma_tile` lays out
K_STEP = 8     # what K must be a multiple of: whole int32 words (K tiles are padded, `permute_k`)


def padded_k(k: int) -> int:
    """A GEMM input's width in the kernel: K padded to whole K tiles."""
    return triton.cdiv(k, K_TILE) * K_TILE


def fits(hidden_size: int, intermediate_size: int) -> bool:
    """Whether the kernel takes a layer's two K dimensions (gate/up: hidden, down: intermediate)."""
    return hidden_size % K_STEP == 0 and intermediate_size % K_STEP == 0


def _launch(a, a_row_div, w, w3, out, sorted_ids, block_expert, route_w, num_pairs, compute, cfg, act,
            bias=None, bias3=None, perm_out=False, routing_ready=False):
    """One GEMM launch; `out` is [pairs, N], or when split (`_split`) or w1/w3 apart FP32 partials
    [S, pairs, N] ([S, 2, pairs, N] for w1/w3). `act` (a SwiGLU) is fused after w1/w3 unless
    split or apart. routing_ready: sorted_ids, block_expert and route_w were written before the
    launch that precedes this one, so under programmatic dependent launch its programs read them
    (and the global scales) before they wait for that launch: w2's, after w1/w3."""
    if w.k % K_STEP or cfg.block_k != K_TILE or w.group % 8:
        raise ValueError(f"K={w.k}, group {w.group} do not fit block_k={cfg.block_k} (the kernel takes K tiles of "
                         f"128, the 16 words that `_mma_tile` lays out, K a multiple of {K_STEP} and groups of whole "
                         "words)")
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
    act = act or SwiGLU()
    split = _split(cfg, w.k)
    apart = gated and cfg.gate_up_apart
    partials = split > 1 or apart   # FP32 partials [S, pairs, N] ([S, 2, pairs, N] for w1/w3)
    n_tiles = triton.cdiv(padded_k(w.n) if perm_out else w.n, cfg.block_n)  # PERM_OUT pads the next GEMM's K
    layout, scale, scale3 = _launch_scales(cfg, w, w3)
    row_scales = row_scaled(cfg, w.kernel_code, w.group, layout)
    grid = (n_tiles, block_expert.numel(), split * (2 if apart else 1))
    return _moe_gemm_kernel[grid](
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
        ROUTE_WEIGHT=route_w is not None, ACTIVATION=_ACTIVATION_CODES[act.kind], LIMIT=float(act.limit),
        ALPHA=float(act.alpha), COMPUTE=_TL_DTYPES[compute], ASM=compute != torch.float32,
        DOT_PRECISION="ieee" if compute == torch.float32 else "tf32", PERM_OUT=perm_out,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        EVEN_K=w.k % cfg.block_k == 0, APART=apart,
        PIPELINED_SCALES=cfg.pipelined_scales and layout != SCALES_ROWS.value, ROUTING_READY=routing_ready,
        SCALE_LAYOUT=layout, ROW_SCALES=row_scales, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **_chained(a), **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )


def scale_layout(cfg: KernelConfig, group: int, scale_bytes: int, k: int) -> int:
    """How a launch reads the block scales (SCALE_LAYOUT), and so whether they are fetched stages
    ahead with the words (anything but SCALES_ROWS, where cfg asks): Triton's pipeliner copies
    them with cp.async where a thread reads 4 bytes or more.
    - SCALES_BLOCKS: rows of 8 bytes or more a K tile (NVFP4; INT4 with groups of 32), which
      `kernel_weights` put in blocks (`scales_in_blocks`).
    - SCALES_WORDS: rows of 4 bytes a K tile (MXFP4, INT4 g64), K whole tiles, read as one int32
      word per row and tile where cfg pipelines the scales: MXFP4 4% faster at 4096 tokens, the
      same at 1-64 (scripts/bench_moe_results.md, run 16).
    - SCALES_ROWS: the others, loaded one tile ahead by hand: K off whole tiles (gpt-oss's 2880),
      which the pipeliner left as a load in the loop that was waited for (sm_90 SASS:
      scripts/bench_moe_asm.py; run 14), and INT4 g128's 2 bytes, 5-11% slower as words holding
      two tiles (run 16)."""
    if scales_in_blocks(group, scale_bytes):
        return SCALES_BLOCKS.value
    if cfg.pipelined_scales and group <= K_TILE and _tile_scale_bytes(group, scale_bytes) == 4 and k % K_TILE == 0:
        return SCALES_WORDS.value
    return SCALES_ROWS.value


def row_scaled(cfg: KernelConfig, kernel_code: int, group: int, layout: int) -> bool:
    """Whether a launch multiplies by INT4's scales after the MMA (ROW_SCALES): where cfg asks and a
    group spans the K tile (whole groups: K is a multiple of the group), so that a tile has one
    scale per row, read as stored (the launch's SCALE_LAYOUT, `scale_layout`)."""
    return cfg.scale_after_dot and kernel_code == INT4.value and group % K_TILE == 0 and layout == SCALES_ROWS.value


def _as_words(scale: torch.Tensor) -> torch.Tensor | None:
    """scale's bytes as int32 (a view), or None where its rows or strides are not whole words."""
    b = scale.element_size()
    if scale.stride(-1) != 1 or any(x * b % 4 for x in (*scale.stride()[:-1], scale.shape[-1], scale.storage_offset())):
        return None
    return scale.view(torch.int32)


def _launch_scales(cfg: KernelConfig, w: KernelWeights, w3: KernelWeights):
    """(SCALE_LAYOUT, w's scales, w3's) as the launch passes them (`scale_layout`); as stored
    where the int32 views do not exist."""
    if w.scale.dim() == 5:  # `kernel_weights` put them in blocks
        return SCALES_BLOCKS.value, w.scale, w3.scale
    if scale_layout(cfg, w.group, w.scale.element_size(), w.k) == SCALES_WORDS.value:
        words, words3 = _as_words(w.scale), _as_words(w3.scale)
        if words is not None and words3 is not None and words.stride() == words3.stride():
            return SCALES_WORDS.value, words, words3
    return SCALES_ROWS.value, w.scale, w3.scale


def _chained(t: torch.Tensor) -> dict:
    """A launch's PDL argument (its waits compiled in) and the launch option that lets it start
    before the previous launch ends, on t's device (`_pdl`)."""
    return {"PDL": True, "launch_pdl": True} if _pdl(t) else {"PDL": False}


def _split(cfg: KernelConfig, k: int) -> int:
    """K slices for a GEMM of depth k: the most, up to cfg.split_k, that divide its K tiles."""
    return max(s for s in range(1, cfg.split_k + 1) if triton.cdiv(k, cfg.block_k) % s == 0)


def gate_up(a, top_k, w1, w3, sorted_ids, block_expert, pairs, compute, cfg, act, b1=None, b3=None,
            perm_out=True) -> torch.Tensor:
    """The intermediate h [pairs, I] (compute dtype) = act(a W1.T + b1, a W3.T + b3) for a's rows,
    its columns permuted for `down` when perm_out (and then zero-padded to whole K tiles)."""
    h = torch.empty(pairs, padded_k(w1.n) if perm_out else w1.n, dtype=compute, device=a.device)
    split = _split(cfg, w1.k)
    if split == 1 and not cfg.gate_up_apart:
        _launch(a, top_k, w1, w3, h, sorted_ids, block_expert, None, pairs, compute, cfg, act, b1, b3,
                perm_out=perm_out)
        return h
    part = torch.empty(split, 2, pairs, w1.n, dtype=torch.float32, device=a.device)
    _launch(a, top_k, w1, w3, part, sorted_ids, block_expert, None, pairs, compute, cfg, act, b1, b3)
    block = 1024
    _swiglu_partials_kernel[(pairs, triton.cdiv(h.shape[1], block))](
        part, part.stride(0), part.stride(1), h, h.stride(0), w1.n, ACTIVATION=_ACTIVATION_CODES[act.kind],
        LIMIT=float(act.limit), ALPHA=float(act.alpha), SPLIT_K=split, PERM_OUT=perm_out, BLOCK_K=cfg.block_k,
        BLOCK=block, num_warps=4, **_chained(part))
    return h


def down(h, w2, sorted_ids, block_expert, route_w, pairs, compute, cfg, b2=None) -> torch.Tensor:
    """Per-pair outputs (h W2.T + b2) * routing weight (route_w: [pairs], any float dtype): [S, pairs,
    H], FP32 partials when split (S slices), else the compute dtype (BF16 on the GPU halves this
    buffer's traffic). cfg: the layer's config, whose `down` applies where it has one."""
    cfg = cfg.down or cfg
    split = _split(cfg, w2.k)
    dtype = torch.float32 if split > 1 else compute
    y = torch.empty(split, pairs, w2.n, dtype=dtype, device=h.device)
    _launch(h, 1, w2, None, y if split > 1 else y[0], sorted_ids, block_expert, route_w, pairs, compute, cfg, None,
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
              w1: ExpertWeights, w3: ExpertWeights, w2: ExpertWeights, *, swiglu_limit: float = 10.0,
              activation: str = "swiglu_clamp", swiglu_alpha: float | None = None,
              b1: torch.Tensor | None = None, b3: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              compute_dtype: torch.dtype | None = None, config: KernelConfig | None = None,
              activation_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] (BF16): sum_k w_k * (act(x W1_e.T + b1_e, x W3_e.T + b3_e) W2_e.T + b2_e).

    x: [T, H] activations; topk_ids: [T, top_k] expert indices; topk_weights: [T, top_k] routing
    weights. w1 (gate), w3 (up): N = intermediate, K = H; w2 (down): N = H, K = intermediate.
    activation: "swiglu_clamp" (DeepSeek-V4: silu(min(g, L)) * clamp(u, -L, L)) or "swiglu_oai"
    (gpt-oss: (clamp(u, -L, L) + 1) * g' * sigmoid(swiglu_alpha * g'), g' = min(g, L)), L = swiglu_limit.
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
    if compute not in _TL_DTYPES:
        raise ValueError(f"compute dtype {compute} is not one of {sorted(map(str, _TL_DTYPES))}")
    w1, w3, w2 = (kernel_weights(w) for w in (w1, w3, w2))
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if (w1.k, w2.n, w2.k) != (hidden, hidden, w1.n) or w1.experts != w2.experts:
        raise FormatError(f"expert shapes w1 [{w1.experts}, {w1.n}, {w1.k}] w2 [{w2.experts}, {w2.n}, {w2.k}] "
                          f"do not fit hidden size {hidden}")
    _check_biases(b1, b3, b2, w1, w2)
    if (activation == "swiglu_oai") != (swiglu_alpha is not None):
        raise ValueError("swiglu_alpha is the gpt-oss activation's sigmoid slope: give it with "
                         "activation='swiglu_oai' and only then")
    act = SwiGLU(activation, swiglu_limit, 1.0 if swiglu_alpha is None else swiglu_alpha)
    cfg = config or default_config(pairs, w1.experts, w1.kernel_code)
    if activation_scales is not None:
        x = fake_quantize_activations(x.bfloat16(), activation_scales[0])
    a, sorted_ids, block_expert = prepare(x, topk_ids, w1.experts, cfg.block_m, compute)
    quantize_h = activation_scales is not None  # in the natural column order, then permuted here
    h = gate_up(a, top_k, w1, w3, sorted_ids, block_expert, pairs, compute, cfg, act, b1, b3,
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
    _topk_sum_kernel[(pairs // top_k, triton.cdiv(hidden, block))](
        y, y.stride(0), y.stride(1), out, hidden, SLICES=slices, TOP_K=top_k, BLOCK=block, num_warps=4, **_chained(y))
    return out.to(torch.bfloat16)


@triton.jit
def _topk_sum_kernel(y_ptr, stride_ys, stride_ym, out_ptr, H, SLICES: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    _wait_for_inputs(PDL, False)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SLICES):
        for k in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + s * stride_ys + (token * TOP_K + k) * stride_ym + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
