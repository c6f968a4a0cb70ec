"""One view of a checkpoint's routed experts (`ExpertIndex`): per block, its kind, its format, its
units and their tensor names, and reads of any part as [E, rows, columns] whatever the layout.

A recipe lays experts out one tensor per expert and projection (DeepSeek-V4) or stacked, every
expert of a block in one tensor per part (gpt-oss); sources.py reads each layout's names. This is
the one module that tells the two apart: verify, report, validate, plan and the card ask it
which experts there are, in what format, and for their tensors, and never branch on the layout.
Block kinds ("layer", "mtp", a drafter's) are the recipe's `blocks`; only "layer" blocks are the
model's main layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from requant import formats, sources
from requant.errors import FormatError
from requant.model import ABSENT, MAIN_KIND, Expert, ModelSpec, config_value

T = TypeVar("T")


@dataclass
class Block:
    """The routed experts of one block."""

    name: str                    # e.g. "layers.3", "mtp.0"
    kind: str                    # the recipe's block kind
    units: list[Expert]          # what is read, converted and checked together: an expert, or the
                                 # block's stacked tensors (one unit holding every expert)
    codec: formats.Codec | None  # the most common format among the units' projections
    count: int                   # experts the block holds
    indices: list[int]           # their numbers, in the order the units hold them
    _stacked: bool
    _index: "ExpertIndex"

    def __post_init__(self):
        self._by_number = {u.expert: u for u in self.units}

    @property
    def main(self) -> bool:
        """A main layer (not an MTP or drafter block)."""
        return self.kind == MAIN_KIND

    def missing(self, expected: int) -> list[int]:
        """Expert numbers below `expected` the block has no tensors for."""
        present = set(self.indices)
        return [i for i in range(expected) if i not in present]

    def extra(self, expected: int) -> list[int]:
        """Expert numbers at or beyond `expected`."""
        return sorted(i for i in self.indices if i >= expected)

    def unit_of(self, expert: int) -> Expert | None:
        """The unit holding expert number `expert`."""
        if self._stacked:
            return self.units[0] if 0 <= expert < self.count else None
        return self._by_number.get(expert)

    def part_names(self, proj: str) -> dict[str, str]:
        """Part -> tensor name of `proj` in the block's first unit (stacked: the one unit)."""
        return self.units[0].parts.get(proj, {}) if self.units else {}

    def read(self, proj: str, part: str, experts: Sequence[int], fmt: str) -> torch.Tensor | None:
        """Part `part` (a codec suffix, or a carried part such as "bias") of projection `proj` of
        the listed experts: [len(experts), rows, columns] as each expert's matrix in the codec's
        (out, in) orientation ([len(experts), rows] for a vector per expert such as a bias;
        [len(experts)] for a per-tensor scalar); None where the block
        stores no such part. A stacked block's tensor is read once for all the listed experts."""
        ck = self._index.ck
        if self._stacked:
            name = self.units[0].parts.get(proj, {}).get(part)
            if name is None:
                return None
            t = ck.tensor(name)
            if t.dim() < 2:   # one scalar for the whole stacked tensor
                return t.reshape(-1)[:1].expand(len(experts))
            if t.dim() > 2:   # matrices; a [E, rows] tensor (a bias) is one vector per expert
                t = self._index.reader.as_matrices(t, fmt)
            return t.index_select(0, torch.as_tensor(list(experts))).contiguous()
        units = [self.unit_of(e) for e in experts]
        if None in units:
            missing = experts[units.index(None)]
            raise FormatError(f"{self._index.model.experts_module(self.name)}.{missing}: routed expert has no tensors")
        names = [u.parts.get(proj, {}).get(part) for u in units]
        if None in names:
            return None
        return torch.stack([ck.tensor(n) for n in names])

    def reader_by_expert(self, load: Callable[[list[int]], T], pick: Callable[[T, int], T]) -> Callable[[int], T]:
        """e -> pick(load(experts), position of e): per-expert tensors are loaded when an expert is
        first asked for, a stacked block's all at once (each of its tensors holds every expert)."""
        if self._stacked:
            everything = load(list(range(self.count)))
            return lambda e: pick(everything, e)
        return lambda e: pick(load([e]), 0)

    def matrices(self, unit: Expert, proj: str, codec: formats.Codec) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """(expert number, its decoded parts as that expert's matrices) for every expert `unit` (one
        of this block's) holds; a stacked unit's tensors are read once."""
        tensors = {p: self._index.ck.tensor(n) for p, n in unit.parts[proj].items() if p in codec.decoded_parts}
        if not self._stacked:
            return [(unit.expert, tensors)]
        tensors = {p: self._index.reader.as_matrices(t, codec.name) for p, t in tensors.items()}
        experts = next(t for t in tensors.values() if t.dim() == 3).shape[0]
        return [(e, {p: t[e] if t.dim() == 3 else t for p, t in tensors.items()}) for e in range(experts)]


class ExpertIndex:
    """A checkpoint's routed experts by block, from its tensor names and headers (no data read).

    `ck` needs `names`, `info(name)` and, for reads, `tensor(name)` (io.checkpoint.Checkpoint)."""

    def __init__(self, model: ModelSpec, ck):
        self.model, self.ck = model, ck
        self.reader = sources.reader(model)
        self._stacked = isinstance(self.reader, sources.StackedReader)
        self.units: list[Expert] = self.reader.experts(ck.names)   # in order of first appearance
        self._codecs = {(id(u), proj): self._identify(parts) for u in self.units for proj, parts in u.parts.items()}
        by_block: dict[str, list[Expert]] = {}
        for unit in self.units:
            by_block.setdefault(unit.block, []).append(unit)
        self.blocks: dict[str, Block] = {name: self._block(name, units) for name, units in by_block.items()}
        self._keys = {(u.block, u.expert): u for u in self.units}

    def _identify(self, parts: dict[str, str]) -> formats.Codec | None:
        return formats.identify({p: self.ck.info(n).spec.dtype for p, n in parts.items()})

    def _block(self, name: str, units: list[Expert]) -> Block:
        counted = Counter(self._codecs[(id(u), p)] for u in units for p in u.parts)
        codec = counted.most_common(1)[0][0]
        if self._stacked:
            count = self.reader.expert_count(units[0], self.ck)
            indices = list(range(count))
        else:
            indices = [u.expert for u in units]
            count = len(indices)
        return Block(name, self.model.block_kind(name), units, codec, count, indices, self._stacked, self)

    def __bool__(self) -> bool:
        return bool(self.units)

    @property
    def main_codec(self) -> formats.Codec | None:
        """The main layers' format: the most common among their projections (every block's where
        the checkpoint has no main layer)."""
        main = [b for b in self.blocks.values() if b.main] or list(self.blocks.values())
        counted = Counter(c for b in main for u in b.units for p in u.parts if (c := self._codecs[(id(u), p)]))
        return counted.most_common(1)[0][0] if counted else None

    def codec_by_block(self) -> dict[str, formats.Codec]:
        """Each block's format; a block in no known format gets the main layers'."""
        main = self.main_codec
        return {name: block.codec or main for name, block in self.blocks.items()}

    def codec_of(self, unit: Expert, proj: str) -> formats.Codec | None:
        """The format of one projection of a unit of this index."""
        return self._codecs.get((id(unit), proj))

    def in_order(self) -> list[str]:
        """Block names in layer order, the MTP and drafter blocks last."""
        return sorted(self.blocks, key=self.model.block_position)

    def drafter_blocks(self) -> list[str]:
        """Blocks with routed experts that are not main layers (MTP, drafters), in layer order."""
        return [b for b in self.in_order() if not self.blocks[b].main]

    def unit(self, block: str, key: int | None) -> Expert | None:
        """The unit of `block` named by `key` (a unit's own `expert` field, from an index of a
        checkpoint with the same layout)."""
        return self._keys.get((block, key))

    def key(self, unit: Expert) -> tuple[str, int | None]:
        """A unit's name in every index of the same model: (block, its key)."""
        return unit.block, unit.expert

    def where(self, unit: Expert, proj: str | None = None) -> str:
        """How messages name a unit: an expert module (`layers.3.ffn.experts.7`), or a block's
        stacked experts (`model.layers.3.mlp.experts`); with `proj`, one of its projections."""
        name = self.model.experts_module(unit.block)
        if not self._stacked:
            name = f"{name}.{unit.expert}"
        return f"{name}.{proj}" if proj else name


def model_difference(a: ExpertIndex, b: ExpertIndex) -> str | None:
    """None when the checkpoints of `a` and `b` are the same model, in any expert format: the same
    model_type and architectures, the same values of every config key its recipe reads (dims,
    expert counts, layers) and the vocabulary, and the same modules outside the routed experts (a
    conversion may rename a module's parts, e.g. an FP8 scale, never the modules). Otherwise one
    phrase saying what differs, the first few names at most."""
    keys = ["model_type", "architectures", "vocab_size", *a.model.recipe.config_keys.values(),
            *(k for own in a.model.recipe.block_config_keys.values() for k in own.values())]
    for key in dict.fromkeys(keys):
        va, vb = config_value(a.model.config, key), config_value(b.model.config, key)
        if va != vb:
            return f"config.json's {key} differs: {_shown(va)} vs {_shown(vb)}"
    ma, mb = _other_modules(a), _other_modules(b)
    if ma != mb:
        sides = [(n, sorted(m)) for n, m in (("first only", ma - mb), ("second only", mb - ma)) if m]
        return "the modules outside the routed experts differ: " + "; ".join(
            f"{n}: {', '.join(ms[:3])}" + (f" and {len(ms) - 3} more" if len(ms) > 3 else "") for n, ms in sides)
    return None


def _shown(value) -> str:
    return "absent" if value is ABSENT else repr(value)


def _other_modules(index: ExpertIndex) -> set[str]:
    """The modules (a tensor name less its last part) of every tensor that is no routed expert's."""
    experts = {n for u in index.units for parts in u.parts.values() for n in parts.values()}
    return {n.rsplit(".", 1)[0] for n in index.ck.names if n not in experts}
