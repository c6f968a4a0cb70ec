"""What verify's checks share: the checkpoint under check and where findings go (`Context`), how
its routed experts are stored (`Layout`), and what the per-expert checks saw that the
checkpoint-wide rules need (`Observed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from requant.engine_check import MarlinSpan
from requant.formats import Codec
from requant.io.checkpoint import Checkpoint
from requant.model import Expert, ModelSpec
from requant.verify.findings import Findings


@dataclass
class Context:
    ck: Checkpoint
    model: ModelSpec
    out: Findings

    def where(self, expert: Expert, proj: str | None = None) -> str:
        """How findings name an expert (or one of its projections)."""
        name = f"{self.model.experts_module(expert.block)}.{expert.expert}"
        return f"{name}.{proj}" if proj else name

    def logical_shape(self, proj: str) -> tuple[int, int]:
        """[out, K] of a projection, from config.json's sizes."""
        hidden, inter = self.model.value("hidden_size"), self.model.value("intermediate_size")
        return (hidden, inter) if proj == self.model.down_projection else (inter, hidden)


@dataclass
class Layout:
    codecs_by_block: dict[str, Codec]    # each block's routed experts, by their most common format
    main: Codec                          # the main layers' format

    @property
    def formats_by_block(self) -> dict[str, str]:
        return {block: codec.name for block, codec in self.codecs_by_block.items()}


@dataclass
class Observed:
    spans: dict[tuple[str, str], MarlinSpan] = field(default_factory=dict)   # (block, fused group) -> block scales
    input_scales: dict[tuple[str, str], set[float]] = field(default_factory=dict)   # (block, proj) -> values
    group_sizes: set[int] = field(default_factory=set)   # the group sizes the scale shapes give
    zero_points: bool = False                            # any projection stores zero points
