"""What verify's checks share: the checkpoint under check and where findings go (`Context`), how
its routed experts are stored (`Layout`), and what the per-expert checks saw that the
checkpoint-wide rules need (`Observed`)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from requant.engines.check import MarlinSpan
from requant.experts import ExpertIndex
from requant.formats import Codec
from requant.io.checkpoint import Checkpoint, read_json
from requant.model import Expert, ModelSpec
from requant.verify.findings import Findings


@dataclass
class Context:
    ck: Checkpoint
    model: ModelSpec
    out: Findings
    # metadata files not (yet) on disk, by name: what a conversion is about to write beside its
    # shards (config.json, the index, hf_quant_config.json, requant.json), read before the disk's
    files: dict | None = None

    def side_file(self, name: str) -> dict | None:
        """A JSON file beside the shards (from `files` first), None when there is none;
        CheckpointError when it cannot be read."""
        if self.files is not None and name in self.files:
            return self.files[name]
        path = os.path.join(self.ck.path, name)
        return read_json(path) if os.path.exists(path) else None

    @functools.cached_property
    def experts(self) -> ExpertIndex:
        """The checkpoint's routed experts."""
        return ExpertIndex(self.model, self.ck)

    def where(self, expert: Expert, proj: str | None = None) -> str:
        """How findings name an expert, or a block's stacked experts (or one of its projections)."""
        return self.experts.where(expert, proj)

    def matrix_shape(self, tensor: str, codec: Codec) -> tuple:
        """A stored expert tensor of `codec` as one expert's matrix (stacked layouts drop dim 0)."""
        return self.experts.reader.matrix_shape(self.ck.info(tensor).spec.shape, codec.name)

    def logical_shape(self, proj: str) -> tuple[int, int]:
        """[out, K] of a projection, from config.json's sizes."""
        return self.model.projection_shape(proj)


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
