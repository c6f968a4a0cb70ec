"""Where a checkpoint keeps its routed experts: one reader per storage layout a recipe names.

A reader turns tensor names into experts (`model.Expert`: each projection's tensors by codec part),
the unit the pipeline converts, verifies and compares, and says how a stored tensor looks as one
expert's matrix; nothing else needs to know how a layout spells or stacks an expert's tensors.
"""

from __future__ import annotations

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

    def matrix_shape(self, shape: tuple) -> tuple:
        """How a stored part looks as one expert's matrix (rows, columns): as stored."""
        return tuple(shape)

    def expert_count(self, expert: Expert, source) -> int:
        """How many experts the unit `expert` holds: one."""
        return 1


class StackedReader:
    """Each projection of a block is one tensor per part with every expert along dim 0 (gpt-oss:
    `model.layers.3.mlp.experts.gate_up_proj_blocks` [E, out, K/32, 16]); a block's stacked tensors
    are one unit (`Expert.expert` None). Parts are named by the recipe's `stacked_parts`."""

    def __init__(self, model: ModelSpec):
        self.model = model
        self.codec_part = {suffix: part for part, suffix in model.stacked_parts.items()}

    def experts(self, names) -> list[Expert]:
        """One unit per block holding routed experts, in order of first appearance."""
        units: dict[str, Expert] = {}
        for name in names:
            ref = self.model.expert_tensor(name)
            if ref is None:
                continue
            unit = units.setdefault(ref.block, Expert(ref.block, None, {}, {}))
            unit.parts.setdefault(ref.proj, {})[self.codec_part[ref.part]] = name
            unit.prefixes[ref.proj] = ref.prefix
        return list(units.values())

    def tensor_name(self, block: str, expert: None, proj: str, part: str) -> str:
        return f"{self.model.experts_module(block)}.{proj}_{self.model.stacked_parts[part]}"

    def matrix_shape(self, shape: tuple) -> tuple:
        """One expert's matrix of a stacked part: [E, rows, ...] -> (rows, the rest flattened)
        (MXFP4 blocks [E, out, K/32, 16] -> (out, K/2))."""
        columns = 1
        for size in shape[2:]:
            columns *= size
        return (shape[1], columns) if len(shape) > 2 else tuple(shape[1:])

    def expert_count(self, expert: Expert, source) -> int:
        """The experts stacked in the unit: dim 0 of its tensors."""
        first = next(iter(expert.parts[self.model.projections[0]].values()))
        return source.info(first).spec.shape[0]


Reader = PerExpertReader | StackedReader
READERS = {"per_expert": PerExpertReader, "stacked": StackedReader}


def reader(model: ModelSpec) -> Reader:
    """The reader of `model`'s expert layout."""
    layout = model.expert_layout
    if layout not in READERS:
        raise UnsupportedError(f"{model.name}: no reader for the expert layout {layout!r} "
                               f"(known: {', '.join(READERS)})")
    return READERS[layout](model)
