"""Plain torch reference of one DeepSeek-V4-Flash MoE layer (docs/formats.md section 4).

Works on dequantized float weights and computes in FP32; written from the model's definition,
independently of the Triton kernel, so that it can judge it. Activations stay BF16/FP32 (no FP8
activation rounding), as on Hopper serving engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from requant.errors import FormatError

ExpertFn = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Intermediate = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    intermediate_size: int
    n_routed_experts: int
    top_k: int
    routed_scaling_factor: float
    swiglu_limit: float
    num_hash_layers: int

    @classmethod
    def from_config(cls, config: dict) -> "MoEConfig":
        try:
            return cls(
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["moe_intermediate_size"]),
                n_routed_experts=int(config["n_routed_experts"]),
                top_k=int(config["num_experts_per_tok"]),
                routed_scaling_factor=float(config["routed_scaling_factor"]),
                swiglu_limit=float(config["swiglu_limit"]),
                num_hash_layers=int(config.get("num_hash_layers", 0)),
            )
        except KeyError as e:
            raise FormatError(f"config.json lacks {e.args[0]!r}, needed for the MoE forward") from None


@dataclass
class MoELayer:
    gate_weight: torch.Tensor               # [E, H]
    gate_bias: torch.Tensor | None          # [E] float32, non-hash layers
    tid2eid: torch.Tensor | None            # [vocab, top_k] int64, hash layers
    experts: ExpertFn                       # e -> float (w1 [I, H], w3 [I, H], w2 [H, I])
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # float (w1, w3, w2)


def route(x: torch.Tensor, layer: MoELayer, cfg: MoEConfig,
          token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, top_k] int64, routing weights [T, top_k] float32)."""
    logits = x.float() @ layer.gate_weight.float().T
    scores = torch.sqrt(F.softplus(logits))
    if layer.tid2eid is not None:
        if token_ids is None:
            raise ValueError("a hash-routed layer needs the token ids")
        ids = layer.tid2eid[token_ids.long()].long()
    else:
        if layer.gate_bias is None:
            raise FormatError("a non-hash layer needs gate.bias")
        # The bias only chooses the experts; the weights use the unbiased scores.
        ids = (scores + layer.gate_bias.float()).topk(cfg.top_k, dim=-1).indices
    chosen = scores.gather(1, ids)
    weights = chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    return ids, weights


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                  limit: float, intermediate: Intermediate | None = None) -> torch.Tensor:
    gate = (x @ w1.T).clamp(max=limit)
    up = (x @ w3.T).clamp(-limit, limit)
    h = F.silu(gate) * up
    return (h if intermediate is None else intermediate(h)) @ w2.T


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertFn,
                   limit: float, intermediate: Intermediate | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) in FP32, one expert at a time.
    `intermediate` sees (and may replace) each expert's input to w2."""
    x = x.float()
    y = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w1, w3, w2 = (w.float() for w in experts(e))
        y.index_add_(0, rows, swiglu_expert(x[rows], w1, w3, w2, limit, intermediate) * weights[rows, slots, None])
    return y


def moe_forward(x: torch.Tensor, layer: MoELayer, cfg: MoEConfig,
                token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [T, H] float32 = routed + shared expert, expert ids, routing weights)."""
    ids, weights = route(x, layer, cfg, token_ids)
    y = routed_experts(x, ids, weights, layer.experts, cfg.swiglu_limit)
    if layer.shared is not None:
        y += swiglu_expert(x.float(), *(w.float() for w in layer.shared), cfg.swiglu_limit)
    return y, ids, weights
