"""INT4 weights with one scale (and, asymmetric, one integer zero point) per group of K elements,
in compressed-tensors' pack-quantized layout, the W4A16 format vLLM runs through Marlin
(docs/formats.md, W4A16 tensors).

Dequantized value: (q - z) * scale[r, k // group], q and z integers in [-8, 7] (z = 0 when symmetric).

Layout:
- weight_packed  int32 [out, K/8]: element k of a row sits in word k // 8, bits 4*(k % 8) .. +3,
  stored as q + 8 (a nibble 0..15).
- weight_scale   bf16  [out, K/group].
- weight_zero_point (asymmetric only) int32 [out/8, K/group]: packed the same way but along the
  OUTPUT dimension (row r in word r // 8 of its column, bits 4*(r % 8)), stored as z + 8.

The format only: the data-free encoder that searches each group's scale is int4_search.
"""

from __future__ import annotations

import torch

from requant import formats
from requant.errors import FormatError

GROUP_SIZES = (32, 64, 128)   # what vLLM's Marlin WNA16 MoE runs (docs/formats.md, W4A16 group sizes)
SCHEMES = ("sym", "asym")
QMIN, QMAX = -8, 7
PACK = 8                      # int4 values per int32 word


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
# Both values of each byte (low nibble first), as float32: one lookup per byte decodes two weights.
_BYTE_VALUES = torch.stack([torch.arange(256) & 15, torch.arange(256) >> 4], 1).float() - 8


def decode(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [out, K] from the stored tensors, on their device (into `out` when given). Plain
    torch, independent of the encoder."""
    rows, words = packed.shape
    k = words * PACK
    groups = scale.shape[1]
    if scale.shape[0] != rows or k % groups:
        raise FormatError(f"weight_scale shape {list(scale.shape)} does not match weight_packed {list(packed.shape)}")
    q = formats.byte_pairs(_BYTE_VALUES, packed.contiguous().view(torch.uint8), out).view(rows, groups, k // groups)
    if zero_point is not None:
        q -= unpack_zero_point(zero_point, rows).to(torch.float32)[..., None]
    q *= scale.to(torch.float32)[..., None]
    return q.view(rows, k)


def nibbles(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> formats.Nibbles:
    """The stored tensors as formats.Nibbles: the operations of decode, per code."""
    rows, words = packed.shape
    offset = None if zero_point is None else unpack_zero_point(zero_point, rows).to(torch.float32)
    return formats.Nibbles(packed.contiguous().view(torch.uint8).view(rows, -1), scale.to(torch.float32), offset,
                           _BYTE_VALUES[:16, 0].contiguous(), words * PACK // max(scale.shape[1], 1))


def value_problems(read, shape) -> list[formats.Problem]:
    """Group scales no decoder should meet (non-finite, negative; zero ones decode their group to
    0), and a weight_shape that does not hold the logical [out, K]."""
    problems = []
    scales = read("weight_scale").float()
    for code, mask, what, severity in (
            ("nonfinite-group-scale", ~torch.isfinite(scales), "non-finite group scales", "error"),
            ("negative-group-scale", scales < 0, "negative group scales", "error"),
            ("zero-group-scale", scales == 0, "zero group scales (those weights decode to 0)", "warning")):
        n = int(mask.sum())
        if n:
            problems.append(formats.Problem(severity, code, what, "weight_scale", f"{n} groups"))
    stored = [int(v) for v in read("weight_shape").reshape(-1).tolist()]
    if stored != list(shape):
        problems.append(formats.Problem("error", "weight-shape-value", "weight_shape does not hold the logical "
                                        "[out, in] shape", "weight_shape", f"{stored}, expected {list(shape)}"))
    return problems


CODEC = formats.Codec(
    name="w4a16",
    elements="int4",
    parts=(formats.Part("weight_packed", formats.WEIGHT, ("I32",), lambda out, k, p: (out, k // PACK)),
           formats.Part("weight_scale", formats.SCALE, ("BF16", "F16", "F32"),
                        lambda out, k, p: (out, k // p.group_size)),
           formats.Part("weight_shape", formats.SHAPE, ("I64", "I32"), lambda out, k, p: (2,)),
           formats.Part("weight_zero_point", formats.ZERO_POINT, ("I32", "I8", "U8", "BF16", "F16", "F32"),
                        lambda out, k, p: (out // PACK, k // p.group_size), shape_checked=False)),
    elements_per_word=PACK,
    packed_dtype=torch.int32,
    decode=lambda t, out=None: decode(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), out),
    nibbles=lambda t: nibbles(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")),
    group_sizes=GROUP_SIZES,
    kernel_code=2,
    value_problems=value_problems,
    # its encoder from MXFP4 (int4_search) builds on this module: formats/__init__ adds it
)
