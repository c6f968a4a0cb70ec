"""INT4 weights with one scale (and, asymmetric, one integer zero point) per group of K elements,
in compressed-tensors' pack-quantized layout (the W4A16 format vLLM runs through Marlin).

Dequantized value: (q - z) * scale[r, k // group], q and z integers in [-8, 7] (z = 0 when symmetric).

Layout:
- weight_packed  int32 [out, K/8]: element k of a row sits in word k // 8, bits 4*(k % 8) .. +3,
  stored as q + 8 (a nibble 0..15).
- weight_scale   bf16  [out, K/group].
- weight_zero_point (asymmetric only) int32 [out/8, K/group]: packed the same way but along the
  OUTPUT dimension (row r in word r // 8 of its column, bits 4*(r % 8)), stored as z + 8.

The encoder is data-free and exact: per group it finds the stored BF16 scale (and zero point)
that minimises the squared error against the MXFP4 source (see encode_mxfp4).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    return byte.contiguous().view(torch.int32)


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
# Every MXFP4 value is m * 2^e, m one of 16 E2M1 codes. Normalised by 2^R, R the exponent of the
# group's largest |value|, an element of block b is m * 2^-d_b for a small integer d_b, so a block
# is fully described by its code histogram and d_b. Its squared error under a candidate scale
# s' * 2^R (and zero point z) is (histogram) . (per-code error table of d_b at s', z): one small
# matrix product covers all blocks and all candidates. The candidates are every BF16 value in a
# range: 2^R being a power of two, s' * 2^R is exactly the BF16 scale that is stored, so the
# choice is the exact MSE-optimal stored scale (and zero point) for round-to-nearest codes, which
# are themselves optimal once the scale is fixed. Codes come from the same tables, so the encoder
# never materialises float weights.
_D_MIN = -1                        # d of a group's top block is floor(log2 |m|) of its top code
_D_MAX = {32: 2, 64: 13, 128: 13}  # deeper blocks lie below 2^-13 of the group max: they round to 0
_SCALE_RANGE = {"sym": (0.1, 0.5), "asym": (0.05, 0.5)}  # s' for a normalised max in [1, 2)
_ZERO_POINTS = range(-3, 4)        # asym offsets searched; E2M1 is symmetric, the best is near 0
_CHUNK_GROUPS = 1 << 13            # groups per step: bounds the [groups, candidates] error matrix
_LOG2_CODE = torch.tensor([-99, -1, 0, 0, 1, 1, 2, 2] * 2)  # floor(log2 |m|); -99 for zeros


def _bf16_between(lo: float, hi: float) -> torch.Tensor:
    """Every positive BF16 value in [lo, hi], as float32."""
    values = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return values[(values >= lo) & (values <= hi)]


class _Tables:
    """Per (d, code) error and code tables over all (s', z) candidates; d = _D_MAX + 1 is "tiny"."""

    def __init__(self, group_size: int, scheme: str):
        s = _bf16_between(*_SCALE_RANGE[scheme])
        zs = list(_ZERO_POINTS) if scheme == "asym" else [0]
        self.z = torch.tensor(zs, dtype=torch.float32).repeat_interleave(len(s))
        self.s = s.repeat(len(zs))
        d = torch.arange(_D_MIN, _D_MAX[group_size] + 1, dtype=torch.float32)
        v = e2m1.signed_values()[None, :, None] * torch.exp2(-d)[:, None, None]      # [d, 16, 1]
        q = torch.clamp(torch.round(v / self.s) + self.z, QMIN, QMAX)                 # [d, 16, C]
        self.error = ((q - self.z) * self.s - v).square()
        tiny = self.z.expand(1, 16, -1)                                              # rounds to 0
        self.nibble = (torch.cat([q, tiny]) - QMIN).to(torch.uint8).flatten()          # stored q + 8
        self.n_d = len(d)
        self.zero_index = int((self.z == 0).nonzero()[0])


_TABLES: dict[tuple[int, str], _Tables] = {}


def encode_mxfp4(weight: torch.Tensor, scale: torch.Tensor, group_size: int = 128, scheme: str = "sym") -> Encoded:
    """Quantize one MXFP4 tensor (packed uint8 [out, K/2], E8M0 [out, K/32]) to INT4 groups along K."""
    weight = weight.contiguous().view(torch.uint8)
    scale = scale.contiguous().view(torch.uint8)
    mxfp4.check_shapes(tuple(weight.shape), tuple(scale.shape))
    mxfp4.check_scales(scale.numpy())
    rows, k = weight.shape[0], weight.shape[1] * 2
    check_shape(rows, k, group_size, scheme)
    tables = _TABLES.get((group_size, scheme))
    if tables is None:
        tables = _TABLES.setdefault((group_size, scheme), _Tables(group_size, scheme))
    n_cand = len(tables.s)
    per_group = group_size // mxfp4.BLOCK

    half = mxfp4.BLOCK // 2
    blocks = weight.view(-1, half)                                   # one MXFP4 block per row
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    n_blocks = len(blocks)
    base = torch.arange(n_blocks)[:, None] * 16
    hist = (torch.bincount((base + lo).flatten(), minlength=n_blocks * 16)
            + torch.bincount((base + hi).flatten(), minlength=n_blocks * 16)).view(n_blocks, 16)
    present = hist > 0
    present[:, 0] = present[:, 8] = False                             # +-0 cost nothing
    top_code = torch.where(present, _LOG2_CODE, -99).amax(1)
    exps = scale.view(-1).long() - mxfp4.E8M0_BIAS
    block_top = torch.where(top_code > -99, exps + top_code, -(10**6))
    group_top = block_top.view(-1, per_group).amax(1)                # R per group
    empty = group_top < -(10**5)
    d = group_top.repeat_interleave(per_group) - exps                 # per block
    slot = torch.where(d > _D_MAX[group_size], tables.n_d, d.clamp(min=_D_MIN) - _D_MIN)
    slot = torch.where(top_code > -99, slot, tables.n_d)             # all-zero blocks: q = z

    n_groups = len(group_top)
    pick = torch.zeros(n_groups, dtype=torch.long)
    best = torch.zeros(n_groups, dtype=torch.float64)
    histf = hist.float()
    table_t = tables.error.reshape(-1, n_cand).t().contiguous()       # [C, d * 16]
    for g0 in range(0, n_groups, _CHUNK_GROUPS):
        g1 = min(g0 + _CHUNK_GROUPS, n_groups)
        b0, b1 = g0 * per_group, g1 * per_group
        # Bin counts per group over (slot, code); the "tiny" slot costs every candidate the same.
        counts = torch.zeros(g1 - g0, tables.n_d + 1, 16)
        owner = torch.arange(g1 - g0).repeat_interleave(per_group)
        counts.index_put_((owner, slot[b0:b1]), histf[b0:b1], accumulate=True)
        counts = counts[:, :-1].reshape(g1 - g0, -1)
        used = counts.any(0).nonzero().squeeze(1)                     # most (slot, code) bins are empty
        err = table_t[:, used] @ counts[:, used].t()                  # [C, groups]: min over dim 0
        low, arg = err.min(0)
        pick[g0:g1] = arg
        best[g0:g1] = low.double()
    pick = torch.where(empty, tables.zero_index, pick)               # all-zero groups: q = z = 0
    norm = torch.exp2(group_top.clamp(min=-126).double())
    scale_out = torch.where(empty, 1.0, tables.s[pick].double() * norm).to(torch.bfloat16)
    zero = torch.where(empty, 0.0, tables.z[pick])

    # Codes: table lookup of (block slot, source code, chosen candidate).
    block_pick = pick.repeat_interleave(per_group)[:, None]
    index = (slot[:, None] * 16) * n_cand + block_pick
    q_lo = tables.nibble[index + lo * n_cand]
    q_hi = tables.nibble[index + hi * n_cand]
    packed = (q_lo | (q_hi << 4)).view(rows, k // 2).view(torch.int32)

    # Error: the table minimum per group, plus the energy of "tiny" blocks (they decode to 0).
    energy = (hist.double() * e2m1.signed_values(torch.float64).square()).sum(1) * torch.exp2(2.0 * exps.double())
    tiny = (slot == tables.n_d).double()
    error = float((best * norm.square()).sum() + (energy * tiny).sum())
    zero = zero.to(torch.int8).view(rows, k // group_size)
    return Encoded(packed, scale_out.view(rows, k // group_size),
                   pack_zero_point(zero) if scheme == "asym" else None, float(energy.sum()), error)
