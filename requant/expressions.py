"""Arithmetic over a recipe's named dimensions: the shapes, conditions and derived values that
recipes/*.json write as expressions, e.g. "heads * head_dim // o_groups" or "index < hash_layers" or
"engram_rows[k]".

A dimension may itself be an expression (DeepSeek-V4's compress ratio as a function of the layer
index); it is read in place, so it sees the names bound where it is used. Recipes are data: only
arithmetic, comparisons, conditionals, lists, comprehensions over range() and min/max are allowed.
"""

from __future__ import annotations

import ast
import types
from functools import lru_cache

_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Name, ast.Load,
          ast.Store, ast.Constant, ast.Call, ast.List, ast.ListComp, ast.comprehension, ast.Subscript, ast.operator,
          ast.unaryop, ast.boolop, ast.cmpop)
_FUNCTIONS = {"min": min, "max": max, "range": range, "len": len}


def evaluate(expr, dims: dict, bound: dict | None = None):
    """The value of `expr` (a non-string is its own value) given the dimensions `dims` (numbers, or
    expressions as strings) and the names `bound` where it is used (index, block...)."""
    if not isinstance(expr, str):
        return expr
    code = _compiled(expr, tuple(sorted((k, v) for k, v in dims.items() if isinstance(v, str))))
    names = {k: v for k, v in dims.items() if not isinstance(v, str)}
    # Everything as globals: a comprehension's own scope sees globals, not eval's locals.
    return eval(code, {"__builtins__": {}, **_FUNCTIONS, **names, **(bound or {})})


@lru_cache(maxsize=4096)
def _compiled(expr: str, expression_dims: tuple) -> types.CodeType:
    """`expr` with the dimensions that are expressions inlined, compiled: a plan evaluates the same
    few expressions for every tensor of every layer."""
    return compile(_parse(expr, dict(expression_dims), ()), "<recipe>", "eval")


def _parse(expr: str, dims: dict, stack: tuple) -> ast.Expression:
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _NODES) or isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            raise ValueError(f"recipe expression {expr!r}: {type(node).__name__} is not allowed")
    return ast.fix_missing_locations(_Inline(dims, stack).visit(tree))


class _Inline(ast.NodeTransformer):
    """Replaces a dimension that is an expression by that expression's tree."""

    def __init__(self, dims: dict, stack: tuple):
        self.dims, self.stack = dims, stack

    def visit_Name(self, node: ast.Name):
        value = self.dims.get(node.id)
        if not isinstance(node.ctx, ast.Load) or not isinstance(value, str):
            return node
        if node.id in self.stack:
            raise ValueError(f"recipe dimension {node.id!r} is defined through itself")
        return _parse(value, self.dims, self.stack + (node.id,)).body
