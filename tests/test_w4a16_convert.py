"""End to end: synth -> requant convert --out w4a16 -> every output tensor checked independently,
the config checked against what vLLM probes, and the refused option combinations."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors import safe_open

from requant.cli import cli
from requant.formats import int4, int4_search_c, mxfp4

EXPERT = re.compile(r"^(?P<block>(layers|mtp)\.\d+)\.ffn\.experts\.(?P<e>\d+)\.(?P<proj>w[123])\.(?P<part>\w+)$")
VLLM_LAYERS = 5   # synth's default num_hidden_layers: vLLM builds the MTP block as model.layers.5
SGLANG_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def engine_probe(engine: str, block: str, proj: str) -> str:
    """The module name each engine release asks compressed-tensors about for a block's experts
    (vLLM 0.33.0: nvidia/model.py ckpt_names, mtp.py layer numbering; SGLang 0.5.23:
    compressed_tensors.py get_moe_scheme, deepseek_v4_nextn.py model.decoder)."""
    n = int(block.split(".")[1])
    if engine == "vllm":
        return f"model.layers.{n + (VLLM_LAYERS if block.startswith('mtp.') else 0)}.ffn.experts.0.{proj}"
    module = "model.decoder" if block.startswith("mtp.") else f"model.layers.{n}"
    return f"{module}.mlp.experts.0.{SGLANG_NAMES[proj]}"


def _tensors(path):
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    return out, index


def _raw(t):
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _matches(target, name):
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


@pytest.mark.parametrize("group,scheme,engine", [(128, "sym", "vllm"), (32, "asym", "vllm"), (64, "sym", "sglang")])
def test_convert_w4a16_every_tensor(small_source, tmp_path, group, scheme, engine):
    dst = str(tmp_path / "out")
    result = CliRunner().invoke(cli, ["convert", small_source, dst, "--out", "w4a16", "--group-size", str(group),
                                      "--scheme", scheme, "--engine", engine, "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    if not torch.cuda.is_available():   # encoded by CPU worker processes: the summary says by which encoder
        assert json.loads(result.output)["summary"].endswith(f"; CPU encoder: {int4_search_c.status()}")
    src, _ = _tensors(small_source)
    out, index = _tensors(dst)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    config = json.load(open(os.path.join(dst, "config.json")))
    qc = config["quantization_config"]
    ct = QuantizationConfig.model_validate(qc)          # compressed-tensors parses it
    int4_group = ct.config_groups["group_0"]
    scheme_obj = QuantizationScheme(targets=["Linear"], weights=int4_group.weights)
    assert int4_group.weights.group_size == group and int4_group.weights.symmetric == (scheme == "sym")
    assert qc["scale_fmt"] == "ue8m0" and config["expert_dtype"] == "fp4"
    if engine == "sglang":   # SGLang's own FP8-linear key, and the top-level format its INT4 MoE checks
        assert qc["format"] == "pack-quantized" and list(qc["config_groups"]) == ["group_0"]
        assert qc["linear_fp8_config"]["weight_block_size"] == [128, 128]
    else:
        assert qc["format"] == "mixed-precision" and "linear_fp8_config" not in qc

    signal = error = 0.0
    seen = set()
    for name, s in src.items():
        m = EXPERT.match(name)
        if m:
            if m["part"] != "weight":
                continue
            prefix = name[: -len(".weight")]
            shape = (s.shape[0], s.shape[1] * 2)
            state = {p: out[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
            assert state["weight_packed"].dtype == torch.int32 and state["weight_scale"].dtype == torch.bfloat16
            assert state["weight_shape"].tolist() == list(shape)
            zp = out.get(f"{prefix}.weight_zero_point")
            assert (zp is not None) == (scheme == "asym")
            if zp is not None:
                state["weight_zero_point"] = zp
            seen.update(f"{prefix}.{p}" for p in state)
            theirs = PackedQuantizationCompressor.decompress(state, scheme_obj)["weight"]
            decoded = int4.decode(state["weight_packed"], state["weight_scale"], zp)
            assert torch.equal(theirs, decoded.to(theirs.dtype)), name   # they dequantize in BF16
            x = mxfp4.decode(s.view(torch.uint8), src[prefix + ".scale"].view(torch.uint8))
            signal += float(x.double().square().sum())
            error += float((decoded.double() - x).square().sum())
            # The engine probes <experts>.0.<name> under its own prefix; the INT4 group must match.
            assert _matches(int4_group.targets[0], engine_probe(engine, m["block"], m["proj"]))
        elif name.endswith(".scale") and engine == "sglang":
            assert torch.equal(_raw(out[name]), _raw(s)) and out[name].dtype == s.dtype, name   # read as .scale
            seen.add(name)
        elif name.endswith(".scale"):
            renamed = name[: -len("scale")] + "weight_scale"
            assert name not in out and out[renamed].dtype == torch.float32
            expected = torch.exp2(s.view(torch.uint8).double() - 127)
            assert torch.equal(out[renamed].double(), expected), name
            seen.add(renamed)
            # FP8 linears must not fall into the INT4 group (vLLM name for the same module).
            assert not _matches(int4_group.targets[0], "model." + renamed)
        else:
            assert torch.equal(_raw(out[name]), _raw(s)) and out[name].dtype == s.dtype, name
            seen.add(name)
    assert seen == set(out), sorted(set(out) - seen)[:5]
    sqnr = 10 * torch.log10(torch.tensor(signal / error)).item()
    assert qc["requant_accuracy"]["sqnr_db"] == pytest.approx(sqnr, abs=0.01)
    assert sqnr > (20 if group == 32 else 16)
    assert json.loads(result.output)["tensors_converted"] == qc["requant_accuracy"]["tensors"]
    shown = CliRunner().invoke(cli, ["inspect", dst, "--json"])
    assert json.loads(shown.output)["quantization_config"]["sqnr_db_vs_source"] == qc["requant_accuracy"]["sqnr_db"]


@pytest.mark.parametrize("args,why", [
    (["--out", "w4a16", "--mtp", "keep"], "--mtp convert"),
    (["--out", "w4a16", "--scale-headroom", "2"], "scale-headroom"),
    (["--out", "w4a16", "--input-scale", "1.0"], "input-scale"),
    (["--out", "nvfp4", "--group-size", "32"], "w4a16 only"),
    (["--out", "nvfp4", "--scheme", "asym"], "w4a16 only"),
    (["--out", "w4a16", "--group-size", "48"], "48"),
])
def test_refused_combinations(small_source, tmp_path, args, why):
    dst = str(tmp_path / "out")
    result = CliRunner().invoke(cli, ["convert", small_source, dst, *args, "--quiet"])
    assert result.exit_code != 0
    lines = [l for l in result.output.strip().splitlines() if l]
    assert why in result.output and (len(lines) == 1 or "Usage" in result.output), result.output
    assert not os.path.exists(dst) or not os.listdir(dst)

