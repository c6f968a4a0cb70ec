"""The @triton.jit kernels of the fused MoE: the prologue (alignment and A's cast and column
order), the grouped GEMM with its fused epilogue, the SwiGLU of split-K partials, and the top-k sum.
Host code launches them from `launch` and `requant.kernels.fused_moe`.
"""

import triton
import triton.language as tl

try:  # Triton >= 3.4: grid dependency control, for programmatic dependent launch (Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

from requant.kernels._details._decode import (FOLDED_WEIGHT_FACTOR, NVFP4, W_TILE_ROWS, dequant, load_scales,
                                              mma_rows, mma_tile, row_scales)
from requant.kernels._details.device import interpreting


def _interpreter_takes_1_element_bounds() -> None:
    """Under Triton's interpreter a runtime scalar is a 1-element array, and `range(0, n, ...)`
    turns it into a Python int through the tensor's __index__. Triton 3.6's does int() of the
    array, which numpy 2.5 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"); later releases squeeze it first. Give the older ones the same __index__."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "takes_1_element", False):
        return

    def patch_with_item_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_with_item_index.takes_1_element = True
    interpreter._patch_lang_tensor = patch_with_item_index


if interpreting():
    _interpreter_takes_1_element_bounds()

HAS_GDC = gdc_wait is not None  # whether this Triton can chain launches (`launch.chains`)
SWIGLU_CLAMP = tl.constexpr(0)  # `configs.ACTIVATION_CODES`
SWIGLU_OAI = tl.constexpr(1)


@triton.jit
def wait_for_inputs(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """Under programmatic dependent launch (`launch.chains`): wait until the previous launch has finished and
    its writes are visible, then (TRIGGER) let the next launch start its programs."""
    if PDL:
        gdc_wait()
        if TRIGGER:
            gdc_launch_dependents()



@triton.jit
def prologue_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks,
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
    """`align.align_torch` in one program, for up to PAIRS pairs and EXPERTS - 1 experts (the last bin
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
def moe_gemm_kernel(
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
    from registers (`mma_tile`); A's columns come permuted to match (`permute_k`), and with
    PERM_OUT the output is stored in that order for the next GEMM.

    SPLIT_K > 1: program (n, m, s) sums the s-th K slice only and stores FP32 partials at
    out + s * stride_os (w1's at +0, w3's at + stride_og when GATED, before the SwiGLU, which
    needs the whole sum: `swiglu_partials_kernel`). Decode batches touch few experts, and
    slicing K gives every SM weights to stream.
    APART: w1 (the w_ parts) and w3 (the w3_ parts) by separate programs, not GATED: program
    (n, m, 2s + j) stores the FP32 partial of slice s of w1 (j = 0) or w3 (j = 1) where GATED
    would store it.

    K need not be whole tiles (not EVEN_K: gpt-oss's 2880 is 22.5): the last tile's words beyond K
    are the layout's zero padding and its scales there load as zero, and A's columns beyond K are
    zero too (`permute_k` pads x; with PERM_OUT the output's padding columns, up to whole tiles,
    are stored as zeros for the next GEMM).
    ROUTING_READY (`launch.launch`'s routing_ready): the programs wait for the previous launch (PDL) only
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
        wait_for_inputs(PDL, True)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc_rows = pid_n * BLOCK_N + mma_rows(BLOCK_N)  # the accumulator's rows
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
        s1, z1 = load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, k_begin // 8, K, BLOCK_N, KW,
                              GROUP, FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
    if ROW_SCALES:  # `load_scales`' scales then go unused (the compiler drops those loads); its zero points do not
        r1 = row_scales(s_ptr, stride_sn, acc_rows, N, k_begin, GROUP)
    if GATED:
        w3_ptr += e * stride_we
        s3_ptr += e * stride_se
        z3_ptr += e * stride_ze
        if not PIPELINED_SCALES:
            s3, z3 = load_scales(s3_ptr, z3_ptr, stride_sn, stride_zn, offs_n, n_mask, k_begin // 8, K, BLOCK_N, KW,
                                  GROUP, FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
        if ROW_SCALES:
            r3 = row_scales(s3_ptr, stride_sn, acc_rows, N, k_begin, GROUP)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The epilogue's scalars now, not after the loop: a program's last load was a wait of its own.
    # On the GPU NVFP4's weights come 2^-7 times the true ones ("e2m1_folded"); the global scale,
    # which NVFP4 always has, takes it back.
    gs_factor: tl.constexpr = FOLDED_WEIGHT_FACTOR if ASM and FMT == NVFP4 else 1.0
    if HAS_GLOBAL:
        gs = tl.load(gs_ptr + e) * gs_factor
        if GATED:
            gs3 = tl.load(gs3_ptr + e) * gs_factor  # w3's own global scale, never w1's
    if ROUTE_WEIGHT:
        route = tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    if ROUTING_READY:  # the routing and weights were read while the launch before this one ran
        wait_for_inputs(PDL, True)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kw = k0 // 8
        kw_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K) // 8  # the last tile reloads itself
        if ROW_SCALES:  # the next tile's, a whole tile before they are used
            r1_next = row_scales(s_ptr, stride_sn, acc_rows, N, kw_next * 8, GROUP)
            if GATED:
                r3_next = row_scales(s3_ptr, stride_sn, acc_rows, N, kw_next * 8, GROUP)
        if PIPELINED_SCALES:  # this tile's, fetched stages ahead with its words by the pipeliner
            s1, z1 = load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, kw, K, BLOCK_N, KW, GROUP,
                                  FMT, HAS_ZP, EVEN_K, True, SCALE_LAYOUT)
        words = tl.load(w_ptr + w_offs + kw * W_TILE_ROWS)  # no mask: the layout pads N and K with zeros
        w_tile = mma_tile(dequant(words, s1, z1, FMT, HAS_ZP, COMPUTE, ASM, not ROW_SCALES), BLOCK_N)
        if not PIPELINED_SCALES:
            s1, z1 = load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, kw_next, K, BLOCK_N, KW, GROUP,
                                  FMT, HAS_ZP, EVEN_K, False, SCALE_LAYOUT)
        if GATED:
            if PIPELINED_SCALES:
                s3, z3 = load_scales(s3_ptr, z3_ptr, stride_sn, stride_zn, offs_n, n_mask, kw, K, BLOCK_N, KW, GROUP,
                                      FMT, HAS_ZP, EVEN_K, True, SCALE_LAYOUT)
            words3 = tl.load(w3_ptr + w_offs + kw * W_TILE_ROWS)
            w3_tile = mma_tile(dequant(words3, s3, z3, FMT, HAS_ZP, COMPUTE, ASM, not ROW_SCALES), BLOCK_N)
            if not PIPELINED_SCALES:
                s3, z3 = load_scales(s3_ptr, z3_ptr, stride_sn, stride_zn, offs_n, n_mask, kw_next, K, BLOCK_N, KW,
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
def swiglu_partials_kernel(part_ptr, stride_ps, stride_pg, h_ptr, stride_hm, N, ACTIVATION: tl.constexpr,
                            LIMIT: tl.constexpr, ALPHA: tl.constexpr, SPLIT_K: tl.constexpr,
                            PERM_OUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
    """h[pair] = the gated activation of the summed split-K partials of w1 and w3 (row `pair` of
    each; their biases are already in slice 0). With PERM_OUT, h's columns up to whole K tiles,
    zeros beyond N, as `moe_gemm_kernel` stores them. Under PDL it lets the down GEMM start its
    programs before it waits for w1/w3: they wait for this launch before they read h, and so take
    SMs as w1/w3's programs end (docs/kernel-notes.md, "The down GEMM started as w1/w3 end")."""
    if PDL:
        gdc_launch_dependents()
    wait_for_inputs(PDL, False)
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


@triton.jit
def topk_sum_kernel(y_ptr, stride_ys, stride_ym, out_ptr, H, SLICES: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL, False)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SLICES):
        for k in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + s * stride_ys + (token * TOP_K + k) * stride_ym + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
