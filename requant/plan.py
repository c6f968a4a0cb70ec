"""Plan a conversion from metadata alone: every output shard, tensor, dtype, shape and byte count
is fixed before any tensor data is read."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from requant import formats, sources
from requant.experts import ExpertIndex
from requant.errors import FormatError, UnsupportedCheckpoint, UnsupportedError
from requant.io.checkpoint import Checkpoint
from requant.io.safetensors import Header, TensorSpec, encode_header
from requant.model import Expert, ModelSpec
from requant.targets import Options, Target, Unit, get_target


@dataclass
class ShardPlan:
    name: str
    units: list[Unit]
    # The source's file where it is this shard's output as it is (whole_file_output): whatever
    # its header's layout, nothing is written for it; None: requant writes the shard.
    source_file: Header | None = None

    @property
    def specs(self) -> list[TensorSpec]:
        return [s for u in self.units for s in u.outputs]

    @property
    def header(self) -> bytes:
        """The output file's header bytes (length prefix included)."""
        return self.source_file.raw if self.source_file else encode_header(self.specs)[0]

    @property
    def file_size(self) -> int:
        if self.source_file:
            return self.source_file.file_size
        return len(self.header) + sum(s.nbytes for s in self.specs)


def whole_file_output(header: Header, units: list[Unit]) -> bool:
    """Whether a source shard's file, as it is, is the output shard these units plan: each tensor
    passes through under its own name, dtype and shape (none renamed, converted, dropped or added),
    the tensors fill the data from its first byte to the file's end without a gap (requant reads
    gaps; safetensors 0.8 refuses them), and loaders take its __metadata__ as they take requant's
    own. How its header is laid out (key order, spacing, padding, other __metadata__ keys) does not
    matter: the index and config.json requant writes name only the tensors."""
    if any(u.encode is not None for u in units):
        return False
    planned = [(u.inputs, u.outputs) for u in units]
    if planned != [([name], [info.spec]) for name, info in header.tensors.items()]:
        return False
    ends = [header.data_start] + [info.end for info in header.tensors.values()]
    return (_loaders_take_metadata(header) and ends[-1] == header.file_size
            and all(info.start == end for info, end in zip(header.tensors.values(), ends)))


def _loaders_take_metadata(header: Header) -> bool:
    """__metadata__ as requant writes it ({"format": "pt"}, other strings beside it allowed) or none
    at all: safetensors refuses a value that is no string, and Transformers 4.57's load_state_dict
    a __metadata__ without format pt/tf/flax/mlx, an empty one too (modeling_utils.py:487)."""
    if header.metadata:
        return header.metadata.get("format") == "pt" and all(isinstance(v, str) for v in header.metadata.values())
    return json.loads(header.raw[8:]).get("__metadata__") is None   # absent or null, not {}


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
    model = ModelSpec.for_checkpoint(source, model=options.model, identify=True)
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
        check_against_config(model, source, index.reader, expert)
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
        header = source.headers[shard_name]
        verbatim = shard_name not in source.rewritten and whole_file_output(header, units)
        shards.append(ShardPlan(shard_name, units, header if verbatim else None))
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


def check_against_config(model: ModelSpec, source: Checkpoint, reader: sources.Reader, expert: Expert) -> None:
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
