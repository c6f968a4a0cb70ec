"""The W4A16 encoder in one C pass over the groups (int4_encode.c), for CPUs.

int4_search._search runs the encoding as a few dozen whole-tensor torch passes; on a CPU most of their
time goes to memory traffic, sorting groups by their coarse winner and small matrix products that
BLAS runs far below a core's peak. The C pass keeps each group in registers. Its search keys are
whole numbers below 2^53 in float64, so it picks the same candidates and writes the same bytes
and energies (tests/test_int4_search_c.py compares them).

Built and loaded by requant.c_helpers; where it is not there (no C compiler, REQUANT_NATIVE=0),
`encode` returns None and int4_search runs its torch passes.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from requant import c_helpers

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int4_encode.c")
_VECTOR, _TILE = 4, 16   # doubles per vector, per tile of four vectors (the C pass reads whole tiles)


_FIELDS = ("coarse", "n_coarse", "table", "stride", "n_s", "n_z", "radius", "z_radius", "tie", "rows", "n_bins",
           "split", "byte_lanes", "bytes", "s", "z", "lane_squared", "zero_index", "d_max", "empty", "e8m0_bias",
           "r_offset")
_POINTERS = {"coarse", "table", "byte_lanes", "bytes", "s", "z", "lane_squared"}


class _Tables(ctypes.Structure):
    """int4_encode.c's requant_int4_tables, field for field."""
    _fields_ = [(name, ctypes.c_void_p if name in _POINTERS else ctypes.c_int64) for name in _FIELDS]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return c_helpers.bind(_SOURCE, {"requant_int4_encode": ([ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                          ctypes.c_void_p, ctypes.POINTER(_Tables), ctypes.c_int,
                                                          *[ctypes.c_void_p] * 5], ctypes.c_int)},
                       "requant_int4_vectorised")


def status() -> str:
    """'c (avx2)' or 'c (portable)' when the library is there; else 'torch: <why not>'. Builds it."""
    return c_helpers.describe(_library())


class Prepared:
    """One int4_search._Tables (CPU) laid out for the C pass: the search table's coarse columns (padded to
    whole tiles by repeating the last) and every column, each row padded; the tensors the
    struct points at are kept here."""

    def __init__(self, tables, *, radius: int, z_radius: int, tie: int, code_lanes: torch.Tensor, **constants: int):
        error = tables.error
        rows, n = error.shape
        columns = torch.cat([tables.coarse, tables.coarse[-1:].expand((-len(tables.coarse)) % _TILE)])
        self.coarse = error[:, columns].contiguous()
        self.table = torch.zeros(rows, n + _VECTOR, dtype=torch.float64)
        self.table[:, :n] = error
        byte = torch.arange(256)
        self.byte_lanes = (code_lanes[:, byte & 15] + code_lanes[:, byte >> 4]).to(torch.int64).contiguous()
        self.bytes = tables.bytes.contiguous()
        self.s, self.z = tables.s.float().contiguous(), tables.z.float().contiguous()
        self.lane_squared = tables.lane_squared.to(torch.int64).contiguous()
        self.struct = _Tables(
            coarse=self.coarse.data_ptr(), n_coarse=len(columns), table=self.table.data_ptr(), stride=n + _VECTOR,
            n_s=tables.n_s, n_z=tables.n_z, radius=radius, z_radius=z_radius, tie=tie,
            rows=rows, n_bins=tables.n_bins, split=tables.split, byte_lanes=self.byte_lanes.data_ptr(),
            bytes=self.bytes.data_ptr(), s=self.s.data_ptr(), z=self.z.data_ptr(),
            lane_squared=self.lane_squared.data_ptr(), zero_index=tables.zero_index, **constants)


def encode(weight: torch.Tensor, scale: torch.Tensor, per_group: int, prepared: Prepared, r_bins: int,
           vectorised: bool = True) -> tuple[torch.Tensor, ...] | None:
    """One tensor's int4_search._search results (codes, BF16 scales, int8 zero points; signal and excess
    energy bins, one row) from its flat packed bytes and E8M0 bytes on the CPU, or None where the C
    pass is not there."""
    lib, _ = _library()
    if lib is None:
        return None
    weight, scale = weight.contiguous(), scale.contiguous()
    blocks = len(scale)
    groups = blocks // per_group
    codes = torch.empty_like(weight)
    scale_out = torch.empty(groups, dtype=torch.bfloat16)
    zero = torch.empty(groups, dtype=torch.int8)
    signal_bins = torch.zeros(1, 256, dtype=torch.float64)
    excess_bins = torch.zeros(1, r_bins, dtype=torch.float64)
    if lib.requant_int4_encode(blocks, per_group, weight.data_ptr(), scale.data_ptr(), ctypes.byref(prepared.struct),
                               int(vectorised), codes.data_ptr(), scale_out.data_ptr(), zero.data_ptr(),
                               signal_bins.data_ptr(), excess_bins.data_ptr()):
        return None
    return codes, scale_out, zero, signal_bins, excess_bins
