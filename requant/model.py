"""Model knowledge: which tensors are routed experts, how they group, what bounds their inputs.

Everything specific to a model family lives in its recipe (recipes/*.json); this module reads
recipes and answers questions about tensor names and config values. The pipeline and the formats
never look at tensor names themselves.

In a recipe, a name template holds `{block}` (a block name such as `layers.3`), `{index}`, `{proj}`
or `{expert}`; a parameter of the router or activation given as a string names a config role
(a key of `config_keys`), a number is a constant of the model family.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from requant import engines, expressions, moe
from requant.errors import FormatError, RequantError, UnsupportedCheckpoint, UnsupportedError
from requant.formats.nvfp4 import CODEC as _NVFP4
from requant.io import identity
from requant.recipe import NamedModel, Recipe, parse

MAIN_KIND = "layer"   # the recipe's block kind of the model's own layers; every other kind is a drafter's

NVFP4 = _NVFP4.name   # the output whose config facts (quant_method kept, ModelOpt's form) ModelSpec answers for


def _recipe_files():
    """Recipe JSON files: inside an installed wheel they are the package requant.recipes; in a
    source checkout (editable install, or run from the tree) they sit in the top-level recipes/."""
    checkout = Path(__file__).resolve().parent.parent / "recipes"
    if (checkout / "__init__.py").is_file():
        return checkout.iterdir()
    return resources.files("requant.recipes").iterdir()


_LOADED: list[Recipe] | None = None


def load_recipes() -> list[Recipe]:
    """Every recipe, checked against the schema (requant/recipe.py); loaded once per process."""
    global _LOADED
    if _LOADED is None:
        raw = {}
        for entry in sorted(_recipe_files(), key=lambda p: p.name):
            if entry.name.endswith(".json"):
                try:
                    raw[entry.name] = json.loads(entry.read_text())
                except json.JSONDecodeError as e:
                    raise UnsupportedCheckpoint(f"recipe {entry.name}: not JSON ({e})") from None
        _LOADED = [parse(data, name, raw) for name, data in raw.items()]
    return _LOADED


def named_models() -> dict[str, tuple[Recipe, NamedModel]]:
    """Every recipe's named models (its `models` section): name -> (recipe, its entry)."""
    return {name: (recipe, entry) for recipe in load_recipes() for name, entry in recipe.models.items()}


def default_model_name() -> str:
    """The named model `requant synth` builds unless told otherwise."""
    return next(name for name, (_, entry) in named_models().items() if entry.default)


@dataclass(frozen=True)
class ExpertTensor:
    """One tensor of a routed expert: `{prefix}.{part}` where prefix names the projection."""

    block: str      # e.g. "layers.3" or "mtp.0"
    expert: int | None   # None: a stacked tensor holding every expert of the block
    proj: str       # e.g. "w1"
    part: str       # e.g. "weight", "scale"
    prefix: str     # e.g. "layers.3.ffn.experts.7.w1"


@dataclass
class Expert:
    """All tensors of one routed expert, by projection then part."""

    block: str
    expert: int | None                 # None: every expert of the block, stacked ([E, ...] tensors)
    parts: dict[str, dict[str, str]]   # proj -> part -> tensor name
    prefixes: dict[str, str]           # proj -> name prefix


def expand_template(value, evaluate):
    """A file template (recipe `synth.files`) with each "=expr" string replaced by its value."""
    if isinstance(value, dict):
        return {k: expand_template(v, evaluate) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_template(v, evaluate) for v in value]
    if isinstance(value, str) and value.startswith("="):
        return evaluate(value[1:])
    return value


ABSENT = object()   # config_value of a key config.json lacks (None is a value a key may hold)


def config_value(config: dict, key: str):
    """config.json's value at `key`, a dotted path where the model nests it (`text_config.hidden_size`);
    ABSENT where there is none."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return ABSENT
        value = value[part]
    return value


def mismatches(recipe: Recipe, config: dict, names=None) -> list[str]:
    """Why config.json (and the tensor `names`, when given) is not a checkpoint of `recipe`'s kind;
    empty when it is."""
    d = recipe.detect
    found = []
    if config.get("model_type") != d.model_type:
        found.append(f"model_type {config.get('model_type')!r}, not {d.model_type!r}")
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and set(map(str, architectures)) & set(d.architectures)):
        found.append(f"architectures {architectures!r}, not {' or '.join(d.architectures)}")
    found += [f"config.json lacks {k}" for k in d.config_requires if config_value(config, k) is ABSENT]
    found += [f"config.json has {k}" for k in d.config_forbids if config_value(config, k) is not ABSENT]
    if names is not None:
        for pattern in d.tensors_require:
            if not any(re.search(pattern, n) for n in names):
                found.append(f"no tensor matches {pattern}")
        for pattern in d.tensors_forbid:
            hit = next((n for n in names if re.search(pattern, n)), None)
            if hit is not None:
                found.append(f"tensor {hit} is not one")
    return found


def detect(config: dict, where: str = "config.json", names=None) -> Recipe:
    """The recipe whose kind of checkpoint config.json (and the tensor `names`) is: exactly one must
    fit, else the refusal names what was seen."""
    recipes = load_recipes()
    fits = [r for r in recipes if not mismatches(r, config, names)]
    if len(fits) == 1:
        return fits[0]
    seen = f"model_type {config.get('model_type')!r}, architectures {config.get('architectures')!r}"
    if fits:
        raise UnsupportedCheckpoint(f"{where}: {seen} fits several recipes ({', '.join(r.file for r in fits)}); "
                                    "their detect sections must tell them apart")
    near = [(r, mismatches(r, config, names)) for r in recipes if r.detect.model_type == config.get("model_type")]
    if near:
        r, why = min(near, key=lambda x: len(x[1]))
        raise UnsupportedCheckpoint(f"{where}: {seen} is no kind of checkpoint requant knows: nearest is {r.name} "
                                    f"({r.file}), but {'; '.join(why)}")
    known = ", ".join(dict.fromkeys(f"{r.detect.model_type} ({'/'.join(r.detect.architectures)})" for r in recipes))
    raise UnsupportedCheckpoint(f"{where}: {seen} has no recipe (supported: {known})")


def refuse_unknown_revision(recipe: Recipe, where: str, seen: list[tuple[str, str]]) -> None:
    """Refuse in one line a checkpoint that names itself (`seen`: (text, where it says so) pairs)
    as one of the recipe's `unknown_revisions`, which no public config tells apart."""
    for revision in recipe.unknown_revisions:
        named = re.compile(rf"(?<![\w.]){re.escape(revision.name)}(?![\w.])", re.IGNORECASE)
        for text, place in seen:
            if named.search(text):
                raise UnsupportedCheckpoint(
                    f"{where}: {text[:120]} ({place}): no public config of {revision.name} was found "
                    f"({revision.see}), so requant has no recipe for it; if it matches {revision.like}, "
                    f"--model {revision.like} reads it as that")


class ModelSpec:
    def __init__(self, recipe: Recipe, config: dict):
        self.recipe = recipe
        self.config = config
        self._named: str | None = None   # the named model --model chose (model_name)
        self._expert_re = re.compile(recipe.routed_expert)
        self._block_re = {kind: re.compile("^" + re.escape(template).replace(re.escape("{index}"), r"(\d+)") + "$")
                          for kind, template in recipe.blocks.items()}

    @classmethod
    def for_config(cls, config: dict, where: str = "config.json", names=None, model: str | None = None) -> "ModelSpec":
        """The spec of the recipe whose `detect` facts config.json (and, given, the tensor `names`)
        fit; `model` (a named model, --model) only chooses among what detection allows."""
        spec = cls(detect(config, where, names), config)
        if model is not None:
            spec._override(model, where, names)
        return spec

    @classmethod
    def for_checkpoint(cls, checkpoint, where: str | None = None, model: str | None = None,
                       identify: bool = False) -> "ModelSpec":
        """for_config() with the checkpoint's config.json and tensor names; `where` names the
        checkpoint in messages (default: its path). `identify`: also refuse a checkpoint that names
        itself a revision its recipe knows only by name, unless `model` says what to read it as."""
        spec = cls.for_config(checkpoint.config, os.path.join(where or checkpoint.path, "config.json"),
                              checkpoint.names, model)
        # a conversion's output is read as the model its conversion was told or found
        if identify and model is None and identity.recorded_model(checkpoint.path) not in spec.recipe.models:
            refuse_unknown_revision(spec.recipe, where or checkpoint.path,
                                    identity.names_seen(checkpoint.path, checkpoint.config))
        return spec

    def _override(self, model: str, where: str, names) -> None:
        models = named_models()
        if model not in models:
            raise UnsupportedError(f"--model {model}: no recipe names such a model (known: {', '.join(models)})")
        recipe = models[model][0]
        if recipe is not self.recipe:
            why = "; ".join(mismatches(recipe, self.config, names)) or f"it is a {self.name} checkpoint"
            raise UnsupportedCheckpoint(f"{where}: --model {model} is a {recipe.name} model, but this checkpoint "
                                        f"is not one ({why})")
        self._named = model

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def synth_template(self):
        """The recipe's `synth` section: a synthetic checkpoint's tensors and files (synth.py)."""
        return self.recipe.synth

    @property
    def model_name(self) -> str | None:
        """The named model (e.g. deepseek-v4-pro) whose config.json this is, going by the values of
        every config role (or as --model named it); None for other dimensions."""
        if self._named:
            return self._named
        for name, entry in self.recipe.models.items():
            config_template = self.synth_template.files["config.json"]
            dims = {**self.synth_template.derived, **entry.dims}
            evaluate = lambda expr: expressions.evaluate(expr, dims)  # noqa: E731
            if all(config_value(self.config, key) == expand_template(config_value(config_template, key), evaluate)
                   for key in self.recipe.config_keys.values()):
                return name
        return None

    def value(self, key: str, block: str | None = None):
        """A config value by its recipe role (e.g. "hidden_size"); given a block, the value for that
        block's kind where the recipe has one of its own (a drafter's expert count)."""
        config_key = self.config_key(key, block)
        value = config_value(self.config, config_key)
        if value is ABSENT:
            raise UnsupportedCheckpoint(f"config.json lacks {config_key!r}, which a {self.name} model must have")
        return value

    def expert_tensor(self, name: str) -> ExpertTensor | None:
        m = self._expert_re.match(name)
        if not m:
            return None
        expert = int(m["expert"]) if "expert" in m.groupdict() else None
        if m["part"] is None:   # a stacked output's weight is named after its projection (ModelOpt)
            return ExpertTensor(m["block"], expert, m["proj"], "", name)
        part = m["part"]
        return ExpertTensor(m["block"], expert, m["proj"], part, name[: -len(part) - 1])

    @property
    def expert_layout(self) -> str:
        return self.recipe.expert_layout

    @property
    def projections(self) -> list[str]:
        """Each expert's projections in the order gate, up, down (moe.py's expert tuples)."""
        return list(self.recipe.projections)

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """Logical [out, K] of one expert's projection, from config.json's sizes."""
        roles = {role: self.value(role) for role in ("hidden_size", "intermediate_size")}
        return tuple(expressions.evaluate(x, roles) for x in self.recipe.projection_shapes[proj])

    @property
    def stacked_parts(self) -> dict[str, str]:
        """Stacked layout: codec part (weight, scale, bias) -> the suffix the release joins to the
        projection's name with "_" (gpt-oss: `gate_up_proj_blocks` is the weight)."""
        return dict(self.recipe.stacked_parts or {})

    def output(self, fmt: str):
        """The recipe's facts about `fmt` output (recipe `outputs`)."""
        if fmt not in self.recipe.outputs:
            raise UnsupportedError(f"{self.name}: the recipe ({self.recipe.file}) describes no {fmt} output "
                                   f"(it has: {', '.join(self.recipe.outputs) or 'none'})")
        output = self.recipe.outputs[fmt]
        if output.refused:
            raise UnsupportedError(f"--out {fmt} is refused for {self.name} checkpoints: {output.refused}")
        return output

    def stacked_output(self, fmt: str) -> dict:
        """How converted `fmt` experts of a stacked layout are stored: {"names", "transpose"}."""
        stacked = self.recipe.outputs[fmt].stacked if fmt in self.recipe.outputs else None
        if stacked is None:
            laid_out = [f for f, o in self.recipe.outputs.items() if o.stacked]
            raise UnsupportedError(f"{self.name}: the recipe lays out no stacked {fmt} experts "
                                   f"(it has: {', '.join(laid_out) or 'none'})")
        return {"names": dict(stacked.names), "transpose": stacked.transpose}

    def stored_transposed(self, fmt: str) -> bool:
        """Whether stacked experts converted to `fmt` are stored (E, in, out), as the engine's module
        holds them; a source format as released is stored (E, out, in)."""
        output = self.recipe.outputs.get(fmt)
        return bool(output and output.stacked and output.stacked.transpose)

    @property
    def nvfp4_quantization_config(self) -> dict | None:
        """{"quant_method", "quant_algo"} where NVFP4 output describes itself in ModelOpt's own form
        (replacing the source's quantization_config); None where it keeps the source's (DeepSeek-V4)."""
        output = self.recipe.outputs.get(NVFP4)
        qc = output.quantization_config if output else None
        return None if qc is None else {"quant_method": qc.quant_method, "quant_algo": qc.quant_algo}

    @property
    def carried_parts(self) -> list[str]:
        """Parts of an expert projection beside its codec's, carried through conversion unchanged
        (gpt-oss: the bias)."""
        return list(self.recipe.carried_parts)

    @property
    def down_projection(self) -> str:
        return self.recipe.down_projection

    @property
    def fused_projections(self) -> list[list[str]]:
        """Projections an engine loads as one tensor (DeepSeek-V4's w1 and w3 as w13)."""
        return [list(group) for group in self.recipe.fused_projections]

    def fused_partner(self, proj: str) -> str | None:
        for group in self.recipe.fused_projections:
            if proj in group:
                return next((p for p in group if p != proj), None)
        return None

    def engine(self, name: str | None = None, version: str | None = None) -> engines.EngineRules:
        """The rules of serving engine `name` (`vllm` or `vllm==VERSION`; None: the recipe's default
        engine) at `version` (None: the release named, else installed here, else the newest checked)."""
        return engines.rules_for(self.recipe, name or engines.default_engine(self.recipe), version)

    @property
    def engine_names(self) -> list[str]:
        return engines.available(self.recipe)

    def block_name(self, kind: str, index: int) -> str:
        """The name of block `index` of `kind` ("layer": `layers.3`, "mtp": `mtp.0`)."""
        return self.recipe.blocks[kind].format(index=index)

    def layer_block(self, index: int) -> str:
        return self.block_name(MAIN_KIND, index)

    def block_kind(self, block: str) -> str:
        """The kind of block (recipe `blocks`: "layer", "mtp") a block name is."""
        for kind, pattern in self._block_re.items():
            if pattern.match(block):
                return kind
        raise FormatError(f"{block!r} is not a block name of a {self.name} model")

    def block_position(self, block: str) -> tuple[bool, int]:
        """(is a drafter block, index): sorts blocks in layer order, the drafter's blocks last."""
        for kind, pattern in self._block_re.items():
            if m := pattern.match(block):
                return kind != MAIN_KIND, int(m[1])
        raise FormatError(f"{block!r} is not a block name of a {self.name} model")

    def block_index(self, block: str) -> int:
        """The index in the block's name: L of `layers.L`, N of the MTP block `mtp.N`."""
        return self.block_position(block)[1]

    def drafter_block_of(self, name: str) -> str | None:
        """The drafter block (a block of any kind but the main layers') tensor `name` belongs to,
        None for a tensor of the model itself."""
        for kind, pattern in self._block_re.items():
            prefix = re.match(pattern.pattern.removesuffix("$") + r"\.", name) if kind != MAIN_KIND else None
            if prefix:
                return prefix[0][:-1]
        return None

    def is_mtp(self, block: str) -> bool:
        return "mtp" in self._block_re and bool(self._block_re["mtp"].match(block))

    def select_blocks(self, spec: str | None, blocks: list[str]) -> list[str]:
        """Blocks selected by --layers: comma-separated layer numbers, ranges A-B, or block names."""
        if not spec:
            return blocks
        wanted = set()
        for item in spec.split(","):
            item = item.strip()
            if m := re.fullmatch(r"(\d+)-(\d+)", item):
                wanted.update(self.layer_block(i) for i in range(int(m[1]), int(m[2]) + 1))
            elif item.isdigit():
                wanted.add(self.layer_block(int(item)))
            elif item:
                wanted.add(item)
        unknown = wanted - set(blocks)
        if unknown:
            raise RequantError(f"--layers names blocks without routed experts in both checkpoints: {sorted(unknown)[:5]}")
        return [b for b in blocks if b in wanted]

    def experts_module(self, block: str) -> str:
        return self.recipe.experts_module.format(block=block)

    def moe_input_norm(self, block: str) -> str:
        return self.recipe.moe_input_norm.format(block=block)

    def shared_expert(self, block: str, proj: str) -> str | None:
        """Name prefix of one projection of the block's shared expert; None for a model without one."""
        template = self.recipe.shared_expert
        return None if template is None else template.format(block=block, proj=proj)

    @property
    def interleaved_gate_up(self) -> str | None:
        """The projection that holds gate and up fused with interleaved rows (gpt-oss: even rows
        gate, odd rows up); None where they are separate projections."""
        return self.recipe.interleaved_gate_up

    def router_tensor(self, block: str, role: str) -> str:
        """The block's router tensor of `role`: weight, bias (DeepSeek-V4: chooses experts only) or
        token_table (hash-routed layers: token id -> expert ids)."""
        return self.recipe.router.tensors[role].format(block=block)

    @property
    def router_roles(self) -> list[str]:
        return list(self.recipe.router.tensors)

    def router(self, block: str | None = None) -> dict:
        """{"kind", "top_k", "scaling_factor"}: how the torch reference routes tokens (moe.py), in
        `block` where given (a drafter may pick fewer experts)."""
        spec = self.recipe.router
        return {"kind": spec.kind, "top_k": int(self.value("top_k", block)),
                "scaling_factor": float(self._parameter(spec.scaling_factor))}

    def activation(self) -> dict:
        """{"kind", and the kind's parameters as numbers}: the experts' activation (moe.py)."""
        spec = self.recipe.activation
        return {"kind": spec.kind, **{k: float(self._parameter(v)) for k, v in spec.parameters().items()}}

    def _parameter(self, value):
        return self.value(value) if isinstance(value, str) else value

    def config_key(self, role: str, block: str | None = None) -> str:
        """The config.json key that holds `role` in this model family (for `block`'s kind, given)."""
        if block is not None:
            own = self.recipe.block_config_keys.get(self.block_kind(block), {})
            if role in own:
                return own[role]
        return self.recipe.config_keys[role]

    def check_config_types(self) -> None:
        """config.json comes from strangers too: the values requant computes with must have the right type."""
        real = set(self.recipe.real_config_roles)
        for role, config_key in self.recipe.config_keys.items():
            value = config_value(self.config, config_key)
            if value is ABSENT:
                continue
            if role in real:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
            else:
                ok = type(value) is int and value >= 0
            if not ok:
                raise FormatError(f"config.json: {config_key} is {value!r}, not a "
                                  f"{'positive number' if role in real else 'count'}")

    def quantization_ignore(self, fmt: str, mtp_converted: bool) -> list[str]:
        """Module patterns an output whose experts are `fmt` lists as left unquantized
        (quantization_config.ignore); the MTP block's experts leave the list when converted too."""
        output = self.output(fmt)
        converted = output.ignore_mtp_converted if mtp_converted else None
        return list(output.ignore if converted is None else converted)

    @property
    def nvfp4_quant_methods(self) -> list[str]:
        """The quant_method values an NVFP4 output that keeps the source's config form may carry."""
        output = self.recipe.outputs.get(NVFP4)
        return list(output.quant_methods if output else ())

    def ignored(self, module: str, patterns) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in patterns)

    def activation_bounds(self, norm_weight_absmax: float) -> dict[str, float]:
        """Data-free bounds on |activation| entering each projection.

        The MoE input is an RMSNorm output, so |x_i| <= sqrt(hidden) * max|norm weight|. The down
        projection sees the activation's bound (DeepSeek-V4: silu(min(g, L)) * clamp(u, -L, L) <=
        L * silu(L)), times the routing weight, which is at most the routed scaling factor where a
        kernel applies it before the down projection.
        """
        up = math.sqrt(self.value("hidden_size")) * norm_weight_absmax
        down = moe.activation(self.activation()).bound() * max(1.0, self.router()["scaling_factor"])
        bounds = {p: up for p in self.projections}
        bounds[self.down_projection] = down
        return bounds
