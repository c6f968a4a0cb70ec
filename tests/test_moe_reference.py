"""The torch MoE reference checked on its own: a case worked by hand, routing invariants, and each
router and activation kind against a direct transcription of its definition."""

import math

import pytest
import torch

from requant.errors import UnsupportedError
from requant.model import ModelSpec
from requant.moe import (Activation, MoEConfig, MoELayer, Router, expert_forward, moe_forward, route, routed_experts,
                         routed_experts_variants)

CONFIG = {"model_type": "deepseek_v4", "hidden_size": 2, "moe_intermediate_size": 1, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3}
DEEPSEEK = (Router("sqrtsoftplus", 4, 1.5), Activation("swiglu_clamp", 10.0))


def sqrt_softplus(v):
    return math.sqrt(math.log1p(math.exp(v)))


def silu(v):
    return v / (1 + math.exp(-v))


def test_hand_computed_layer():
    cfg = MoEConfig.from_model(ModelSpec.for_config(CONFIG))
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


def route_random_tokens(seed: int, kinds: tuple, tokens: int):
    """(layer, x, ids, weights): `tokens` random tokens routed by a random 16-expert layer."""
    gen = torch.Generator().manual_seed(seed)
    cfg = MoEConfig(32, 8, 16, *kinds)
    layer = random_layer(gen)
    x = torch.randn(tokens, 32, generator=gen)
    return layer, x, *route(x, layer, cfg)


def test_routing_invariants():
    layer, x, ids, weights = route_random_tokens(0, DEEPSEEK, 50)
    cfg = MoEConfig(32, 8, 16, *DEEPSEEK)
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
    cfg = MoEConfig(32, 8, 16, *DEEPSEEK)
    layer = random_layer(gen, hash_vocab=100)
    tokens = torch.randint(0, 100, (20,), generator=gen)
    x = torch.randn(20, 32, generator=gen)
    ids, weights = route(x, layer, cfg, tokens)
    assert torch.equal(ids, layer.tid2eid[tokens])
    chosen = torch.sqrt(torch.nn.functional.softplus(x @ layer.gate_weight.T)).gather(1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 1.5)
    with pytest.raises(ValueError):
        route(x, layer, cfg)


def test_config_from_the_recipe_and_the_checkpoint_config():
    cfg = MoEConfig.from_model(ModelSpec.for_config({**CONFIG, "hidden_size": 4096, "n_routed_experts": 256}))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.n_routed_experts) == (4096, 1, 256)
    assert cfg.router == Router("sqrtsoftplus", 2, 1.5) and cfg.activation == Activation("swiglu_clamp", 10.0)
    bad = dict(CONFIG)
    del bad["swiglu_limit"]
    with pytest.raises(UnsupportedError, match="swiglu_limit"):
        MoEConfig.from_model(ModelSpec.for_config(bad))


# gpt-oss, transcribed from its definition: the router adds its bias to the logits, keeps the top k
# and takes a softmax over those k; the experts clamp gate (above) and up (both sides) at L, and give
# (up + 1) * gate * sigmoid(alpha * gate), with biases on all three projections.
GPT_OSS = (Router("softmax_topk", 4), Activation("swiglu_oai", 7.0, 1.702))


def test_softmax_topk_router_matches_its_definition():
    layer, x, ids, weights = route_random_tokens(2, GPT_OSS, 40)
    for t in range(40):
        logits = [float(v) for v in x[t] @ layer.gate_weight.T + layer.gate_bias]
        top = sorted(range(16), key=lambda e: -logits[e])[:4]
        z = [math.exp(logits[e] - logits[top[0]]) for e in top]
        assert ids[t].tolist() == top
        assert weights[t].tolist() == pytest.approx([v / sum(z) for v in z], rel=1e-5)


def test_swiglu_oai_expert_matches_its_definition():
    gen = torch.Generator().manual_seed(3)
    act = GPT_OSS[1]
    hidden, inter = 6, 3
    expert = (torch.randn(inter, hidden, generator=gen) * 4, torch.randn(inter, hidden, generator=gen) * 4,
              torch.randn(hidden, inter, generator=gen), torch.randn(inter, generator=gen),
              torch.randn(inter, generator=gen), torch.randn(hidden, generator=gen))
    x = torch.randn(5, hidden, generator=gen)
    y = expert_forward(x, expert, act)
    w_gate, w_up, w_down, b_gate, b_up, b_down = (t.tolist() for t in expert)
    clamped = 0
    for t in range(5):
        xt = x[t].tolist()
        h = []
        for i in range(inter):
            g = sum(a * b for a, b in zip(w_gate[i], xt)) + b_gate[i]
            u = sum(a * b for a, b in zip(w_up[i], xt)) + b_up[i]
            clamped += g > 7.0 or abs(u) > 7.0
            g, u = min(g, 7.0), max(-7.0, min(u, 7.0))
            h.append((u + 1) * g / (1 + math.exp(-1.702 * g)))
        expected = [sum(w_down[j][i] * h[i] for i in range(inter)) + b_down[j] for j in range(hidden)]
        assert y[t].tolist() == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert clamped, "the clamps must bite somewhere for this check to cover them"


def test_routed_expert_bias_comes_before_the_routing_weight():
    act = GPT_OSS[1]
    expert = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(2, 1), torch.zeros(1), torch.zeros(1),
              torch.tensor([3.0, -1.0]))
    layer = MoELayer(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), None, None, lambda e: expert)
    cfg = MoEConfig(2, 1, 2, Router("softmax_topk", 1), act)
    y, ids, weights = moe_forward(torch.tensor([[1.0, 0.0]]), layer, cfg)
    # One expert chosen, weight softmax([l]) = 1: the output is the down bias itself.
    assert weights.tolist() == [[1.0]] and y.tolist() == [[3.0, -1.0]]
    cfg2 = MoEConfig(2, 1, 2, Router("softmax_topk", 2), act)
    y2, _, w2 = moe_forward(torch.tensor([[1.0, 0.0]]), layer, cfg2)
    # Two experts with the same output: weights sum to 1, so the bias is not counted twice.
    assert float(w2.sum()) == pytest.approx(1.0) and y2[0].tolist() == pytest.approx([3.0, -1.0])


def test_activation_bounds_hold():
    for act in (DEEPSEEK[1], GPT_OSS[1]):
        g = torch.linspace(-50, 50, 2001)[:, None]
        u = torch.linspace(-50, 50, 2001)[None, :]
        h = act(g, u).abs().max()
        assert float(h) <= act.bound() * (1 + 1e-6) and float(h) >= act.bound() * 0.999, act.kind


def test_variants_fetch_each_expert_once_and_equal_separate_passes():
    """routed_experts_variants: one fetch per expert for all variants, on any thread count, and each
    variant's output bit-equal to its own routed_experts pass."""
    gen = torch.Generator().manual_seed(3)
    experts = {e: (torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen),
                   torch.randn(16, 8, generator=gen)) for e in range(6)}
    fetched = []

    def fetch(e):
        fetched.append(e)
        return experts[e]

    x = torch.randn(10, 16, generator=gen)
    ids = torch.randint(0, 6, (10, 2), generator=gen)
    weights = torch.rand(10, 2, generator=gen)
    act = Activation("swiglu_clamp", 10.0)
    variants = [(x, None), (x * 2, lambda h: h.round())]
    for workers in (1, 3):
        fetched.clear()
        ys = routed_experts_variants(variants, ids, weights, fetch, act, workers=workers)
        assert sorted(fetched) == ids.unique().tolist()
        for (xv, hook), y in zip(variants, ys):
            assert torch.equal(y, routed_experts(xv, ids, weights, experts.__getitem__, act, intermediate=hook))
    assert not torch.equal(ys[0], ys[1])
