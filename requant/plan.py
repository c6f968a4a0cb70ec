"""Plan a conversion from metadata alone: every output shard, tensor, dtype, shape and byte count
is fixed before any tensor data is read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from requant import formats, sources
from requant.experts import ExpertIndex
from requant.errors import FormatError, UnsupportedCheckpoint, UnsupportedError
from requant.io.checkpoint import Checkpoint
from requant.io.safetensors import TensorSpec, encode_header
from requant.model import Expert, ModelSpec
from requant.targets import Options, Target, Unit, get_target


@dataclass
class ShardPlan:
    name: str
    units: list[Unit]

    @property
    def specs(self) -> list[TensorSpec]:
        return [s for u in self.units for s in u.outputs]

    @property
    def file_size(self) -> int:
        header, _ = encode_header(self.specs)
        return len(header) + sum(s.nbytes for s in self.specs)


@dataclass
class Plan:
    source: Checkpoint
    model: ModelSpec
    target: Target
    shards: list[ShardPlan]
    blocks: list[str]                       # blocks whose routed experts are converted
    source_format: str                      # the source codec's name
    counts: Counter = field(default_factory=Counter)
    label: str = ""                         # how the output's card names the source (path or repo@commit)
    in_format: str | None = None            # --in as given (None: not given)
    # how convert was run, for the card's command line: {"source": SRC as given, "destination":
    # DST (None in place), "in_place": bool}; empty: unknown (the card shows DST)
    run: dict = field(default_factory=dict)
    experts: ExpertIndex | None = None      # the source's routed experts
    # How a new directory gets each shard whose output is its source's bytes unchanged
    # (outputs.verbatim): "link" (a hard link to the source's file, no new disk) or "copy" (copied
    # whole: --copy-all, or the filesystem refuses a link); in place such a shard stays ("keep").
    verbatim_as: str = "copy"

    @property
    def index(self) -> dict:
        """The output's model.safetensors.index.json."""
        return {"metadata": {**self.source.index_metadata, "total_size": self.total_size},
                "weight_map": self.weight_map}

    @property
    def weight_map(self) -> dict[str, str]:
        return {s.name: shard.name for shard in self.shards for s in shard.specs}

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for shard in self.shards for s in shard.specs)

    @property
    def output_bytes(self) -> int:
        return sum(shard.file_size for shard in self.shards)

    @property
    def input_bytes(self) -> int:
        return sum(h.file_size for h in self.source.headers.values())


def make_plan(source: Checkpoint, out_format: str, options: Options, in_format: str | None = None) -> Plan:
    """The plan for converting `source`'s routed experts to `out_format`; `in_format`, when given,
    is the format the caller expects them in (None: whatever they are stored as)."""
    model = ModelSpec.for_checkpoint(source, model=options.model)
    _check_config_values(model)
    index = ExpertIndex(model, source)
    found = index.main_codec
    if found is None:
        raise UnsupportedCheckpoint(f"{source.path}: no routed experts in a known format were found")
    if in_format not in (None, found.name):
        raise UnsupportedError(f"{source.path}: routed experts are stored as {found.name}, not {in_format} "
                               f"(--in {in_format})")
    target_class = get_target(out_format)
    if found.name not in formats.encoder_sources(out_format):
        raise UnsupportedError(f"{source.path}: routed experts are stored as {found.name}; --out {out_format} "
                               f"converts from {', '.join(formats.encoder_sources(out_format))}")
    target = target_class(model, source, options, found)
    target.check_engine(index)

    units_by_first_tensor: dict[str, Unit] = {}
    owned: set[str] = set()
    blocks: list[str] = []
    for expert in index.units:
        if not target.converts(expert.block):
            continue
        # parts the model carries beside the codec's (gpt-oss' biases) pass through like any tensor
        names = [n for parts in expert.parts.values() for part, n in parts.items() if part not in model.carried_parts]
        shards = {source.locations[n] for n in names}
        if len(shards) > 1:
            raise FormatError(f"{index.where(expert)} is split across shards {sorted(shards)}; "
                              "its projections must be converted together", tensor=names[0])
        _check_against_config(model, source, index.reader, expert)
        unit = target.plan_expert(expert)
        first = min(names, key=lambda n: source.info(n).start)
        units_by_first_tensor[first] = unit
        owned.update(names)
        if expert.block not in blocks:
            blocks.append(expert.block)

    counts: Counter = Counter()
    shards = []
    for shard_name in source.shard_names:
        units = []
        for name, info in source.headers[shard_name].tensors.items():
            if name in units_by_first_tensor:
                unit = units_by_first_tensor[name]
                counts["converted tensors"] += len(unit.inputs)
                units.append(unit)
            elif name not in owned:
                unit = target.plan_tensor(info.spec)
                counts["passed through" if unit.encode is None else "rewritten"] += 1
                units.append(unit)
        shards.append(ShardPlan(shard_name, units))
    plan = Plan(source, model, target, shards, blocks, found.name, counts, label=source.path, in_format=in_format,
                experts=index)
    # verify's own checks on what this plan writes, before a byte is written: an output verify
    # would reject is refused here, in one line (the same rules verify applies afterwards)
    from requant.verify import check_conversion_plan
    check_conversion_plan(plan)
    return plan


def _check_config_values(model: ModelSpec) -> None:
    """config.json comes from strangers too: what requant computes with or extends must have
    the right type."""
    if not isinstance(model.config.get("quantization_config", {}), dict):
        raise FormatError("config.json: quantization_config is not an object")
    model.check_config_types()


def _check_against_config(model: ModelSpec, source: Checkpoint, reader: sources.Reader, expert: Expert) -> None:
    """A config.json that disagrees with the tensors would make the converted model unloadable."""
    hidden, inter = model.value("hidden_size"), model.value("intermediate_size")
    for proj, parts in expert.parts.items():
        if "weight" not in parts:
            continue
        shape = reader.matrix_shape(source.info(parts["weight"]).spec.shape)
        expected = model.projection_shape(proj)
        if len(shape) != 2 or (shape[0], shape[1] * 2) != expected:
            raise FormatError(f"shape {list(shape)} does not match config.json ({model.config_key('hidden_size')}"
                              f"={hidden}, {model.config_key('intermediate_size')}={inter} give logical "
                              f"{list(expected)})", tensor=parts["weight"])
