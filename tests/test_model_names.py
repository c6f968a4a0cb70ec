"""Knowledge of models lives in recipes/ and requant/model.py (with the recipe schema of
requant/recipe.py and the layout readers of requant/sources.py); other modules ask ModelSpec. A
model's name or a fragment of its tensor names in a string the code computes with (docstrings and
comments are prose, not dispatch) is knowledge in the wrong place."""

from __future__ import annotations

import ast
import pathlib
import re

import requant

PACKAGE = pathlib.Path(requant.__file__).parent
MODEL_STRINGS = re.compile(r"deepseek|gpt[-_]oss|\bffn\.|\bmlp\.|experts\.|tid2eid|gate_up|down_proj|"
                           r"shared_experts|embed_tokens|lm_head", re.IGNORECASE)
HOME = {"model.py", "recipe.py", "sources.py"}
# Known exceptions, each with why it is still here: prose for people, naming the model a rule is
# about. Rules themselves live in the recipes.
EXPLAINED = {
    # error messages that name the model a rule is about, for the person reading them
    ("engines/check.py", "its DeepSeek-V4 model has no other FP8-block attention path"),
    ("targets/nvfp4.py", "vLLM and SGLang dispatch DeepSeek-V4 NVFP4"),
    ("targets/nvfp4.py", "SGLang reads the NVFP4 details of DeepSeek-V4"),
}


def _code_strings(tree: ast.AST):
    """String constants other than docstrings, with their line numbers."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_model_strings_outside_recipes_and_model():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in HOME:
            continue
        for line, value in _code_strings(ast.parse(path.read_text())):
            if MODEL_STRINGS.search(value) and not any(relative == f and e in value for f, e in EXPLAINED):
                found.append(f"requant/{relative}:{line}: {value!r}")
    assert not found, "model knowledge outside recipes/ and requant/model.py:\n" + "\n".join(found)


def test_the_check_sees_a_model_string():
    tree = ast.parse('"""deepseek in a docstring"""\nname = f"{block}.ffn.experts.{e}"\nx = "gpt-oss-20b"\n')
    hits = sorted(v for _, v in _code_strings(tree) if MODEL_STRINGS.search(v))
    assert hits == [".ffn.experts.", "gpt-oss-20b"]
