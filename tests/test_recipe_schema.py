"""The recipe schema (requant/recipe.py): every recipe fits it, a recipe that does not is refused in
one line naming its file and key, and every key the schema allows is read by requant."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import pathlib
import typing

import pytest

import requant
from requant import model as model_lib, recipe as schema
from requant.recipe import RecipeError, parse

PACKAGE = pathlib.Path(requant.__file__).parent
RECIPES = pathlib.Path(requant.__file__).parent.parent / "recipes"


def _raw() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(RECIPES.glob("*.json"))}


def _schema_classes() -> list[type]:
    """Every dataclass reachable from Recipe's fields."""
    seen, todo = [], [schema.Recipe]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for hint in typing.get_type_hints(cls).values():
            stack = [hint]
            while stack:
                t = stack.pop()
                stack += typing.get_args(t)
                if dataclasses.is_dataclass(t):
                    todo.append(t)
    return seen


def _attributes_read(skip_functions=("_check_recipe",)) -> set[str]:
    """Attribute names requant's code reads (`x.name`), outside the schema's own validation."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in skip_functions
                   for n in ast.walk(f)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in skipped}
    return names


# Read other than as `x.field`: the loader's own directive, and the activation's parameters, which
# requant reads all together through Activation.parameters().
READ_OTHERWISE = {("Recipe", "base"): '"base"', ("Recipe", "file"): ".file", ("NamedModel", "extends"): '"extends"',
                  ("Activation", "limit"): ".parameters()", ("Activation", "alpha"): ".parameters()"}


def unread_fields(classes, read: set[str]) -> list[str]:
    return [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
            if not f.metadata.get("doc") and (cls.__name__, f.name) not in READ_OTHERWISE and f.name not in read]


def test_every_recipe_fits_the_schema():
    recipes = model_lib.load_recipes()
    assert sorted(r.file for r in recipes) == sorted(_raw())
    assert all(isinstance(r, schema.Recipe) for r in recipes)


def test_every_schema_field_is_read_by_requant():
    assert unread_fields(_schema_classes(), _attributes_read()) == []
    sources = "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert 'raw["base"]' in sources and 'entry["extends"]' in sources and "spec.parameters()" in sources


def test_the_read_check_sees_an_unread_field():
    @dataclasses.dataclass
    class Extra:
        ignore: list
        forgotten_key: int
        evidence: str = schema.doc()

    assert unread_fields([Extra], _attributes_read()) == ["Extra.forgotten_key"]


def test_doc_fields_are_prose():
    for cls in _schema_classes():
        for f in dataclasses.fields(cls):
            if f.metadata.get("doc"):
                assert typing.get_type_hints(cls)[f.name] in (str, dict[str, str]), f"{cls.__name__}.{f.name}"


def _deepseek() -> dict:
    return copy.deepcopy(_raw()["deepseek_v4.json"])


@pytest.mark.parametrize("edit, where", [
    (lambda r: r["outputs"]["nvfp4"].update(ignoer=["head"]), "outputs.nvfp4.ignoer: not a key of the recipe schema"),
    (lambda r: r.update(nvfp4_ignore=["head"]), "nvfp4_ignore: not a key of the recipe schema"),
    (lambda r: r["outputs"]["nvfp4"].update(ignore="head"), "outputs.nvfp4.ignore: expected list of string"),
    (lambda r: r["outputs"]["w4a16"]["ignore"].__setitem__(1, 7), "outputs.w4a16.ignore[1]: expected string"),
    (lambda r: r["models"]["deepseek-v4-pro"]["dims"].update(layers={"n": 61}),
     "models.deepseek-v4-pro.dims.layers: expected"),
    (lambda r: r.pop("routed_expert"), "routed_expert: missing (required)"),
    (lambda r: r.update(expert_layout="flat"), "expert_layout: 'flat' is not one of per_expert, stacked"),
    (lambda r: r["synth"]["groups"]["block"][0].update(sahpe=[1]), "synth.groups.block[0].sahpe: not a key"),
    (lambda r: r["synth"]["groups"]["block"][0].pop("dtype"), "needs a shape and one of dtype, format"),
    (lambda r: r["router"].update(scaling_factor="no_such_role"), "router.scaling_factor: 'no_such_role' is not a role"),
    (lambda r: r["detect"].update(tensors_forbid=["(unclosed"]), "detect.tensors_forbid[0]: not a regular expression"),
    (lambda r: r.update(evidence={"no_such_key": "x"}), "evidence.no_such_key: not a key"),
    (lambda r: r["outputs"]["w4a16"].update(refused="not established"), "outputs.w4a16: give either ignore or refused"),
    (lambda r: r["outputs"]["w4a16"].pop("ignore"), "outputs.w4a16: give either ignore or refused"),
    (lambda r: r.update(block_config_keys={"drafter": {"num_experts": "x"}}), "block_config_keys.drafter: not a kind"),
    (lambda r: r.update(block_config_keys={"mtp": {"experts": "x"}}), "block_config_keys.mtp.experts: not a role"),
    (lambda r: r["synth"]["shards"][1].update(blocks="stage"), "synth.shards[1].blocks: 'stage' is not one of blocks"),
])
def test_a_recipe_that_does_not_fit_is_refused_naming_file_and_key(edit, where):
    raw = _deepseek()
    edit(raw)
    with pytest.raises(RecipeError) as e:
        parse(raw, "deepseek_v4.json", {})
    message = str(e.value)
    assert message.startswith("recipe deepseek_v4.json: ") and where in message and "\n" not in message


def test_a_recipe_with_a_base_states_only_what_it_changes():
    detect = {"model_type": "variant", "architectures": ["Variant"]}
    raw = {"base": "deepseek_v4.json", "name": "variant", "detect": detect,
           "outputs": {"nvfp4": {"ignore": ["head"]}},
           "models": {"v": {"extends": "deepseek-v4-flash", "dims": {"layers": 2}}}}
    recipe = parse(raw, "variant.json", {"deepseek_v4.json": _deepseek()})
    base = parse(_deepseek(), "deepseek_v4.json", {})
    assert recipe.name == "variant" and recipe.routed_expert == base.routed_expert
    # objects merge key by key; detection and named models are the recipe's own
    assert recipe.outputs["nvfp4"].ignore == ["head"]
    assert recipe.outputs["nvfp4"].quant_methods == base.outputs["nvfp4"].quant_methods
    assert recipe.detect.model_type == "variant" and recipe.detect.config_forbids == []
    assert list(recipe.models) == ["v"]
    assert recipe.models["v"].dims == {**base.models["deepseek-v4-flash"].dims, "layers": 2}
    with pytest.raises(RecipeError, match="recipe variant.json: base: no recipe file 'nope.json'"):
        parse({**raw, "base": "nope.json"}, "variant.json", {})
    with pytest.raises(RecipeError, match="recipe variant.json: models.v.extends: the base recipe names no model"):
        parse({**raw, "models": {"v": {"extends": "nope", "dims": {}}}}, "variant.json", {"deepseek_v4.json": _deepseek()})
    with pytest.raises(RecipeError, match="recipe variant.json: detect: missing"):
        parse({k: v for k, v in raw.items() if k != "detect"}, "variant.json", {"deepseek_v4.json": _deepseek()})


def _variant(**keys) -> dict:
    return {"base": "deepseek_v4.json", "name": "variant", "detect": {"model_type": "variant", "architectures": ["V"]},
            "models": {}, **keys}


def test_a_null_deletes_the_base_s_key():
    raw = _variant(router={"tensors": {"token_table": None}},
                   outputs={"w4a16": {"ignore": None, "evidence": None, "refused": "not established"}},
                   synth={"files": {"config.json": {"num_hash_layers": None, "vision_config": {"max_wh_ratio": None}},
                                    "inference/config.json": None}})
    recipe = parse(raw, "variant.json", {"deepseek_v4.json": _deepseek()})
    base = parse(_deepseek(), "deepseek_v4.json", {})
    assert "token_table" in base.router.tensors and set(recipe.router.tensors) == set(base.router.tensors) - {"token_table"}
    assert base.outputs["w4a16"].ignore and recipe.outputs["w4a16"].ignore == []   # deleted: the schema's default
    assert recipe.outputs["w4a16"].refused == "not established"
    files = recipe.synth.files
    assert "num_hash_layers" in base.synth.files["config.json"] and "num_hash_layers" not in files["config.json"]
    assert set(files) == set(base.synth.files) - {"inference/config.json"}
    # inside an object the base lacks a null is a value, as a file template may hold one
    assert files["config.json"]["vision_config"] == {"max_wh_ratio": None}


@pytest.mark.parametrize("keys, where", [
    ({"router": {"tensors": {"token_tabel": None}}}, "router.tensors.token_tabel"),
    ({"synth": {"files": {"config.json": {"num_hash_layer": None}}}}, "synth.files.config.json.num_hash_layer"),
    ({"stacked_parts": None}, "stacked_parts"),
])
def test_a_null_for_a_key_the_base_lacks_is_refused_in_one_line(keys, where):
    """It deletes nothing, so it is most likely a misspelt key that would leave the base's in place."""
    with pytest.raises(RecipeError) as e:
        parse(_variant(**keys), "variant.json", {"deepseek_v4.json": _deepseek()})
    assert str(e.value) == f"recipe variant.json: {where}: null deletes a key of the base, which has no such key here"


def _repeated(base: dict, own: dict, path: str = "") -> list[str]:
    """Keys of `own` whose value is the base's at the same path."""
    found = []
    for k, v in own.items():
        if k in base and base[k] == v:
            found.append(path + k)
        elif k in base and isinstance(v, dict) and isinstance(base[k], dict):
            found += _repeated(base[k], v, f"{path}{k}.")
    return found


def test_a_recipe_with_a_base_repeats_none_of_its_values():
    raw = _raw()
    for name, data in raw.items():
        if "base" in data:
            base = schema._resolved(raw[data["base"]], raw, (data["base"],))
            inherited = {k: v for k, v in base.items() if k not in schema._OWN}
            assert _repeated(inherited, data) == [], name
    assert _repeated({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 1, "c": 3}, "d": [1]}) == ["a.b", "d"]


def test_loading_refuses_a_broken_recipe_file_in_one_line(tmp_path, monkeypatch):
    """A recipe directory with a misspelt key: loading says which file and key, in one line."""
    for name, raw in _raw().items():
        (tmp_path / name).write_text(json.dumps(raw))
    broken = _deepseek()
    broken["outputs"]["nvfp4"]["ignore_mtp_convertd"] = broken["outputs"]["nvfp4"].pop("ignore_mtp_converted")
    (tmp_path / "deepseek_v4.json").write_text(json.dumps(broken))
    monkeypatch.setattr(model_lib, "_recipe_files", tmp_path.iterdir)
    monkeypatch.setattr(model_lib, "_LOADED", None)
    with pytest.raises(RecipeError) as e:
        model_lib.load_recipes()
    assert str(e.value) == ("recipe deepseek_v4.json: outputs.nvfp4.ignore_mtp_convertd: not a key of the recipe "
                            "schema here (known: evidence, expert_dtype_key, ignore, ignore_mtp_converted, quant_methods, "
                            "quantization_config, refused, stacked)")
