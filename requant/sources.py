"""Where a checkpoint keeps its routed experts: one reader per storage layout a recipe names.

A reader turns tensor names into experts (`model.Expert`: each projection's tensors by part), the
unit the pipeline converts, verifies and compares; nothing else needs to know how a layout spells
an expert's tensors.
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


READERS = {"per_expert": PerExpertReader}


def reader(model: ModelSpec) -> PerExpertReader:
    """The reader of `model`'s expert layout."""
    layout = model.expert_layout
    if layout not in READERS:
        raise UnsupportedError(f"{model.name}: no reader for the expert layout {layout!r} "
                               f"(known: {', '.join(READERS)})")
    return READERS[layout](model)
