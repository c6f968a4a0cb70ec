"""Conformance tier, vLLM half, multi-GPU loading: requant's outputs loaded rank by rank.

vLLM shards the routed experts of a layer over tensor-parallel ranks along the intermediate
dimension (w1/w3 rows, w2 columns, and with them their group scales and zero points), or with
--enable-expert-parallel hands each rank whole experts. Each rank here runs the release's own
create_weights (the dispatched MoE method, for the rank's intermediate size and local experts),
DeepseekV4Model.load_weights and RoutedExperts.weight_loader (its TP narrowing, its expert map
from determine_expert_map), and its parameters must equal their slice of the one-GPU load.

The checkpoint's moe_intermediate_size is 1024, so TP=8 leaves 128 per rank: one 128-group of
w2's K per rank at g128, four at g32; 16 experts, so EP=8 gives each rank two.
"""

from __future__ import annotations

import pytest
import torch

from requant import synth
from requant.targets import Options
from requant.targets.w4a16 import W4A16Options

from . import wheels

if not wheels.available("vllm"):
    pytest.skip(f"vllm=={wheels.version('vllm')} wheel not available in {wheels.CACHE}: vLLM multi-GPU tier skipped",
                allow_module_level=True)

from . import vllm_harness as vllm  # noqa: E402
from .outputs import source_and_outputs  # noqa: E402

DIMS = synth.dims_with(synth.Dims(), layers=2, experts=16, hidden=256, intermediate=1024)
OUTPUTS = {
    "nvfp4": ("nvfp4", Options(engine="vllm")),
    "w4a16-g32-sym": ("w4a16", Options(engine="vllm", target=W4A16Options(32, "sym"))),
    "w4a16-g32-asym": ("w4a16", Options(engine="vllm", target=W4A16Options(32, "asym"))),
    "w4a16-g128-sym": ("w4a16", Options(engine="vllm", target=W4A16Options(128, "sym"))),
    "w4a16-g128-asym": ("w4a16", Options(engine="vllm", target=W4A16Options(128, "asym"))),
}
PLACEMENTS = [*(f"tp{n}" for n in (2, 4, 8)), "ep8"]


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    vllm.reset()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    paths = source_and_outputs(tmp_path_factory.mktemp("vllm-parallel"), DIMS, 5, OUTPUTS)
    return {name: paths[name] for name in OUTPUTS}   # the outputs only: the source is not loaded here


@pytest.fixture(scope="module")
def one_gpu(ckpts) -> dict[str, dict]:
    """Each output's expert parameters as one GPU loads them."""
    loads = {}
    for name, path in ckpts.items():
        params, problems = vllm.rank_experts(path, vllm.ONE_GPU)
        assert problems == [], (name, problems)
        loads[name] = params
    return loads


def placements(kind: str) -> list[vllm.Placement]:
    size = int(kind[2:])
    if kind.startswith("tp"):
        return [vllm.Placement(tp_rank=r, tp_size=size) for r in range(size)]
    return [vllm.Placement(ep_rank=r, ep_size=size) for r in range(size)]


def expected_slice(name: str, full: torch.Tensor, shape: torch.Size, placement: vllm.Placement) -> torch.Tensor:
    """What rank `placement` should hold of parameter `name` (one-GPU value `full`) in a rank
    parameter of `shape`: with EP its experts (linear placement: rank r holds experts
    [r*E/ep, (r+1)*E/ep)); with TP the rank's part of the one dimension the parameter shrinks
    along, which for w13 is in each of the gate and up halves. A parameter of the one-GPU shape
    (per-expert scalars, global scales, weight_shape) is held whole."""
    if tuple(shape) == tuple(full.shape):
        return full
    if placement.ep_size > 1:
        local = DIMS.experts // placement.ep_size
        assert tuple(shape) == (local, *full.shape[1:]), (name, tuple(shape), tuple(full.shape))
        return full[placement.ep_rank * local:(placement.ep_rank + 1) * local]
    (dim,) = [d for d in range(full.ndim) if shape[d] != full.shape[d]]
    assert full.shape[dim] == shape[dim] * placement.tp_size, (name, tuple(shape), tuple(full.shape))
    halves = full.chunk(2, dim) if name.startswith("w13_") else (full,)
    part = shape[dim] // len(halves)
    return torch.cat([h.narrow(dim, placement.tp_rank * part, part) for h in halves], dim)


@pytest.mark.parametrize("kind", PLACEMENTS)
@pytest.mark.parametrize("name", list(OUTPUTS))
def test_each_rank_holds_its_slice(ckpts, one_gpu, name, kind):
    """Every rank loads without error, writes every byte of its expert parameters, and holds
    exactly its slice of the one-GPU load; across the ranks every part of it is held."""
    full = one_gpu[name]
    covered = {block: {param: torch.zeros(t.shape, dtype=torch.bool) for param, t in params.items()}
               for block, params in full.items()}
    for placement in placements(kind):
        params, problems = vllm.rank_experts(ckpts[name], placement)
        assert problems == [], problems
        assert params.keys() == full.keys()
        for block, rank in params.items():
            assert rank.keys() == full[block].keys(), (block, placement)
            for param, tensor in rank.items():
                want = expected_slice(param, full[block][param], tensor.shape, placement)
                assert torch.equal(tensor.view(torch.uint8), want.contiguous().view(torch.uint8)), \
                    (name, str(placement), block, param)
                index = torch.arange(full[block][param].numel()).view(full[block][param].shape)
                covered[block][param].view(-1)[expected_slice(param, index, tensor.shape, placement).reshape(-1)] = True
    for block, params in covered.items():
        for param, mask in params.items():
            assert mask.all(), (name, kind, block, param, "parts of the one-GPU load no rank holds")


def test_w2_groups_per_rank_follow_tp(ckpts):
    """The case issue vllm#41511 reports (compressed-tensors W4A16 MoE weight_scale not split along
    K beyond TP=2): at TP=8 each rank's w2 group scales cover its 128 columns of K, one group at
    g128, four at g32, and equal that slice of the one-GPU scales (test_each_rank_holds_its_slice)."""
    for name, groups in (("w4a16-g128-sym", 1), ("w4a16-g32-sym", 4), ("w4a16-g128-asym", 1)):
        params, problems = vllm.rank_experts(ckpts[name], vllm.Placement(tp_rank=7, tp_size=8))
        assert problems == []
        assert params["layers.0"]["w2_weight_scale"].shape == (DIMS.experts, DIMS.hidden, groups), name
        assert params["layers.0"]["w2_weight_packed"].shape == (DIMS.experts, DIMS.hidden, 128 // 8), name


@pytest.mark.parametrize("name, group, tp, permuted_as_k", [
    ("w4a16-g128-sym", 128, 4, True),     # 256 per rank > 128
    ("w4a16-g32-sym", 32, 8, True),       # 128 per rank > 32
    ("w4a16-g128-sym", 128, 8, False),    # 128 per rank, not > 128: the wrong permutation
    ("w4a16-g128-asym", 128, 8, False),
])
def test_marlin_w13_scales_permuted_by_tp(ckpts, name, group, tp, permuted_as_k):
    """Negative where permuted_as_k is False. The MARLIN backend's W4A16 post-processing
    (int_wna16.py _process_weights_marlin) permutes w13's group scales with
    size_k=layer.intermediate_size_per_partition, though w13's K is hidden_size (w2's call
    passes its own K). marlin_permute_scales takes the grouped permutation only when
    group_size < size_k, so once a rank's intermediate size is no larger than the group (TP=8
    of 1024 at g128 here; DeepSeek-V4's 2048 at TP=16) w13's scales, still hidden/group groups
    along K, get the per-channel one. w2's scales are permuted for their K at every TP."""
    params, problems = vllm.rank_experts(ckpts[name], vllm.Placement(tp_rank=0, tp_size=tp))
    assert problems == []
    rank = params["layers.0"]
    per_rank = DIMS.intermediate // tp
    w13, w2 = vllm.marlin_wna16_scales(rank, per_rank, group)
    as_k = vllm.marlin_permuted_scales(rank["w13_weight_scale"], DIMS.hidden, group)
    assert torch.equal(w13, as_k) == permuted_as_k, (name, tp)
    assert torch.equal(w2, vllm.marlin_permuted_scales(rank["w2_weight_scale"], per_rank, group))


# DeepSeek-V4's own expert dimensions (recipes/deepseek_v4.json models.*.dims): (hidden, moe intermediate)
MODEL_DIMS = {"deepseek-v4-flash": (4096, 2048), "deepseek-v4-pro": (7168, 3072)}


@pytest.mark.parametrize("model", list(MODEL_DIMS))
@pytest.mark.parametrize("name", [n for n in OUTPUTS if n.startswith("w4a16")])
def test_create_weights_at_model_dims(ckpts, model, name):
    """CompressedTensorsWNA16MoEMethod.create_weights for one expert of the full-size models, per
    TP: requant's W4A16 layouts are taken at TP 1-8 for both models. Negative at TP=16: g128 is
    refused for Pro (3072/16 = 192 per rank is not a multiple of 128, the method's own check that
    scale groups do not cross shard boundaries); g32, or expert parallelism, loads there."""
    hidden, intermediate = MODEL_DIMS[model]
    method = vllm.build_moe_method(vllm.dispatch(vllm.Checkpoint(ckpts[name])).moe("model.layers.0.ffn.experts"))
    group = 128 if "-g128-" in name else 32
    for tp in (1, 2, 4, 8, 16):
        layer = torch.nn.Module()
        refuses = model == "deepseek-v4-pro" and group == 128 and tp == 16
        try:
            method.create_weights(layer=layer, num_experts=1, hidden_size=hidden,
                                  intermediate_size_per_partition=intermediate // tp, params_dtype=torch.bfloat16,
                                  weight_loader=None, global_num_experts=1)
        except ValueError as e:
            assert refuses and "divisible by group_size" in str(e), (model, name, tp, e)
            continue
        assert not refuses, (model, name, tp, "taken")
        assert layer.w2_weight_scale.shape == (1, hidden, intermediate // tp // group)
