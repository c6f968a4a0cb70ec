"""Conformance tier, vLLM half, gpt-oss: the vLLM release's own gpt-oss loader on tiny checkpoints.

The checkpoints come from a small builder here (the next phase replaces it with
`requant synth --model gpt-oss-20b`): the MXFP4 release layout (openai/gpt-oss-20b), and NVFP4
in the two layouts a ModelOpt-style export could take: stacked as ModelOpt's own HF export
writes gpt-oss (hf_export_handlers.py _export_bmm_experts), and per expert. What vLLM does with
each is executed (vllm_gptoss_harness.py) and pinned here, so a vLLM release that changes it
fails these tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from requant.formats import mxfp4, nvfp4

from . import wheels

if not wheels.available("vllm"):
    pytest.skip(f"vllm=={wheels.version('vllm')} wheel not available in {wheels.CACHE}: vLLM gpt-oss tier skipped",
                allow_module_level=True)

from . import vllm_gptoss_harness as oss  # noqa: E402

# gpt-oss-20b's shapes, scaled down: hidden and intermediate multiples of 32 (MXFP4 blocks)
DIMS = SimpleNamespace(layers=2, experts=4, hidden=64, intermediate=64, heads=4, kv_heads=2, head_dim=16, vocab=32,
                       top_k=2)
ENGINE = f"vLLM {oss.VERSION}"


# --------------------------------------------------------------------------------------- builder
def config(d, quantization_config: dict) -> dict:
    """config.json with openai/gpt-oss-20b's keys (values scaled down where they are dims)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": d.top_k,
        "num_experts_per_tok": d.top_k, "head_dim": d.head_dim, "hidden_act": "silu", "hidden_size": d.hidden,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": d.intermediate,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.layers)],
        "max_position_embeddings": 131072, "num_attention_heads": d.heads, "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads, "num_local_experts": d.experts, "output_router_logits": False,
        "quantization_config": quantization_config, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": d.vocab,
    }


MXFP4_QUANT = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
# what ModelOpt's export writes into config.json for NVFP4 (convert_hf_config.py
# convert_hf_quant_config_format), with attention, router, embedding and head left BF16
NVFP4_QUANT = {"config_groups": {"group_0": {
                   "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                   "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                   "targets": ["Linear"]}},
               "ignore": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*", "model.layers.*.mlp.router*"],
               "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}


def write(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True)
    shard = "model-00000-of-00001.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: shard for k in tensors}}))
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def mxfp4_release(d, seed: int) -> dict[str, torch.Tensor]:
    """The MXFP4 release's tensors (names, dtypes, shapes of openai/gpt-oss-20b): experts stacked
    per layer, *_blocks U8 [E, out, in/32, 16] + *_scales U8 [E, out, in/32] + BF16 biases, gate/up
    rows interleaved (gate even, up odd) in gate_up_proj; attention with biases and sinks."""
    g = torch.Generator().manual_seed(seed)
    bf16 = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)   # noqa: E731
    E, H, I, q, kv = d.experts, d.hidden, d.intermediate, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {"model.embed_tokens.weight": bf16(d.vocab, H), "model.norm.weight": bf16(H), "lm_head.weight": bf16(d.vocab, H)}
    for i in range(d.layers):
        p = f"model.layers.{i}"
        out.update({
            f"{p}.input_layernorm.weight": bf16(H), f"{p}.post_attention_layernorm.weight": bf16(H),
            f"{p}.self_attn.q_proj.weight": bf16(q, H), f"{p}.self_attn.q_proj.bias": bf16(q),
            f"{p}.self_attn.k_proj.weight": bf16(kv, H), f"{p}.self_attn.k_proj.bias": bf16(kv),
            f"{p}.self_attn.v_proj.weight": bf16(kv, H), f"{p}.self_attn.v_proj.bias": bf16(kv),
            f"{p}.self_attn.o_proj.weight": bf16(H, q), f"{p}.self_attn.o_proj.bias": bf16(H),
            f"{p}.self_attn.sinks": bf16(d.heads),
            f"{p}.mlp.router.weight": bf16(E, H), f"{p}.mlp.router.bias": bf16(E),
            f"{p}.mlp.experts.gate_up_proj_bias": bf16(E, 2 * I), f"{p}.mlp.experts.down_proj_bias": bf16(E, H),
        })
        for proj, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            out[f"{p}.mlp.experts.{proj}_blocks"] = torch.randint(0, 256, (E, rows, k // 32, 16), generator=g,
                                                                  dtype=torch.uint8)
            # E8M0 exponents around 2^-7, spread over a few octaves per expert
            out[f"{p}.mlp.experts.{proj}_scales"] = torch.randint(114, 124, (E, rows, k // 32), generator=g,
                                                                  dtype=torch.uint8)
    return out


def nvfp4_stacked(blocks: torch.Tensor, scales: torch.Tensor):
    """The lossless NVFP4 cast of one stacked MXFP4 tensor (experts x rows x K) with ONE global
    scale for the whole tensor, as ModelOpt's single per-tensor weight quantizer of GptOssExperts
    gives it: weight U8 [E, rows, K/2], weight_scale E4M3 [E, rows, K/16], weight_scale_2 F32."""
    E, rows, groups, _ = blocks.shape
    w, s = blocks.reshape(E * rows, groups * 16).numpy(), scales.reshape(E * rows, groups).numpy()
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s))
    return (torch.from_numpy(cast.weight).view(E, rows, -1),
            torch.from_numpy(cast.weight_scale).view(E, rows, -1).view(torch.float8_e4m3fn),
            torch.tensor(cast.weight_scale_2, dtype=torch.float32))


def nvfp4_modelopt_export(src: dict[str, torch.Tensor], d) -> dict[str, torch.Tensor]:
    """NVFP4 experts in ModelOpt's own HF export layout for GptOssExperts: the stacked names of
    the BF16 module (gate_up_proj, down_proj) in its (E, in, out) orientation, packed along `in`
    (unified_export_hf.py _export_quantized_weight: maybe_transpose_expert_weight_dimensions
    before and after quantizing), scales named <proj>_weight_scale / _weight_scale_2 /
    _input_scale (quantizer_attr_names), biases unchanged."""
    out = {k: v for k, v in src.items() if "_blocks" not in k and "_scales" not in k}
    for i in range(d.layers):
        p = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            w, s, s2 = nvfp4_stacked(src[f"{p}.{proj}_blocks"], src[f"{p}.{proj}_scales"])
            out[f"{p}.{proj}"] = w.transpose(1, 2)
            out[f"{p}.{proj}_weight_scale"] = s.transpose(1, 2)
            out[f"{p}.{proj}_weight_scale_2"] = s2
            out[f"{p}.{proj}_input_scale"] = torch.tensor(1.0, dtype=torch.float32)
    return out


def nvfp4_per_expert(src: dict[str, torch.Tensor], d) -> dict[str, torch.Tensor]:
    """NVFP4 experts one module per expert (mlp.experts.<e>.gate_up_proj.{weight, weight_scale,
    weight_scale_2, input_scale, bias}), weights in the (in, out) orientation gpt_oss.py's
    per-expert loader transposes (GptOssRoutedExperts._load_unquantized_expert)."""
    out = {k: v for k, v in src.items() if not k.split(".")[-1].startswith(("gate_up_proj", "down_proj"))}
    for i in range(d.layers):
        p = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            w, s, s2 = nvfp4_stacked(src[f"{p}.{proj}_blocks"], src[f"{p}.{proj}_scales"])
            for e in range(d.experts):
                out.update({f"{p}.{e}.{proj}.weight": w[e].t(), f"{p}.{e}.{proj}.weight_scale": s[e].t(),
                            f"{p}.{e}.{proj}.weight_scale_2": s2.clone(),
                            f"{p}.{e}.{proj}.input_scale": torch.tensor(1.0, dtype=torch.float32),
                            f"{p}.{e}.{proj}.bias": src[f"{p}.{proj}_bias"][e].clone()})
    return out


def nvfp4_vllm_names(src: dict[str, torch.Tensor], d) -> dict[str, torch.Tensor]:
    """NVFP4 experts stacked under vLLM's own parameter names (mlp.experts.w13_weight, ...),
    each in the shape ModelOptNvFp4FusedMoE registers, the weight and block scale in the
    (E, in, out) orientation _load_weights_other permutes back: the closest a checkpoint can come
    to what the engine holds."""
    out = {k: v for k, v in src.items() if not k.split(".")[-1].startswith(("gate_up_proj", "down_proj"))}
    E = d.experts
    for i in range(d.layers):
        p = f"model.layers.{i}.mlp.experts"
        for proj, param, shards in (("gate_up_proj", "w13", (E, 2)), ("down_proj", "w2", (E,))):
            w, s, s2 = nvfp4_stacked(src[f"{p}.{proj}_blocks"], src[f"{p}.{proj}_scales"])
            out.update({f"{p}.{param}_weight": w.transpose(1, 2), f"{p}.{param}_weight_scale": s.transpose(1, 2),
                        f"{p}.{param}_weight_scale_2": s2.expand(shards).clone(),
                        f"{p}.{param}_input_scale": torch.ones(shards, dtype=torch.float32),
                        f"{p}.{param}_bias": src[f"{p}.{proj}_bias"]})
    return out


@pytest.fixture(scope="module", autouse=True)
def _engine_stand_ins():
    yield
    oss.reset()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vllm-gptoss")
    src = mxfp4_release(DIMS, seed=5)
    return {"mxfp4": write(root / "mxfp4", config(DIMS, MXFP4_QUANT), src),
            "nvfp4-modelopt": write(root / "nvfp4-modelopt", config(DIMS, NVFP4_QUANT), nvfp4_modelopt_export(src, DIMS)),
            "nvfp4-per-expert": write(root / "nvfp4-per-expert", config(DIMS, NVFP4_QUANT), nvfp4_per_expert(src, DIMS)),
            "nvfp4-vllm-names": write(root / "nvfp4-vllm-names", config(DIMS, NVFP4_QUANT), nvfp4_vllm_names(src, DIMS)),
            "src": src}


# --------------------------------------------------------------------------------------- MXFP4
def test_mxfp4_release_loads_every_tensor(ckpts):
    """The release layout: gpt_oss_mxfp4 (GptOssMxfp4Config), GptOssMxfp4MoEMethod on every
    layer, attention unquantized, every tensor reaching a parameter, every parameter written."""
    result = oss.gptoss_load(ckpts["mxfp4"])
    assert result.dispatch.name == "gpt_oss_mxfp4"
    assert set(result.methods.values()) == {"GptOssMxfp4MoEMethod"}
    assert set(result.linears.values()) == {"UnquantizedLinearMethod"}
    assert result.problems == []


def test_mxfp4_bytes_land_where_the_release_puts_them(ckpts):
    """w13_weight [E, 2I, H/2] is the blocks' bytes, rows in checkpoint order (gate/up interleaved
    as stored: vLLM's swigluoai reads gate = even, up = odd columns of the GEMM output), scales
    E8M0 bytes unchanged, biases by value; q/k/v fused in qkv_proj in that order."""
    src, params = ckpts["src"], oss.gptoss_load(ckpts["mxfp4"]).params
    E, H, I = DIMS.experts, DIMS.hidden, DIMS.intermediate
    for i in range(DIMS.layers):
        p, r = f"model.layers.{i}.mlp.experts", f"layers.{i}.mlp.experts.routed_experts"
        assert torch.equal(params[f"{r}.w13_weight"], src[f"{p}.gate_up_proj_blocks"].reshape(E, 2 * I, H // 2))
        assert torch.equal(params[f"{r}.w13_weight_scale"], src[f"{p}.gate_up_proj_scales"])
        assert torch.equal(params[f"{r}.w2_weight"], src[f"{p}.down_proj_blocks"].reshape(E, H, I // 2))
        assert torch.equal(params[f"{r}.w2_weight_scale"], src[f"{p}.down_proj_scales"])
        assert torch.equal(params[f"{r}.w13_bias"], src[f"{p}.gate_up_proj_bias"])
        assert torch.equal(params[f"{r}.w2_bias"], src[f"{p}.down_proj_bias"])
        qkv = torch.cat([src[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(params[f"layers.{i}.attn.qkv_proj.weight"], qkv)


# --------------------------------------------------------------------------------------- NVFP4
def test_modelopt_config_selects_nvfp4_method_for_experts_only(ckpts):
    """quantization_config {quant_method: modelopt, quant_algo: NVFP4, ignore: [...]} selects
    modelopt_fp4; every expert layer gets ModelOptNvFp4FusedMoE; the ignore list (after
    apply_vllm_mapper turns self_attn into attn) keeps qkv_proj / o_proj unquantized."""
    for name in ("nvfp4-modelopt", "nvfp4-per-expert", "nvfp4-vllm-names"):
        result = oss.gptoss_load(ckpts[name])
        assert result.dispatch.name == "modelopt_fp4"
        assert set(result.methods.values()) == {"ModelOptNvFp4FusedMoE"}
        assert set(result.linears.values()) == {"UnquantizedLinearMethod"}


def test_modelopt_nvfp4_registers_no_expert_bias(ckpts):
    """ModelOptNvFp4FusedMoE.create_weights (modelopt.py) registers no w13_bias / w2_bias, though
    gpt-oss builds its experts with has_bias=True: the expert biases have nowhere to go."""
    params = oss.gptoss_load(ckpts["nvfp4-modelopt"]).params
    names = {k.rsplit(".", 1)[1] for k in params if ".routed_experts." in k}
    assert names == {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2",
                     "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"}


def test_modelopt_export_layout_does_not_load(ckpts):
    """ModelOpt's own gpt-oss export layout through GptOssModel._load_weights_other: the packed
    weights land (the BF16 path transposes (E, in, out) back), the biases raise KeyError, the
    scale tensors match no name and are dropped, so the block scales, global scales and input
    scales stay uninitialised memory."""
    result = oss.gptoss_load(ckpts["nvfp4-modelopt"])
    text = "\n".join(result.problems)
    for i in range(DIMS.layers):
        p, r = f"model.layers.{i}.mlp.experts", f"layers.{i}.mlp.experts.routed_experts"
        # remap_moe_expert_weights inserts routed_experts only where that parameter exists
        assert f"{p}.gate_up_proj_bias: {ENGINE} GptOssModel.load_weights raises KeyError: '{p[6:]}.w13_bias'" in text
        assert f"{p}.down_proj_bias: {ENGINE} GptOssModel.load_weights raises KeyError: '{p[6:]}.w2_bias'" in text
        for proj in ("gate_up_proj", "down_proj"):
            for part in ("weight_scale", "weight_scale_2", "input_scale"):
                assert f"{p}.{proj}_{part}: no {ENGINE} parameter takes it (dropped at load)" in text
        for param in ("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2",
                      "w13_input_scale", "w2_input_scale"):
            assert f"{r}.{param}: never written" in text, param
        assert f"{r}.w13_weight: never written" not in text
    # the packed weights are the only expert tensors that land, in the right orientation
    src = ckpts["src"]
    for i in range(DIMS.layers):
        w, _, _ = nvfp4_stacked(src[f"model.layers.{i}.mlp.experts.gate_up_proj_blocks"],
                                src[f"model.layers.{i}.mlp.experts.gate_up_proj_scales"])
        assert torch.equal(result.params[f"layers.{i}.mlp.experts.routed_experts.w13_weight"], w)


def test_per_expert_layout_does_not_load(ckpts):
    """Per-expert NVFP4 names through the per-expert ("streamed") path: weights and block scales
    land (GptOssRoutedExperts._load_unquantized_expert transposes them), the global and input
    scales match no name and are dropped, the biases fail: gate_up's in the stacked-bias slicing
    (`weight[:, 2 * tp_rank_start:...]` on a 1-D tensor), down's in the params_dict lookup."""
    result = oss.gptoss_load(ckpts["nvfp4-per-expert"])
    text = "\n".join(result.problems)
    for i in range(DIMS.layers):
        p, r = f"model.layers.{i}.mlp.experts", f"layers.{i}.mlp.experts.routed_experts"
        for e in range(DIMS.experts):
            assert (f"{p}.{e}.gate_up_proj.bias: {ENGINE} GptOssModel.load_weights raises IndexError: "
                    "too many indices for tensor of dimension 1") in text
            assert (f"{p}.{e}.down_proj.bias: {ENGINE} GptOssModel.load_weights raises KeyError: "
                    f"'layers.{i}.mlp.experts.{e}.w2_bias'") in text
            for proj in ("gate_up_proj", "down_proj"):
                for part in ("weight_scale_2", "input_scale"):
                    assert f"{p}.{e}.{proj}.{part}: no {ENGINE} parameter takes it (dropped at load)" in text
        for param in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"):
            assert f"{r}.{param}: never written" in text, param
        for param in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            assert f"{r}.{param}: never written" not in text, param
    src = ckpts["src"]
    for i in range(DIMS.layers):
        for proj, param in (("gate_up_proj", "w13"), ("down_proj", "w2")):
            w, s, _ = nvfp4_stacked(src[f"model.layers.{i}.mlp.experts.{proj}_blocks"],
                                    src[f"model.layers.{i}.mlp.experts.{proj}_scales"])
            r = f"layers.{i}.mlp.experts.routed_experts"
            assert torch.equal(result.params[f"{r}.{param}_weight"], w)
            assert torch.equal(result.params[f"{r}.{param}_weight_scale"].view(torch.uint8), s.view(torch.uint8))


def test_vllm_parameter_names_do_not_load(ckpts):
    """Even under vLLM's own parameter names no NVFP4 gpt-oss layout loads: every name containing
    ".w13_weight" / ".w2_weight" takes the BF16 path (`weight[:, :, ...]`, permute, copy_), which
    cannot place the 2-D / 1-D global scales; input scales reach RoutedExperts' weight_loader with
    two arguments (the "all other weights" branch); the biases have no parameter."""
    result = oss.gptoss_load(ckpts["nvfp4-vllm-names"])
    text = "\n".join(result.problems)
    for i in range(DIMS.layers):
        p, r = f"model.layers.{i}.mlp.experts", f"layers.{i}.mlp.experts.routed_experts"
        for param in ("w13", "w2"):
            assert f"{p}.{param}_weight_scale_2: {ENGINE} GptOssModel.load_weights raises IndexError" in text, param
            assert (f"{p}.{param}_input_scale: {ENGINE} GptOssModel.load_weights raises TypeError: "
                    "GptOssRoutedExperts.weight_loader() missing 3 required positional arguments") in text, param
            assert f"{p}.{param}_bias: {ENGINE} GptOssModel.load_weights raises KeyError" in text, param
            for part in ("weight_scale_2", "input_scale"):
                assert f"{r}.{param}_{part}: never written" in text
            for part in ("weight", "weight_scale"):
                assert f"{r}.{param}_{part}: never written" not in text


# ---------------------------------------------------------------------------------------- W4A16
W4A16_GROUP = 32
CT_QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}, "ignore": []}


def w4a16_per_expert(src: dict[str, torch.Tensor], d, weight_shape: bool) -> tuple[dict, dict]:
    """INT4 pack-quantized experts one per expert under vLLM's parameter names
    (mlp.experts.<e>.w13_weight_packed I32 [2I, H/8], w13_weight_scale [2I, H/g], w13_bias [2I], w2_*),
    random codes: the loader test compares bytes, not values. Returns (tensors, expected stacks)."""
    g = torch.Generator().manual_seed(1)
    out = {k: v for k, v in src.items() if not k.split(".")[-1].startswith(("gate_up_proj", "down_proj"))}
    want = {}
    for i in range(d.layers):
        p = f"model.layers.{i}.mlp.experts"
        for proj, param, rows, k in (("gate_up_proj", "w13", 2 * d.intermediate, d.hidden),
                                     ("down_proj", "w2", d.hidden, d.intermediate)):
            packed = torch.randint(-2**31, 2**31 - 1, (d.experts, rows, k // 8), generator=g, dtype=torch.int32)
            scale = torch.rand(d.experts, rows, k // W4A16_GROUP, generator=g).to(torch.bfloat16)
            want[f"layers.{i}.mlp.experts.routed_experts.{param}"] = (packed, scale, src[f"{p}.{proj}_bias"])
            for e in range(d.experts):
                out.update({f"{p}.{e}.{param}_weight_packed": packed[e], f"{p}.{e}.{param}_weight_scale": scale[e],
                            f"{p}.{e}.{param}_bias": src[f"{p}.{proj}_bias"][e].clone()})
                if weight_shape:
                    out[f"{p}.{e}.{param}_weight_shape"] = torch.tensor([rows, k], dtype=torch.int32)
    return out, want


def wna16_method(ckpt: oss.Checkpoint) -> oss.Dispatch:
    """CompressedTensorsWNA16MoEMethod (g32, symmetric INT4) built directly: the config-group
    dispatch for gpt-oss (which probes <layer>.mlp.experts.0.gate_proj/up_proj/down_proj) is not
    executed by this tier yet; what follows it (create_weights, the loader) is."""
    from compressed_tensors.quantization import QuantizationArgs
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=W4A16_GROUP)
    config = SimpleNamespace(get_name=lambda: "compressed-tensors")
    return oss.Dispatch("compressed-tensors", config,
                        lambda prefix: oss.vh._ct_wna16((args, None, oss.gpt_oss_moe_config(ckpt), prefix), {}),
                        lambda prefix: oss.vh.recorder("UnquantizedLinearMethod")())


def test_w4a16_per_expert_loads_with_biases(tmp_path):
    """CompressedTensorsWNA16MoEMethod registers gpt-oss's expert biases, and gpt_oss.py's
    per-expert path (GptOssRoutedExperts._load_packed_expert / _load_expert_bias) puts packed
    weights, group scales and biases where they belong: the W4A16 output layout the vLLM release takes."""
    tensors, want = w4a16_per_expert(mxfp4_release(DIMS, seed=5), DIMS, weight_shape=False)
    result = oss.gptoss_load(write(tmp_path / "w4a16", config(DIMS, CT_QUANT), tensors), wna16_method)
    assert set(result.methods.values()) == {"CompressedTensorsWNA16MoEMethod"}
    # weight_shape is registered but never read by the MoE kernels; with none written it keeps its fill
    assert all(p.split(": ")[0].endswith("_weight_shape") for p in result.problems), result.problems
    assert len(result.problems) == 2 * DIMS.layers
    for prefix, (packed, scale, bias) in want.items():
        assert torch.equal(result.params[f"{prefix}_weight_packed"], packed)
        assert torch.equal(result.params[f"{prefix}_weight_scale"].to(torch.bfloat16), scale)
        assert torch.equal(result.params[f"{prefix}_bias"], bias)


def test_w4a16_weight_shape_breaks_the_gpt_oss_loader(tmp_path):
    """A compressed-tensors weight_shape tensor per expert takes gpt_oss.py's BF16 branch (its
    name contains ".w13_weight") and raises there: requant must not write it for gpt-oss."""
    tensors, _ = w4a16_per_expert(mxfp4_release(DIMS, seed=5), DIMS, weight_shape=True)
    text = "\n".join(oss.gptoss_load(write(tmp_path / "w4a16", config(DIMS, CT_QUANT), tensors), wna16_method).problems)
    for proj in ("w13", "w2"):
        assert (f"model.layers.0.mlp.experts.0.{proj}_weight_shape: {ENGINE} GptOssModel.load_weights raises "
                "IndexError: too many indices for tensor of dimension 1") in text


def test_nvfp4_stacked_cast_is_lossless_here():
    """The builder's cast itself: one global scale per stacked tensor keeps every block of this
    source (its exponents span a few octaves) exactly: decode(NVFP4) == decode(MXFP4)."""
    src = mxfp4_release(DIMS, seed=5)
    blocks, scales = src["model.layers.0.mlp.experts.gate_up_proj_blocks"], src["model.layers.0.mlp.experts.gate_up_proj_scales"]
    w, s, s2 = nvfp4_stacked(blocks, scales)
    E, rows = blocks.shape[:2]
    want = mxfp4.decode(blocks.reshape(E * rows, -1), scales.reshape(E * rows, -1))
    got = nvfp4.decode(w.reshape(E * rows, -1), s.view(torch.uint8).reshape(E * rows, -1), float(s2))
    assert torch.equal(got, want)
