"""Target formats behind a small registry: each knows how to plan and encode routed experts and
how to describe itself in config.json. The pipeline talks to targets only through `Target`; a
target's storage is its codec's (requant/formats), and it reads whatever source codec the plan
found, through the codec pair's encoder."""

from __future__ import annotations

import dataclasses
import shlex
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from requant import __version__, formats, sources
from requant.errors import FormatError, RequantError, UnsupportedError
from requant.experts import ExpertIndex
from requant.io.checkpoint import Checkpoint
from requant.io.safetensors import TensorSpec
from requant.engines.serve import calibrated_input_scale
from requant.model import MAIN_KIND, Expert, ModelSpec

PRODUCER = {"name": "requant", "version": __version__}
TARGETS: dict[str, type["Target"]] = {}


def register(codec: formats.Codec):
    """Register a target class writing `codec`, under the codec's name."""
    def wrap(cls):
        cls.codec, cls.name = codec, codec.name
        TARGETS[codec.name] = cls
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
    mtp: str | None = None              # "keep" MTP experts in the source format, "convert" them, "graft"
                                        # the donor's (kept as it stores them), or None: what the engine
                                        # loads them as
    donor: str | None = None            # the checkpoint whose drafter "graft" takes (a directory)
    input_scale: float | None = None    # None: data-free bound; else this constant everywhere
    target: object | None = None        # the target's own options (its `options_type`); None: its defaults
    engine: str | None = None           # serving engine the layout is made for; None: the recipe's default
    model: str | None = None            # the named model (--model), among those detection allows; None: detected
    force: bool = False                 # write a layout the engine would load wrongly (recorded in the card)
    device: str = "cpu"                 # where encoders run ("cpu", "cuda"): never changes the output


@dataclass(frozen=True)
class NoOptions:
    """A target without options of its own."""


class Target:
    """Base: encodes routed experts of the source codec into the target's, leaves everything else
    alone."""

    name = "?"
    codec: formats.Codec
    options_type: type = NoOptions
    # Whether encoding is CPU work worth worker processes (on a CPU device). Such a target's encode
    # must depend on its input tensors and on planning state only: it runs in forked workers.
    cpu_heavy = False

    def __init__(self, model: ModelSpec, source: Checkpoint, options: Options, source_codec: formats.Codec):
        self.model, self.source, self.options = model, source, options
        self.source_codec = source_codec
        self.encoder = formats.encoder(source_codec.name, self.name)
        self.params = formats.Params(self.codec.fixed_group)   # the stored shapes' params; targets with
                                                               # options of their own set theirs
        self.target_options = options.target or self.options_type()
        if not isinstance(self.target_options, self.options_type):
            raise UnsupportedError(f"--out {self.name} takes {self.options_type.__name__}, "
                                   f"not {type(self.target_options).__name__}")
        self.engine = model.engine(options.engine)
        self.reader = sources.reader(model)
        self.mtp = options.mtp or self._engine_mtp()
        self.forced_problems: list[str] = []
        self._bounds: dict[str, dict[str, float]] = {}
        self._bounds_lock = threading.Lock()

    def ready_workers(self) -> None:
        """Before worker processes fork: build what every one of them would otherwise build."""

    # the engine the layout is made for -----------------------------------------------------
    def _engine_mtp(self) -> str:
        """MTP policy that gives the engine the experts in the format it loads them as."""
        return "convert" if self.engine.mtp_format(self.name) == self.name else "keep"

    def check_engine(self, experts: ExpertIndex) -> None:
        """Refuse (once the target knows its options) a layout the engine would load wrongly,
        unless --force; then remember why, for the card. `experts` is the plan's view of the
        source's routed experts."""
        has_drafter = bool(experts.drafter_blocks())
        if self.options.mtp and not has_drafter:
            raise UnsupportedError(f"--drafter {self.options.mtp}: {self.source.path} has no drafter (MTP block "
                                   f"or DSpark stages) with routed experts ({self.model.name}); leave --drafter out")
        self.forced_problems = self._engine_problems(has_drafter)
        if self.forced_problems and not self.options.force:
            raise UnsupportedError(f"{self.forced_problems[0]} (--force writes it anyway)")

    def _engine_problems(self, has_drafter: bool) -> list[str]:
        """What the engine would load wrongly from this layout (`has_drafter`: the source has MTP or
        drafter blocks with routed experts): one sentence each, with the fix."""
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
        written = self.name if self.mtp == "convert" else self.source_codec.name
        if expected and has_drafter and not self.engine.mtp_loads(self.name, written):
            fix = "convert" if expected == self.name else "keep"
            how = (f"use --mtp {fix}" if self.mtp != "graft" else
                   f"a grafted drafter is kept as the donor stores it, so graft one stored as {expected.upper()}")
            problems.append(f"{self.engine.label} loads the MTP block's experts as {expected.upper()}, so "
                            f"{written.upper()} ones would load without error and draft garbage "
                            f"({self.engine.mtp_evidence(self.name)}); {how}, or --engine for another engine")
        return problems

    # planning -------------------------------------------------------------------------------
    def converts(self, block: str) -> bool:
        """Whether `block`'s routed experts are converted: a main layer's always, an MTP or drafter
        block's (any other kind in the recipe's `blocks`) as --mtp says."""
        return self.model.block_kind(block) == MAIN_KIND or self.mtp == "convert"

    def plan_tensor(self, spec: TensorSpec) -> Unit:
        """How a tensor that is not a converted routed expert reaches the output."""
        return Unit([spec.name], [spec])

    def plan_expert(self, expert: Expert) -> Unit:
        """How one routed expert is converted: read from the source, encoded by `encode_expert`."""
        outputs = self.expert_outputs(expert)   # checks the source tensors first
        return Unit(self.source_inputs(expert), outputs, lambda tensors: self.encode_expert(expert, tensors))

    def encode_expert(self, expert: Expert, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Stats]:
        raise NotImplementedError

    @classmethod
    def options_from(cls, given: dict) -> object:
        """This target's options from those given by name (as `requant convert` spells them, with
        underscores); refuses options that belong to other targets."""
        taken = {f.name for f in dataclasses.fields(cls.options_type)}
        foreign = [name for name in given if name not in taken]
        if foreign:
            takers = [n for n, t in TARGETS.items() if foreign[0] in {f.name for f in dataclasses.fields(t.options_type)}]
            flags = " and ".join(f"--{name.replace('_', '-')}" for name in foreign)
            raise UnsupportedError(f"{flags} appl{'y' if len(foreign) > 1 else 'ies'} to --out {', '.join(takers)} only")
        return cls.options_type(**given)

    def source_expert_specs(self, expert: Expert) -> dict[str, dict[str, TensorSpec]]:
        """Check an expert's tensors against the source codec; return proj -> part -> spec of the
        parts its encoder reads."""
        codec = self.source_codec
        found = {}
        for proj in self.model.projections:
            parts = expert.parts.get(proj, {})
            where = expert.prefixes.get(proj) or f"{self.model.experts_module(expert.block)}.{expert.expert}.{proj}"
            needed = [p for p in codec.parts if p.required]
            missing = next((p.suffix for p in needed if p.suffix not in parts), None)
            if missing:
                raise FormatError(f"routed expert projection has no .{missing} tensor", tensor=f"{where}.{missing}")
            specs = {p.suffix: self.source.info(parts[p.suffix]).spec for p in needed}
            if any(specs[p.suffix].dtype not in p.dtypes for p in needed):
                expected = ", ".join(f"{'/'.join(p.dtypes)} {p.suffix}" for p in needed)
                found_dtypes = " and ".join(s.dtype for s in specs.values())
                raise FormatError(f"expected {codec.name.upper()} ({expected}), found {found_dtypes}",
                                  tensor=parts[codec.weight.suffix])
            with self.source.naming(parts[codec.part(formats.SCALE).suffix]):
                codec.check_shapes({suffix: self.reader.unit_shape(spec.shape) for suffix, spec in specs.items()})
            found[proj] = specs
        return found

    def expert_outputs(self, expert: Expert) -> list[TensorSpec]:
        """The tensors a converted expert is written as: the target codec's parts, at each
        projection's logical shape as the source's (checked) tensors give it."""
        specs = self.source_expert_specs(expert)
        outputs = []
        for proj in self.model.projections:
            rows, words = self.reader.unit_shape(specs[proj][self.source_codec.weight.suffix].shape)
            k = words * self.source_codec.elements_per_word
            for part in self.codec.written_parts(self.params):
                name, stored = self.output(expert, proj, part.suffix)
                outputs.append(TensorSpec(name, part.dtypes[0], stored(part.shape(rows, k, self.params))))
        return outputs

    def output(self, expert: Expert, proj: str, part: str):
        """(name, shape or tensor -> as stored) of one converted part, as the source's layout
        stores this format."""
        return self.reader.output(expert, proj, part, self.name, self.source)

    def source_inputs(self, expert: Expert) -> list[str]:
        """The source tensors a converted expert is read from, in projection order."""
        return [expert.parts[p][part.suffix] for p in self.model.projections
                for part in self.source_codec.parts if part.required]

    # numbers shared by targets --------------------------------------------------------------
    def input_scales(self, block: str) -> dict[str, float]:
        """Per-projection activation scale for a block: the constant, or bound / (6 * 448)."""
        if self.options.input_scale is not None:
            return {p: float(self.options.input_scale) for p in self.model.projections}
        with self._bounds_lock:
            if block not in self._bounds:
                norm_name = self.model.moe_input_norm(block)
                if norm_name not in self.source.locations:
                    # not FormatError: the shards are not damaged, and --input-scale is the way on
                    raise RequantError("needed for the data-free input_scale bound but missing "
                                      "(pass --input-scale VALUE to set a constant)", tensor=norm_name)
                absmax = float(self.source.tensor(norm_name).float().abs().max())
                if not (absmax > 0 and absmax < float("inf")):
                    raise RequantError(f"max |weight| is {absmax}, which gives no usable input_scale bound "
                                      "(pass --input-scale VALUE)", tensor=norm_name)
                self._bounds[block] = self.model.activation_bounds(absmax)
        return {p: calibrated_input_scale(b) for p, b in self._bounds[block].items()}   # the bound as an amax

    def read_source(self, expert: Expert, tensors: dict[str, torch.Tensor], proj: str):
        """(weight bytes, scale bytes) of one projection as uint8 numpy arrays, the form the
        encoders from MXFP4 take; invalid scales reported by name."""
        codec = self.source_codec
        parts = expert.parts[proj]
        weight_name, scale_name = parts[codec.weight.suffix], parts[codec.part(formats.SCALE).suffix]
        weight, scale = (tensors[name].view(torch.uint8).reshape(self.reader.unit_shape(tensors[name].shape)).numpy()
                         for name in (weight_name, scale_name))
        with self.source.naming(scale_name):
            codec.check_scales(scale)
        return weight, scale

    # description ----------------------------------------------------------------------------
    def config(self, blocks: list[str], stats: Stats) -> dict:
        """The output config.json, given the blocks whose experts were converted and what encoding
        them did (summed over the whole conversion, resumed shards included)."""
        raise NotImplementedError

    def extra_files(self, blocks: list[str]) -> dict[str, dict]:
        """Other JSON files the format needs beside config.json."""
        return {}

    @classmethod
    def check_config(cls, ctx, layout, seen) -> None:
        """Findings, into ctx.out, on the config.json (and extra files) of a checkpoint whose main
        experts are in this format: the check of what `config` and `extra_files` write, from the
        same constants. `ctx`, `layout` and `seen` are verify's (requant/verify/context.py);
        `requant verify`, convert's pre-flight and its check after writing all call this."""
        raise NotImplementedError

    def summary(self, stats: Stats) -> str:
        raise NotImplementedError

    # the model card -------------------------------------------------------------------------
    format_label = "?"   # how the card names the experts' storage

    def describe_options(self) -> dict:
        """The options that shaped the output, as `requant convert` spells them."""
        return {"mtp": f"graft {shlex.quote(self.options.donor or '')}" if self.mtp == "graft" else self.mtp}

    def other_tensor_groups(self) -> dict[str, str]:
        return {"every other tensor": "copied byte for byte"}

    def accuracy(self, stats: Stats) -> dict:
        raise NotImplementedError


def _load_builtin_targets() -> None:
    from requant.targets import nvfp4  # noqa: F401  (registers itself)
    from requant.targets import w4a16  # noqa: F401  (registers itself)


_load_builtin_targets()
