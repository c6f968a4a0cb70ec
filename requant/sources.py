"""Where a checkpoint keeps its routed experts: one reader per storage layout a recipe names.

A reader turns tensor names into experts (`model.Expert`: each projection's tensors by codec part),
the unit the pipeline converts, verifies and compares, and says how a stored tensor looks as one
expert's matrix. The rest of requant reads experts through experts.ExpertIndex, built on these
readers, and never needs to know how a layout spells or stacks an expert's tensors.
"""

from __future__ import annotations

from collections.abc import Callable

from requant.errors import UnsupportedError
from requant.model import Expert, ModelSpec


class PerExpertReader:
    """Every projection of every expert is a tensor of its own (DeepSeek-V4:
    `layers.3.ffn.experts.7.w1.weight`), matched by the recipe's `routed_expert` pattern."""

    def __init__(self, model: ModelSpec):
        self.model = model

    def experts(self, names) -> list[Expert]:
        """The routed experts among `names`, in order of first appearance."""
        experts: dict[tuple[str, int], Expert] = {}
        for name in names:
            ref = self.model.expert_tensor(name)
            if ref is None:
                continue
            expert = experts.setdefault((ref.block, ref.expert), Expert(ref.block, ref.expert, {}, {}))
            expert.parts.setdefault(ref.proj, {})[ref.part] = name
            expert.prefixes[ref.proj] = ref.prefix
        return list(experts.values())

    def tensor_name(self, block: str, expert: int, proj: str, part: str) -> str:
        return f"{self.model.experts_module(block)}.{expert}.{proj}.{part}"

    def matrix_shape(self, shape: tuple, fmt: str | None = None) -> tuple:
        """How a stored part looks as one expert's matrix (rows, columns): as stored."""
        return tuple(shape)

    def unit_shape(self, shape: tuple) -> tuple:
        """How a stored part looks as the matrix the unit converts: as stored."""
        return tuple(shape)

    def output(self, expert: Expert, proj: str, part: str, fmt: str, source) -> tuple[str, Callable]:
        """(name, shape or tensor -> as stored) of a converted part: `<prefix>.<part>`, as encoded."""
        return f"{expert.prefixes[proj]}.{part}", lambda x: x

    def expert_count(self, expert: Expert, source) -> int:
        """How many experts the unit `expert` holds: one."""
        return 1


class StackedReader:
    """Each projection of a block is one tensor per part with every expert along dim 0 (gpt-oss:
    `model.layers.3.mlp.experts.gate_up_proj_blocks` [E, out, K/32, 16]); a block's stacked tensors
    are one unit (`Expert.expert` None). Parts are named by the recipe's `stacked_parts`."""

    def __init__(self, model: ModelSpec):
        self.model = model
        # the release's suffixes; a converted output's parts go by the codec's own names, and its
        # weight by the projection's name alone (recipe `stacked_outputs`)
        self.codec_part = {suffix: part for part, suffix in model.stacked_parts.items()} | {"": "weight"}

    def experts(self, names) -> list[Expert]:
        """One unit per block holding routed experts, in order of first appearance."""
        units: dict[str, Expert] = {}
        for name in names:
            ref = self.model.expert_tensor(name)
            if ref is None:
                continue
            unit = units.setdefault(ref.block, Expert(ref.block, None, {}, {}))
            unit.parts.setdefault(ref.proj, {})[self.codec_part.get(ref.part, ref.part)] = name
            unit.prefixes[ref.proj] = ref.prefix
        return list(units.values())

    def tensor_name(self, block: str, expert: None, proj: str, part: str) -> str:
        return f"{self.model.experts_module(block)}.{proj}_{self.model.stacked_parts[part]}"

    def matrix_shape(self, shape: tuple, fmt: str | None = None) -> tuple:
        """One expert's matrix of a stacked part: [E, rows, ...] -> (rows, the rest flattened)
        (MXFP4 blocks [E, out, K/32, 16] -> (out, K/2)); a converted `fmt` part that the recipe
        stores transposed ((E, in, out), ModelOpt) is read back as (out, in)."""
        if len(shape) < 3:
            return tuple(shape[1:])
        columns = 1
        for size in shape[2:]:
            columns *= size
        if fmt is not None and self.model.stored_transposed(fmt):
            return (columns, shape[1])
        return (shape[1], columns)

    def as_matrices(self, t, fmt: str):
        """A stacked part read as [E, rows, columns] in the codec's (out, in) orientation (a view);
        a per-tensor scalar (ModelOpt's weight_scale_2) stays as it is."""
        if t.dim() < 2:
            return t
        t = t.reshape(t.shape[0], t.shape[1], -1)
        return t.transpose(1, 2) if self.model.stored_transposed(fmt) else t

    def unit_shape(self, shape: tuple) -> tuple:
        """The unit's matrix of a stacked part: every expert's rows one after the other
        ([E, out, K/32, 16] -> (E*out, K/2)); a conversion over it sees the whole stacked tensor,
        as ModelOpt's cast does (one global scale per stacked tensor)."""
        rows, columns = self.matrix_shape(shape)
        return (shape[0] * rows, columns)

    def output(self, expert: Expert, proj: str, part: str, fmt: str, source) -> tuple[str, Callable]:
        """(name, shape or tensor -> as stored) of a converted part, as the recipe's
        `stacked_outputs` for `fmt` lays it out: named from the projection (ModelOpt's export: the
        weight is `<proj>`, the rest `<proj>_<part>`) and, where `transpose`, each expert's matrix
        stored (in, out) as the engine's module holds it."""
        layout = self.model.stacked_output(fmt)
        names = layout["names"]
        name = names.get(part, names["*"]).format(prefix=expert.prefixes[proj], part=part)
        experts = self.expert_count(expert, source)
        return name, lambda x: _stored(x, experts, layout["transpose"])

    def expert_count(self, expert: Expert, source) -> int:
        """The experts stacked in the unit: dim 0 of its tensors."""
        first = next(iter(expert.parts[self.model.projections[0]].values()))
        return source.info(first).spec.shape[0]


def _stored(x, experts: int, transpose: bool):
    """A unit's (E*rows, columns) matrix, or its shape, as [E, rows, columns], transposed per expert
    when asked; scalars stay as they are."""
    shape = tuple(x) if isinstance(x, tuple) else tuple(x.shape)
    if len(shape) < 2:
        return x
    stacked = (experts, shape[0] // experts, shape[1])
    if isinstance(x, tuple):
        return (stacked[0], stacked[2], stacked[1]) if transpose else stacked
    x = x.reshape(stacked)
    return x.transpose(1, 2).contiguous() if transpose else x


Reader = PerExpertReader | StackedReader
READERS = {"per_expert": PerExpertReader, "stacked": StackedReader}


def reader(model: ModelSpec) -> Reader:
    """The reader of `model`'s expert layout."""
    layout = model.expert_layout
    if layout not in READERS:
        raise UnsupportedError(f"{model.name}: no reader for the expert layout {layout!r} "
                               f"(known: {', '.join(READERS)})")
    return READERS[layout](model)
