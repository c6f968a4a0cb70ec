"""The comparison of two nibble-coded projections in one C pass (compare.c), for report and
verify --deep on a CPU.

The torch passes (weights.compare_chunks) decode both sides to float32 and go over them a dozen
times; compare.c reads the stored codes once, with the same float32 values and errors, so every
count (exact blocks, the error histogram, max error, non-finite values) is the same, and the sums
are float64 over float32 lane sums (the torch passes: float32 BLAS dots), equal to ~1e-6.

The library is compiled on first use with the machine's C compiler ($CC, else cc) into requant's
cache directory ($REQUANT_CACHE_DIR, else $XDG_CACHE_HOME/requant, else ~/.cache/requant), one file
per source and compiler, and loaded with ctypes, whose calls release the GIL. Where none compiles,
or REQUANT_NATIVE=0, `status` says why and callers use the torch passes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile

import torch

from requant.formats import Nibbles
from requant.report.weights import ErrorSums, fold_exponents

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")   # no fused multiply-adds: the decoders' roundings


class _Side(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("group", ctypes.c_int64)]


class _Sums(ctypes.Structure):
    _fields_ = [("sum_a2", ctypes.c_double), ("sum_e2", ctypes.c_double), ("sum_ea", ctypes.c_double),
                ("exponents", ctypes.c_int64 * 256), ("zero", ctypes.c_int64), ("nonfinite", ctypes.c_int64),
                ("blocks", ctypes.c_int64), ("exact_blocks", ctypes.c_int64), ("max_bits", ctypes.c_uint32)]


def cache_dir() -> str:
    if os.environ.get("REQUANT_CACHE_DIR"):
        return os.environ["REQUANT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "requant")


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("REQUANT_NATIVE", "1") == "0":
        return None, "REQUANT_NATIVE=0"
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler} not found)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
        with open(_SOURCE, "rb") as f:
            source = f.read()
        key = hashlib.sha256(source + version + " ".join(_FLAGS).encode()).hexdigest()[:16]
        folder = os.path.join(cache_dir(), "native")
        path = os.path.join(folder, f"compare-{key}.so")
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".compare-", suffix=".so", dir=folder)
            os.close(fd)
            try:
                done = subprocess.run([compiler, *_FLAGS, "-o", tmp, _SOURCE], capture_output=True, text=True,
                                      timeout=300)
                if done.returncode:
                    first = (done.stderr.strip().splitlines() or ["no message"])[0]
                    return None, f"{compiler} could not compile {os.path.basename(_SOURCE)}: {first}"
                os.replace(tmp, path)   # whole or absent, with other processes building the same
                for stale in os.listdir(folder):   # earlier sources' builds (a loaded one stays mapped)
                    if stale.startswith("compare-") and stale.endswith(".so") and stale != os.path.basename(path):
                        os.unlink(os.path.join(folder, stale))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C comparison did not build or load: {e}"
    lib.requant_compare.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_Side), ctypes.POINTER(_Side),
                                    ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Sums)]
    lib.requant_compare.restype = ctypes.c_int
    lib.requant_compare_vectorised.argtypes = [ctypes.c_int]
    lib.requant_compare_vectorised.restype = ctypes.c_int
    return lib, "avx2" if lib.requant_compare_vectorised(1) else "portable"


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return _build()


def available() -> bool:
    """Whether compare() runs here (builds the library on first use)."""
    return _library()[0] is not None


def status() -> str:
    """'c (avx2)' or 'c (portable)' when the library is there; else 'torch: <why not>'. Builds it."""
    lib, what = _library()
    return f"c ({what})" if lib is not None else f"torch: {what}"


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
