"""Pure numerics, one module per storage format: decode and encode side by side, no I/O.

Each format module declares one `Codec`: the tensors ("parts") one stored projection consists of,
their dtypes and shapes, how to decode them, and the exact encoders into it from other formats.
They are registered here; the rest of requant asks this registry instead of comparing format
names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from requant.errors import FormatError, UnsupportedError

# What a part is to its projection. Only weight, scale and global_scale tell formats apart (a
# projection may lack an input_scale or the zero points and still be recognisable), and only the
# weight's numbers (weight, scale, global_scale, zero_point) are decoded.
WEIGHT, SCALE, GLOBAL_SCALE, INPUT_SCALE, SHAPE, ZERO_POINT = (
    "weight", "scale", "global_scale", "input_scale", "shape", "zero_point")
_IDENTIFYING = (WEIGHT, SCALE, GLOBAL_SCALE)
_DECODED = (WEIGHT, SCALE, GLOBAL_SCALE, ZERO_POINT)


@dataclass(frozen=True)
class Params:
    """What a stored projection's shapes depend on beyond its logical [out, K]."""

    group_size: int | None          # K elements per scale; None: the shapes do not tell
    zero_points: bool = False       # asymmetric INT4 stores a zero point per group


@dataclass(frozen=True)
class Part:
    """One tensor of a stored projection, named `<projection>.<suffix>`."""

    suffix: str
    role: str                                            # WEIGHT, SCALE, ...
    dtypes: tuple[str, ...]                              # accepted; requant writes the first
    shape: Callable[[int, int, Params], tuple[int, ...]]  # as requant writes it, from logical [out, K]
    shape_checked: bool = True                           # False: writers disagree, any shape is read

    @property
    def required(self) -> bool:
        return self.role != ZERO_POINT

    @property
    def scalar(self) -> bool:
        return self.role in (GLOBAL_SCALE, INPUT_SCALE)

    @property
    def grouped(self) -> bool:
        """Whether its shape depends on the group size."""
        return self.role in (SCALE, ZERO_POINT)


@dataclass(frozen=True)
class Problem:
    """A value in one stored projection that no valid file holds, or that engines mis-serve: found
    by its codec (Codec.value_problems) and reported by verify as a finding on that part."""

    severity: str               # "error" or "warning"
    code: str                   # the finding's code, as verify reports it
    message: str
    part: str                   # the suffix of the part it is in
    detail: str | None = None


def bad_scalar(value: float) -> str | None:
    """Why a per-tensor scale is unusable (engines multiply or divide by it), or None."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "infinite"
    if value <= 0:
        return "zero" if value == 0 else "negative"
    return None


@dataclass(frozen=True, eq=False)
class CodeTables:
    """What comparing stored codes needs of a packed code set (two codes per byte) whose value is
    code x block scale: value equality of two packed arrays, and a table of squares."""

    same_values: Callable[[np.ndarray, np.ndarray], bool]   # two packed uint8 arrays: the same values?
    squares: np.ndarray     # float32 [65536]: sum of the squared values of the 4 codes in 2 bytes


@dataclass(frozen=True, eq=False)
class Nibbles:
    """A projection stored one code per nibble: element k of row r is (table[code] -
    offset[r, k // group]) * scale[r, k // group], in float32, the operations of its format's
    torch decoder, so that a pass over the codes (report/compare.c) sees the decoder's values."""

    codes: torch.Tensor            # uint8 [rows, K/2]: element 2i in the low nibble of byte i
    scale: torch.Tensor            # float32 [rows, K/group]
    offset: torch.Tensor | None    # float32 [rows, K/group]; None: no offset
    table: torch.Tensor            # float32 [16]: each code's value before offset and scale
    group: int


@dataclass(frozen=True, eq=False)   # one object per format: compared and hashed by identity
class Codec:
    name: str                                       # as --in/--out and every report spell it
    elements: str                                   # the element code set (e2m1, int4, e4m3): codecs
                                                    # sharing it can hold the same weights exactly
    parts: tuple[Part, ...]
    elements_per_word: int                          # K elements per stored element of the weight part
    packed_dtype: torch.dtype                       # how decoders and the MoE kernel view the weight part
    # (parts by suffix, out=None) -> float32 [out, K], written into `out` when given (a reused buffer
    # of that shape: a fresh one per call costs the page faults of a pass)
    decode: Callable[..., torch.Tensor]
    # parts -> how many decoded values are not finite, where the format can tell without decoding
    # it all (None: verify --deep decodes and counts)
    count_nonfinite: Callable[[dict[str, torch.Tensor]], int] | None = None
    fixed_group: int | None = None                  # the block size, when the format fixes it
    group_sizes: tuple[int, ...] = ()               # the block sizes it allows (one: the fixed one)
    kernel_code: int | None = None                  # the fused-MoE kernel's format constant; None: not read
    check_scales: Callable[[object], None] = lambda scale: None   # FormatError on scale bytes no valid file holds
    # (read, logical [out, K]) -> the Problems of one stored projection's values (its scales, and
    # what they decode with); read(suffix) gives a part's tensor, None where the projection has none
    value_problems: Callable[..., list[Problem]] = lambda read, shape: []
    encoders: dict[str, Callable] = field(default_factory=dict)  # source codec name -> exact encoder
    # Where a value is its code times a per-block scale (no zero point): the code set's tables and
    # parts -> float32 [out, K/block] scales, so that equal values can be seen without decoding.
    code_tables: CodeTables | None = None
    block_scales: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    # parts -> Nibbles (FormatError on scales no valid file holds), for formats of one code a nibble
    nibbles: Callable[[dict[str, torch.Tensor]], Nibbles] | None = None

    def part(self, role: str) -> Part | None:
        return next((p for p in self.parts if p.role == role), None)

    @property
    def weight(self) -> Part:
        return self.part(WEIGHT)

    @property
    def decoded_parts(self) -> tuple[str, ...]:
        return tuple(p.suffix for p in self.parts if p.role in _DECODED)

    def rows(self, tensors: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor] | None:
        """The stored parts of rows start:stop (output channels) of a projection, as views; None when
        a part is not laid out one row per output channel (INT4 zero points pack 8 rows a word)."""
        roles = {p.suffix: p.role for p in self.parts}
        if any(roles.get(name) not in (WEIGHT, SCALE, GLOBAL_SCALE, INPUT_SCALE) for name in tensors):
            return None
        return {name: t[start:stop] if roles[name] in (WEIGHT, SCALE) else t for name, t in tensors.items()}

    def matches(self, dtypes_by_part: dict[str, str]) -> bool:
        return all(dtypes_by_part.get(p.suffix) in p.dtypes for p in self.parts if p.role in _IDENTIFYING)

    def written_parts(self, params: Params) -> tuple[Part, ...]:
        """The parts requant writes under `params`."""
        return tuple(p for p in self.parts if p.required or params.zero_points)

    def params_from_shapes(self, shapes_by_part: dict[str, tuple], k: int | None = None) -> Params:
        """Params of a stored projection from its part shapes: the one place a group size is inferred.
        `k` is the logical K when known otherwise (config.json); else the weight part's width tells."""
        weight = shapes_by_part.get(self.weight.suffix)
        if k is None and weight:
            k = weight[-1] * self.elements_per_word
        group = self.fixed_group
        if group is None:
            scale = shapes_by_part.get(self.part(SCALE).suffix)
            cols = scale[-1] if scale else None
            group = k // cols if cols and k and k % cols == 0 else None
        zero = self.part(ZERO_POINT)
        return Params(group, zero is not None and zero.suffix in shapes_by_part)

    def block_size(self, params: Params) -> int:
        """K elements per scale (the unit of 'exact scale blocks')."""
        return params.group_size

    def check_shapes(self, shapes_by_part: dict[str, tuple]) -> None:
        """Raise FormatError, naming the part, unless the parts' shapes fit the weight part's."""
        weight = shapes_by_part[self.weight.suffix]
        if len(weight) != 2:
            raise FormatError(f"expected a 2-D .{self.weight.suffix}, got {list(weight)}")
        out, k = weight[0], weight[1] * self.elements_per_word
        params = self.params_from_shapes(shapes_by_part)
        for part in self.parts:
            if part.suffix not in shapes_by_part or not part.shape_checked or part.role == WEIGHT:
                continue
            expected = part.shape(out, k, params) if params.group_size or not part.grouped else None
            if tuple(shapes_by_part[part.suffix]) != expected:
                raise FormatError(f".{part.suffix} shape {list(shapes_by_part[part.suffix])} does not match "
                                  f".{self.weight.suffix} shape {list(weight)}"
                                  + (f" (expected {list(expected)})" if expected is not None else ""))


_CODECS: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    if codec.name in _CODECS:
        raise ValueError(f"codec {codec.name!r} registered twice")
    _CODECS[codec.name] = codec
    return codec


def get(name: str) -> Codec:
    if name not in _CODECS:
        raise UnsupportedError(f"unknown format {name!r} (known: {', '.join(_CODECS)})")
    return _CODECS[name]


def codecs() -> list[Codec]:
    return list(_CODECS.values())


def identify(dtypes_by_part: dict[str, str]) -> Codec | None:
    """The codec whose parts (suffix -> safetensors dtype) one stored projection has, or None."""
    return next((c for c in _CODECS.values() if c.matches(dtypes_by_part)), None)


def encoder(source: str, target: str) -> Callable:
    """The exact encoder from codec `source` into codec `target`."""
    found = get(target).encoders.get(source)
    if found is None:
        raise UnsupportedError(f"--out {target} converts from {', '.join(encoder_sources(target)) or 'nothing'}, "
                               f"not {source}")
    return found


def encoder_sources(target: str) -> list[str]:
    """The codecs an encoder into `target` reads."""
    return list(get(target).encoders)


def byte_pairs(table: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [..., 2n] from uint8 [..., n]: both values of every byte from a [256, 2] table, into
    `out` (float32, that shape, contiguous) when given.

    On the CPU each byte's pair is fetched as one 8-byte word by numpy's `take`, about 3x faster
    than torch's index_select with its int32 index copy; mode="wrap" (a no-op for byte indices)
    selects numpy's loop without bounds checks. (A 1 MiB table of two bytes' four values halved
    the lookups and was 1.5x faster alone on a core, but 1.2x slower in a report with a worker per
    core, the table competing with the data for each core's cache.)
    """
    packed = packed.view(torch.uint8)
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=packed.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {list(shape)}, got {out.dtype} {list(out.shape)}")
    if packed.device.type != "cpu":
        torch.index_select(table.to(packed.device), 0, packed.reshape(-1).int(), out=out.view(-1, 2))
        return out
    words = table.contiguous().numpy().view(np.int64).reshape(256)
    np.take(words, packed.numpy(), out=out.view(torch.int64).numpy(), mode="wrap")
    return out


def identical_energy(ca: Codec, ta: dict[str, torch.Tensor], cb: Codec, tb: dict[str, torch.Tensor]) -> float | None:
    """sum(value^2) of a's weights when b stores the very same values, seen on the stored bytes
    without decoding: the same codes (zero's two spellings alike) under the same scale in every
    block. None when this does not show it (b may still be equal: decode and compare then).

    This confirms a lossless cast (MXFP4 -> NVFP4) at about reading speed; CPU tensors only, a GPU
    decodes and compares fast enough.
    """
    tables = ca.code_tables
    if tables is None or tables is not cb.code_tables or ca.block_scales is None or cb.block_scales is None:
        return None
    wa, wb = ta[ca.weight.suffix].view(torch.uint8), tb[cb.weight.suffix].view(torch.uint8)
    if wa.shape != wb.shape or wa.dim() != 2 or wa.shape[1] % 2 or "cpu" != wa.device.type or "cpu" != wb.device.type:
        return None
    sa, sb = ca.block_scales(ta), cb.block_scales(tb)
    blocks = max(sa.shape[-1], sb.shape[-1])
    if blocks % sa.shape[-1] or blocks % sb.shape[-1] or wa.shape[1] % (2 * blocks):
        return None
    sa = sa.repeat_interleave(blocks // sa.shape[-1], dim=-1)
    if not torch.equal(sa, sb.repeat_interleave(blocks // sb.shape[-1], dim=-1)) or not torch.isfinite(sa).all():
        return None
    a, b = wa.contiguous().numpy(), wb.contiguous().numpy()
    if not tables.same_values(a, b):
        return None
    # two bytes per lookup (a 256 KiB table, cache-resident): half the lookups of a byte table
    squares = torch.from_numpy(np.take(tables.squares, a.view(np.uint16), mode="wrap"))
    # Per block: a few multiples of 1/4 far below 2^24, exact in any order; a matrix-vector product
    # adds them 4x faster than a sum over the short last dimension.
    pairs = squares.numel() // (wa.shape[0] * blocks)
    per_block = squares.view(-1, pairs).mv(torch.ones(pairs)).view(wa.shape[0], blocks)
    return float((per_block * sa.square()).sum(dtype=torch.float64))


def scalar(t: torch.Tensor) -> float:
    """A per-tensor scale stored as [] or [1]."""
    return float(t.reshape(-1)[0].float())


def _int4_from_mxfp4(*args, **kwargs):
    """W4A16's data-free scale search from MXFP4, batched: ({name: (weight, scale)}, group_size,
    scheme, device) -> {name: Encoded}. int4_search is imported on first use (its tables take a
    fraction of a second to build) and builds on int4, so int4's codec cannot name it itself."""
    from requant.formats import int4_search

    return int4_search.encode_many(*args, **kwargs)


def _register_builtin() -> None:
    # Identification order: the first codec whose parts match wins.
    from requant.formats import fp8_block, int4, mxfp4, nvfp4

    for module in (mxfp4, nvfp4, int4, fp8_block):
        register(module.CODEC)
    int4.CODEC.encoders["mxfp4"] = _int4_from_mxfp4


_register_builtin()
