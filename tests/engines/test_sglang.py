"""Conformance tier, SGLang half: SGLang 0.5.23's own start-up and loading code (tests/engines/
sglang_harness.py, executed from the release wheel) over requant's outputs.

Positive: every layout requant writes for --engine sglang loads with no problem, each routed-expert
layer gets the method requant's rules name (requant/engines/releases/sglang-*.json), and the NextN
block's experts load in the format the rules say. Negative: each broken layout of issue 9 that
concerns SGLang (M2, M3, the top-level format refusal, M5, M7) is reproduced and the specific
problem found.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from requant.convert import convert
from requant.errors import UnsupportedError
from requant.model import ModelSpec
from requant.targets import Options
from requant.targets.w4a16 import W4A16Options
from requant.verify import verify
from tests.engines import wheels

if not wheels.available("sglang"):
    pytest.skip(f"sglang=={wheels.ENGINES['sglang']} wheel not available in {wheels.CACHE} (pip download failed "
                "or REQUANT_NO_WHEEL_FETCH set): SGLang conformance tier skipped", allow_module_level=True)

from tests.engines.sglang_harness import GPU_CAPABILITY, loaded_format, reset, sglang_load_report  # noqa: E402
from tests.engines.outputs import SMALL, source_and_outputs  # noqa: E402

GPUS = list(GPU_CAPABILITY)
OLD_W4A16_TARGET = r"re:.*\.ffn\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"   # requant's target before issue 9


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    """The stand-in sglang.* (and einops) modules the harness places leave with this module's tests."""
    yield
    reset()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A 3-layer synthetic source (one compressed-attention layer, one MTP block) and requant's
    outputs from it."""
    outputs = {"nvfp4": ("nvfp4", Options(engine="sglang")), "nvfp4_vllm": ("nvfp4", Options(engine="vllm")),
               "w4a16": ("w4a16", Options(engine="sglang")), "w4a16_vllm": ("w4a16", Options(engine="vllm")),
               "w4a16_g32": ("w4a16", Options(engine="sglang", target=W4A16Options(group_size=32))),
               # asym for SGLang is refused by requant's rules; --force writes it to show the engine fails
               "w4a16_asym": ("w4a16", Options(engine="sglang", target=W4A16Options(32, "asym"), force=True))}
    return source_and_outputs(tmp_path_factory.mktemp("sglang"), SMALL, 3, outputs, source_name="src")


@pytest.fixture(scope="module")
def rules(ckpts):
    with open(f"{ckpts['src']}/config.json") as f:
        return ModelSpec.for_config(json.load(f)).engine("sglang", wheels.version("sglang"))


def variant(ckpts, tmp_path, base, edit):
    """A copy of output `base` whose quantization_config `edit` changed."""
    path = tmp_path / base
    shutil.copytree(ckpts[base], path)
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def main_methods(report):
    return report.method(nextn=False)


def nextn_format(report):
    return loaded_format(report.params["model.decoder.mlp.experts"])


# ---------------------------------------------------------------------------------------------
# positive: requant's --engine sglang outputs (and the stock source) load completely
# ---------------------------------------------------------------------------------------------
# the backend each GPU family runs: the default, or the flag requant's rules tell the user to pass
SERVED = [(fmt, gpu) for fmt in ("mxfp4", "nvfp4", "w4a16") for gpu in GPUS]


def served_backend(rules, fmt, gpu):
    """(the --moe-runner-backend requant's serve command passes, the method it then gives the main layers)."""
    how = rules.serving(fmt, gpu)
    return (re.search(r"--moe-runner-backend (\S+)", how.flags).group(1) if how.flags else "auto"), how.kernel.method


@pytest.mark.parametrize("fmt,gpu", SERVED)
def test_sglang_output_loads_completely(ckpts, rules, fmt, gpu):
    path = ckpts["src" if fmt == "mxfp4" else fmt]
    backend, method = served_backend(rules, fmt, gpu)
    report = sglang_load_report(path, gpu, backend)
    assert report.problems == []
    assert main_methods(report) == {method}
    assert nextn_format(report) == rules.mtp_format(fmt)
    for prefix, params in report.params.items():
        if not prefix.startswith("model.decoder."):
            assert loaded_format(params) == fmt, prefix


def test_nvfp4_expert_parameters_are_the_methods_own(ckpts):
    """Names, dtypes and shapes come from ModelOptNvFp4FusedMoEMethod.create_weights (E=8, H=256,
    I=128 here), and the engine's FusedMoE.weight_loader copied every expert tensor into them."""
    report = sglang_load_report(ckpts["nvfp4"], "sm_100")
    params = report.params["model.layers.0.mlp.experts"]
    assert params["w13_weight"] == ("uint8", (8, 256, 128))
    assert params["w13_weight_scale"] == ("float8_e4m3fn", (8, 256, 16))
    assert params["w13_weight_scale_2"] == ("float32", (8, 2))
    assert params["w2_input_scale"] == ("float32", (8,))
    layers, experts = 3, 8
    assert report.loads["w13_weight <- uint8"] == layers * experts * 2
    assert report.loads["w2_weight_scale <- float8_e4m3fn"] == layers * experts
    assert report.loads["w13_weight <- int8"] == experts * 2       # NextN, MXFP4
    assert report.loads["w13_weight_scale_inv <- float8_e8m0fnu"] == experts * 2


def test_w4a16_attention_goes_through_linear_fp8_config(ckpts):
    """SGLang's own _dequant_fp8 turns wo_a into BF16 from its kept `.scale`; the fused wqkv_a gets
    its scale as weight_scale_inv."""
    report = sglang_load_report(ckpts["w4a16"], "sm_90", "marlin")
    assert report.quant_config == "CompressedTensorsConfig"
    attentions = 3 + 1   # main layers and the NextN block
    assert report.loads["self_attn.wo_a.weight <- bfloat16"] == attentions
    assert report.loads["self_attn.wqkv_a.weight_scale_inv <- float8_e8m0fnu"] == attentions


@pytest.mark.parametrize("name,group", [("w4a16", 128), ("w4a16_g32", 32)])
def test_w4a16_group_sizes_load(ckpts, rules, name, group):
    report = sglang_load_report(ckpts[name], "sm_90", "marlin")
    assert report.problems == []
    assert main_methods(report) == {rules.kernel("w4a16", "sm_90").method}
    # CompressedTensorsWNA16MoE.create_weights: transposed, one scale row per group (E=8, H=256, I=128)
    assert report.params["model.layers.0.mlp.experts"]["w13_weight_scale"] == ("bfloat16", (8, 256 // group, 256))
    assert report.loads["w13_weight_scale <- bfloat16"] == (3 + 1) * 8 * 2


def test_asymmetric_w4a16_zero_points_do_not_load(ckpts):
    """SGLang 0.5.23 registers zero points as [groups, out/8] per expert and its FusedMoE loader
    copies them without the transpose it gives every other compressed-tensors tensor, so the
    compressed-tensors layout [out/8, groups] that requant writes fails the copy: an engine limit,
    which requant's rules for SGLang refuse (convert) and flag (verify)."""
    report = sglang_load_report(ckpts["w4a16_asym"], "sm_90", "marlin")
    assert main_methods(report) == {"CompressedTensorsWNA16MoE"}
    with pytest.raises(UnsupportedError, match="--scheme asym"):
        convert(ckpts["src"], ckpts["w4a16_asym"] + "-refused", "w4a16",
                Options(engine="sglang", target=W4A16Options(32, "asym")), progress=False)
    assert "w4a16-scheme" in {f["code"] for f in verify(ckpts["w4a16_asym"], progress=False)["findings"]
                              if f["severity"] == "error"}
    assert any(p.startswith("model.layers.0.mlp.experts.w13_weight_zero_point: SGLang's weight loader fails on (16, 8)")
               for p in report.problems)
    assert {p.split(":")[0] for p in report.problems} <= {
        f"{pre}.mlp.experts.{w}_weight_zero_point" for pre in ("model.layers.0", "model.layers.1", "model.layers.2",
                                                                "model.decoder") for w in ("w13", "w2")}


# ---------------------------------------------------------------------------------------------
# negative: the broken layouts of issue 9, each reproduced and its problem found
# ---------------------------------------------------------------------------------------------
def test_m2_old_w4a16_target_gives_the_fp8_moe_method(ckpts, tmp_path):
    """The layout requant wrote before issue 9: the vLLM one (an FP8 `Linear` group) with the
    `.ffn.` expert target that SGLang's `.mlp.experts.0.gate_proj` probe misses."""
    path = variant(ckpts, tmp_path, "w4a16_vllm", lambda qc: qc["config_groups"]["group_0"].update(targets=[OLD_W4A16_TARGET]))
    report = sglang_load_report(path, "sm_90", "marlin")
    assert main_methods(report) == {"CompressedTensorsW8A8Fp8MoE"}   # the FusedMoE class target: FP8
    # the W4A16 scales reach FP8 block-scale parameters of another shape: the engine's loader fails
    assert any(re.match(r"model\.layers\.\d\.mlp\.experts\.w13_weight_scale: SGLang's weight loader fails", p)
               for p in report.problems)
    assert "layers.0.ffn.experts.0.w1.weight_packed: reaches no parameter (SGLang skips it)" in report.problems


def test_old_target_on_the_sglang_layout_finds_no_scheme(ckpts, tmp_path):
    """Without an FP8 `Linear` group there is not even the FP8 fallback: no target at all."""
    path = variant(ckpts, tmp_path, "w4a16", lambda qc: qc["config_groups"]["group_0"].update(targets=[OLD_W4A16_TARGET]))
    report = sglang_load_report(path, "sm_90", "marlin")
    assert ("model.layers.0.mlp.experts: refuses to start: ValueError: Unable to find matching target for "
            "model.layers.0.mlp.experts.0.gate_proj in the compressed-tensors config.") in report.problems


def test_sglang_w4a16_without_linear_fp8_config_has_no_scheme_for_attention(ckpts, tmp_path):
    """linear_fp8_config is what gives the FP8-block linears a method in the SGLang layout."""
    path = variant(ckpts, tmp_path, "w4a16", lambda qc: qc.pop("linear_fp8_config"))
    report = sglang_load_report(path, "sm_90", "marlin")
    assert ("model.layers.0.self_attn.wqkv_a: refuses to start: ValueError: Unable to find matching target for "
            "model.layers.0.self_attn.wqkv_a in the compressed-tensors config.") in report.problems


def test_top_level_mixed_precision_format_is_refused(ckpts):
    """The vLLM layout's top-level format: CompressedTensorsWNA16MoE reads the TOP-LEVEL format."""
    report = sglang_load_report(ckpts["w4a16_vllm"], "sm_90", "marlin")
    assert any("refuses to start: ValueError" in p and "pack-quantized" in p for p in report.problems)


def test_m3_vllm_w4a16_attention_scales_are_not_loaded(ckpts, tmp_path):
    """The vLLM W4A16 layout with only its top-level format changed, so the experts build and the
    attention loading is reached: renamed `.weight_scale` scales go nowhere, wo_a gets raw FP8."""
    path = variant(ckpts, tmp_path, "w4a16_vllm", lambda qc: qc.update(format="pack-quantized"))
    report = sglang_load_report(path, "sm_90", "marlin")
    assert main_methods(report) == {"CompressedTensorsWNA16MoE"}
    assert "layers.0.attn.wq_a.weight_scale: reaches no parameter (SGLang skips it)" in report.problems
    assert "layers.0.attn.wo_a.weight_scale: reaches no parameter (SGLang skips it)" in report.problems
    assert ("model.layers.0.self_attn.wo_a.weight: raw FP8 bytes (torch.float8_e4m3fn) copied into a "
            "torch.bfloat16 parameter") in report.problems


def test_m5_converted_mtp_experts_are_skipped(ckpts, rules):
    report = sglang_load_report(ckpts["nvfp4_vllm"], "sm_100")
    assert nextn_format(report) == rules.mtp_format("nvfp4") == "mxfp4"
    for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
        assert f"mtp.0.ffn.experts.0.w1.{suffix}: reaches no parameter (SGLang skips it)" in report.problems
    assert ("parameters left at their initial values (no checkpoint tensor loads them): "
            "['model.decoder.mlp.experts.w13_weight_scale_inv', 'model.decoder.mlp.experts.w2_weight_scale_inv']"
            ) in report.problems
    assert not any(p.startswith(("layers.", "model.layers.")) for p in report.problems)   # main layers fine


# M7 (NVFP4 refused on Hopper/Ampere without --moe-runner-backend marlin) and every other kernel
# choice: tests/engines/test_sglang_kernels.py, against the engine answers requant's release data records.
