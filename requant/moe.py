"""Plain torch reference of one MoE layer: router, routed experts and shared expert.

The router and the experts' activation are the kinds a recipe names (model.ModelSpec.router() and
.activation()): DeepSeek-V4's ("sqrtsoftplus", "swiglu_clamp"; docs/formats.md, DeepSeek-V4 MoE forward) and
gpt-oss' ("softmax_topk", "swiglu_oai"). Works on dequantized float weights and computes in FP32;
written from the models' definitions, independently of the Triton kernel, so that it can judge it.
Activations stay BF16/FP32 (no FP8 activation rounding), as on Hopper serving engines.

An expert is its weights (gate [I, H], up [I, H], down [H, I]), optionally followed by its biases
(gate [I], up [I], down [H]); the down bias is added before the routing weight scales the output.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from requant.errors import FormatError, UnsupportedError

ExpertFn = Callable[[int], tuple[torch.Tensor, ...]]
Intermediate = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation: h = act(x @ gate.T, x @ up.T)."""

    kind: str
    limit: float
    alpha: float | None = None   # swiglu_oai's sigmoid slope

    def __post_init__(self):
        if self.kind not in _ACTIVATIONS:
            raise UnsupportedError(f"activation {self.kind!r} has no torch reference (known: {', '.join(_ACTIVATIONS)})")
        if (self.kind == "swiglu_oai") != (self.alpha is not None):
            raise ValueError(f"activation {self.kind!r}: alpha is swiglu_oai's sigmoid slope, given with it and only then")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _ACTIVATIONS[self.kind][0](self, gate, up)

    def bound(self) -> float:
        """The largest |h| the activation can give (both clamps bind)."""
        return _ACTIVATIONS[self.kind][1](self)


def _swiglu_clamp(act: Activation, gate, up):
    """DeepSeek-V4: silu(min(gate, L)) * clamp(up, -L, L)."""
    return F.silu(gate.clamp(max=act.limit)) * up.clamp(-act.limit, act.limit)


def _swiglu_oai(act: Activation, gate, up):
    """gpt-oss: g = min(gate, L), u = clamp(up, -L, L), (u + 1) * g * sigmoid(alpha * g)."""
    gate = gate.clamp(max=act.limit)
    up = up.clamp(-act.limit, act.limit)
    return (up + 1) * gate * torch.sigmoid(act.alpha * gate)


_ACTIVATIONS = {
    "swiglu_clamp": (_swiglu_clamp, lambda a: a.limit * a.limit / (1 + math.exp(-a.limit))),
    "swiglu_oai": (_swiglu_oai, lambda a: (a.limit + 1) * a.limit / (1 + math.exp(-a.alpha * a.limit))),
}


def activation(spec: dict) -> Activation:
    """An Activation from the recipe's description (model.ModelSpec.activation())."""
    return Activation(**spec)


@dataclass(frozen=True)
class Router:
    kind: str
    top_k: int
    scaling_factor: float = 1.0


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    intermediate_size: int
    n_routed_experts: int
    router: Router
    activation: Activation

    @classmethod
    def from_model(cls, model, block: str | None = None) -> "MoEConfig":
        """From a model.ModelSpec: its recipe's router and activation, its config's dimensions; those
        of `block`'s kind where given (a drafter may have its own expert count and top-k: V4.1's)."""
        router = model.router(block)
        if router["kind"] not in _ROUTERS:
            raise UnsupportedError(f"router {router['kind']!r} has no torch reference (known: {', '.join(_ROUTERS)})")
        return cls(int(model.value("hidden_size")), int(model.value("intermediate_size")),
                   int(model.value("num_experts", block)), Router(**router), activation(model.activation()))


@dataclass
class MoELayer:
    gate_weight: torch.Tensor               # router [E, H]
    gate_bias: torch.Tensor | None          # router bias [E] float32 (sqrtsoftplus: non-hash layers)
    tid2eid: torch.Tensor | None            # [vocab, top_k] int64, hash-routed layers (sqrtsoftplus)
    experts: ExpertFn                       # e -> float (gate, up, down[, gate bias, up bias, down bias])
    shared: tuple[torch.Tensor, ...] | None = None  # float, as an expert


def _route_sqrtsoftplus(x, layer: MoELayer, router: Router, token_ids):
    """DeepSeek-V4: scores sqrt(softplus(logits)); the bias (or, in hash layers, the token's row of
    tid2eid) chooses the experts, the unbiased scores of the chosen ones, normalised and times the
    routed scaling factor, weigh them."""
    logits = x.float() @ layer.gate_weight.float().T
    scores = torch.sqrt(F.softplus(logits))
    if layer.tid2eid is not None:
        if token_ids is None:
            raise ValueError("a hash-routed layer needs the token ids")
        ids = layer.tid2eid[token_ids.long()].long()
    else:
        if layer.gate_bias is None:
            raise FormatError("a non-hash layer needs gate.bias")
        ids = (scores + layer.gate_bias.float()).topk(router.top_k, dim=-1).indices
    chosen = scores.gather(1, ids)
    return ids, chosen / chosen.sum(-1, keepdim=True) * router.scaling_factor


def _route_softmax_topk(x, layer: MoELayer, router: Router, token_ids):
    """gpt-oss: logits = x W^T + b; the top-k logits choose the experts, a softmax over those k
    gives their weights."""
    logits = x.float() @ layer.gate_weight.float().T
    if layer.gate_bias is not None:
        logits = logits + layer.gate_bias.float()
    top = logits.topk(router.top_k, dim=-1)
    return top.indices, torch.softmax(top.values, dim=-1) * router.scaling_factor


_ROUTERS = {"sqrtsoftplus": _route_sqrtsoftplus, "softmax_topk": _route_softmax_topk}


def route(x: torch.Tensor, layer: MoELayer, cfg: MoEConfig,
          token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, top_k] int64, routing weights [T, top_k] float32)."""
    return _ROUTERS[cfg.router.kind](x, layer, cfg.router, token_ids)


def expert_forward(x: torch.Tensor, expert: tuple[torch.Tensor, ...], act: Activation,
                   intermediate: Intermediate | None = None) -> torch.Tensor:
    """One expert on x [T, H]; `intermediate` sees (and may replace) the down projection's input."""
    gate_w, up_w, down_w, *biases = expert
    gate_b, up_b, down_b = biases or (None, None, None)
    gate, up = x @ gate_w.T, x @ up_w.T
    if gate_b is not None:
        gate, up = gate + gate_b, up + up_b
    h = act(gate, up)
    y = (h if intermediate is None else intermediate(h)) @ down_w.T
    return y if down_b is None else y + down_b


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertFn,
                   act: Activation, intermediate: Intermediate | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) in FP32, one expert at a time.
    `intermediate` sees (and may replace) each expert's input to its down projection."""
    return routed_experts_variants([(x, intermediate)], ids, weights, experts, act)[0]


def routed_experts_variants(inputs: list[tuple[torch.Tensor, Intermediate | None]], ids: torch.Tensor,
                            weights: torch.Tensor, experts: ExpertFn, act: Activation,
                            workers: int = 1) -> list[torch.Tensor]:
    """routed_experts for several (x, intermediate) variants of the same tokens and routing, each
    expert fetched once for all of them (fetching, i.e. reading and decoding, is the cost on a
    CPU). `workers` threads fetch and compute experts side by side; their contributions are
    summed in expert order, so the result does not depend on the thread count."""
    ys = [torch.zeros_like(x, dtype=torch.float32) for x, _ in inputs]

    def contribution(e: int):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        expert = tuple(w.float() for w in experts(e))
        scale = weights[rows, slots, None]
        return rows, [expert_forward(x.float()[rows], expert, act, hook) * scale for x, hook in inputs]

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for rows, parts in pool.map(contribution, ids.unique().tolist()):
            for y, part in zip(ys, parts):
                y.index_add_(0, rows, part)
    return ys


def moe_forward(x: torch.Tensor, layer: MoELayer, cfg: MoEConfig,
                token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [T, H] float32 = routed + shared expert, expert ids, routing weights)."""
    ids, weights = route(x, layer, cfg, token_ids)
    y = routed_experts(x, ids, weights, layer.experts, cfg.activation)
    if layer.shared is not None:
        y += expert_forward(x.float(), tuple(w.float() for w in layer.shared), cfg.activation)
    return y, ids, weights
