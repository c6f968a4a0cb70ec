"""The @triton.jit code that turns a tile of kernel words (`layout`) and its block scales into one
MMA operand in registers: on the GPU through the inline PTX of `ptx` (packed BF16), under the
interpreter through FP32 arithmetic reading the same layout tables.
"""

import triton
import triton.language as tl

from requant.formats import int4, mxfp4, nvfp4
from requant.kernels._details import layout, ptx

NVFP4 = tl.constexpr(nvfp4.CODEC.kernel_code)
MXFP4 = tl.constexpr(mxfp4.CODEC.kernel_code)
INT4 = tl.constexpr(int4.CODEC.kernel_code)

# NVFP4's BF16 route ("e2m1_folded"): E4M3 block scales come times 2^119 (`scale_bf16_bits`), the
# decoded weights 2^(126 - 119) = 2^7 below the true ones, which the accumulator takes back.
SCALE_FOLD = 119
_SCALE_FOLD_BITS = tl.constexpr(SCALE_FOLD << 7)              # added to a BF16 exponent field
FOLDED_WEIGHT_FACTOR = tl.constexpr(2.0 ** (126 - SCALE_FOLD))

W_TILE_ROWS = tl.constexpr(layout.TILE_ROWS)
SCALES_ROWS = tl.constexpr(layout.SCALES_ROWS)
SCALES_BLOCKS = tl.constexpr(layout.SCALES_BLOCKS)
SCALES_WORDS = tl.constexpr(layout.SCALES_WORDS)

# `ptx.PAIR_ASM` by byte pair m.
ASM_FP4 = tl.constexpr(ptx.PAIR_ASM["e2m1", True])
ASM_FP4_FOLDED = tl.constexpr(ptx.PAIR_ASM["e2m1_folded", True])
ASM_INT4 = tl.constexpr(ptx.PAIR_ASM["integer", True])
ASM_INT4_ZP = tl.constexpr(ptx.PAIR_ASM["integer_zero_point", True])
ASM_INT4_UNSCALED = tl.constexpr(ptx.PAIR_ASM["integer", False])
ASM_INT4_ZP_UNSCALED = tl.constexpr(ptx.PAIR_ASM["integer_zero_point", False])
# The same terms for the FP32 route, two per pair (a zero mask where there is one).
_TERMS = {name: tuple(tuple(t[i] if i < len(t) else (0, 0) for t in terms) for i in range(2))
          for name, terms in layout.PAIR_TERMS.items()}
_E2M1_ROT = tl.constexpr(tuple(r for r, _ in _TERMS["e2m1"][0]))
_E2M1_MASK = tl.constexpr(tuple(layout.signed(m) for _, m in _TERMS["e2m1"][0]))
_E2M1_ROT2 = tl.constexpr(tuple(r for r, _ in _TERMS["e2m1"][1]))
_E2M1_MASK2 = tl.constexpr(tuple(layout.signed(m) for _, m in _TERMS["e2m1"][1]))
_INT4_ROT = tl.constexpr(tuple(r for r, _ in _TERMS["integer"][0]))
_E2M1_BITS = tl.constexpr(layout.NIBBLE_BITS["e2m1"])


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
def scale_bf16_bits(raw, FMT: tl.constexpr):
    """Block scales as BF16 bit patterns (int16); exact for E4M3, E8M0 and BF16 alike. E4M3 comes
    times 2^119 (`ptx.pair_asm`'s "e2m1_folded"): every nonzero E4M3 value is a normal BF16, so that is
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


@triton.jit
def _asm_pair(words, s, nz, M: tl.constexpr, FMT: tl.constexpr, HAS_ZP: tl.constexpr, SCALED: tl.constexpr):
    """Nibbles 2M and 2M + 1 of each kernel word as two BF16 tiles (INT4 not SCALED: s unused)."""
    if FMT == INT4:
        if not SCALED:
            if HAS_ZP:
                lo, hi = tl.inline_asm_elementwise(ASM_INT4_ZP_UNSCALED[M], "=h,=h,r,h", [words, nz],
                                                   (tl.bfloat16, tl.bfloat16), True, 1)
            else:
                lo, hi = tl.inline_asm_elementwise(ASM_INT4_UNSCALED[M], "=h,=h,r", [words],
                                                   (tl.bfloat16, tl.bfloat16), True, 1)
        elif HAS_ZP:
            lo, hi = tl.inline_asm_elementwise(ASM_INT4_ZP[M], "=h,=h,r,h,h", [words, s, nz],
                                               (tl.bfloat16, tl.bfloat16), True, 1)
        else:
            lo, hi = tl.inline_asm_elementwise(ASM_INT4[M], "=h,=h,r,h", [words, s], (tl.bfloat16, tl.bfloat16),
                                               True, 1)
    elif FMT == NVFP4:
        lo, hi = tl.inline_asm_elementwise(ASM_FP4_FOLDED[M], "=h,=h,r,h", [words, s], (tl.bfloat16, tl.bfloat16),
                                           True, 1)
    else:
        lo, hi = tl.inline_asm_elementwise(ASM_FP4[M], "=h,=h,r,h", [words, s], (tl.bfloat16, tl.bfloat16), True,
                                           1)
    return lo, hi


@triton.jit
def _rotl(x, R: tl.constexpr):
    if R == 0:
        return x
    return (x << R) | ((x >> (32 - R)) & ((1 << R) - 1))


@triton.jit
def pair_nibbles(words, M: tl.constexpr, FMT: tl.constexpr):
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
    lo, hi = pair_nibbles(words, M, FMT)
    lo, hi = _nibble_f32(lo, zero, FMT), _nibble_f32(hi, zero, FMT)
    if SCALED:
        lo, hi = lo * s, hi * s
    return lo.to(COMPUTE), hi.to(COMPUTE)


@triton.jit
def dequant(words, scale_raw, zero, FMT: tl.constexpr, HAS_ZP: tl.constexpr, COMPUTE: tl.constexpr,
             ASM: tl.constexpr, SCALED: tl.constexpr):
    """The 8 nibble planes of a tile of kernel words as COMPUTE tiles: plane j holds nibble j of
    each word. scale_raw and zero are per group (`load_scales`), converted before they are
    broadcast to the words: once per group instead of once per word. Not SCALED (INT4 only):
    the codes minus their zero points, scale_raw unused (`KernelConfig.scale_after_dot`).
    On the GPU NVFP4's planes are 2^-7 times the weights ("e2m1_folded")."""
    s = 1.0
    if ASM:
        if SCALED:
            s = _per_word(scale_bf16_bits(scale_raw, FMT), words)
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
def mma_tile(p, BLOCK_N: tl.constexpr):
    """The 8 planes [BLOCK_N, 16 words] of a K tile as one [BLOCK_N, 128] MMA operand, its rows and
    columns ordered so that every thread already holds its share of the wgmma register operand.

    A thread holds 4 consecutive words (one 16-byte load) of a row: words 4l..4l+3 in lane l of its
    quad; the MMA wants lane l at columns 2l, 2l + 1 (+ multiples of 8). Column d = 32q + 8m + 2l +
    n0 therefore takes nibble 2m + n0 of word 4l + q (`permute_k` orders the activations the same
    way). Rows: the load spreads warps over 8-row groups and repeats at BLOCK_N / 2; the MMA wants
    16-row groups per warp with the 8-row halves in registers, so tile row 16w + 8h + i holds
    weight row h * BLOCK_N / 2 + 8w + i (`mma_rows`). Planned with Triton 3.6's layouts for
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
def mma_rows(BLOCK_N: tl.constexpr):
    """Weight row (within the N tile) of each row of `mma_tile`."""
    r = tl.arange(0, BLOCK_N)
    return ((r >> 3) & 1) * (BLOCK_N // 2) + (r >> 4) * 8 + (r & 7)


@triton.jit
def load_scales(s_ptr, z_ptr, stride_sn, stride_zn, offs_n, n_mask, kw, K, BLOCK_N: tl.constexpr,
                 KW: tl.constexpr, GROUP: tl.constexpr, FMT: tl.constexpr, HAS_ZP: tl.constexpr,
                 EVEN_K: tl.constexpr, PIPELINED: tl.constexpr, LAYOUT: tl.constexpr):
    """Scales (raw) and zero points [BLOCK_N, G] of the groups of the tile starting at word column
    kw (G = 1 when a group spans more than the tile); zero for groups at or beyond K (the last tile
    when not EVEN_K): in SCALES_BLOCKS the scales' padding in their block layout (`tile_blocks`,
    blocks stride_sn apart), otherwise (scales as stored, rows stride_sn apart) and for the zero
    points by a mask. SCALES_WORDS: the rows as stored, read through an int32 view (`scale_layout`:
    K whole tiles, a tile's scales 4 bytes a row).

    One load per group, broadcast to its words by `dequant`: the tile's layout then follows the
    weight words (vector stores of the dequantized planes) instead of a per-word gather of
    repeated bytes.
    PIPELINED (the caller's PIPELINED_SCALES): a plain load of the tile's row, which Triton's
    pipeliner fetches stages ahead with the words, through shared memory: it copies 4 bytes or more
    a thread with cp.async, so 4-byte rows come as int32 words (SCALES_WORDS).
    Otherwise the caller issues the load one K tile ahead, the loop waiting for it; NVFP4's are then
    loaded in the layout the words' groups have in registers (2 bytes per row and thread), so they
    need no trip through shared memory. Under Nsight Compute that wait was the largest stall of the
    decode GEMMs (docs/kernel-notes.md, "Block scales in the pipeline").
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
def row_scales(s_ptr, stride_sn, rows, N, k0, GROUP: tl.constexpr):
    """FP32 scales [len(rows)] of the given rows for the group holding K column k0 (scales as
    stored, one group a K tile or more); zero beyond N."""
    return tl.load(s_ptr + rows * stride_sn + k0 // GROUP, mask=rows < N, other=0.0).to(tl.float32)
