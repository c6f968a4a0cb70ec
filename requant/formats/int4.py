"""INT4 weights with one scale (and, asymmetric, one integer zero point) per group of K elements,
in compressed-tensors' pack-quantized layout (the W4A16 format vLLM runs through Marlin).

Dequantized value: (q - z) * scale[r, k // group], q and z integers in [-8, 7] (z = 0 when symmetric).

Layout:
- weight_packed  int32 [out, K/8]: element k of a row sits in word k // 8, bits 4*(k % 8) .. +3,
  stored as q + 8 (a nibble 0..15).
- weight_scale   bf16  [out, K/group].
- weight_zero_point (asymmetric only) int32 [out/8, K/group]: packed the same way but along the
  OUTPUT dimension (row r in word r // 8 of its column, bits 4*(r % 8)), stored as z + 8.

The encoder is data-free: per group it searches the stored BF16 scale (and zero point) that
minimises the squared error against the MXFP4 source (see encode_mxfp4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from requant.errors import FormatError
from requant.formats import e2m1, mxfp4

GROUP_SIZES = (32, 64, 128)
SCHEMES = ("sym", "asym")
QMIN, QMAX = -8, 7
PACK = 8                      # int4 values per int32 word


@dataclass
class Encoded:
    packed: torch.Tensor              # int32 [out, K/8]
    scale: torch.Tensor               # bfloat16 [out, K/group]
    zero_point: torch.Tensor | None   # int32 [out/8, K/group], asymmetric only
    signal_energy: float              # sum of squared source values
    error_energy: float               # sum of squared error of the decoded weights vs the source


def check_shape(rows: int, k: int, group_size: int, scheme: str) -> None:
    if group_size not in GROUP_SIZES:
        raise FormatError(f"group size {group_size} is not one of {GROUP_SIZES}")
    if scheme not in SCHEMES:
        raise FormatError(f"scheme {scheme!r} is not one of {SCHEMES}")
    if k % group_size or k % PACK:
        raise FormatError(f"K={k} is not a multiple of the group size {group_size}")
    if scheme == "asym" and rows % PACK:
        raise FormatError(f"{rows} rows cannot pack zero points {PACK} to a word")


# packing ------------------------------------------------------------------------------------
def pack(q: torch.Tensor) -> torch.Tensor:
    """int [.., n] values in [-8, 7] -> int32 [.., n/8]; element j of a word in bits 4j..4j+3."""
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
    byte = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    # Little-endian: byte b of a word holds bits 8b..8b+7, so elements 2b and 2b+1 land in place.
    # Through a flat copy: .contiguous() keeps odd strides on size-1 dimensions (one group: K equal
    # to the group size), which view() refuses.
    return byte.reshape(-1).view(torch.int32).reshape(*byte.shape[:-1], -1)


def unpack(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """int32 [.., w] -> int8 [.., 8w] (or the first n) values in [-8, 7]."""
    byte = packed.contiguous().view(torch.uint8)
    nibbles = torch.stack([byte & 0x0F, byte >> 4], dim=-1).flatten(-2)
    values = nibbles.to(torch.int8) - 8
    return values if n is None else values[..., :n]


def pack_zero_point(z: torch.Tensor) -> torch.Tensor:
    """int [out, groups] -> int32 [out/8, groups], packed along the output dimension."""
    return pack(z.t()).t().contiguous()


def unpack_zero_point(packed: torch.Tensor, rows: int) -> torch.Tensor:
    return unpack(packed.t().contiguous(), rows).t().contiguous()


# decode -------------------------------------------------------------------------------------
def decode(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [out, K] from the stored tensors. Plain torch, independent of the encoder."""
    rows, words = packed.shape
    k = words * PACK
    groups = scale.shape[1]
    if scale.shape[0] != rows or k % groups:
        raise FormatError(f"weight_scale shape {list(scale.shape)} does not match weight_packed {list(packed.shape)}")
    q = unpack(packed).to(torch.float32).view(rows, groups, k // groups)
    if zero_point is not None:
        q = q - unpack_zero_point(zero_point, rows).to(torch.float32)[..., None]
    return (q * scale.to(torch.float32)[..., None]).view(rows, k)


# encode -------------------------------------------------------------------------------------
# Every nonzero MXFP4 |value| m * 2^e is 2^k or 1.5 * 2^k. Normalised by 2^R, R the exponent of
# the group's largest |value|, the group's top is exactly 1 or 1.5 and every element is one of the
# signed levels +-1.5, +-1, +-0.75, +-0.5, ... (_LEVELS). Levels below half the smallest candidate
# scale round to 0 under every candidate, so their error is their energy whatever is chosen. A
# group is thus fully described by its counts over at most 2 * n_bins signed levels, and its
# squared error under a candidate scale s' * 2^R (and zero point z) is counts . (per-level error
# at s', z): one matrix product covers many groups and candidates. The candidates are BF16 values
# s': 2^R being a power of two, s' * 2^R is exactly the stored BF16 scale. Codes are
# round-to-nearest, optimal once the scale is fixed; they come from byte tables, so the encoder
# never materialises float weights.
#
# The exhaustive search (every BF16 s' in range, times every zero point) is exact but costs
# [groups x candidates x levels]; it stays as the test oracle. The default search is coarse to
# fine: every _COARSE-th scale (with every zero point), then every BF16 scale within _RADIUS of
# each group's winner, with the winner's zero point and its two neighbours.
_SCALE_RANGE = {"sym": (0.1, 0.5), "asym": (0.05, 0.5)}  # s' for a normalised max of 1 or 1.5
_ZERO_POINTS = range(-3, 4)        # asym offsets searched; E2M1 is symmetric, the best is near 0
_D_MAX = 8                         # blocks 2^-8 below the group's top round to 0 under any s'
_LEVELS = torch.tensor([(1.5 if i % 2 == 0 else 1.0) * 2.0 ** -(i // 2) for i in range(2 * _D_MAX)])
_MAG_LEVEL = np.array([7, 5, 4, 3, 2, 1, 0])   # magnitudes 0.5 .. 6 as level offsets (6 -> 0)
_MAG_SQUARED = np.square(e2m1.MAGNITUDES[1:], dtype=np.float32)
# Half-octave level of the largest magnitude present, from the bit mask of magnitudes 0.5 .. 6.
_TOP_LEVEL = np.array([max([(-2, 0, 1, 2, 3, 4, 5)[j] for j in range(7) if m >> j & 1], default=-(10**6))
                       for m in range(128)], dtype=np.int32)
# Coarse-to-fine, per scheme: BF16 steps between coarse scales, then the radius (in BF16 steps)
# searched around each group's coarse winner. Chosen on DeepSeek-V4-size synthetic experts: vs the
# exhaustive search they lose about 0.001 dB (sym) and 0.03 dB (asym); scripts/bench_w4a16.py.
_COARSE = {"sym": 8, "asym": 16}
_RADIUS = {"sym": 4, "asym": 8}
_CHUNK_GROUPS = 1 << 13            # bounds the [candidates, groups] error matrix
# Per pair of source bytes (4 codes), one 4-bit count field per code: sums of two cannot overflow.
_PAIR_FIELDS = sum(np.uint64(1) << (np.uint64(4) * ((np.arange(1 << 16, dtype=np.uint64) >> np.uint64(4 * j))
                                                    & np.uint64(15))) for j in range(4))
_LANES = np.uint64(0x0F0F0F0F0F0F0F0F)


def _bf16_between(lo: float, hi: float) -> torch.Tensor:
    """Every positive BF16 value in [lo, hi], as float32."""
    values = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return values[(values >= lo) & (values <= hi)]


class _Tables:
    """Error per (signed level, candidate) and output byte per (block shift, candidate, source
    byte). Candidate c is scale s[c % n_s] with zero point z[c // n_s]."""

    def __init__(self, scheme: str):
        self.scheme = scheme
        s = _bf16_between(*_SCALE_RANGE[scheme])
        zs = list(_ZERO_POINTS) if scheme == "asym" else [0]
        self.n_s, self.n_z = len(s), len(zs)
        self.z = torch.tensor(zs, dtype=torch.float32).repeat_interleave(self.n_s)
        self.s = s.repeat(self.n_z)
        assert float(e2m1.MAX) * 2.0**-_D_MAX < float(s[0]) / 2   # deeper blocks are all "tiny"
        self.n_bins = int((_LEVELS >= s[0] / 2).sum())
        x = torch.cat([_LEVELS[: self.n_bins], -_LEVELS[: self.n_bins]])[:, None]
        q = torch.clamp(torch.round(x / self.s) + self.z, QMIN, QMAX)
        error = ((q - self.z) * self.s - x).square()                                 # [2 bins, C]
        # Levels that never clamp cost the same for +v and -v: one row counts both signs, which
        # shrinks every product below. Row r counts level row_level[r] of sign plane row_plane[r]
        # (0: +, 1: -, 2: both).
        merged = (error[: self.n_bins] == error[self.n_bins:]).all(1).numpy()
        levels = np.arange(self.n_bins)
        self.row_level = np.concatenate([levels, levels[~merged]])
        self.row_plane = np.concatenate([np.where(merged, 2, 0), np.ones((~merged).sum(), dtype=int)])
        kept = torch.from_numpy(np.concatenate([np.ones(self.n_bins, dtype=bool), ~merged]))
        self.error, self.level_energy = error[kept], x.squeeze(1).square()[kept]
        d = torch.arange(-1, _D_MAX + 1, dtype=torch.float32)
        v = e2m1.signed_values()[None, :, None] * torch.exp2(-d)[:, None, None]      # [d, 16, 1]
        nibble = (torch.clamp(torch.round(v / self.s) + self.z, QMIN, QMAX) - QMIN).to(torch.uint8)
        nibble = nibble.transpose(1, 2)                                              # [d, C, 16]
        byte = torch.arange(256)
        self.bytes = (nibble[..., byte & 15] | (nibble[..., byte >> 4] << 4)).contiguous().numpy().reshape(-1)
        self.zero_index = int((self.z == 0).nonzero()[0])

    def exhaustive(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._best(counts, torch.arange(len(self.s)))

    def coarse_to_fine(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coarse = torch.arange(0, self.n_s, _COARSE[self.scheme]) + self.n_s * torch.arange(self.n_z)[:, None]
        pick, _ = self._best(counts, coarse.flatten())
        radius = _RADIUS[self.scheme]
        return self._refine(counts, pick, torch.arange(-radius, radius + 1))

    def _best(self, counts, options):
        """(best candidate among `options`, its error) per group."""
        pick, best = torch.empty(len(counts), dtype=torch.long), torch.empty(len(counts))
        table = self.error[:, options].t()
        for g0 in range(0, len(counts), _CHUNK_GROUPS):
            # [options, groups]: the min runs across rows, which vectorises (a per-row min does not).
            best[g0:g0 + _CHUNK_GROUPS], arg = (table @ counts[g0:g0 + _CHUNK_GROUPS].float().t()).min(0)
            pick[g0:g0 + _CHUNK_GROUPS] = options[arg]
        return pick, best

    def _refine(self, counts, pick, ds):
        """Best of each group's scale +- ds (zero point +-1 for asym), one matmul per distinct pick."""
        dz = torch.arange(-1, 2) if self.n_z > 1 else torch.zeros(1, dtype=torch.long)
        per_pick = np.bincount(pick.numpy(), minlength=len(self.s))
        centres = torch.from_numpy(per_pick.nonzero()[0])
        s = (centres % self.n_s)[:, None, None] + ds[None, None, :]
        z = (centres // self.n_s)[:, None, None] + dz[None, :, None]
        # Out-of-range neighbours are clipped to the edge: a repeated candidate is harmless.
        options = (z.clamp(0, self.n_z - 1) * self.n_s + s.clamp(0, self.n_s - 1)).flatten(1)
        # Groups sorted by pick (a radix sort), so each centre's groups are one contiguous slice.
        order = np.argsort(pick.numpy().astype(np.int16), kind="stable")
        cells = torch.from_numpy(np.take(counts.numpy(), order, axis=0)).split(per_pick[per_pick > 0].tolist())
        order = torch.from_numpy(order)
        picks, bests = zip(*(self._best(cell, opts) for cell, opts in zip(cells, options)))
        new_pick, new_best = torch.empty_like(pick), torch.empty(len(pick))
        new_pick[order], new_best[order] = torch.cat(picks), torch.cat(bests)
        return new_pick, new_best


_TABLES: dict[str, _Tables] = {}


def _block_histograms(blocks: np.ndarray) -> np.ndarray:
    """uint8 [n, 16] packed MXFP4 blocks -> uint8 [n, 16] count of each code per block."""
    n = len(blocks)
    fields = _PAIR_FIELDS[blocks.view(np.uint16)]                   # 4-bit counts of 4 codes
    fields = fields[:, 0:4] + fields[:, 4:8]                         # <= 8 each
    even, odd = fields & _LANES, (fields >> np.uint64(4)) & _LANES  # 8-bit lanes, sums <= 32
    even, odd = even[:, 0:2] + even[:, 2:4], odd[:, 0:2] + odd[:, 2:4]
    hist = np.empty((n, 16), dtype=np.uint8)
    hist[:, 0::2] = (even[:, 0] + even[:, 1]).view(np.uint8).reshape(n, 8)   # little-endian lanes
    hist[:, 1::2] = (odd[:, 0] + odd[:, 1]).view(np.uint8).reshape(n, 8)
    return hist


def encode_mxfp4(weight: torch.Tensor, scale: torch.Tensor, group_size: int = 128, scheme: str = "sym",
                 exhaustive: bool = False) -> Encoded:
    """Quantize one MXFP4 tensor (packed uint8 [out, K/2], E8M0 [out, K/32]) to INT4 groups along K.

    exhaustive=True evaluates every candidate: the exact optimum, many times slower (a test oracle)."""
    weight = weight.contiguous().view(torch.uint8)
    scale = scale.contiguous().view(torch.uint8)
    mxfp4.check_shapes(tuple(weight.shape), tuple(scale.shape))
    mxfp4.check_scales(scale.numpy())
    rows, k = weight.shape[0], weight.shape[1] * 2
    check_shape(rows, k, group_size, scheme)
    tables = _TABLES.get(scheme)
    if tables is None:
        tables = _TABLES.setdefault(scheme, _Tables(scheme))
    per_group = group_size // mxfp4.BLOCK
    blocks = weight.numpy().reshape(-1, mxfp4.BLOCK // 2)
    n_blocks = len(blocks)
    hist = _block_histograms(blocks)
    both = hist[:, 1:8] + hist[:, 9:16]
    mags = np.stack([hist[:, 1:8], hist[:, 9:16], both], 1)          # [blocks, +/-/both, magnitude 0.5 .. 6]

    # Level of each block's top |value|, counted in half octaves (level 2e+1 is 1.5 * 2^e).
    exps = scale.numpy().reshape(-1).astype(np.int32) - mxfp4.E8M0_BIAS
    present = np.zeros(n_blocks, dtype=np.uint8)                    # bit j: magnitude j present
    for j in range(7):
        present |= (both[:, j] > 0).view(np.uint8) << j
    group_top = (_TOP_LEVEL[present] + 2 * exps).reshape(-1, per_group).max(1)
    empty = group_top < -(10**5)
    r = group_top >> 1                                                # 2^R <= top < 2^(R+1)
    shift = np.clip(np.repeat(r, per_group) - exps, -1, _D_MAX)       # block values are m * 2^-shift

    # Counts per group over the table's rows: a block's magnitudes land at level 2 * shift + offset.
    lo = max(0, int(shift.max()) * 2 - 4)
    width = lo + max(8, tables.n_bins + 6)
    padded = np.zeros((n_blocks, 3, width), dtype=np.uint8)
    padded[:, :, lo + _MAG_LEVEL] = mags
    offsets = (width * tables.row_plane + lo + 4 + tables.row_level).astype(np.int32)
    index = (3 * width * np.arange(n_blocks, dtype=np.int32) - 2 * shift)[:, None] + offsets
    counts = np.take(padded, index).reshape(-1, per_group, len(offsets))
    counts = torch.from_numpy(counts.sum(1, dtype=np.uint8) if per_group > 1 else counts[:, 0])   # <= 128

    pick, best = tables.exhaustive(counts) if exhaustive else tables.coarse_to_fine(counts)
    empty_t = torch.from_numpy(empty)
    pick = torch.where(empty_t, tables.zero_index, pick)             # all-zero groups: q = z = 0
    r_t = torch.from_numpy(r).double()
    norm = torch.exp2(r_t.clamp(min=-126))
    scale_out = torch.where(empty_t, 1.0, tables.s[pick].double() * norm).to(torch.bfloat16)
    zero = torch.where(empty_t, 0.0, tables.z[pick])

    # Codes: one table lookup per source byte, keyed by (block shift, chosen candidate).
    key = (shift + 1) * len(tables.s) + np.repeat(pick.numpy().astype(np.int32), per_group)
    codes = np.take(tables.bytes, (key[:, None] << 8) | blocks)
    packed = torch.from_numpy(codes).view(rows, k // 2).view(torch.int32)

    # Error: the searched error per group, plus the energy of the levels left out (they decode to
    # 0): all energy minus the binned energy. Energies of normalised blocks and groups are sums of
    # multiples of 2^-12 below 2^12, exact in float32.
    block_energy = both.astype(np.float32) @ _MAG_SQUARED
    by_exponent = np.bincount(exps + mxfp4.E8M0_BIAS, weights=block_energy, minlength=256)
    signal = float(by_exponent @ np.exp2(2.0 * (np.arange(256) - mxfp4.E8M0_BIAS)))
    binned = torch.where(empty_t, 0.0, (counts.float() @ tables.level_energy).double() * torch.exp2(2 * r_t))
    error = signal + float((torch.where(empty_t, 0.0, best.double() * norm.square()) - binned).sum())
    zero = zero.to(torch.int8).view(rows, k // group_size)
    return Encoded(packed, scale_out.view(rows, k // group_size),
                   pack_zero_point(zero) if scheme == "asym" else None, signal, error)
