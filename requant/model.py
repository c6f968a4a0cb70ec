"""Model knowledge: which tensors are routed experts, how they group, what bounds their inputs.

Everything specific to a model family lives in its recipe (recipes/*.json); this module reads
recipes and answers questions about tensor names and config values. The pipeline and the formats
never look at tensor names themselves.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from requant import engines
from requant.errors import UnsupportedError


def _recipe_files():
    """Recipe JSON files: inside an installed wheel they are the package requant.recipes; in a
    source checkout (editable install, or run from the tree) they sit in the top-level recipes/."""
    checkout = Path(__file__).resolve().parent.parent / "recipes"
    if (checkout / "__init__.py").is_file():
        return checkout.iterdir()
    return resources.files("requant.recipes").iterdir()


def load_recipes() -> list[dict]:
    return [json.loads(entry.read_text()) for entry in sorted(_recipe_files(), key=lambda p: p.name)
            if entry.name.endswith(".json")]


@dataclass(frozen=True)
class ExpertTensor:
    """One tensor of a routed expert: `{prefix}.{part}` where prefix names the projection."""

    block: str      # e.g. "layers.3" or "mtp.0"
    expert: int
    proj: str       # e.g. "w1"
    part: str       # e.g. "weight", "scale"
    prefix: str     # e.g. "layers.3.ffn.experts.7.w1"


@dataclass
class Expert:
    """All tensors of one routed expert, by projection then part."""

    block: str
    expert: int
    parts: dict[str, dict[str, str]]   # proj -> part -> tensor name
    prefixes: dict[str, str]           # proj -> name prefix


class ModelSpec:
    def __init__(self, recipe: dict, config: dict):
        self.recipe = recipe
        self.config = config
        self._expert_re = re.compile(recipe["routed_expert"])

    @classmethod
    def for_config(cls, config: dict, where: str = "config.json") -> "ModelSpec":
        model_type = config.get("model_type")
        for recipe in load_recipes():
            if recipe["model_type"] == model_type:
                return cls(recipe, config)
        known = ", ".join(r["model_type"] for r in load_recipes())
        raise UnsupportedError(f"{where}: model_type {model_type!r} has no recipe (supported: {known})")

    @property
    def name(self) -> str:
        return self.recipe["name"]

    def value(self, key: str):
        """A config value by its recipe role (e.g. "hidden_size")."""
        config_key = self.recipe["config_keys"][key]
        if config_key not in self.config:
            raise UnsupportedError(f"config.json lacks {config_key!r}, which a {self.name} model must have")
        return self.config[config_key]

    def expert_tensor(self, name: str) -> ExpertTensor | None:
        m = self._expert_re.match(name)
        if not m:
            return None
        part = m["part"]
        return ExpertTensor(m["block"], int(m["expert"]), m["proj"], part, name[: -len(part) - 1])

    def group_experts(self, names) -> list[Expert]:
        """Group routed-expert tensor names by expert, in order of first appearance."""
        experts: dict[tuple[str, int], Expert] = {}
        for name in names:
            ref = self.expert_tensor(name)
            if ref is None:
                continue
            expert = experts.setdefault((ref.block, ref.expert), Expert(ref.block, ref.expert, {}, {}))
            expert.parts.setdefault(ref.proj, {})[ref.part] = name
            expert.prefixes[ref.proj] = ref.prefix
        return list(experts.values())

    @property
    def projections(self) -> list[str]:
        return list(self.recipe["projections"])

    def fused_partner(self, proj: str) -> str | None:
        for group in self.recipe["fused_projections"]:
            if proj in group:
                return next((p for p in group if p != proj), None)
        return None

    def engine(self, name: str | None = None) -> engines.EngineRules:
        """The rules of serving engine `name` (None: the recipe's default engine) for this model."""
        return engines.rules_for(self.recipe, name or engines.default_engine(self.recipe))

    @property
    def engine_names(self) -> list[str]:
        return engines.available(self.recipe)

    def is_mtp(self, block: str) -> bool:
        return block.startswith(self.recipe["mtp_block_prefix"])

    def experts_module(self, block: str) -> str:
        return self.recipe["experts_module"].format(block=block)

    def moe_input_norm(self, block: str) -> str:
        return self.recipe["moe_input_norm"].format(block=block)

    def ignored(self, module: str, patterns) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in patterns)

    def activation_bounds(self, norm_weight_absmax: float) -> dict[str, float]:
        """Data-free bounds on |activation| entering each projection.

        The MoE input is an RMSNorm output, so |x_i| <= sqrt(hidden) * max|norm weight|. The down
        projection sees silu(min(g, L)) * clamp(u, -L, L) <= L * silu(L), times the routing weight,
        which is at most the routed scaling factor where a kernel applies it before w2.
        """
        limit = float(self.value("swiglu_limit"))
        up = math.sqrt(self.value("hidden_size")) * norm_weight_absmax
        down = limit * limit / (1 + math.exp(-limit)) * max(1.0, float(self.value("routed_scaling_factor")))
        bounds = {p: up for p in self.projections}
        bounds[self.recipe["down_projection"]] = down
        return bounds
