"""requant's import graph: no import circles, and no module imports one of a higher layer.

The graph is read with `ast` from every module under requant/, so it sees what a run would import
without importing anything. What counts as an edge:
- every `import` / `from ... import` of a requant module, at module level or inside a function: a
  function-level import is still a dependency, only a later one. A lazy import of an optional
  extra's code counts the same (it runs whenever that feature is used), and so does one under
  `if TYPE_CHECKING:` (it never runs, but annotating with a module's types depends on it: a circle
  hidden there is still a circle of the design);
- `from package import name` is an edge to package.name where that is a module, else to the package;
- not an import of the module's own package or its ancestors: Python runs a package's __init__
  before any module in it, so that adds nothing, and a package's __init__ may import its own modules
  (formats/__init__ registers its codecs) without that being a circle;
- not an import under `if __name__ == "__main__":`: that is the module run as a program, the top
  of the stack as cli is.

LAYERS, lowest first, from ../shared/docs/architecture.md (formats and I/O at the bottom, model
knowledge in recipes read through model.py, engine knowledge per release in engines/, the pipeline
over them, the CLI thin on top) and what the code imports (model.ModelSpec asks engines for its
recipe's rules, so engines sit below model and are handed the recipe). A module may import its own
layer and the layers below; modules of one layer may import each other only without a circle.
Every module must have a layer: a new top-level module is placed here on purpose. A module is placed
by the longest prefix naming it, so engine knowledge that reads a model or a checkpoint lives under
engines/ as the engines' named client (engines.check, engines.serve_paths) in the layer its imports
put it, above the release data the rest of engines/ is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "requant"

LAYERS = (
    # leaf helpers: errors, expression arithmetic, C helper loading, optional extras, where compute
    # runs and the forked pools it runs in, measured path errors as data, the torch MoE reference,
    # the recipe schema
    ("foundation", ("errors", "expressions", "c_helpers", "extras", "compute", "pools", "paths", "moe", "recipe")),
    # pure numerics per format, and file I/O
    ("storage", ("formats", "io")),
    # per-release engine data, the engines' numerics and serving modes, and the fused-MoE kernel:
    # all over formats, none knows a model
    ("engines and kernels", ("engines", "kernels")),
    # model knowledge: recipes read through model.py, the layout readers, the expert index
    ("model", ("model", "sources", "experts")),
    # what one output is and how an engine runs it: targets, the card, the engine checks (engines'
    # own client of model and targets: it judges a model's checkpoint by a release's rules),
    # synthetic checkpoints
    ("outputs", ("targets", "card", "engines.check", "synth")),
    # what reads a checkpoint and judges it, engines.serve_paths with them: it runs a checkpoint's
    # layer through validate's readers in every serving path
    ("checks", ("validate", "engines.serve_paths", "report", "verify", "describe", "advise")),
    # the conversion: planning, the encoders that run a plan, then the writer
    ("pipeline", ("plan", "workers", "convert")),
    ("cli", ("cli", "__main__")),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["requant", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _skipped(test: ast.expr) -> bool:
    """An `if` whose body runs only when the module is run as a program."""
    return ast.unparse(test).replace("'", '"') == '__name__ == "__main__"'


def _imports(tree: ast.AST):
    """Every import node, except those of the module run as a program."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _skipped(node.test):
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
            continue
        yield from _imports(node)


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules) -> set[str]:
    def known(dotted: str) -> str | None:   # the module a dotted name is, or is inside of
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    return {m for m in map(known, (n for n in named if n.split(".")[0] == "requant")) if m}


def graph() -> dict[str, set[str]]:
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        out = set()
        for node in _imports(tree):
            out |= _targets(name, path.name == "__init__.py", node, modules)
        # itself and its own packages are no dependency (see the docstring)
        edges[name] = {m for m in out if not (name == m or name.startswith(m + "."))}
    return edges


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix that names the module: engines.check sits above engines."""
    rest = module.removeprefix("requant.")
    if module == "requant":
        return 0
    named = [(len(p), index) for index, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if rest == p or rest.startswith(p + ".")]
    return max(named)[1] if named else None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    found = []
    for component in components:   # the shortest circle through the component's first module
        start = min(component)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            following = sorted(w for w in edges[path[-1]] if w in component)
            if start in following:
                found.append(path + [start])
                break
            for w in following:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in graph() if layer_of(m) is None)
    assert not unplaced, f"modules with no layer in tests/test_import_graph.py LAYERS: {unplaced}"


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_upward_imports():
    edges = graph()
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in edges.items() for t in targets
                    if None not in (layer_of(m), layer_of(t)) and layer_of(t) > layer_of(m))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_graph_sees_what_it_must():
    """The reader itself: a function-level import, `from package import module`, a relative import,
    a TYPE_CHECKING import and the program's block, on modules written for the purpose."""
    modules = {"requant", "requant.a", "requant.b", "requant.pkg", "requant.pkg.c", "requant.pkg.d"}
    code = ("from requant import a\n"
            "def f():\n    from .pkg import c\n"
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from requant import b\n"
            "if __name__ == '__main__':\n    import requant.pkg.d\n")
    found = set()
    for node in _imports(ast.parse(code)):
        found |= _targets("requant.x", False, node, modules)
    assert found == {"requant.a", "requant.pkg.c", "requant.b"}
    from_package = _targets("requant.pkg.c", False, ast.parse("from requant.pkg import name").body[0], modules)
    assert from_package == {"requant.pkg"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # the longest prefix places a module: the engines' clients sit above the release data
    assert layer_of("requant.engines.check") > layer_of("requant.model") > layer_of("requant.engines.table")
