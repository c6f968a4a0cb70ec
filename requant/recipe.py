"""The recipe schema: what recipes/*.json may hold, as typed dataclasses, checked when a recipe loads.

A recipe that names a key the schema lacks, or gives a value of the wrong type, is refused in one
line naming its file and the key's path (`deepseek_v4.json: outputs.nvfp4.ignore[2]: ...`), so a
misspelt key can never be silently ignored. Fields marked `doc` are prose for people (sources,
evidence); every other field is read by requant (tests/test_recipe_schema.py holds both to it).

A recipe may start from another (`base`): the base's JSON with this file's keys merged over it
(objects merge key by key, a null deletes the base's key, anything else replaces; a base may have
its own), so a release that changes a few facts of a family states only those. A null where the
base has no such key is refused (it deletes nothing, so it is most likely misspelt); a null inside
an object the base lacks is a value, kept as written (a file template may hold one). Detection and
named models are not inherited; a named model may extend one of the base (`extends`), stating only
the dimensions it adds or changes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from requant.errors import UnsupportedCheckpoint


class RecipeError(UnsupportedCheckpoint):
    """A recipe file that does not fit the schema (a defect of the installation, named in one line)."""


def doc(default_factory=str) -> Any:
    """A field for people: sources and evidence, never read by the code."""
    return field(default_factory=default_factory, metadata={"doc": True})


def key(name: str, default: Any = None, default_factory=None) -> Any:
    """An optional field whose JSON key is a Python keyword (`if`, `for`, `with`)."""
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"key": name})
    return field(default=default, metadata={"key": name})


Json = Any   # free-form JSON (a metadata file's template): any value JSON can hold
Number = Union[int, float]
Dim = Union[int, float, str, list[int]]   # a dimension: a number, an expression, or a list of indices or sizes


@dataclass(frozen=True)
class Detect:
    """How a checkpoint is recognised as this recipe's: config.json values, then tensor names."""

    model_type: str
    architectures: list[str]
    config_requires: list[str] = field(default_factory=list)   # config.json keys that must be present
    config_forbids: list[str] = field(default_factory=list)    # ... and keys that must be absent
    tensors_require: list[str] = field(default_factory=list)   # regexes each matched by some tensor name
    tensors_forbid: list[str] = field(default_factory=list)    # regexes no tensor name may match


@dataclass(frozen=True)
class Router:
    kind: str
    tensors: dict[str, str]
    scaling_factor: Union[str, Number] = 1.0
    evidence: str = doc()


@dataclass(frozen=True)
class Activation:
    kind: str
    limit: Union[str, Number, None] = None
    alpha: Union[str, Number, None] = None
    evidence: str = doc()

    def parameters(self) -> dict:
        """The kind's parameters the recipe gives (a config role name or a number)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("kind", "evidence") and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class QuantizationConfig:
    """The quantization_config form an output writes in place of the source's (ModelOpt's own)."""

    quant_method: str
    quant_algo: str
    evidence: str = doc()


@dataclass(frozen=True)
class StackedOutput:
    """How converted experts of a stacked layout are named and stored."""

    names: dict[str, str]
    transpose: bool
    evidence: str = doc()


@dataclass(frozen=True)
class Output:
    """What an output format of this family writes beside its experts."""

    ignore: list[str] = field(default_factory=list)   # quantization_config.ignore: modules left unquantized
    refused: Union[str, None] = None               # why requant will not write this output for the family
    ignore_mtp_converted: Union[list[str], None] = None   # ... when the MTP block's experts are converted
    quant_methods: list[str] = field(default_factory=list)   # quant_method values kept from the source's config
    expert_dtype_key: str = "expert_dtype"   # where config.json says the experts' dtype (vLLM's V4 configs read it)
    quantization_config: Union[QuantizationConfig, None] = None
    stacked: Union[StackedOutput, None] = None
    evidence: str = doc()


@dataclass(frozen=True)
class NamedModel:
    dims: dict[str, Dim]
    default: bool = False
    extends: Union[str, None] = None   # a named model of the base recipe whose dims these update
    source: str = doc()


@dataclass(frozen=True)
class UnknownRevision:
    """A revision of the family known only by its name: no public config tells its checkpoints
    apart, so one that names itself so (its Hub repository, `_name_or_path`, its model card) is
    refused unless --model names the model it is to be read as."""

    name: str    # as its releases are named, e.g. DeepSeek-V4.1-Flash-1017 (matched case-insensitively)
    like: str    # the named model of this recipe it may match (what --model would read it as)
    see: str     # where the search for its config is recorded
    evidence: str = doc()


@dataclass(frozen=True)
class TensorEntry:
    """One entry of a synth template: a tensor (`name` with `dtype` or `format`, and `shape`), a
    named group of entries (`group`, binding `with`), or a loop (`for` over `count`, `tensors`)."""

    name: Union[str, None] = None
    dtype: Union[str, None] = None
    format: Union[str, None] = None
    block: Union[int, list[int], None] = None   # for a format of several blocks: a side or [rows, columns]
    shape: Union[list[Union[str, int]], None] = None
    group: Union[str, None] = None
    with_: dict[str, str] = key("with", default_factory=dict)
    for_: Union[str, None] = key("for")
    count: Union[str, int, None] = None
    tensors: Union[list["TensorEntry"], None] = None
    if_: Union[str, None] = key("if")
    note: str = doc()

    def check(self, where: str) -> None:
        kinds = [k for k, v in (("name", self.name), ("group", self.group), ("for", self.for_)) if v is not None]
        if len(kinds) != 1:
            raise ValueError(f"{where}: an entry has exactly one of name, group, for (it has {kinds or 'none'})")
        if self.name is not None and (self.shape is None or (self.dtype is None) == (self.format is None)):
            raise ValueError(f"{where}: tensor {self.name!r} needs a shape and one of dtype, format")
        if self.for_ is not None and (self.count is None or self.tensors is None):
            raise ValueError(f"{where}: a `for` entry needs count and tensors")


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a synth template, or one per block of a kind (`blocks`, `count`)."""

    shard: list[TensorEntry]
    blocks: Union[str, None] = None
    count: Union[str, int, None] = None
    with_: dict[str, str] = key("with", default_factory=dict)


@dataclass(frozen=True)
class Tokenizer:
    bos: str
    eos: str
    model_max_length: int


@dataclass(frozen=True)
class Synth:
    """A synthetic checkpoint's layout and files as a template over a named model's dimensions."""

    reduced: dict[str, Dim]                    # small-mode dimensions (tests)
    fit: dict[str, str]                        # dimensions recomputed after reduction
    checks: list[list[str]]                    # [condition, message] pairs
    derived: dict[str, str]                    # dimensions computed from others
    shards: list[ShardEntry]
    groups: dict[str, list[TensorEntry]]
    files: dict[str, Json]                     # metadata files beside the shards ("=expr" strings evaluated)
    tokenizer: Tokenizer
    evidence: dict[str, str] = doc(dict)   # field name -> where the fact comes from


@dataclass(frozen=True)
class Recipe:
    name: str
    detect: Detect
    default_engine: str
    routed_expert: str
    expert_layout: str
    projections: list[str]
    projection_shapes: dict[str, list[str]]
    fused_projections: list[list[str]]
    down_projection: str
    blocks: dict[str, str]
    moe_input_norm: str
    experts_module: str
    router: Router
    activation: Activation
    config_keys: dict[str, str]
    real_config_roles: list[str]
    outputs: dict[str, Output]
    models: dict[str, NamedModel]
    synth: Synth
    file: str = ""   # the recipe's file name, for messages; not a JSON key
    stacked_parts: Union[dict[str, str], None] = None
    carried_parts: list[str] = field(default_factory=list)
    interleaved_gate_up: Union[str, None] = None
    shared_expert: Union[str, None] = None
    block_config_keys: dict[str, dict[str, str]] = field(default_factory=dict)   # block kind -> role -> key,
                                                   # where a kind of block has its own (a drafter's experts)
    base: Union[str, None] = None
    unknown_revisions: list[UnknownRevision] = field(default_factory=list)
    description: str = doc()
    evidence: dict[str, str] = doc(dict)   # field name -> where the fact comes from

    @property
    def model_type(self) -> str:
        return self.detect.model_type


# Fields filled by the loader, not read from the JSON.
_DERIVED = {"file"}
_CHOICES = {"expert_layout": ("per_expert", "stacked")}


def json_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"object of {_type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "object"
    return {str: "string", int: "integer", float: "number", bool: "true/false"}.get(tp, str(tp))


def _build(tp, value, where: str):
    """`value` (parsed JSON) as type `tp`; ValueError naming `where` if it is not one."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _build(option, value, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: expected {_type_name(tp)}, got {json.dumps(value)[:60]}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected {_type_name(tp)}, got {json.dumps(value)[:60]}")
        (item,) = typing.get_args(tp)
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected {_type_name(tp)}, got {json.dumps(value)[:60]}")
        item = typing.get_args(tp)[1]
        return {k: _build(item, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, where)
    if tp is type(None):
        if value is not None:
            raise ValueError(f"{where}: expected null")
        return None
    ok = isinstance(value, tp) and not (isinstance(value, bool) and tp is not bool)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{where}: expected {_type_name(tp)}, got {json.dumps(value)[:60]}")
    return value


def _build_dataclass(cls, value, where: str):
    if not isinstance(value, dict):
        raise ValueError(f"{where or 'the file'}: expected an object, got {json.dumps(value)[:60]}")
    hints = typing.get_type_hints(cls)
    fields = {json_key(f): f for f in dataclasses.fields(cls) if f.name not in _DERIVED}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: not a key of the recipe schema here "
                         f"(known: {', '.join(sorted(fields))})")
    args = {}
    for jkey, f in fields.items():
        if jkey in value:
            args[f.name] = _build(hints[f.name], value[jkey], prefix + jkey)
            if f.name in _CHOICES and args[f.name] not in _CHOICES[f.name]:
                raise ValueError(f"{prefix}{jkey}: {args[f.name]!r} is not one of {', '.join(_CHOICES[f.name])}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{prefix}{jkey}: missing (required)")
    built = cls(**args)
    if hasattr(built, "check"):
        built.check(where)
    return built


def _merge(base, patch, where: str = ""):
    """`patch` over `base`: objects key by key, a null deleting the base's key, anything else replaced.
    A null for a key the base lacks deletes nothing: refused, as a misspelt key would go unnoticed."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return patch
    merged = dict(base)
    for k, v in patch.items():
        path = f"{where}.{k}" if where else k
        if v is None and k not in base:
            raise ValueError(f"{path}: null deletes a key of the base, which has no such key here")
        if v is None:
            del merged[k]
        else:
            merged[k] = _merge(base[k], v, path) if k in base else v
    return merged


# What a recipe never takes from its base: how its checkpoints are told apart, and its named models.
_OWN = ("detect", "models")


def _extend(entry, base_models: dict, name: str):
    """A named model's entry with the dims of the base's model it `extends` under its own."""
    if not isinstance(entry, dict) or "extends" not in entry:
        return entry
    if entry["extends"] not in base_models:
        raise ValueError(f"models.{name}.extends: the base recipe names no model {entry['extends']!r}")
    return {**entry, "dims": {**base_models[entry["extends"]]["dims"], **entry.get("dims", {})}}


def _resolved(raw, bases: dict[str, dict], chain: tuple[str, ...]):
    """`raw` with its `base` merged under it, that base resolved first (a base may have its own)."""
    if not isinstance(raw, dict) or "base" not in raw:
        return raw
    name = raw["base"]
    if name not in bases:
        raise ValueError(f"base: no recipe file {name!r} (have: {', '.join(sorted(bases))})")
    if name in chain:
        raise ValueError(f"base: {' -> '.join(chain + (name,))} is a circle")
    base = _resolved(bases[name], bases, chain + (name,))
    data = _merge({k: v for k, v in base.items() if k not in _OWN}, raw)
    data["models"] = {model: _extend(entry, base.get("models", {}), model)
                      for model, entry in raw.get("models", {}).items()}
    return data


def parse(raw: dict, file: str, bases: dict[str, dict]) -> Recipe:
    """A recipe from its parsed JSON (`bases`: other recipe files' JSON by file name, for `base`);
    RecipeError naming `file` and the key when it does not fit the schema."""
    try:
        recipe = _build_dataclass(Recipe, _resolved(raw, bases, (file,)), "")
        _check_recipe(recipe)
    except ValueError as e:
        raise RecipeError(f"recipe {file}: {e}") from None
    return dataclasses.replace(recipe, file=file)


def _check_recipe(recipe: Recipe) -> None:
    """Cross-field facts the types alone cannot say."""
    for where, pattern in ([("routed_expert", recipe.routed_expert)]
                           + [(f"detect.tensors_require[{i}]", p) for i, p in enumerate(recipe.detect.tensors_require)]
                           + [(f"detect.tensors_forbid[{i}]", p) for i, p in enumerate(recipe.detect.tensors_forbid)]):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: not a regular expression ({e})") from None
    for where, names in (("projection_shapes", recipe.projection_shapes),
                         ("fused_projections", {p for g in recipe.fused_projections for p in g})):
        stray = sorted(set(names) - set(recipe.projections))
        if stray:
            raise ValueError(f"{where}: {stray[0]!r} is not one of projections")
    if recipe.down_projection not in recipe.projections:
        raise ValueError(f"down_projection: {recipe.down_projection!r} is not one of projections")
    if recipe.expert_layout == "stacked" and recipe.stacked_parts is None:
        raise ValueError("stacked_parts: missing (required by expert_layout stacked)")
    for where, role in ([("router.scaling_factor", recipe.router.scaling_factor)]
                        + [(f"activation.{k}", v) for k, v in recipe.activation.parameters().items()]
                        + [(f"real_config_roles[{i}]", r) for i, r in enumerate(recipe.real_config_roles)]):
        if isinstance(role, str) and role not in recipe.config_keys:
            raise ValueError(f"{where}: {role!r} is not a role of config_keys")
    for where, cls, evidence in (("evidence", Recipe, recipe.evidence), ("synth.evidence", Synth, recipe.synth.evidence)):
        for name in evidence:
            if name not in {json_key(f) for f in dataclasses.fields(cls)}:
                raise ValueError(f"{where}.{name}: not a key beside it")
    for fmt, output in recipe.outputs.items():
        if (output.refused is None) == (not output.ignore):
            raise ValueError(f"outputs.{fmt}: give either ignore or refused")
    for kind, roles in recipe.block_config_keys.items():
        if kind not in recipe.blocks:
            raise ValueError(f"block_config_keys.{kind}: not a kind of blocks")
        stray = sorted(set(roles) - set(recipe.config_keys))
        if stray:
            raise ValueError(f"block_config_keys.{kind}.{stray[0]}: not a role of config_keys")
    for i, revision in enumerate(recipe.unknown_revisions):
        if revision.like not in recipe.models:
            raise ValueError(f"unknown_revisions[{i}].like: {revision.like!r} is not one of models")
    defaults = [name for name, m in recipe.models.items() if m.default]
    if len(defaults) > 1:
        raise ValueError(f"models: {', '.join(defaults)} are all marked default")
    for group in {e.group for entries in recipe.synth.groups.values() for e in entries if e.group} | \
            {e.group for s in recipe.synth.shards for e in s.shard if e.group}:
        if group not in recipe.synth.groups:
            raise ValueError(f"synth: group {group!r} is not one of synth.groups")
    for i, s in enumerate(recipe.synth.shards):
        if s.blocks is not None and s.blocks not in recipe.blocks:
            raise ValueError(f"synth.shards[{i}].blocks: {s.blocks!r} is not one of blocks")
