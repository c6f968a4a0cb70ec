"""Conformance tier, SGLang: requant's outputs loaded at TP=2/4/8 and EP=8 through SGLang's own
FusedMoE weight loader (layers/moe/fused_moe_triton/layer.py: weight_loader,
_map_global_expert_id_to_local_expert_id, _load_w13, _load_w2, executed from the release wheel),
rank by rank, each rank's routed-expert parameters held to their slice of the TP=1 load.

The slice is computed here, independently of the engine: along the one axis where a rank's
parameter is smaller than the TP=1 one (by exactly the TP degree), w13 parameters hold their
rank's part of the gate half and of the up half, w2 parameters their rank's contiguous part;
parameters of equal shape (per-tensor and per-expert scales) are replicated; under EP a rank
holds experts [rank*E/ep, (rank+1)*E/ep). The dimensions are DeepSeek-V4-Flash's MoE
intermediate (2048), so TP=8 leaves 256 per rank: 2 groups of 128 / 8 of 32 for W4A16's w2
scales along K.
"""

from __future__ import annotations

import pytest
import torch

from requant import synth
from requant.convert import convert
from requant.targets import Options
from requant.targets.w4a16 import W4A16Options
from tests.engines import wheels

if not wheels.available("sglang"):
    pytest.skip(f"sglang=={wheels.version('sglang')} wheel not available in {wheels.CACHE}: SGLang tier skipped",
                allow_module_level=True)

from tests.engines.sglang_harness import reset, sglang_load_report  # noqa: E402
from tests.engines.outputs import source_and_outputs  # noqa: E402

INTERMEDIATE = 2048   # DeepSeek-V4-Flash moe_intermediate_size
EXPERTS = 8
# (output, GPU family, --moe-runner-backend) as served: the MoE method (and so the parameter
# layout the loader fills) is the one SGLang selects there
SERVED = {"nvfp4": ("sm_100", "auto"), "w4a16": ("sm_90", "marlin"), "w4a16_g32": ("sm_90", "marlin"),
          "mxfp4": ("sm_100", "auto")}
LAYOUTS = [(tp, 1) for tp in (2, 4, 8)] + [(1, 8)]   # (moe_tp_size, moe_ep_size)


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    reset()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    dims = synth.Dims(layers=2, hash_layers=1, intermediate=INTERMEDIATE, experts=EXPERTS)
    return source_and_outputs(tmp_path_factory.mktemp("sglang_tp"), dims, 5, {
        "nvfp4": ("nvfp4", Options(engine="sglang")),
        "w4a16": ("w4a16", Options(engine="sglang", target=W4A16Options(group_size=128))),
        "w4a16_g32": ("w4a16", Options(engine="sglang", target=W4A16Options(group_size=32)))})


@pytest.fixture(scope="module")
def full_loads(outputs):
    """The TP=1, EP=1 load of each output: the reference every rank is held to."""
    loads = {}
    for name, (gpu, backend) in SERVED.items():
        report = sglang_load_report(outputs[name], gpu, backend)
        assert report.problems == [], (name, report.problems)
        loads[name] = report.tensors
    return loads


def rank_slice(name: str, full: torch.Tensor, local_shape, tp: int, tp_rank: int, ep: int, ep_rank: int,
               global_experts: bool = False):
    """What rank (tp_rank, ep_rank) should hold of parameter `name` whose TP=1 value is `full`;
    `global_experts`: the method registered it for every expert on every rank
    (_sglang_require_global_experts, as ModelOptNvFp4FusedMoEMethod does for its input scales)."""
    if not global_experts:
        per = full.shape[0] // ep
        full = full[ep_rank * per:(ep_rank + 1) * per]
    axes = [a for a in range(1, full.dim()) if full.shape[a] != local_shape[a]]
    if not axes:
        return full
    assert len(axes) == 1 and full.shape[axes[0]] == tp * local_shape[axes[0]], (name, tuple(full.shape), local_shape)
    a, n = axes[0], local_shape[axes[0]]
    if name.startswith("w13"):
        half, k = full.shape[a] // 2, n // 2
        return torch.cat([full.narrow(a, tp_rank * k, k), full.narrow(a, half + tp_rank * k, k)], dim=a)
    return full.narrow(a, tp_rank * n, n)


def mismatches(full: dict, report, tp: int, tp_rank: int, ep: int, ep_rank: int) -> list[str]:
    bad = []
    for prefix, params in report.tensors.items():
        for pname, local in params.items():
            if "g_idx" in pname:   # no act-order: never loaded, replaced after loading (sglang_harness._unloaded_problem)
                continue
            want = rank_slice(pname, full[prefix][pname], tuple(local.shape), tp, tp_rank, ep, ep_rank,
                              f"{prefix}.{pname}" in report.global_experts)
            if tuple(want.shape) != tuple(local.shape) or not torch.equal(want.view(torch.uint8) if want.dtype.itemsize == 1
                                                                           else want, local.view(torch.uint8)
                                                                           if local.dtype.itemsize == 1 else local):
                bad.append(f"{prefix}.{pname}")
    return bad


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[f"tp{t}" if e == 1 else f"ep{e}" for t, e in LAYOUTS])
@pytest.mark.parametrize("name", list(SERVED))
def test_every_rank_holds_its_slice(outputs, full_loads, name, tp, ep):
    gpu, backend = SERVED[name]
    for rank in range(max(tp, ep)):
        report = sglang_load_report(outputs[name], gpu, backend, tp=(tp, rank % tp), ep=(ep, rank % ep))
        assert report.problems == [], (name, tp, ep, rank, report.problems[:5])
        assert set(report.tensors) == set(full_loads[name])
        assert mismatches(full_loads[name], report, tp, rank % tp, ep, rank % ep) == [], (name, tp, ep, rank)


def test_the_slice_check_catches_a_misshard(outputs, full_loads):
    """The comparison can fail: rank 1's w2 scales put in place of rank 0's are found."""
    report = sglang_load_report(outputs["w4a16"], "sm_90", "marlin", tp=(8, 0))
    other = sglang_load_report(outputs["w4a16"], "sm_90", "marlin", tp=(8, 1))
    layer = "model.layers.0.mlp.experts"
    report.tensors[layer]["w2_weight_scale"] = other.tensors[layer]["w2_weight_scale"]
    assert mismatches(full_loads["w4a16"], report, 8, 0, 1, 0) == [f"{layer}.w2_weight_scale"]


def test_w4a16_fewer_k_per_rank_than_a_group_loads_without_w2_scales(tmp_path):
    """Negative, an engine limit: where moe_intermediate/TP is smaller than the group (here
    128/8 = 16 < 32), CompressedTensorsWNA16MoE.create_weights registers num_groups_w2 =
    16 // 32 = 0 scale rows (schemes/compressed_tensors_wNa16_moe.py) and FusedMoE._load_w2
    narrows the checkpoint's 4 groups to 4 // 8 = 0 (layer.py): SGLang raises nothing and every
    rank's w2 weights are left without scales. DeepSeek-V4-Flash (2048) reaches it only past
    TP 16 at group 128 (TP 64 at group 32)."""
    src, out = str(tmp_path / "src"), str(tmp_path / "w4a16")
    synth.write_checkpoint(src, synth.Dims(layers=2, hash_layers=1), seed=5)   # moe_intermediate 128
    convert(src, out, "w4a16", Options(engine="sglang", target=W4A16Options(group_size=32)), progress=False)
    report = sglang_load_report(out, "sm_90", "marlin", tp=(8, 0))
    layer = report.tensors["model.layers.0.mlp.experts"]
    assert report.problems == []                              # silent
    assert tuple(layer["w2_weight_scale"].shape) == (EXPERTS, 0, 256)
    assert layer["w2_weight_packed"].shape[1] * 8 == 128 // 8   # 16 K rows per rank, packed 8 per int32
    full = sglang_load_report(out, "sm_90", "marlin").tensors["model.layers.0.mlp.experts"]
    assert tuple(full["w2_weight_scale"].shape) == (EXPERTS, 4, 256)
