"""The serving engines' released wheels, read as source at test time.

Nothing here installs or imports an engine: the wheels are zip files whose Python sources the
conformance tests read and, definition by definition, execute: `extract` (top-level functions,
classes, constants), `methods` (methods of a class, as plain functions), `klass` (a whole class on
stand-in bases); `fake_module` answers the imports their bodies do themselves. A new engine release is
one pin change in ENGINES.
"""

from __future__ import annotations

import ast
import copy
import glob
import os
import subprocess
import sys
import types
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
    wanted, picked = set(names), []
    for node in _tree(engine, relpath).body:
        bound = _binds(node)
        if bound & wanted:
            picked.append(copy.deepcopy(node))
            wanted -= bound
    if wanted:
        raise KeyError(f"{where(engine, relpath)} defines no {', '.join(sorted(wanted))}")
    return _exec(engine, relpath, picked, namespace)


def methods(engine: str, relpath: str, cls: str, names: list[str], namespace: dict | None = None) -> dict:
    """The methods `names` of class `cls` of one engine file, executed as plain functions in
    `namespace`; returns {name: function} (call them with a stand-in `self`, or put them on a
    class of your own, wrapping static/class methods again).

    Signature annotations and decorators other than staticmethod/classmethod/property are dropped:
    annotations are evaluated when a function is defined, so keeping them would need a stand-in for
    every type a signature names; bodies run unchanged. Where a name is defined more than once
    (typing.overload stubs), the last definition is taken, as Python does."""
    node = _class_node(engine, relpath, cls)
    found = {item.name: item for item in node.body
             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in names}
    missing = set(names) - set(found)
    if missing:
        raise KeyError(f"{where(engine, relpath)}: class {cls} defines no {', '.join(sorted(missing))}")
    ns = _exec(engine, f"{relpath}:{cls}", [_StripAnnotations().visit(found[n]) for n in names], namespace)
    return {n: ns[n] for n in names}


def klass(engine: str, relpath: str, cls: str, namespace: dict | None = None, bases: tuple[str, ...] = ()) -> type:
    """Class `cls` of one engine file, whole, rebuilt on the bases named by `bases` (names looked
    up in `namespace`: the test's stand-ins for the engine's base classes), and returned.

    Its decorators and metaclass keywords are dropped, annotations as in `methods`; class-level
    annotated names without a value (declarations only) are dropped, those with one kept as plain
    assignments."""
    node = _StripAnnotations().visit(_class_node(engine, relpath, cls))
    node.bases = [ast.Name(id=b, ctx=ast.Load()) for b in bases]
    node.keywords, node.decorator_list = [], []
    node.body = [ast.Assign(targets=[ast.Name(id=s.target.id, ctx=ast.Store())], value=s.value)
                 if isinstance(s, ast.AnnAssign) else s
                 for s in node.body if not (isinstance(s, ast.AnnAssign) and s.value is None)] or [ast.Pass()]
    return _exec(engine, relpath, [node], namespace)[cls]


def fake_module(name: str, **attrs) -> types.ModuleType:
    """A stand-in module `name` (and its parent packages) in sys.modules, with `attrs` set on it,
    for the imports that engine function bodies perform themselves (`from vllm.x import y` inside
    a function). Never shadows a real, importable module of that name."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = sys.modules[name]
    if getattr(module, "__file__", None):
        raise RuntimeError(f"{name} is a real module ({module.__file__}); refusing to overwrite it with stand-ins")
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@lru_cache(maxsize=None)
def _tree(engine: str, relpath: str) -> ast.Module:
    """The parsed file; callers copy the nodes they change."""
    return ast.parse(source(engine, relpath), filename=f"{engine}/{relpath}")


def _class_node(engine: str, relpath: str, cls: str) -> ast.ClassDef:
    for node in _tree(engine, relpath).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return copy.deepcopy(node)
    raise KeyError(f"{where(engine, relpath)} defines no class {cls}")


def _exec(engine: str, filename: str, body: list[ast.stmt], namespace: dict | None) -> dict:
    ns = {} if namespace is None else namespace
    ns.setdefault("__name__", f"engine_{engine}")
    # dataclasses and enum look their class's module up in sys.modules
    sys.modules.setdefault(ns["__name__"], types.ModuleType(ns["__name__"]))
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    exec(compile(module, f"{engine}/{filename}", "exec"), ns)
    return ns


class _StripAnnotations(ast.NodeTransformer):
    """Drops signature annotations and non-builtin decorators of every function it visits."""

    _KEPT_DECORATORS = ("staticmethod", "classmethod", "property")

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None:
                arg.annotation = None
        node.returns = None
        node.decorator_list = [d for d in node.decorator_list
                               if isinstance(d, ast.Name) and d.id in self._KEPT_DECORATORS]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef


def _binds(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()
