"""The serving engines' released wheels, read as source at test time.

Nothing here installs or imports an engine: the wheels are zip files whose Python sources the
conformance tests read and, definition by definition, execute: `extract` (top-level functions,
classes, constants), `extract_closure` (those and the file's definitions they use), `methods`
(methods of a class, as plain functions, optionally inherited from bases in the same file),
`klass` (a whole class on stand-in bases); `fake_module` answers the imports their bodies do
themselves; `imports` tells releases apart where a file itself differs.

Which release of each engine the tier runs: `--engine-release vllm==0.33.0` (repeatable; registered
by tests/conftest.py, applied by tests/engines/conftest.py through `use`), else the environment's
REQUANT_ENGINE_RELEASES="vllm==0.33.0,sglang==0.5.22", else NEWEST. `version(engine)` is the release
in use; everything that names a release asks it.
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
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path

from requant import engines as _rules

# The tier runs, unless told otherwise, the newest release of each engine requant has rules for
# (requant/engines/releases/); a new release is run with --engine-release before its data exists.
NEWEST = {name: _rules.releases(name, scope="loader")[-1] for name in _rules.engine_names()}
ENV = "REQUANT_ENGINE_RELEASES"

# CI and later runs keep this folder; REQUANT_ENGINE_WHEELS points elsewhere.
CACHE = Path(os.environ.get("REQUANT_ENGINE_WHEELS", Path.home() / ".cache" / "requant" / "engine-wheels"))

_chosen: dict[str, str] = {}   # set by `use` (the pytest option), over the environment's choice


def parse_releases(specs: Iterable[str]) -> dict[str, str]:
    """["vllm==0.34.0", "sglang==0.5.23,..."] -> {engine: release}; only engines in NEWEST."""
    out = {}
    for spec in (part.strip() for item in specs for part in item.split(",")):
        if not spec:
            continue
        engine, sep, release = spec.partition("==")
        if not sep or engine not in NEWEST or not release:
            raise ValueError(f"engine release {spec!r}: expected one of {', '.join(f'{e}==X.Y.Z' for e in NEWEST)}")
        out[engine] = release
    return out


def use(specs: Iterable[str]) -> None:
    """Run the tier against these releases (`--engine-release` values), forgetting wheels read so far.
    The choice is also exported as REQUANT_ENGINE_RELEASES: the tier's modules are imported both
    as `tests.engines.*` and, relatively, as `engines.*`, two copies of this module that must agree."""
    _chosen.clear()
    _chosen.update(parse_releases(specs))
    if _chosen:
        os.environ[ENV] = ",".join(f"{e}=={v}" for e, v in _chosen.items())
    _zip.cache_clear()
    source.cache_clear()
    _tree.cache_clear()


def version(engine: str) -> str:
    """The release of `engine` the tier runs: the pytest option, else REQUANT_ENGINE_RELEASES, else NEWEST."""
    return _chosen.get(engine) or parse_releases([os.environ.get(ENV, "")]).get(engine) or NEWEST[engine]


class _InUse(Mapping):
    """ENGINES[engine]: version(engine), for the callers that index the pins."""

    def __getitem__(self, engine):
        if engine not in NEWEST:
            raise KeyError(engine)
        return version(engine)

    def __iter__(self):
        return iter(NEWEST)

    def __len__(self):
        return len(NEWEST)


ENGINES = _InUse()


def wheel(distribution: str, release: str, slim: bool = False) -> Path | None:
    """The wheel of `distribution`==`release` (an engine, or a library it pins, such as
    flashinfer-python), downloaded into CACHE on first use; None when it cannot be had (no network,
    registry refusing), with the reason on stderr. With `slim`, the cache keeps only what the tier
    reads (the Python sources and the .dist-info) as `<name>-<release>-slim.zip`, a few percent of
    the wheel: how the older releases, checked for their selection code only, are kept."""
    name = distribution.replace("-", "_")
    pattern, slim_path = str(CACHE / f"{name}-{release}-*.whl"), CACHE / f"{name}-{release}-slim.zip"
    hits = sorted(glob.glob(pattern))
    for dangling in [h for h in hits if not os.path.exists(h)]:   # a link whose wheel is gone: fetch again
        os.unlink(dangling)
        hits.remove(dangling)
    if not hits and slim_path.exists():
        return slim_path
    if not hits and not os.environ.get("REQUANT_NO_WHEEL_FETCH"):
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                               f"{distribution}=={release}"], capture_output=True, text=True, timeout=1800)
        if done.returncode:
            print(f"pip download {distribution}=={release} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
        hits = sorted(glob.glob(pattern))
        if hits and slim:
            _slim(Path(hits[0]), slim_path)
            return slim_path
    return Path(hits[0]) if hits else None


def _slim(full: Path, slim_path: Path) -> None:
    """Keep the sources and metadata of wheel `full` as `slim_path` (written whole, then renamed),
    and remove the wheel."""
    partial = slim_path.with_suffix(".partial")
    with zipfile.ZipFile(full) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.endswith(".py") or ".dist-info/" in item.filename:
                dst.writestr(item, src.read(item))
    partial.replace(slim_path)
    full.unlink()


def fetch(engine: str) -> Path | None:
    """The wheel of `engine`'s release in use (see `wheel`); slim for a vLLM release requant has
    selection-scope rules for (its selection tier reads Python sources and METADATA only)."""
    release = version(engine)
    return wheel(engine, release, slim=engine == "vllm" and release in _rules.releases(engine, scope="selection"))


@lru_cache(maxsize=None)
def _zip(engine: str) -> zipfile.ZipFile:
    path = fetch(engine)
    if path is None:
        raise FileNotFoundError(f"{engine}=={version(engine)} wheel not available in {CACHE}")
    return zipfile.ZipFile(path)


def available(engine: str) -> bool:
    try:
        _zip(engine)
        return True
    except FileNotFoundError:
        return False


def zip_names(engine: str, folder: str) -> list[str]:
    """The files directly in `folder` of the engine's wheel, relative to it."""
    return sorted(n[len(folder):] for n in _zip(engine).namelist()
                  if n.startswith(folder) and "/" not in n[len(folder):])


@lru_cache(maxsize=None)
def source(engine: str, relpath: str) -> str:
    """Text of one file of the engine's wheel, e.g. source("vllm", "vllm/models/deepseek_v4/quant_config.py")."""
    return _zip(engine).read(relpath).decode()


def where(engine: str, relpath: str) -> str:
    """How a finding names its evidence: the file as the engine release has it."""
    return f"{engine} {version(engine)}: {relpath}"


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


def extract_closure(engine: str, relpath: str, roots: list[str], namespace: dict) -> dict:
    """`extract` of `roots` and of every top-level definition of the same file they use, directly
    or through each other, that `namespace` does not already hold (the test's stand-ins win): the
    definitions a function needs as this release has them, without a list per release."""
    bound = {}
    for node in _tree(engine, relpath).body:
        for name in _binds(node):
            bound[name] = node
    wanted, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in wanted or (name in namespace and name not in roots):
            continue
        if name not in bound:
            raise KeyError(f"{where(engine, relpath)} defines no {name}")
        wanted.add(name)
        todo += [n.id for n in ast.walk(bound[name]) if isinstance(n, ast.Name) and n.id in bound]
    return extract(engine, relpath, sorted(wanted), namespace)


def methods(engine: str, relpath: str, cls: str, names: list[str], namespace: dict | None = None,
            inherited: bool = False, helpers: bool = False) -> dict:
    """The methods `names` of class `cls` of one engine file, executed as plain functions in
    `namespace`; returns {name: function} (call them with a stand-in `self`, or put them on a
    class of your own, wrapping static/class methods again). With `inherited`, a name `cls` does
    not define is taken from the first of its bases defined in the same file that does, in
    Python's method resolution order (bases from other files are not searched). With `helpers`,
    the file's top-level definitions the methods use and `namespace` lacks are executed too
    (extract_closure).

    Signature annotations and decorators other than staticmethod/classmethod/property are dropped:
    annotations are evaluated when a function is defined, so keeping them would need a stand-in for
    every type a signature names; bodies run unchanged. Where a name is defined more than once
    (typing.overload stubs), the last definition is taken, as Python does."""
    found = {}
    for owner in (_file_mro(engine, relpath, cls) if inherited else [cls]):
        for item in _class_node(engine, relpath, owner).body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in names:
                if item.name not in found or found[item.name][0] == owner:
                    found[item.name] = (owner, item)
    found = {name: item for name, (_, item) in found.items()}
    missing = set(names) - set(found)
    if missing:
        raise KeyError(f"{where(engine, relpath)}: class {cls} defines no {', '.join(sorted(missing))}")
    namespace = {} if namespace is None else namespace
    if helpers:
        bound = {name for node in _tree(engine, relpath).body for name in _binds(node)}
        used = {n.id for item in found.values() for n in ast.walk(item) if isinstance(n, ast.Name)}
        if roots := sorted((used & bound) - set(namespace)):
            extract_closure(engine, relpath, roots, namespace)
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


_PLACED: set[str] = set()   # sys.modules entries this module added


def fake_module(name: str, **attrs) -> types.ModuleType:
    """A stand-in module `name` (and its parent packages) in sys.modules, with `attrs` set on it,
    for the imports that engine function bodies perform themselves (`from vllm.x import y` inside
    a function). Never shadows a real, importable module of that name. `remove_fakes` takes them
    out again."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        _place(".".join(parts[:i]))
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


def remove_fakes() -> None:
    """Take every module fake_module (or an executed dataclass's home module) placed out of
    sys.modules: left there, they would answer `importlib.util.find_spec("vllm")` with an error
    for the rest of the test session. Call it when a tier's tests are done."""
    for name in _PLACED:
        sys.modules.pop(name, None)
    _PLACED.clear()


def _place(name: str) -> None:
    if name not in sys.modules:
        sys.modules[name] = types.ModuleType(name)
        _PLACED.add(name)


def imports(engine: str, relpath: str) -> dict[str, str]:
    """The names one engine file imports at its top level, by the module they come from: what a
    test asks to tell two releases apart where the file itself differs."""
    out = {}
    for node in _tree(engine, relpath).body:
        if isinstance(node, ast.ImportFrom):
            out.update({alias.asname or alias.name: node.module or "" for alias in node.names})
        elif isinstance(node, ast.Import):
            out.update({alias.asname or alias.name: alias.name for alias in node.names})
    return out


def _file_mro(engine: str, relpath: str, cls: str) -> list[str]:
    """`cls` and its bases defined in the same file, in Python's method resolution order."""
    classes = {node.name: node for node in _tree(engine, relpath).body if isinstance(node, ast.ClassDef)}
    if cls not in classes:
        raise KeyError(f"{where(engine, relpath)} defines no class {cls}")
    built: dict[str, type] = {}

    def build(name):
        if name not in built:
            bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name) and b.id in classes]
            built[name] = type(name, tuple(build(b) for b in bases) or (object,), {})
        return built[name]

    return [k.__name__ for k in build(cls).__mro__ if k is not object]


def _class_node(engine: str, relpath: str, cls: str) -> ast.ClassDef:
    for node in _tree(engine, relpath).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return copy.deepcopy(node)
    raise KeyError(f"{where(engine, relpath)} defines no class {cls}")


def _exec(engine: str, filename: str, body: list[ast.stmt], namespace: dict | None) -> dict:
    ns = {} if namespace is None else namespace
    ns.setdefault("__name__", f"engine_{engine}")
    _place(ns["__name__"])   # dataclasses look their class's module up in sys.modules
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
