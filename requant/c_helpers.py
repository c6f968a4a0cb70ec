"""requant's C helpers (report/compare.c, formats/int4_encode.c): each compiled on first use with
the machine's C compiler ($CC, else cc) into requant's cache directory ($REQUANT_CACHE_DIR, else
$XDG_CACHE_HOME/requant, else ~/.cache/requant), one file per source and compiler, and loaded
with ctypes, whose calls release the GIL. Where one does not compile, or with REQUANT_NATIVE=0,
`load` says why and its callers run their torch code instead, which computes the same.

Load them before forking workers: the processes then share one build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")   # no fused multiply-adds: torch's roundings


def cache_dir() -> str:
    if os.environ.get("REQUANT_CACHE_DIR"):
        return os.environ["REQUANT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "requant")


@functools.cache
def load(source: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from C file `source`, "") or (None, why not)."""
    if os.environ.get("REQUANT_NATIVE", "1") == "0":
        return None, "REQUANT_NATIVE=0"
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler} not found)"
    stem = os.path.splitext(os.path.basename(source))[0]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
        with open(source, "rb") as f:
            key = hashlib.sha256(f.read() + version + " ".join(_FLAGS).encode()).hexdigest()[:16]
        folder = os.path.join(cache_dir(), "native")
        path = os.path.join(folder, f"{stem}-{key}.so")
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=folder)
            os.close(fd)
            try:
                done = subprocess.run([compiler, *_FLAGS, "-o", tmp, source], capture_output=True, text=True,
                                      timeout=300)
                if done.returncode:
                    first = (done.stderr.strip().splitlines() or ["no message"])[0]
                    return None, f"{compiler} could not compile {os.path.basename(source)}: {first}"
                os.replace(tmp, path)   # whole or absent, with other processes building the same
                for stale in os.listdir(folder):   # earlier versions' builds (a loaded one stays mapped)
                    if stale.startswith(f"{stem}-") and stale.endswith(".so") and stale != os.path.basename(path):
                        os.unlink(os.path.join(folder, stale))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(path), ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{os.path.basename(source)} did not build or load: {e}"


def bind(source: str, signatures: dict[str, tuple[list, type]], vectorised: str) -> tuple[ctypes.CDLL | None, str]:
    """`load`, each function named in `signatures` given its ctypes (argtypes, restype): (the
    library, "avx2" or "portable" as its int `vectorised`(1) answers) or (None, why not)."""
    lib, why = load(source)
    if lib is None:
        return None, why
    for name, (argtypes, restype) in {**signatures, vectorised: ([ctypes.c_int], ctypes.c_int)}.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib, "avx2" if getattr(lib, vectorised)(1) else "portable"


def describe(bound: tuple[ctypes.CDLL | None, str]) -> str:
    """What `bind` gave, for users: 'c (avx2)' or 'c (portable)', else 'torch: <why not>'."""
    lib, what = bound
    return f"c ({what})" if lib is not None else f"torch: {what}"
