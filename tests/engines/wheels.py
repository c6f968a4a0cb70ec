"""The serving engines' released wheels, read as source at test time.

Nothing here installs or imports an engine: the wheels are zip files whose Python sources the
conformance tests read and, function by function, execute (see `extract`). A new engine release is
one pin change in ENGINES.
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

ENGINES = {"vllm": "0.33.0", "sglang": "0.5.23"}

# CI and later runs keep this folder; REQUANT_ENGINE_WHEELS points elsewhere.
CACHE = Path(os.environ.get("REQUANT_ENGINE_WHEELS", Path.home() / ".cache" / "requant" / "engine-wheels"))


def _find(engine: str) -> Path | None:
    hits = sorted(glob.glob(str(CACHE / f"{engine}-{ENGINES[engine]}-*.whl")))
    return Path(hits[0]) if hits else None


def fetch(engine: str) -> Path | None:
    """The pinned wheel of `engine`, downloaded into CACHE on first use; None when it cannot be had
    (no network, registry refusing), with the reason on stderr."""
    found = _find(engine)
    if found is None and not os.environ.get("REQUANT_NO_WHEEL_FETCH"):
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                               f"{engine}=={ENGINES[engine]}"], capture_output=True, text=True, timeout=1800)
        if done.returncode:
            print(f"pip download {engine}=={ENGINES[engine]} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
        found = _find(engine)
    return found


@lru_cache(maxsize=None)
def _zip(engine: str) -> zipfile.ZipFile:
    path = fetch(engine)
    if path is None:
        raise FileNotFoundError(f"{engine}=={ENGINES[engine]} wheel not available in {CACHE}")
    return zipfile.ZipFile(path)


def available(engine: str) -> bool:
    try:
        _zip(engine)
        return True
    except FileNotFoundError:
        return False


@lru_cache(maxsize=None)
def source(engine: str, relpath: str) -> str:
    """Text of one file of the engine's wheel, e.g. source("vllm", "vllm/models/deepseek_v4/quant_config.py")."""
    return _zip(engine).read(relpath).decode()


def where(engine: str, relpath: str) -> str:
    """How a finding names its evidence: the file as the engine release has it."""
    return f"{engine} {ENGINES[engine]}: {relpath}"


def extract(engine: str, relpath: str, names: list[str], namespace: dict | None = None) -> dict:
    """Execute the top-level definitions `names` (functions, classes, assignments, by the name they
    bind) of one engine file in `namespace`, and return it.

    The file's imports are not run: whatever the definitions use from elsewhere must be in
    `namespace` (a test's stand-ins for engine internals it does not want to execute). Names that
    cannot be found raise KeyError, so an engine release that renames one fails loudly."""
    tree = ast.parse(source(engine, relpath), filename=f"{engine}/{relpath}")
    wanted, picked = set(names), []
    for node in tree.body:
        bound = _binds(node)
        if bound & wanted:
            picked.append(node)
            wanted -= bound
    if wanted:
        raise KeyError(f"{where(engine, relpath)} defines no {', '.join(sorted(wanted))}")
    ns = {} if namespace is None else namespace
    ns.setdefault("__name__", f"engine_{engine}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), f"{engine}/{relpath}", "exec"), ns)
    return ns


def _binds(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()
