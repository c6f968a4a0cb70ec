"""The torch MoE reference checked on its own: a case worked by hand, and routing invariants."""

import math

import pytest
import torch

from requant.errors import FormatError
from requant.moe import MoEConfig, MoELayer, moe_forward, route

CONFIG = {"hidden_size": 2, "moe_intermediate_size": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3}


def sqrt_softplus(v):
    return math.sqrt(math.log1p(math.exp(v)))


def silu(v):
    return v / (1 + math.exp(-v))


def test_hand_computed_layer():
    cfg = MoEConfig.from_config(CONFIG)
    # x = [1, 0]: expert e's logit is gate[e, 0] = 0, 1, 2, 3.
    gate = torch.tensor([[0.0, 5.0], [1.0, 5.0], [2.0, 5.0], [3.0, 5.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, -10.0])  # picks expert 0, then 2 (s2 > s1); 3 is pushed out
    experts = {
        0: (torch.tensor([[20.0, 1.0]]), torch.tensor([[-15.0, 1.0]]), torch.tensor([[1.0], [2.0]])),  # both clamps bite
        2: (torch.tensor([[0.5, 1.0]]), torch.tensor([[3.0, 1.0]]), torch.tensor([[-1.0], [0.25]])),
    }
    shared = (torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0], [1.0]]))
    layer = MoELayer(gate, bias, None, lambda e: experts[e], shared)
    y, ids, weights = moe_forward(torch.tensor([[1.0, 0.0]]), layer, cfg)

    s0, s2 = sqrt_softplus(0.0), sqrt_softplus(2.0)
    r0, r2 = 1.5 * s0 / (s0 + s2), 1.5 * s2 / (s0 + s2)
    h0 = silu(10.0) * -10.0      # gate 20 -> 10, up -15 -> -10
    h2 = silu(0.5) * 3.0
    hs = silu(1.0) * 2.0
    expected = [r0 * h0 * 1.0 + r2 * h2 * -1.0 + hs, r0 * h0 * 2.0 + r2 * h2 * 0.25 + hs]
    assert ids.tolist() == [[0, 2]]
    assert weights[0].tolist() == pytest.approx([r0, r2], rel=1e-6)
    assert y[0].tolist() == pytest.approx(expected, rel=1e-5)


def random_layer(gen, experts=16, hidden=32, hash_vocab=None, top_k=4):
    tid2eid = None
    if hash_vocab:
        tid2eid = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(hash_vocab)])
    return MoELayer(torch.randn(experts, hidden, generator=gen), torch.randn(experts, generator=gen), tid2eid,
                    experts=None)


def test_routing_invariants():
    gen = torch.Generator().manual_seed(0)
    cfg = MoEConfig(32, 8, 16, 4, 1.5, 10.0, 0)
    layer = random_layer(gen)
    x = torch.randn(50, 32, generator=gen)
    ids, weights = route(x, layer, cfg)
    scores = torch.sqrt(torch.nn.functional.softplus(x @ layer.gate_weight.T))
    assert ids.shape == (50, 4)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 1.5))
    # Selection is the top-k of the biased scores; the weights are proportional to unbiased ones.
    threshold = (scores + layer.gate_bias).gather(1, ids).min(-1).values
    unchosen = torch.ones_like(scores, dtype=torch.bool).scatter(1, ids, False)
    assert ((scores + layer.gate_bias)[unchosen].view(50, -1) <= threshold[:, None]).all()
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 1.5)
    # Without the bias the selection changes for some tokens (so the bias is really used).
    plain = MoELayer(layer.gate_weight, torch.zeros(16), None, None)
    assert not torch.equal(route(x, plain, cfg)[0].sort(-1).values, ids.sort(-1).values)


def test_hash_routing_ignores_scores_for_selection():
    gen = torch.Generator().manual_seed(1)
    cfg = MoEConfig(32, 8, 16, 4, 1.5, 10.0, 3)
    layer = random_layer(gen, hash_vocab=100)
    tokens = torch.randint(0, 100, (20,), generator=gen)
    x = torch.randn(20, 32, generator=gen)
    ids, weights = route(x, layer, cfg, tokens)
    assert torch.equal(ids, layer.tid2eid[tokens])
    chosen = torch.sqrt(torch.nn.functional.softplus(x @ layer.gate_weight.T)).gather(1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 1.5)
    with pytest.raises(ValueError):
        route(x, layer, cfg)


def test_config_from_checkpoint_config():
    cfg = MoEConfig.from_config({**CONFIG, "hidden_size": 4096, "n_routed_experts": 256})
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.top_k, cfg.num_hash_layers) == (4096, 256, 2, 3)
    bad = dict(CONFIG)
    del bad["swiglu_limit"]
    with pytest.raises(FormatError):
        MoEConfig.from_config(bad)
