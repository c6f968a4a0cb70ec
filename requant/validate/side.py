"""One checkpoint of the two validate compares (`Side`): its model, its routed experts as the
kernel and the torch reference take them, its router and shared expert, and the inputs a layer sees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from requant import formats
from requant.errors import FormatError, RequantError, UnsupportedError
from requant.experts import ExpertIndex
from requant.formats import fp8_block
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.moe import MoELayer

ROLES = ("gate", "up", "down")
_BYTE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu)


class Side:
    """One of the two checkpoints, with its model and its routed experts (`index`)."""

    def __init__(self, ck: Checkpoint, where: str):
        self.ck = ck
        self.model = ModelSpec.for_checkpoint(ck, where)
        self.index = ExpertIndex(self.model, ck)

    def moe_blocks(self) -> list[str]:
        """Blocks with a router and routed experts, in layer order (the MTP blocks last)."""
        names = set(self.ck.names)
        return [b for b in self.index.in_order() if self.model.router_tensor(b, "weight") in names]


def kernel_format(side: Side, block: str) -> str:
    """Format of a block's routed experts, as the kernel names it."""
    found = side.index.blocks.get(block)
    if found is None or found.codec is None:
        raise UnsupportedError(f"{block}: routed experts in no format requant's kernel reads")
    return found.codec.name


def dense_expert(w, e: int) -> torch.Tensor:
    """Float32 [N, K] of expert e by requant's plain torch decoders (independent of the kernel)."""
    codec = formats.get(w.format)
    stored = {formats.WEIGHT: w.packed, formats.SCALE: w.scale, formats.GLOBAL_SCALE: w.global_scale,
              formats.ZERO_POINT: w.zero_point}
    return codec.decode({codec.part(role).suffix: t[e] for role, t in stored.items() if t is not None})


@dataclass
class LayerExperts:
    """A layer's routed experts as the kernel and the reference take them: gate, up and down
    projections stacked over experts, per-expert biases where the model has them."""

    gate: object                 # kernels.weights.ExpertWeights
    up: object
    down: object
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # [E, I], [E, I], [E, H]
    fused: list[list[str]]       # groups of ROLES engines load as one tensor (one Marlin factor each)

    @property
    def weights(self) -> list:
        return [self.gate, self.up, self.down]

    def with_weights(self, weights: dict) -> "LayerExperts":
        return LayerExperts(*(weights[r] for r in ROLES), self.biases, self.fused)

    def expert(self, e: int) -> "LayerExperts":
        """Expert e alone, as views."""
        from requant.kernels.weights import ExpertWeights

        def one(t):
            return None if t is None else t[e:e + 1]

        return LayerExperts(*(ExpertWeights(w.format, *(one(t) for t in (w.packed, w.scale, w.global_scale, w.zero_point)))
                              for w in self.weights),
                            None if self.biases is None else tuple(one(b) for b in self.biases), self.fused)

    def dense(self, e: int) -> tuple[torch.Tensor, ...]:
        """Float32 (gate, up, down[, their biases]) of expert e, decoded by the plain torch decoders."""
        found = tuple(dense_expert(w, e) for w in self.weights)
        return found + tuple(b[e].float() for b in self.biases) if self.biases else found

    def kernel_biases(self) -> dict:
        return dict(zip(("b1", "b3", "b2"), self.biases)) if self.biases else {}


def fused_roles(side: Side) -> list[list[str]]:
    """Groups of ROLES engines load as one tensor: gate and up where one interleaved projection
    holds both, else the recipe's fused projections."""
    if side.model.interleaved_gate_up is not None:
        return [["gate", "up"]]
    role = dict(zip(side.model.projections, ROLES))
    return [[role[p] for p in group] for group in side.model.fused_projections]


def _by_role(model: ModelSpec, by_proj: dict[str, object], split: Callable[[object, int], object]) -> dict[str, object]:
    """role -> value from projection -> value: an interleaved gate/up projection split by rows
    (`split(value, 0)` the even rows, gate; `split(value, 1)` the odd ones, up)."""
    if model.interleaved_gate_up is None:
        return dict(zip(ROLES, (by_proj[p] for p in model.projections)))
    gate_up = by_proj[model.interleaved_gate_up]
    return {"gate": split(gate_up, 0), "up": split(gate_up, 1), "down": by_proj[model.down_projection]}


def layer_scales(side: Side, block: str, fmt: str) -> dict[str, torch.Tensor]:
    """role -> the block scales of every expert of a block [E, N, K/g] as stored (bytes where
    byte-coded), without reading the weights: all a layer-wide scale rule (Marlin's) needs."""
    found = side.index.blocks[block]
    suffix = formats.get(fmt).part(formats.SCALE).suffix
    experts = list(range(int(side.model.value("num_experts", block))))
    by_proj = {p: found.read(p, suffix, experts, fmt) for p in side.model.projections}
    scales = _by_role(side.model, by_proj, lambda t, i: t[:, i::2])
    return {r: t.view(torch.uint8) if t.dtype in _BYTE_DTYPES else t for r, t in scales.items()}


def load_layer(side: Side, block: str, fmt: str, experts: int | list[int], device) -> LayerExperts:
    """Every (or the listed) routed expert of a block, as stored, on `device`."""
    model = side.model
    found = side.index.blocks[block]
    chosen = list(range(experts)) if isinstance(experts, int) else list(experts)
    codec = formats.get(fmt)

    def weights(proj):
        def read(role):
            part = codec.part(role)
            return None if part is None else found.read(proj, part.suffix, chosen, fmt)
        where = found.part_names(proj).get(codec.part(formats.SCALE).suffix, f"{block}.{proj}")
        return _expert_weights(codec, read, len(chosen), where, device)

    ws = _by_role(model, {p: weights(p) for p in model.projections},
                  lambda w, i: type(w)(w.format, w.packed[:, i::2], w.scale[:, i::2], w.global_scale))  # row views
    biases = {p: found.read(p, "bias", chosen, fmt) for p in model.projections}
    if all(b is None for b in biases.values()):
        bias = None
    else:
        by_role = _by_role(model, biases, lambda b, i: b[:, i::2])
        bias = tuple(by_role[r].float().to(device) for r in ROLES)
    return LayerExperts(*(ws[r] for r in ROLES), bias, fused_roles(side))


def _expert_weights(codec, read, experts: int, where: str, device):
    """ExpertWeights from `read(role)`: that part of every expert stacked on dim 0 as stored (None:
    absent); byte-coded parts viewed as bytes, their scales checked."""
    from requant.kernels.weights import ExpertWeights

    def part(role):
        t = read(role)
        return t.view(torch.uint8) if t is not None and t.dtype in _BYTE_DTYPES else t

    scale = part(formats.SCALE)
    if scale.dtype == torch.uint8:   # byte-coded scales (E8M0, E4M3) can hold bytes no valid file has
        try:
            codec.check_scales(scale.numpy())
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
    global_scale, zero_point = part(formats.GLOBAL_SCALE), part(formats.ZERO_POINT)
    return ExpertWeights(codec.name, part(formats.WEIGHT).view(codec.packed_dtype).to(device), scale.to(device),
                         None if global_scale is None else global_scale.reshape(experts).float().contiguous().to(device),
                         None if zero_point is None else zero_point.to(device))


def reference_layer(side: Side, block: str, fmt: str) -> Callable[[int], LayerExperts]:
    """e -> a LayerExperts whose expert 0 is expert e as stored, read when first needed."""
    return side.index.blocks[block].reader_by_expert(lambda chosen: load_layer(side, block, fmt, chosen, "cpu"),
                                                     LayerExperts.expert)


def reference_experts(side: Side, block: str, fmt: str):
    """e -> float32 (gate, up, down[, biases]) of expert e, read and decoded when first asked for."""
    stored = reference_layer(side, block, fmt)
    return lambda e: stored(e).dense(0)


def written_input_scales(side: Side, block: str) -> tuple[float, float] | None:
    """(gate/up input_scale, down input_scale) as engines load them: the largest over the layer's
    experts (and over gate and up, which see the same input); None when the checkpoint writes none."""
    found = []
    units = side.index.blocks[block].units
    down = side.model.down_projection
    for projs in ([p for p in side.model.projections if p != down], [down]):
        if not all("input_scale" in u.parts.get(p, {}) for u in units for p in projs):
            return None
        found.append(max(float(side.ck.tensor(u.parts[p]["input_scale"]).float().max()) for u in units for p in projs))
    return found[0], found[1]


def _shared(side: Side, block: str, device):
    names = set(side.ck.names)
    bases = [side.model.shared_expert(block, p) for p in side.model.projections]
    if bases[0] is None or f"{bases[0]}.weight" not in names:
        return None

    def scale(base):  # W4A16 output keeps these FP8 blocks but names their scales compressed-tensors' way
        return side.ck.tensor(f"{base}.scale" if f"{base}.scale" in names else f"{base}.weight_scale")

    return tuple(fp8_block.decode(side.ck.tensor(f"{base}.weight"), scale(base)).to(device) for base in bases)


def router(side: Side, block: str, device) -> MoELayer:
    names = set(side.ck.names)
    found = {role: side.ck.tensor(n).to(device) for role in side.model.router_roles
             if (n := side.model.router_tensor(block, role)) in names}
    return MoELayer(found.get("weight"), found.get("bias"), found.get("token_table"), experts=None,
                    shared=_shared(side, block, device))


def hidden_states(ck: Checkpoint, block: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """RMS-normalised Gaussian vectors times the block's MoE input norm weight: what the MoE sees, in BF16."""
    model = ModelSpec.for_config(ck.config)
    x = torch.randn(tokens, int(model.value("hidden_size")), generator=gen)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    norm = model.moe_input_norm(block)
    if norm in set(ck.names):
        x = x * ck.tensor(norm).float()
    return x.bfloat16()


def load_activations(path: str) -> dict[str, torch.Tensor]:
    """A safetensors or torch file: one [T, H] tensor for every layer, or tensors named by block
    (`layers.3`, `mtp.0`); an optional `token_ids` [T] feeds hash-routed layers."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        data = load_file(path)
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
        data = data if isinstance(data, dict) else {"hidden_states": data}
    if not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise RequantError("activations file holds no tensors", file=path)
    return data


def is_block_name(model: ModelSpec, name: str) -> bool:
    try:
        model.block_position(name)
    except FormatError:
        return False
    return True
