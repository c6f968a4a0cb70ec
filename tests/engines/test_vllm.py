"""Conformance tier, vLLM half: the vLLM release's own code (wheels.version("vllm")), from its
release wheel, run on requant's outputs.

Every check executes the engine's functions (see vllm_harness.py for which, and the stand-ins
around them). The positive tests ask the one checker, vllm_load_report, for no problems; the
negative tests hand it the layouts vLLM is known to load wrongly (issue 9: M1, M4) and require
the specific problem.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from requant import synth
from requant.engines.check import marlin_flush_threshold
from requant.formats import mxfp4
from requant.model import ModelSpec
from requant.targets import Options
from requant.targets.w4a16 import W4A16Options

from . import wheels

if not wheels.available("vllm"):
    pytest.skip(f"vllm=={wheels.version('vllm')} wheel not available in {wheels.CACHE} (pip download failed or "
                "REQUANT_NO_WHEEL_FETCH set): vLLM conformance tier skipped", allow_module_level=True)

from . import vllm_harness as vllm  # noqa: E402
from .outputs import source_and_outputs, with_ignore  # noqa: E402
from .vllm_kernels import DEVIATIONS, installed  # noqa: E402

ENGINE = f"vLLM {wheels.version('vllm')}"

# small, but with what the engine treats specially: hash-routed layers, an MTP block, W4A16
# groups spanning more than one group along K (moe_intermediate 256, hidden 256)
DIMS = synth.dims_with(synth.Dims(), layers=2, experts=6, hidden=256, intermediate=256)
OUTPUTS = {
    "nvfp4": ("nvfp4", Options(engine="vllm")),
    "w4a16-g32-sym": ("w4a16", Options(engine="vllm", target=W4A16Options(32, "sym"))),
    "w4a16-g128-asym": ("w4a16", Options(engine="vllm", target=W4A16Options(128, "asym"))),
    "w4a16-g128-sym": ("w4a16", Options(engine="vllm")),
    "w4a16-g32-asym": ("w4a16", Options(engine="vllm", target=W4A16Options(32, "asym"))),
    "sglang-nvfp4": ("nvfp4", Options(engine="sglang")),   # MTP experts kept MXFP4 (M4 for vLLM)
}
OLD_W4A16_TARGET = r"re:.*\.ffn\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    """The stand-in vllm.* modules the harness places leave with this module's tests."""
    yield
    vllm.reset()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    return source_and_outputs(tmp_path_factory.mktemp("vllm-tier"), DIMS, 3, OUTPUTS, source_name="mxfp4-source")


def with_expert_target(src: str, dst, target: str) -> str:
    """A copy of W4A16 output `src` whose expert config group targets `target` (shards linked)."""
    dst.mkdir()
    for entry in Path(src).iterdir():
        if entry.name != "config.json":
            (dst / entry.name).symlink_to(entry)
    config = json.loads((Path(src) / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    expert_group = next(g for g in groups.values() if g["weights"]["type"] == "int")
    expert_group["targets"] = [target]
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


# ------------------------------------------------------------------------------ loading (1, 3)
@pytest.mark.parametrize("name", ["mxfp4-source", "nvfp4", "w4a16-g32-sym", "w4a16-g128-asym", "w4a16-g128-sym",
                                  "w4a16-g32-asym"])
def test_vllm_loads_every_tensor(ckpts, name):
    """Every tensor, MTP block included, reaches a parameter of the method vLLM dispatches for its
    layer, that method is the one requant's rules name, attention and shared experts are FP8 block."""
    assert vllm.vllm_load_report(ckpts[name]) == []


@pytest.mark.parametrize("name", ["mxfp4-source", "nvfp4", "w4a16-g32-sym", "w4a16-g128-asym"])
def test_dispatch_per_layer(ckpts, name):
    """The method class each routed-expert layer gets, main and MTP, as requant's rules say, and
    the parameters its create_weights registers are exactly those the checkpoint's expert tensors
    are renamed to (hf_to_vllm_mapper, then w1/w3 -> w13_, w2 -> w2_)."""
    ckpt = vllm.Checkpoint(ckpts[name])
    dispatch = vllm.dispatch(ckpt)
    rules = ModelSpec(ckpt.spec.recipe, ckpt.config).engine("vllm", wheels.version("vllm"))
    blocks = vllm.expert_blocks(ckpt)
    assert [b for b, _ in blocks][-1] == "mtp.0"
    for block, prefix in blocks:
        fmt = ckpt.expert_format(block)
        method = dispatch.moe(prefix)
        for gpu in vllm.GPUS:
            assert type(method).__name__ == rules.kernel(fmt, gpu).method, (block, gpu)
        layer = vllm.routed_experts(vllm.build_moe_method(method), dispatch.config, *vllm.dims(ckpt),
                                    vllm.LoadRecord())
        registered = {name for name, _ in layer.named_parameters()}
        mapper = vllm.weights_mapper(ckpt)
        stored = {("w2_" if ref.proj == "w2" else "w13_") +
                  mapper.map_name(f"layers.0.ffn.experts.0.{ref.proj}.{ref.part}").rsplit(".", 1)[1]
                  for ref in map(ckpt.spec.expert_tensor, ckpt.header) if ref and ref.block == block}
        assert stored == registered, (block, stored, registered)
    for prefix in ("model.layers.1.attn.fused_wqa_wkv", "model.layers.1.ffn.shared_experts.gate_up_proj",
                   "model.layers.2.attn.wo_a", "model.layers.2.ffn.shared_experts.down_proj"):
        assert vllm.build_linear_method(dispatch.linear(prefix)).weight_block_size == [128, 128], prefix


def test_m1_old_w4a16_target_crashes_vllm(ckpts, tmp_path):
    """M1: the expert target requant wrote before misses vLLM's probes (experts.0.w1): the FP8 MoE
    method is built and the loader has no weight_packed parameter."""
    problems = vllm.vllm_load_report(with_expert_target(ckpts["w4a16-g128-sym"], tmp_path / "m1", OLD_W4A16_TARGET))
    text = "\n".join(problems)
    assert f"layers.0 (w4a16 experts): {ENGINE} gives model.layers.0.ffn.experts CompressedTensorsW8A8Fp8MoEMethod" in text
    assert f"mtp.0 (w4a16 experts): {ENGINE} gives model.layers.2.ffn.experts CompressedTensorsW8A8Fp8MoEMethod" in text
    assert "DeepseekV4Model.load_weights raises KeyError: 'layers.0.ffn.experts.routed_experts.w13_weight_packed'" in text
    assert "DeepSeekV4MTP.load_weights raises KeyError: 'model.layers.2.mtp_block.ffn.experts.routed_experts.w13_weight_packed'" in text


def test_mxfp4_mtp_experts_under_ignore_load_as_mxfp4(ckpts):
    """SGLang's layout (MTP experts kept MXFP4, `ignore` listing mtp.*) loads in vLLM too: on CUDA
    the deepseek_v4_fp8 config is models/deepseek_v41/quant_config.py's, which gives an expert layer
    that `ignore` matches (mtp.0.ffn.experts) Mxfp4MoEMethod."""
    assert vllm.cuda_ds4_quant_file() == "vllm/models/deepseek_v41/quant_config.py"
    assert "mtp.*" in json.loads(Path(ckpts["sglang-nvfp4"], "config.json").read_text())["quantization_config"]["ignore"]
    assert vllm.vllm_load_report(ckpts["sglang-nvfp4"]) == []


def test_m4_mxfp4_mtp_experts_outside_ignore_load_as_garbage(ckpts, tmp_path):
    """M4: NVFP4 main experts with MXFP4 MTP experts that `ignore` does not cover: vLLM gives the MTP
    layer the NVFP4 method, converts the E8M0 scale bytes by value and never writes the global and
    input scales; no error. The main layers load."""
    ignore = [p for p in json.loads(Path(ckpts["sglang-nvfp4"], "config.json").read_text())["quantization_config"]["ignore"]
              if not p.startswith("mtp.")]
    problems = vllm.vllm_load_report(with_ignore(ckpts["sglang-nvfp4"], tmp_path / "m4", ignore))
    assert problems and all("mtp.0" in p for p in problems), problems
    text = "\n".join(problems)
    assert f"mtp.0 (mxfp4 experts): {ENGINE} gives model.layers.2.ffn.experts ModelOptNvFp4FusedMoE" in text
    for param in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"):
        assert f"mtp.0: {param} never written" in text, param
    assert "w1.scale (torch.uint8) copied by value into w13_weight_scale (torch.float8_e4m3fn)" in text
    assert not any("raises" in p for p in problems)


# --------------------------------------------------------------------------------- dequant (2)
def test_vllm_nvfp4_dequant_equals_mxfp4_source(ckpts):
    """vLLM's NVFP4 emulation dequant (checkpoint layout: swizzle=False) of every converted expert
    matrix, main and MTP, equals the MXFP4 source's values."""
    dequantize = vllm.nvfp4_dequantizer()
    out, src = vllm.Checkpoint(ckpts["nvfp4"]), vllm.Checkpoint(ckpts["mxfp4-source"])
    prefixes = sorted({ref.prefix for ref in map(out.spec.expert_tensor, out.header) if ref})
    assert len(prefixes) == (DIMS.layers + DIMS.mtp_layers) * DIMS.experts * 3
    for prefix in prefixes:
        got = dequantize(out.tensor(f"{prefix}.weight"), out.tensor(f"{prefix}.weight_scale"),
                         out.tensor(f"{prefix}.weight_scale_2").float(), torch.float32, 16, swizzle=False)
        want = mxfp4.decode(src.tensor(f"{prefix}.weight"), src.tensor(f"{prefix}.scale")).float()
        assert torch.equal(got, want), prefix


# --------------------------------------------------------------------------- Marlin scales (5)
E4M3_POSITIVE = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 2^-9 .. 448


@pytest.mark.parametrize("largest", [448.0, 256.0, 240.0, 64.0, 1.0, 2.0 ** -3])
def test_marlin_flush_matches_requant_prediction(largest):
    """One layer's block scales: every E4M3 value up to `largest`. vLLM's Marlin preparation zeroes
    exactly those below requant.engines.check.marlin_flush_threshold(largest)."""
    scales = E4M3_POSITIVE[E4M3_POSITIVE <= largest]
    # one scale per group of 4 columns, so the column permutation inside a group changes nothing
    layer = scales.repeat_interleave(4).view(1, -1).to(torch.bfloat16)
    factor, process = vllm.marlin_scale_processing()
    processed, _ = process(layer.clone(), scale_factor=factor(layer, torch.bfloat16), a_dtype=torch.bfloat16)
    zeroed = processed.view(torch.uint8).view(-1, 4).eq(0).all(dim=1)
    predicted = scales < marlin_flush_threshold(largest)
    assert torch.equal(zeroed, predicted), (largest, scales[zeroed != predicted].tolist())
    if largest >= 2.0 ** 5:
        assert predicted.any()   # the rule flushes something here, so the comparison is not vacuous


# -------------------------------------------------------------------------- kernel choice (4)
@pytest.mark.parametrize("gpu", vllm.GPUS)
def test_kernel_selection_matches_rules(gpu):
    """vLLM's own backend selectors, on a GPU of that family, for every combination of install
    conditions, return the backend requant's rules name (engines.vllm.kernels.<fmt>.<gpu>.selects),
    the same for hash-routed and normal layers and for every W4A16 group size / scheme."""
    rules = ModelSpec.for_config({"model_type": "deepseek_v4"}).engine("vllm", wheels.version("vllm"))
    cap = int(gpu.removeprefix("sm_"))
    for deviations in DEVIATIONS:
        picked = vllm.kernel_selection(cap, installed(deviations))
        for fmt, backends in picked.items():
            want = rules.kernel(fmt, gpu).selected(deviations)
            assert want is not None, f"recipe has no selects for vllm {fmt} {gpu}"
            assert set(backends) == {want}, (fmt, gpu, sorted(deviations), backends)
