"""Per-format rules for how config.json (and hf_quant_config.json) dispatch the routed experts, as
vLLM and SGLang read them. Which engine probes reach which group is each engine's own rule
(engine_check); here, the configuration itself."""

from __future__ import annotations

from requant.engine_check import int4_groups
from requant.errors import CheckpointError
from requant.formats import int4, mxfp4, nvfp4
from requant.io.checkpoint import CONFIG_NAME
from requant.verify.context import Context, Layout, Observed

HF_QUANT_CONFIG = "hf_quant_config.json"


def _check_quantized_layers(ctx: Context, layout: Layout, label: str, layers) -> None:
    model, out = ctx.model, ctx.out
    if not isinstance(layers, dict) or not layers:
        out.add("warning", "quantized-layers-missing", f"{label} has no quantized_layers map (SGLang dispatches "
                "ModelOpt mixed-precision checkpoints per layer from it)")
        return
    for block, codec in layout.codecs_by_block.items():
        module = model.experts_module(block)
        entry = layers.get(module)
        if codec is nvfp4.CODEC:
            if not isinstance(entry, dict):
                out.add("error", "quantized-layers", f"{label} quantized_layers omits NVFP4 experts", module)
            elif entry.get("quant_algo") != "NVFP4" or entry.get("group_size", nvfp4.BLOCK) != nvfp4.BLOCK:
                out.add("error", "quantized-layers", f"{label} quantized_layers describes NVFP4 experts wrongly",
                        module, str(entry))
        elif entry is not None:
            out.add("error", "quantized-layers", f"{label} quantized_layers lists experts that are not NVFP4",
                    module, f"stored as {codec.name}")


def check_nvfp4_config(ctx: Context, layout: Layout, seen: Observed) -> None:
    model, out = ctx.model, ctx.out
    config = ctx.ck.config
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        out.add("error", "no-quantization-config", "config.json has no quantization_config", CONFIG_NAME)
        return
    if model.nvfp4_quantization_config:
        _check_modelopt_form(ctx, layout, qc, model.nvfp4_quantization_config)
        return
    method = qc.get("quant_method")
    if method not in model.nvfp4_quant_methods:
        out.add("error", "quant-method", "quant_method must stay 'fp8': vLLM and SGLang dispatch DeepSeek-V4 NVFP4 "
                "experts through the FP8 config (block-FP8 attention + moe_quant_algo)", CONFIG_NAME, repr(method))
    dtype = config.get("expert_dtype")
    if dtype is None:
        out.add("info", "expert-dtype-missing", "config.json has no expert_dtype; vLLM defaults it to 'fp4'", CONFIG_NAME)
    elif dtype != "fp4":
        out.add("error", "expert-dtype", "expert_dtype must be 'fp4' for FP4 experts (vLLM builds FP8 experts for "
                "'fp8' and rejects other values)", CONFIG_NAME, repr(dtype))
    algo = qc.get("moe_quant_algo")
    if algo is None:
        out.add("error", "moe-quant-algo", "quantization_config lacks moe_quant_algo: engines build MXFP4 expert "
                "layers and the NVFP4 tensors do not load", CONFIG_NAME)
    elif str(algo).upper() != "NVFP4":
        out.add("error", "moe-quant-algo", "moe_quant_algo is not NVFP4 but the experts are", CONFIG_NAME, repr(algo))
    if qc.get("group_size", nvfp4.BLOCK) != nvfp4.BLOCK:
        out.add("error", "group-size", "group_size must be 16 for NVFP4 (vLLM hard-codes 16)", CONFIG_NAME,
                repr(qc.get("group_size")))
    if qc.get("quant_algo") != "MIXED_PRECISION":
        out.add("warning", "quant-algo", "quant_algo is not MIXED_PRECISION (FP8 attention + NVFP4 experts); "
                "SGLang picks its ModelOpt config from it", CONFIG_NAME, repr(qc.get("quant_algo")))
    _check_quantized_layers(ctx, layout, "config.json", qc.get("quantized_layers"))
    ignore = qc.get("ignore")
    if ignore is not None and not isinstance(ignore, list):
        out.add("error", "ignore", "quantization_config.ignore is not a list", CONFIG_NAME)
        ignore = None
    for block, codec in layout.codecs_by_block.items():
        module = model.experts_module(block)
        if codec is nvfp4.CODEC and ignore and model.ignored(module, ignore):
            out.add("error", "ignored-nvfp4", "an ignore pattern matches NVFP4 experts (engines honouring it build "
                    "unquantized experts)", module)
        if codec is mxfp4.CODEC and str(algo).upper() == "NVFP4" and ignore is not None and not model.ignored(module, ignore):
            out.add("warning", "mxfp4-not-ignored", "MXFP4 experts are not excluded by ignore", module)
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        if weights and (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != (4, "float", 16):
            out.add("warning", "config-groups", "config_groups weights are not {num_bits 4, float, group_size 16}",
                    CONFIG_NAME, name)
    _check_hf_quant_config(ctx, layout, qc)


def _check_modelopt_form(ctx: Context, layout: Layout, qc: dict, expected: dict) -> None:
    """A model whose NVFP4 output describes itself as ModelOpt exports it (gpt-oss): the method and
    algorithm engines select ModelOpt's NVFP4 config by, in config.json and hf_quant_config.json,
    and no ignore pattern over the NVFP4 experts."""
    out = ctx.out
    for key in ("quant_method", "quant_algo"):
        if qc.get(key) != expected[key]:
            out.add("error", key.replace("_", "-"), f"quantization_config.{key} must be {expected[key]!r} for "
                    f"{ctx.model.name} NVFP4 experts", CONFIG_NAME, repr(qc.get(key)))
    ignore = qc.get("ignore") or []
    for block, codec in layout.codecs_by_block.items():
        module = ctx.model.experts_module(block)
        if codec is nvfp4.CODEC and ctx.model.ignored(module, ignore):
            out.add("error", "ignored-nvfp4", "an ignore pattern matches NVFP4 experts (engines honouring it build "
                    "unquantized experts)", module)
    try:
        hf = (ctx.side_file(HF_QUANT_CONFIG) or {}).get("quantization")
    except CheckpointError as e:
        out.add("error", "hf-quant-config", "hf_quant_config.json cannot be read", detail=str(e))
        return
    if not isinstance(hf, dict) or hf.get("quant_algo") != expected["quant_algo"]:
        out.add("warning", "hf-quant-config", f"hf_quant_config.json does not say quant_algo "
                f"{expected['quant_algo']!r} (ModelOpt writes it beside config.json)", HF_QUANT_CONFIG)


def _check_hf_quant_config(ctx: Context, layout: Layout, qc: dict) -> None:
    out = ctx.out
    try:
        side = ctx.side_file(HF_QUANT_CONFIG)
    except CheckpointError as e:
        out.add("error", "hf-quant-config", "hf_quant_config.json cannot be read", detail=str(e))
        return
    if side is None:
        out.add("warning", "hf-quant-config-missing", "no hf_quant_config.json (SGLang reads the NVFP4 details of "
                "DeepSeek-V4 from it)", HF_QUANT_CONFIG)
        return
    hf = side.get("quantization")
    if not isinstance(hf, dict):
        out.add("error", "hf-quant-config", "hf_quant_config.json has no 'quantization' object", HF_QUANT_CONFIG)
        return
    for key, other in (("quant_algo", "quant_algo"), ("group_size", "group_size"),
                       ("kv_cache_quant_algo", "kv_cache_quant_algo"), ("quantized_layers", "quantized_layers")):
        if key in hf and other in qc and hf[key] != qc[other]:
            out.add("error", "config-disagreement", f"hf_quant_config.json and config.json disagree on {key}",
                    HF_QUANT_CONFIG, f"{_short(hf[key])} vs {_short(qc[other])}")
    if "exclude_modules" in hf and "ignore" in qc and sorted(hf["exclude_modules"] or []) != sorted(qc["ignore"] or []):
        out.add("error", "config-disagreement", "hf_quant_config.json exclude_modules and config.json ignore disagree",
                HF_QUANT_CONFIG, f"{hf['exclude_modules']} vs {qc['ignore']}")
    _check_quantized_layers(ctx, layout, HF_QUANT_CONFIG, hf.get("quantized_layers"))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_w4a16_config(ctx: Context, layout: Layout, seen: Observed) -> None:
    out = ctx.out
    qc = ctx.ck.config.get("quantization_config")
    if not isinstance(qc, dict):
        out.add("error", "no-quantization-config", "config.json has no quantization_config", CONFIG_NAME)
        return
    if qc.get("quant_method") != "compressed-tensors":
        out.add("error", "quant-method", "W4A16 experts need quant_method 'compressed-tensors'", CONFIG_NAME,
                repr(qc.get("quant_method")))
    if qc.get("quantization_status") not in (None, "compressed"):
        out.add("warning", "quantization-status", "quantization_status is not 'compressed'", CONFIG_NAME,
                repr(qc.get("quantization_status")))
    expert_groups = int4_groups(qc)
    if not expert_groups:
        out.add("error", "config-groups", "config_groups has no 4-bit int weight group for the experts", CONFIG_NAME)
        return
    # Which engine probes reach these groups is each engine's rule (engine_check); here, the
    # groups themselves.
    for group in expert_groups.values():
        weights = group.get("weights") or {}
        size = weights.get("group_size")
        if weights.get("strategy") not in (None, "group"):
            out.add("warning", "strategy", "expert weights strategy is not 'group'", CONFIG_NAME, repr(weights.get("strategy")))
        if size not in int4.CODEC.group_sizes:
            out.add("warning", "group-size", "group_size is not one vLLM's Marlin WNA16 MoE accepts "
                    f"({', '.join(map(str, int4.CODEC.group_sizes))})", CONFIG_NAME, repr(size))
        if seen.group_sizes and size not in seen.group_sizes:
            out.add("error", "group-size", "config group_size disagrees with the weight_scale shapes", CONFIG_NAME,
                    f"config {size}, tensors {sorted(seen.group_sizes)}")
        symmetric = weights.get("symmetric", True)
        if symmetric and seen.zero_points:
            out.add("warning", "zero-point", "symmetric scheme but weight_zero_point tensors are present", CONFIG_NAME)
        if not symmetric and not seen.zero_points:
            out.add("error", "zero-point", "asymmetric scheme but no weight_zero_point tensors", CONFIG_NAME)
        fmt = group.get("format") or qc.get("format")
        if fmt not in ("pack-quantized", "mixed-precision"):
            out.add("warning", "ct-format", "experts' compressed-tensors format is not pack-quantized", CONFIG_NAME, repr(fmt))


CONFIG_RULES = {nvfp4.CODEC: check_nvfp4_config, int4.CODEC: check_w4a16_config}
