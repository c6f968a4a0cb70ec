"""The comparison of two nibble-coded projections in one C pass (compare.c), for report and
verify --deep on a CPU.

The torch passes (weights.compare_chunks) decode both sides to float32 and go over them a dozen
times; compare.c reads the stored codes once, with the same float32 values and errors, so every
count (exact blocks, the error histogram, max error, non-finite values) is the same. The sums are
float64 over float32 lane sums of a few products each: on a full-size W4A16 projection equal to
float64 sums of the same errors, where the torch passes' float32 BLAS dots were 5e-5 off sum(e^2).

Built and loaded by requant.c_helpers; where it is not there, `status` says why and callers use the
torch passes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct

import torch

from requant import c_helpers
from requant.formats import Nibbles
from requant.report.weights import ErrorSums, fold_exponents

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare.c")


class _Side(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("group", ctypes.c_int64)]


class _Sums(ctypes.Structure):
    _fields_ = [("sum_a2", ctypes.c_double), ("sum_e2", ctypes.c_double), ("sum_ea", ctypes.c_double),
                ("exponents", ctypes.c_int64 * 256), ("zero", ctypes.c_int64), ("nonfinite", ctypes.c_int64),
                ("blocks", ctypes.c_int64), ("exact_blocks", ctypes.c_int64), ("max_bits", ctypes.c_uint32)]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return c_helpers.bind(_SOURCE, {"requant_compare": ([ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_Side),
                                                      ctypes.POINTER(_Side), ctypes.c_int64, ctypes.c_int,
                                                      ctypes.POINTER(_Sums)], ctypes.c_int)},
                       "requant_compare_vectorised")


def available() -> bool:
    """Whether compare() runs here (builds the library on first use)."""
    return _library()[0] is not None


def status() -> str:
    """'c (avx2)' or 'c (portable)' when the library is there; else 'torch: <why not>'. Builds it."""
    return c_helpers.describe(_library())


def _side(n: Nibbles, rows: int, k: int, keep: list) -> _Side | None:
    """The C view of one side, its tensors kept alive in `keep`; None when the shapes do not fit."""
    groups = k // n.group if n.group > 0 and k % n.group == 0 else 0
    shapes = [tuple(n.codes.shape) == (rows, k // 2), tuple(n.scale.shape) == (rows, groups), n.table.numel() == 16,
              n.offset is None or tuple(n.offset.shape) == (rows, groups)]
    if not all(shapes) or groups == 0:
        return None
    tensors = [n.codes.contiguous(), n.scale.to(torch.float32).contiguous(), n.table.to(torch.float32).contiguous(),
               None if n.offset is None else n.offset.to(torch.float32).contiguous()]
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        return None
    keep.extend(tensors)
    codes, scale, table, offset = tensors
    return _Side(codes.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(), table.data_ptr(),
                 n.group)


def compare(a: Nibbles, b: Nibbles, block: int, vectorised: bool = True) -> ErrorSums | None:
    """weights.compare_chunks' sums of b against reference a, exactness per `block` of K; None when
    the library is unavailable, the tensors are not on the CPU or the shapes are not supported
    (then the torch passes compare, and say what is wrong)."""
    lib, _ = _library()
    if lib is None:
        return None
    rows, k = a.codes.shape[0], a.codes.shape[1] * 2
    keep: list = []
    sa, sb = _side(a, rows, k, keep), _side(b, rows, k, keep)
    if sa is None or sb is None or block <= 0:
        return None
    out = _Sums()
    if lib.requant_compare(rows, k, ctypes.byref(sa), ctypes.byref(sb), block, int(vectorised), ctypes.byref(out)):
        return None
    counts = list(out.exponents)
    counts[0] -= out.zero   # exact zeros are counted apart
    return ErrorSums(n=rows * k, blocks=out.blocks, exact_blocks=out.exact_blocks, sum_a2=out.sum_a2,
                     sum_b2=out.sum_a2 + 2 * out.sum_ea + out.sum_e2, sum_e_apb=2 * out.sum_ea + out.sum_e2,
                     sum_e2=out.sum_e2, max_abs=struct.unpack("<f", struct.pack("<I", out.max_bits))[0],
                     nonfinite=out.nonfinite, hist=fold_exponents(counts), zero_error=out.zero)
