"""Target formats behind a small registry: each knows how to plan and encode routed experts and
how to describe itself in config.json. The pipeline talks to targets only through `Target`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from requant import __version__
from requant.errors import FormatError, UnsupportedError
from requant.formats import mxfp4
from requant.io.checkpoint import Checkpoint
from requant.io.safetensors import TensorSpec
from requant.model import Expert, ModelSpec

PRODUCER = {"name": "requant", "version": __version__}
TARGETS: dict[str, type["Target"]] = {}


def register(name: str):
    def wrap(cls):
        cls.name = name
        TARGETS[name] = cls
        return cls
    return wrap


def get_target(name: str) -> type["Target"]:
    if name not in TARGETS:
        raise UnsupportedError(f"unknown output format {name!r} (known: {', '.join(sorted(TARGETS))})")
    return TARGETS[name]


@dataclass
class Stats:
    """What a conversion did, summed over units."""

    tensors_converted: int = 0
    blocks: int = 0
    exact_blocks: int = 0
    requantized_blocks: int = 0
    signal_energy: float = 0.0   # sum of squared source values (lossy targets)
    error_energy: float = 0.0    # sum of squared conversion error (lossy targets)
    per_layer: dict[str, list[float]] = field(default_factory=dict)  # block -> [signal, error]

    def add(self, other: "Stats") -> None:
        self.tensors_converted += other.tensors_converted
        self.blocks += other.blocks
        self.exact_blocks += other.exact_blocks
        self.requantized_blocks += other.requantized_blocks
        self.signal_energy += other.signal_energy
        self.error_energy += other.error_energy
        for block, (s, e) in other.per_layer.items():
            acc = self.per_layer.setdefault(block, [0.0, 0.0])
            acc[0] += s
            acc[1] += e


@dataclass
class Unit:
    """A piece of work: read `inputs` from the source, write `outputs`.

    `encode` is None for a byte copy (one input, one output of the same spec)."""

    inputs: list[str]
    outputs: list[TensorSpec]
    encode: Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], Stats]] | None = None


@dataclass
class Options:
    mtp: str | None = None              # "keep" MTP experts in the source format, "convert" them, or
                                        # None: what the engine loads them as
    input_scale: float | None = None    # None: data-free bound; else this constant everywhere
    extra: dict = field(default_factory=dict)  # target-specific options
    engine: str | None = None           # serving engine the layout is made for; None: the recipe's default
    force: bool = False                 # write a layout the engine would load wrongly (recorded in the card)
    device: str = "cpu"                 # where encoders run ("cpu", "cuda"): never changes the output


class Target:
    """Base: reads MXFP4 experts, leaves everything else alone."""

    name = "?"
    source_format = "mxfp4"
    # Whether encoding is CPU work worth worker processes (on a CPU device). Such a target's encode
    # must depend on its input tensors and on planning state only: it runs in forked workers.
    cpu_heavy = False

    def __init__(self, model: ModelSpec, source: Checkpoint, options: Options):
        self.model, self.source, self.options = model, source, options
        self.engine = model.engine(options.engine)
        self.mtp = options.mtp or self._engine_mtp()
        self.forced_problems: list[str] = []
        self._bounds: dict[str, dict[str, float]] = {}
        self._bounds_lock = threading.Lock()

    # the engine the layout is made for -----------------------------------------------------
    def _engine_mtp(self) -> str:
        """MTP policy that gives the engine the experts in the format it loads them as."""
        return "convert" if self.engine.mtp_format(self.name) == self.name else "keep"

    def check_engine(self) -> None:
        """Refuse (once the target knows its options) a layout the engine would load wrongly,
        unless --force; then remember why, for the card."""
        self.forced_problems = self._engine_problems()
        if self.forced_problems and not self.options.force:
            raise UnsupportedError(f"{self.forced_problems[0]} (--force writes it anyway)")

    def _engine_problems(self) -> list[str]:
        """What the engine would load wrongly from this layout: one sentence each, with the fix."""
        problems = []
        refusal = self.engine.refusal(self.name)
        if refusal:
            problems.append(f"{self.engine.label} cannot serve --out {self.name}: {refusal}")
        options = self.describe_options()
        for option, refused in (self.engine.layout(self.name, "refuses") or {}).items():
            if options.get(option) in refused:
                value = options[option]
                problems.append(f"{self.engine.label} cannot load --{option.replace('_', '-')} {value}: "
                                f"{refused[value]}")
        expected = self.engine.mtp_format(self.name)
        written = self.name if self.mtp == "convert" else self.source_format
        if expected and written != expected and any(self.model.is_mtp(e.block)
                                                    for e in self.model.group_experts(self.source.names)):
            fix = "convert" if expected == self.name else "keep"
            problems.append(f"{self.engine.label} loads the MTP block's experts as {expected.upper()}, so "
                            f"{written.upper()} ones would load without error and draft garbage "
                            f"({self.engine.mtp_evidence(self.name)}); use --mtp {fix}, or --engine for another engine")
        return problems

    # planning -------------------------------------------------------------------------------
    def converts(self, block: str) -> bool:
        return not self.model.is_mtp(block) or self.mtp == "convert"

    def plan_tensor(self, spec: TensorSpec) -> Unit:
        """How a tensor that is not a converted routed expert reaches the output."""
        return Unit([spec.name], [spec])

    def plan_expert(self, expert: Expert) -> Unit:
        raise NotImplementedError

    def source_expert_specs(self, expert: Expert) -> dict[str, tuple[TensorSpec, TensorSpec]]:
        """Check an expert's MXFP4 tensors; return proj -> (weight spec, scale spec)."""
        found = {}
        for proj in self.model.projections:
            parts = expert.parts.get(proj, {})
            where = f"{self.model.experts_module(expert.block)}.{expert.expert}.{proj}"
            if "weight" not in parts or "scale" not in parts:
                missing = "weight" if "weight" not in parts else "scale"
                raise FormatError(f"routed expert projection has no .{missing} tensor", tensor=f"{where}.{missing}")
            weight, scale = self.source.info(parts["weight"]).spec, self.source.info(parts["scale"]).spec
            if weight.dtype not in ("I8", "U8") or scale.dtype != "F8_E8M0":
                raise FormatError(f"expected MXFP4 (I8/U8 weight, F8_E8M0 scale), found {weight.dtype} and {scale.dtype}",
                                  tensor=parts["weight"])
            try:
                mxfp4.check_shapes(weight.shape, scale.shape)
            except FormatError as e:
                raise FormatError(str(e), file=self.source.shard_path(self.source.locations[parts["scale"]]),
                                  tensor=parts["scale"]) from None
            found[proj] = (weight, scale)
        return found

    # numbers shared by targets --------------------------------------------------------------
    def input_scales(self, block: str) -> dict[str, float]:
        """Per-projection activation scale for a block: the constant, or bound / (6 * 448)."""
        if self.options.input_scale is not None:
            return {p: float(self.options.input_scale) for p in self.model.projections}
        with self._bounds_lock:
            if block not in self._bounds:
                norm_name = self.model.moe_input_norm(block)
                if norm_name not in self.source.locations:
                    raise FormatError("needed for the data-free input_scale bound but missing "
                                      "(pass --input-scale VALUE to set a constant)", tensor=norm_name)
                absmax = float(self.source.tensor(norm_name).float().abs().max())
                if not (absmax > 0 and absmax < float("inf")):
                    raise FormatError(f"max |weight| is {absmax}, which gives no usable input_scale bound "
                                      "(pass --input-scale VALUE)", tensor=norm_name)
                self._bounds[block] = self.model.activation_bounds(absmax)
        return {p: b / (6.0 * 448.0) for p, b in self._bounds[block].items()}

    def read_mxfp4(self, expert: Expert, tensors: dict[str, torch.Tensor], proj: str):
        """(weight bytes, scale bytes) of one projection as uint8 numpy arrays, NaN scales reported
        by name."""
        parts = expert.parts[proj]
        weight = tensors[parts["weight"]].view(torch.uint8).numpy()
        scale = tensors[parts["scale"]].view(torch.uint8).numpy()
        try:
            mxfp4.check_scales(scale)
        except FormatError as e:
            raise FormatError(str(e), file=self.source.shard_path(self.source.locations[parts["scale"]]),
                              tensor=parts["scale"]) from None
        return weight, scale

    # description ----------------------------------------------------------------------------
    def config(self, blocks: list[str], stats: Stats) -> dict:
        """The output config.json, given the blocks whose experts were converted and what encoding
        them did (summed over the whole conversion, resumed shards included)."""
        raise NotImplementedError

    def extra_files(self, blocks: list[str]) -> dict[str, dict]:
        """Other JSON files the format needs beside config.json."""
        return {}

    def summary(self, stats: Stats) -> str:
        raise NotImplementedError

    # the model card -------------------------------------------------------------------------
    format_label = "?"   # how the card names the experts' storage

    def describe_options(self) -> dict:
        """The options that shaped the output, as `requant convert` spells them."""
        return {"mtp": self.mtp}

    def other_tensor_groups(self) -> dict[str, str]:
        return {"every other tensor": "copied byte for byte"}

    def accuracy(self, stats: Stats) -> dict:
        raise NotImplementedError


def _load_builtin_targets() -> None:
    from requant.targets import nvfp4  # noqa: F401  (registers itself)
    from requant.targets import w4a16  # noqa: F401  (registers itself)


_load_builtin_targets()
