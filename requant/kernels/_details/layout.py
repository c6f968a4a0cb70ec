"""Where the kernel finds each weight, scale and activation: the bit permutation of the int32
words, the 64-row blocks the weights are stored in, the column order of the GEMM inputs, and how a
launch reads the block scales. Plain torch, no triton, so that the layout is tested on any CPU
(tests/test_kernel_layout.py) and the jit code (`_decode`, `_kernels`) only reads these tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from requant import formats
from requant.errors import FormatError
from requant.formats import int4, mxfp4, nvfp4

if TYPE_CHECKING:
    from requant.kernels._details.configs import KernelConfig
    from requant.kernels.weights import ExpertWeights

K_TILE = 128   # the kernel's K step: the 16 words `_decode.mma_tile` lays out
K_STEP = 8     # what K must be a multiple of: whole int32 words (K tiles are padded, `padded_k`)
TILE_ROWS = 64  # rows of a weight block (`tile_blocks`): one wgmma M tile
ROW_PAD = 128  # rows padded to whole blocks of the widest N tile a config takes

# How a launch reads the block scales (`scale_layout`): as stored, in `tile_blocks`' blocks, or as
# stored through an int32 view.
SCALES_ROWS = 0
SCALES_BLOCKS = 1
SCALES_WORDS = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_k(k: int) -> int:
    """A GEMM input's width in the kernel: K padded to whole K tiles."""
    return cdiv(k, K_TILE) * K_TILE


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
LAYOUTS = {nvfp4.CODEC.kernel_code: "e2m1", mxfp4.CODEC.kernel_code: "e2m1", int4.CODEC.kernel_code: "integer"}


def signed(bits: int) -> int:
    """A 32-bit pattern as the int32 holding it."""
    return bits - (1 << 32) if bits >> 31 else bits


def bit_moves(layout: str) -> list[tuple[int, int]]:
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


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    # int32 shifts: << wraps, >> is arithmetic, so the bits shifted in from the left are masked off.
    return x if r == 0 else (x << r) | ((x >> (32 - r)) & ((1 << r) - 1))


def kernel_words(words: torch.Tensor, kernel_code: int) -> torch.Tensor:
    """int32 words (8 nibbles, element 8w + j in bits 4j) with their bits in the kernel's layout for
    the format with this kernel code: a fixed permutation of each word's 32 bits, same size."""
    out = torch.zeros_like(words)
    for mask, r in bit_moves(LAYOUTS[kernel_code]):
        out |= _rotl(words & signed(mask), r)
    return out


def tile_blocks(x: torch.Tensor, group: int) -> torch.Tensor:
    """[E, N, C], each column `group` elements of K (int32 words: 8; block scales: their group),
    as [E, N', K'/128, 64, P]: blocks of 64 rows by one K tile, each contiguous (4 KB of words), a
    row block's K tiles one after another. A block holds its tile's P = 128 / group columns (one,
    repeated per tile, where a group spans tiles). N is padded to N' (whole ROW_PAD rows) and K to
    whole K tiles, with zeros. A program then streams whole blocks instead of 64-byte pieces of
    rows 2 KB apart (docs/kernel-notes.md, "Weights in 4 KB blocks")."""
    experts, n, c = x.shape
    per_tile, tiles = max(1, K_TILE // group), cdiv(c * group, K_TILE)
    rows = cdiv(n, ROW_PAD) * ROW_PAD
    out = x.new_zeros(experts, rows, tiles * per_tile)
    if group <= K_TILE:  # whole groups to a tile: the columns in order, zeros after them
        out[:, :n, :c] = x
    else:  # tile t takes group t * 128 // group
        out[:, :n] = x[:, :, torch.arange(tiles, device=x.device) * K_TILE // group]
    return out.view(experts, rows // TILE_ROWS, TILE_ROWS, tiles, per_tile).transpose(2, 3).contiguous()


def permute_k(x: torch.Tensor, block_k: int = K_TILE) -> torch.Tensor:
    """Columns of x reordered within each 128-column tile as `_decode.mma_tile` orders the weights:
    new column 32q + 8m + 2l + n0 holds old column 32l + 8q + 2m + n0; zero columns pad the last tile."""
    rows, k = x.shape
    padded = padded_k(k)
    if padded != k:
        x = torch.nn.functional.pad(x, (0, padded - k))
    return x.view(rows, padded // block_k, 4, 4, 4, 2).permute(0, 1, 3, 4, 2, 5).reshape(rows, padded)


def as_int32_words(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes as int32 words: little-endian, so nibble j of word w is element 8w + j, as for INT4."""
    if packed.dtype == torch.int32:
        return packed
    if packed.shape[-1] % 4:
        raise FormatError(f"K/2={packed.shape[-1]} bytes is not a whole number of int32 words")
    return (packed if packed.stride(-1) == 1 else packed.contiguous()).view(torch.int32)


def tile_scale_bytes(group: int, scale_bytes: int) -> int:
    """Bytes of one row's block scales per K tile (one scale where a group spans tiles)."""
    return max(1, K_TILE // group) * scale_bytes


def scales_in_blocks(group: int, scale_bytes: int) -> bool:
    """Whether block scales are stored in `tile_blocks`' layout: where a row's scales per K tile are
    8 bytes or more (NVFP4, INT4 g32). Narrower rows, loaded one K tile ahead by hand or as int32
    words (`scale_layout`), stay as stored: in a row one 32-byte sector serves many tiles, so most
    of those loads hit L2, where in blocks each went to DRAM (docs/kernel-notes.md, "Weights in
    4 KB blocks")."""
    return tile_scale_bytes(group, scale_bytes) >= 8


def scale_layout(cfg: KernelConfig, group: int, scale_bytes: int, k: int) -> int:
    """How a launch reads the block scales (SCALE_LAYOUT), and so whether they are fetched stages
    ahead with the words (anything but SCALES_ROWS, where cfg asks): Triton's pipeliner copies
    them with cp.async where a thread reads 4 bytes or more (docs/kernel-notes.md, "Block scales
    in the pipeline").
    - SCALES_BLOCKS: rows of 8 bytes or more a K tile (NVFP4; INT4 with groups of 32), which
      `kernel_weights` put in blocks (`scales_in_blocks`).
    - SCALES_WORDS: rows of 4 bytes a K tile (MXFP4, INT4 g64), K whole tiles, read as one int32
      word per row and tile where cfg pipelines the scales.
    - SCALES_ROWS: the others, loaded one tile ahead by hand: K off whole tiles (gpt-oss's 2880),
      which the pipeliner left as a load in the loop that was waited for, and INT4 g128's 2 bytes,
      slower as words holding two tiles."""
    if scales_in_blocks(group, scale_bytes):
        return SCALES_BLOCKS
    if cfg.pipelined_scales and group <= K_TILE and tile_scale_bytes(group, scale_bytes) == 4 and k % K_TILE == 0:
        return SCALES_WORDS
    return SCALES_ROWS


def row_scaled(cfg: KernelConfig, kernel_code: int, group: int, layout: int) -> bool:
    """Whether a launch multiplies by INT4's scales after the MMA (ROW_SCALES): where cfg asks and a
    group spans the K tile (whole groups: K is a multiple of the group), so that a tile has one
    scale per row, read as stored (the launch's SCALE_LAYOUT, `scale_layout`)."""
    return (cfg.scale_after_dot and kernel_code == int4.CODEC.kernel_code and group % K_TILE == 0
            and layout == SCALES_ROWS)


def scale_words(scale: torch.Tensor) -> torch.Tensor | None:
    """scale's bytes as int32 (a view), or None where its rows or strides are not whole words."""
    b = scale.element_size()
    if scale.stride(-1) != 1 or any(x * b % 4 for x in (*scale.stride()[:-1], scale.shape[-1], scale.storage_offset())):
        return None
    return scale.view(torch.int32)


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


def kernel_weights(w: ExpertWeights | KernelWeights) -> KernelWeights:
    """w with its weights in the kernel's layout (a copy; row views such as gpt-oss's interleaved
    gate/up rows come out contiguous). KernelWeights pass through."""
    if isinstance(w, KernelWeights):
        return w
    words = kernel_words(as_int32_words(w.packed), w.codec.kernel_code)
    scale = tile_blocks(w.scale, w.group) if scales_in_blocks(w.group, w.scale.element_size()) else w.scale
    return KernelWeights(w.format, tile_blocks(words, 8), scale, w.global_scale, w.zero_point, w.group,
                         words.shape[1], words.shape[2] * 8)
