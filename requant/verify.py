"""requant verify: lint an FP4 MoE checkpoint (NVFP4, W4A16 or MXFP4 routed experts), requant's or
anyone's, for the failures that stop serving engines loading it or make them compute garbage.

Checks, in order: the index and shard headers (every indexed tensor present at a valid offset,
total_size), the routed experts' tensors (every projection complete with the right dtypes and
shapes), their scales (finite, positive, fused partners agreeing), how config.json and
hf_quant_config.json dispatch the experts in vLLM and SGLang, and the Hopper (Marlin) fp16
scale-overflow hazard. Tensors are read one expert at a time; only scales are read unless --deep.
"""

from __future__ import annotations

import math
import os
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from requant import card
from requant.compute import compute_device, default_workers
from requant.engine_check import MarlinSpan, int4_groups, judge
from requant.errors import CheckpointError, RequantError, UnsupportedError
from requant.formats import mxfp4, nvfp4
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json, resolve_inside
from requant.io.safetensors import read_header
from requant.model import Expert, ModelSpec
from requant.formats import scalar
from requant.report.weights import DECODE_PARTS, block_size, decode_projection, exactness, projection_format

SEVERITIES = ("error", "warning", "info")
EXAMPLES = 5
HF_QUANT_CONFIG = "hf_quant_config.json"
NVFP4_GROUP = nvfp4.BLOCK
SCALAR_SHAPES = ((), (1,))
MARLIN_INT4_GROUPS = (32, 64, 128)   # group sizes vLLM's Marlin WNA16 MoE accepts (formats.md 3)


@dataclass
class Finding:
    severity: str
    code: str
    message: str
    count: int = 0
    examples: list[str] = field(default_factory=list)


class Findings:
    """Findings grouped by (severity, code, message): one line per kind, with a few tensor names."""

    def __init__(self):
        self._by_key: dict[tuple, Finding] = {}

    def add(self, severity: str, code: str, message: str, where: str | None = None, detail: str | None = None):
        f = self._by_key.setdefault((severity, code, message), Finding(severity, code, message))
        f.count += 1
        if len(f.examples) < EXAMPLES and (where or detail):
            f.examples.append(f"{where}: {detail}" if where and detail else where or detail)

    def sorted(self) -> list[Finding]:
        return sorted(self._by_key.values(), key=lambda f: SEVERITIES.index(f.severity))

    def count(self, severity: str) -> int:
        return sum(1 for f in self._by_key.values() if f.severity == severity)


# ------------------------------------------------------------------------------------------------
# index and shards


def open_leniently(path: str, out: Findings) -> Checkpoint | None:
    """Open what can be opened, reporting every unreadable shard or index mismatch as a finding."""
    try:
        config = read_json(os.path.join(path, CONFIG_NAME))
        index_path = os.path.join(path, INDEX_NAME)
        if not os.path.exists(index_path):
            return Checkpoint.open(path)   # single-file checkpoint: nothing to cross-check
        index = read_json(index_path)
    except CheckpointError as e:
        out.add("error", "unreadable", "checkpoint cannot be opened", detail=str(e))
        return None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        out.add("error", "index", "weight_map is missing or not a map of tensor name to shard file", INDEX_NAME)
        return None
    headers = {}
    for shard in dict.fromkeys(weight_map.values()):
        try:
            shard_path = resolve_inside(path, shard, "shard")
            if not os.path.isfile(shard_path):
                raise CheckpointError("shard named by the index is missing", file=shard_path)
            headers[shard] = read_header(shard_path)
        except CheckpointError as e:
            out.add("error", "shard-unreadable", "shard cannot be read (missing, truncated or corrupt header)",
                    shard, str(e))
    locations: dict[str, str] = {}
    for shard, header in headers.items():
        for name in header.tensors:
            if name in locations:
                out.add("error", "duplicate-tensor", "tensor stored in two shards", name, f"{locations[name]}, {shard}")
            locations[name] = shard
    for name, shard in weight_map.items():
        if shard in headers and locations.get(name) != shard:
            out.add("error", "index-tensor-missing", "tensor named by the index is not in the shard it names",
                    name, shard)
    for name, shard in locations.items():
        if name not in weight_map:
            out.add("warning", "unindexed-tensor", "tensor stored in a shard but absent from the index", name, shard)
    metadata = index.get("metadata") or {}
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is None:
        out.add("info", "no-total-size", "the index has no metadata.total_size")
    elif len(headers) == len(set(weight_map.values())):
        actual = sum(i.nbytes for h in headers.values() for i in h.tensors.values())
        if total != actual:
            out.add("error", "total-size", "index metadata.total_size disagrees with the tensor bytes in the shards",
                    INDEX_NAME, f"total_size {total:,}, shards hold {actual:,}")
    return Checkpoint(path, config, list(headers), headers, locations, metadata if isinstance(metadata, dict) else {})


# ------------------------------------------------------------------------------------------------
# expert structure


def _logical_shape(model: ModelSpec, proj: str) -> tuple[int, int]:
    hidden, inter = model.value("hidden_size"), model.value("intermediate_size")
    return (hidden, inter) if proj == model.recipe["down_projection"] else (inter, hidden)


def expected_parts(fmt: str, rows: int, k: int, group: int | None) -> dict[str, tuple[tuple, tuple | None, bool]]:
    """part -> (accepted dtypes, accepted shapes or None for any, required) of one projection."""
    if fmt == "nvfp4":
        return {"weight": (("U8",), ((rows, k // 2),), True),
                "weight_scale": (("F8_E4M3",), ((rows, k // NVFP4_GROUP),), True),
                "weight_scale_2": (("F32",), SCALAR_SHAPES, True),
                "input_scale": (("F32",), SCALAR_SHAPES, True)}
    if fmt == "w4a16":
        return {"weight_packed": (("I32",), ((rows, k // 8),), True),
                "weight_scale": (("BF16", "F16", "F32"), ((rows, k // group),) if group else (), True),
                "weight_shape": (("I64", "I32"), ((2,),), True),
                "weight_zero_point": (("I32", "I8", "U8", "BF16", "F16", "F32"), None, False)}
    return {"weight": (("I8", "U8"), ((rows, k // 2),), True),
            "scale": (("F8_E8M0",), ((rows, k // mxfp4.BLOCK),), True)}


def _check_structure(ck: Checkpoint, model: ModelSpec, expert: Expert, fmt: str, out: Findings) -> dict[str, str]:
    """Check each projection's parts; return proj -> format for the projections complete enough to read."""
    readable = {}
    module = model.experts_module(expert.block)
    for proj in model.projections:
        parts = expert.parts.get(proj, {})
        prefix = f"{module}.{expert.expert}.{proj}"
        if not parts:
            out.add("error", "missing-projection", "routed expert projection has no tensors", prefix)
            continue
        rows, k = _logical_shape(model, proj)
        group = None
        if fmt == "w4a16" and "weight_scale" in parts:
            cols = ck.info(parts["weight_scale"]).spec.shape[-1]
            group = k // cols if cols and k % cols == 0 else None
        expected = expected_parts(fmt, rows, k, group)
        ok = True
        for part, (dtypes, shapes, required) in expected.items():
            name = f"{prefix}.{part}"
            if part not in parts:
                if required:
                    code = "missing-input-scale" if part == "input_scale" else "missing-part"
                    why = (" (engines divide by it: vLLM emits NaN or empty output)" if part == "input_scale" else "")
                    out.add("error", code, f"{fmt} projection lacks .{part}{why}", name)
                    ok = ok and part == "input_scale"
                continue
            spec = ck.info(parts[part]).spec
            if spec.dtype not in dtypes:
                out.add("error", "wrong-dtype", f"{fmt} .{part} has the wrong dtype", name,
                        f"{spec.dtype}, expected {'/'.join(dtypes)}")
                ok = False
            elif shapes is not None and spec.shape not in shapes:
                out.add("error", "wrong-shape", f"{fmt} .{part} has the wrong shape for config.json's sizes", name,
                        f"{list(spec.shape)}, expected {' or '.join(str(list(s)) for s in shapes)}")
                ok = False
        for part in parts:
            if part not in expected:
                severity = "error" if fmt != "mxfp4" and part == "scale" else "warning"
                out.add(severity, "unexpected-part", f"{fmt} projection carries a tensor engines do not expect "
                        "(a leftover source tensor fails the load)", f"{prefix}.{part}")
        if ok:
            readable[proj] = fmt
    return readable


# ------------------------------------------------------------------------------------------------
# scales


def _bad_scalar(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "infinite"
    if value <= 0:
        return "zero" if value == 0 else "negative"
    return None


def _check_nvfp4_values(ck, model, expert, projs, out, spans):
    module = model.experts_module(expert.block)
    globals_, inputs = {}, {}
    for proj in projs:
        parts = expert.parts[proj]
        prefix = f"{module}.{expert.expert}.{proj}"
        scales = ck.tensor(parts["weight_scale"]).view(torch.float8_e4m3fn).float()
        nan = int(torch.isnan(scales).sum())
        if nan:
            out.add("error", "nan-block-scale", "NaN block scales (E4M3 0x7F/0xFF)", f"{prefix}.weight_scale", f"{nan} blocks")
        negative = int((scales < 0).sum())
        if negative:
            out.add("error", "negative-block-scale", "negative block scales", f"{prefix}.weight_scale", f"{negative} blocks")
        zero = scales == 0
        if zero.any():
            weight = ck.tensor(parts["weight"]).view(torch.uint8)
            codes = (weight.view(weight.shape[0], -1, NVFP4_GROUP // 2) & 0x77).ne(0).any(dim=-1)
            lost = int((zero & codes).sum())
            if lost:
                out.add("warning", "zero-block-scale", "zero block scales over non-zero codes (those weights decode to 0)",
                        f"{prefix}.weight_scale", f"{lost} blocks")
        group = "+".join(_fused_group(model, proj))
        spans.setdefault((expert.block, group), MarlinSpan()).update(scales)
        g = scalar(ck.tensor(parts["weight_scale_2"]))
        globals_[proj] = g
        if (why := _bad_scalar(g)) is not None:
            out.add("error", "bad-global-scale", "weight_scale_2 is not finite and positive", f"{prefix}.weight_scale_2", why)
        if "input_scale" in parts:
            a = scalar(ck.tensor(parts["input_scale"]))
            inputs[proj] = a
            if (why := _bad_scalar(a)) is not None:
                out.add("error", "bad-input-scale", "input_scale is not finite and positive (engines divide by it: "
                        "NaN or empty output)", f"{prefix}.input_scale", why)
    for group in model.recipe["fused_projections"]:
        for values, severity, code, what in (
                (globals_, "error", "fused-global-scale-mismatch",
                 "weight_scale_2 differs between fused projections (vLLM keeps the first and mis-scales the other)"),
                (inputs, "warning", "fused-input-scale-mismatch",
                 "input_scale differs between fused projections (engines keep the max for the pair)")):
            present = {p: values[p] for p in group if p in values}
            if len(set(present.values())) > 1:
                out.add(severity, code, what, f"{module}.{expert.expert}",
                        ", ".join(f"{p}={v:g}" for p, v in present.items()))
    return inputs


def _fused_group(model: ModelSpec, proj: str) -> list[str]:
    for group in model.recipe["fused_projections"]:
        if proj in group:
            return list(group)
    return [proj]


def _check_mxfp4_values(ck, model, expert, projs, out):
    for proj in projs:
        name = expert.parts[proj]["scale"]
        nan = int((ck.tensor(name).view(torch.uint8) == mxfp4.E8M0_NAN).sum())
        if nan:
            out.add("error", "nan-block-scale", "NaN block scales (E8M0 0xFF)", name, f"{nan} blocks")


def _check_w4a16_values(ck, model, expert, projs, out):
    module = model.experts_module(expert.block)
    for proj in projs:
        parts = expert.parts[proj]
        prefix = f"{module}.{expert.expert}.{proj}"
        scales = ck.tensor(parts["weight_scale"]).float()
        for code, mask, what, severity in (
                ("nonfinite-group-scale", ~torch.isfinite(scales), "non-finite group scales", "error"),
                ("negative-group-scale", scales < 0, "negative group scales", "error"),
                ("zero-group-scale", scales == 0, "zero group scales (those weights decode to 0)", "warning")):
            n = int(mask.sum())
            if n:
                out.add(severity, code, what, f"{prefix}.weight_scale", f"{n} groups")
        shape = [int(v) for v in ck.tensor(parts["weight_shape"]).reshape(-1).tolist()]
        if shape != list(_logical_shape(model, proj)):
            out.add("error", "weight-shape-value", "weight_shape does not hold the logical [out, in] shape",
                    f"{prefix}.weight_shape", f"{shape}, expected {list(_logical_shape(model, proj))}")


# ------------------------------------------------------------------------------------------------
# dispatch: config.json and hf_quant_config.json as vLLM and SGLang read them


def _check_quantized_layers(label, layers, model, formats_by_block, out):
    if not isinstance(layers, dict) or not layers:
        out.add("warning", "quantized-layers-missing", f"{label} has no quantized_layers map (SGLang dispatches "
                "ModelOpt mixed-precision checkpoints per layer from it)")
        return
    for block, fmt in formats_by_block.items():
        module = model.experts_module(block)
        entry = layers.get(module)
        if fmt == "nvfp4":
            if not isinstance(entry, dict):
                out.add("error", "quantized-layers", f"{label} quantized_layers omits NVFP4 experts", module)
            elif entry.get("quant_algo") != "NVFP4" or entry.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
                out.add("error", "quantized-layers", f"{label} quantized_layers describes NVFP4 experts wrongly",
                        module, str(entry))
        elif entry is not None:
            out.add("error", "quantized-layers", f"{label} quantized_layers lists experts that are not NVFP4",
                    module, f"stored as {fmt}")


def _check_nvfp4_config(ck, model, formats_by_block, out):
    config = ck.config
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        out.add("error", "no-quantization-config", "config.json has no quantization_config", CONFIG_NAME)
        return
    method = qc.get("quant_method")
    if method not in ("fp8", "deepseek_v4_fp8"):
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
    if qc.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        out.add("error", "group-size", "group_size must be 16 for NVFP4 (vLLM hard-codes 16)", CONFIG_NAME,
                repr(qc.get("group_size")))
    if qc.get("quant_algo") != "MIXED_PRECISION":
        out.add("warning", "quant-algo", "quant_algo is not MIXED_PRECISION (FP8 attention + NVFP4 experts); "
                "SGLang picks its ModelOpt config from it", CONFIG_NAME, repr(qc.get("quant_algo")))
    _check_quantized_layers("config.json", qc.get("quantized_layers"), model, formats_by_block, out)
    ignore = qc.get("ignore")
    if ignore is not None and not isinstance(ignore, list):
        out.add("error", "ignore", "quantization_config.ignore is not a list", CONFIG_NAME)
        ignore = None
    for block, fmt in formats_by_block.items():
        module = model.experts_module(block)
        if fmt == "nvfp4" and ignore and model.ignored(module, ignore):
            out.add("error", "ignored-nvfp4", "an ignore pattern matches NVFP4 experts (engines honouring it build "
                    "unquantized experts)", module)
        if fmt == "mxfp4" and str(algo).upper() == "NVFP4" and ignore is not None and not model.ignored(module, ignore):
            out.add("warning", "mxfp4-not-ignored", "MXFP4 experts are not excluded by ignore", module)
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        if weights and (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != (4, "float", 16):
            out.add("warning", "config-groups", "config_groups weights are not {num_bits 4, float, group_size 16}",
                    CONFIG_NAME, name)
    _check_hf_quant_config(ck, model, qc, formats_by_block, out)


def _check_hf_quant_config(ck, model, qc, formats_by_block, out):
    path = os.path.join(ck.path, HF_QUANT_CONFIG)
    if not os.path.exists(path):
        out.add("warning", "hf-quant-config-missing", "no hf_quant_config.json (SGLang reads the NVFP4 details of "
                "DeepSeek-V4 from it)", HF_QUANT_CONFIG)
        return
    try:
        hf = read_json(path).get("quantization")
    except CheckpointError as e:
        out.add("error", "hf-quant-config", "hf_quant_config.json cannot be read", detail=str(e))
        return
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
    _check_quantized_layers(HF_QUANT_CONFIG, hf.get("quantized_layers"), model, formats_by_block, out)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_w4a16_config(ck, model, formats_by_block, groups_seen, zero_points, out):
    qc = ck.config.get("quantization_config")
    if not isinstance(qc, dict):
        out.add("error", "no-quantization-config", "config.json has no quantization_config", CONFIG_NAME)
        return
    if qc.get("quant_method") != "compressed-tensors":
        out.add("error", "quant-method", "W4A16 experts need quant_method 'compressed-tensors'", CONFIG_NAME,
                repr(qc.get("quant_method")))
    if qc.get("quantization_status") not in (None, "compressed"):
        out.add("warning", "quantization-status", "quantization_status is not 'compressed'", CONFIG_NAME,
                repr(qc.get("quantization_status")))
    int4 = int4_groups(qc)
    if not int4:
        out.add("error", "config-groups", "config_groups has no 4-bit int weight group for the experts", CONFIG_NAME)
        return
    # Which engine probes reach these groups is each engine's rule (engine_check); here, the
    # groups themselves.
    for group in int4.values():
        weights = group.get("weights") or {}
        size = weights.get("group_size")
        if weights.get("strategy") not in (None, "group"):
            out.add("warning", "strategy", "expert weights strategy is not 'group'", CONFIG_NAME, repr(weights.get("strategy")))
        if size not in MARLIN_INT4_GROUPS:
            out.add("warning", "group-size", "group_size is not one vLLM's Marlin WNA16 MoE accepts (32, 64, 128)",
                    CONFIG_NAME, repr(size))
        if groups_seen and size not in groups_seen:
            out.add("error", "group-size", "config group_size disagrees with the weight_scale shapes", CONFIG_NAME,
                    f"config {size}, tensors {sorted(groups_seen)}")
        symmetric = weights.get("symmetric", True)
        if symmetric and zero_points:
            out.add("warning", "zero-point", "symmetric scheme but weight_zero_point tensors are present", CONFIG_NAME)
        if not symmetric and not zero_points:
            out.add("error", "zero-point", "asymmetric scheme but no weight_zero_point tensors", CONFIG_NAME)
        fmt = group.get("format") or qc.get("format")
        if fmt not in ("pack-quantized", "mixed-precision"):
            out.add("warning", "ct-format", "experts' compressed-tensors format is not pack-quantized", CONFIG_NAME, repr(fmt))


# ------------------------------------------------------------------------------------------------


def verify(path: str, deep: bool = False, source: str | None = None, progress: bool = True,
           engine: str | None = None, gpu: str | None = None, device: str | None = None) -> dict:
    """Check checkpoint `path`; return a JSON-able result whose 'ok' is False when errors were found.

    `engine` (vllm, sglang): judge loading by that engine's rules only, its problems as errors;
    None: the engine requant.json names, else every engine the recipe knows. `gpu` (sm_80 ...):
    also name the MoE kernel each judged engine selects on that GPU family. `device` decodes for
    --deep (default: CUDA when present)."""
    out = Findings()
    result = {"path": os.path.abspath(path), "format": None, "experts_checked": 0, "deep": None, "engines": {}}
    ck = open_leniently(path, out)
    if ck is not None:
        try:
            _verify_experts(ck, out, result, deep, source, progress, engine, gpu, device)
        finally:
            ck.close()
    findings = out.sorted()
    result["summary"] = {s: sum(f.count for f in findings if f.severity == s) for s in SEVERITIES}
    result["ok"] = result["summary"]["error"] == 0
    result["findings"] = [asdict(f) for f in findings]
    return result


def _verify_experts(ck, out, result, deep, source, progress, engine, gpu, device):
    try:
        model = ModelSpec.for_config(ck.config, os.path.join(ck.path, CONFIG_NAME))
    except RequantError as e:
        out.add("error", "model", "no recipe for this model; expert checks skipped", detail=str(e))
        return
    experts = model.group_experts(ck.names)
    formats_of = {}
    for e in experts:
        for proj, parts in e.parts.items():
            formats_of[(e.block, e.expert, proj)] = projection_format({p: ck.info(n).spec.dtype for p, n in parts.items()})
    main = Counter(f for (b, _, _), f in formats_of.items() if f and not model.is_mtp(b))
    if not main:
        out.add("error", "no-experts", "no routed experts in a known format (nvfp4, w4a16, mxfp4)")
        return
    dominant = main.most_common(1)[0][0]
    result["format"] = dominant
    formats_by_block = {}
    for e in experts:
        found = Counter(formats_of[(e.block, e.expert, p)] for p in e.parts)
        formats_by_block.setdefault(e.block, Counter()).update(found)
    formats_by_block = {b: (c.most_common(1)[0][0] or dominant) for b, c in formats_by_block.items()}

    n_experts = model.value("num_experts")
    blocks = list(formats_by_block)
    layer_blocks = [b for b in blocks if not model.is_mtp(b)]
    if len(layer_blocks) != model.value("num_layers"):
        out.add("error", "missing-layers", "layers with routed experts do not match num_hidden_layers", CONFIG_NAME,
                f"{len(layer_blocks)} found, {model.value('num_layers')} expected")
    by_key = {(e.block, e.expert): e for e in experts}
    for block in blocks:
        for i in range(n_experts):
            if (block, i) not in by_key:
                out.add("error", "missing-expert", "routed expert has no tensors", f"{model.experts_module(block)}.{i}")
        extra = sorted(i for (b, i) in by_key if b == block and i >= n_experts)
        if extra:
            out.add("warning", "extra-expert", "expert index beyond n_routed_experts", model.experts_module(block), str(extra))

    source_ck = Checkpoint.open(source) if source else None
    source_experts = {(e.block, e.expert): e for e in model.group_experts(source_ck.names)} if source_ck else {}
    deep_stats: dict[str, list[int]] = {}
    spans: dict[tuple[str, str], MarlinSpan] = {}
    input_scales: dict[tuple[str, str], set[float]] = {}
    w4a16_groups, zero_points = set(), False
    # --deep decodes on the GPU when there is one, else on every core (torch's kernels release the GIL).
    device = compute_device(device) if deep else "cpu"
    workers = default_workers()
    deep_pool, deep_pending = ThreadPoolExecutor(workers), deque()
    try:
        for expert in tqdm(experts, unit="expert", desc="verify", disable=not progress, dynamic_ncols=True):
            fmt = formats_by_block[expert.block]
            projs = _check_structure(ck, model, expert, fmt, out)
            if fmt == "nvfp4":
                for proj, a in _check_nvfp4_values(ck, model, expert, projs, out, spans).items():
                    input_scales.setdefault((expert.block, proj), set()).add(a)
            elif fmt == "mxfp4":
                _check_mxfp4_values(ck, model, expert, projs, out)
            else:
                _check_w4a16_values(ck, model, expert, projs, out)
                for p in projs:
                    parts = expert.parts[p]
                    k = ck.info(parts["weight_packed"]).spec.shape[1] * 8
                    w4a16_groups.add(k // ck.info(parts["weight_scale"]).spec.shape[1])
                    zero_points = zero_points or "weight_zero_point" in parts
            if deep:   # decoded by the pool while this loop reads the next experts' scales
                src = source_experts.get((expert.block, expert.expert))
                deep_pending.append((expert, deep_pool.submit(_deep_measure, ck, expert, projs, source_ck, src, device)))
                while len(deep_pending) > 2 * workers:
                    _deep_record(model, *deep_pending.popleft(), deep_stats, out)
            result["experts_checked"] += 1
        while deep_pending:
            _deep_record(model, *deep_pending.popleft(), deep_stats, out)
    finally:
        for _, future in deep_pending:
            future.cancel()
        deep_pool.shutdown(wait=True)
        if source_ck is not None:
            source_ck.close()

    for (block, proj), values in input_scales.items():
        if len(values) > 1:
            out.add("info", "input-scale-spread", "input_scale of one projection varies across a layer's experts "
                    "(W4A4 kernels use the layer maximum)", f"{model.experts_module(block)} {proj}",
                    f"{min(values):g} .. {max(values):g}")
    _judge_engines(ck, model, formats_by_block, dominant, spans, engine, gpu, result, out)
    if dominant == "nvfp4":
        _check_nvfp4_config(ck, model, formats_by_block, out)
    elif dominant == "w4a16":
        _check_w4a16_config(ck, model, formats_by_block, w4a16_groups, zero_points, out)
    if deep:
        result["deep"] = {b: {"blocks": s[0], "exact_blocks": s[1], "nonfinite": s[2]} for b, s in deep_stats.items()}
        blocks_total = sum(s[0] for s in deep_stats.values())
        exact_total = sum(s[1] for s in deep_stats.values())
        if source and blocks_total:
            out.add("info", "deep-compare", f"decoded every block against the source: {exact_total:,} of "
                    f"{blocks_total:,} exact, {blocks_total - exact_total:,} re-quantized")


def _judge_engines(ck, model, formats_by_block, dominant, spans, engine, gpu, result, out):
    """Each engine's verdict. Problems are errors for the engine the output is served with (named,
    or recorded in requant.json at conversion); with none known, warnings per engine, and an
    error only when no engine loads the checkpoint correctly."""
    made_for = (card.recorded_engine(ck.path) or {}).get("name")
    names = [engine] if engine else [made_for] if made_for in model.engine_names else model.engine_names
    strict = len(names) == 1
    for name in names:
        verdict, found = judge(model.engine(name), model, ck.config, formats_by_block, dominant, spans, gpu,
                               _fp8_linear_scale_names(ck, model))
        result["engines"][name] = asdict(verdict)
        for code, message, where, detail in found:
            severity = ("info" if code == "kernel" else "warning" if code in ("marlin-flush", "marlin-unguarded")
                        else "error" if strict else "warning")
            out.add(severity, code, message, where, detail)
    if not strict and not any(v["loads"] for v in result["engines"].values()):
        out.add("error", "no-engine", "no engine release requant knows loads this checkpoint correctly (see the "
                "warnings above)")


def _fp8_linear_scale_names(ck, model) -> set[str]:
    """The suffixes the FP8-block linears' scales carry: the source's `scale`, compressed-tensors'
    `weight_scale`, or `weight_scale_inv`."""
    found = set()
    for name in ck.names:
        if name.endswith(".weight") and model.expert_tensor(name) is None and ck.info(name).spec.dtype == "F8_E4M3":
            base = name[: -len("weight")]
            found.update(s for s in ("scale", "weight_scale", "weight_scale_inv") if base + s in ck.locations)
    return found


def _deep_measure(ck, expert, projs, source_ck, src, device) -> list[tuple]:
    """Decode one expert's projections (and, with --source, the source's) on `device`; per
    projection ("skipped", why), ("no-source", proj) or ("ok", proj, blocks, exact blocks, non-finite)."""
    found = []
    for proj, fmt in projs.items():
        parts = expert.parts[proj]
        tensors = {p: ck.tensor(n).to(device) for p, n in parts.items() if p in DECODE_PARTS[fmt]}
        try:
            values = decode_projection(fmt, tensors)
        except UnsupportedError as e:
            return found + [("skipped", str(e))]
        if source_ck is None:
            found.append(("ok", proj, 0, 0, int((~torch.isfinite(values)).sum())))
            continue
        if src is None or proj not in src.parts:
            found.append(("no-source", proj))
            continue
        src_parts = src.parts[proj]
        src_fmt = projection_format({p: source_ck.info(n).spec.dtype for p, n in src_parts.items()})
        src_tensors = {p: source_ck.tensor(n).to(device) for p, n in src_parts.items()
                       if p in DECODE_PARTS.get(src_fmt, ())}
        found.append(("ok", proj, *exactness(decode_projection(src_fmt, src_tensors), values,
                                             block_size(src_fmt, src_tensors))))
    return found


def _deep_record(model, expert, future, deep_stats, out) -> None:
    acc = deep_stats.setdefault(expert.block, [0, 0, 0])
    where = f"{model.experts_module(expert.block)}.{expert.expert}"
    for kind, *detail in future.result():
        if kind == "skipped":
            out.add("info", "deep-skipped", "not decoded", detail=detail[0])
        elif kind == "no-source":
            out.add("warning", "deep-no-source", "projection absent from --source", f"{where}.{detail[0]}")
        else:
            proj, blocks, exact, bad = detail
            acc[0] += blocks
            acc[1] += exact
            acc[2] += bad
            if bad:
                out.add("error", "nonfinite-weights", "decoded weights are not finite", f"{where}.{proj}", f"{bad} values")


def format_result(result: dict) -> str:
    lines = [f"checkpoint  {result['path']}",
             f"experts     {result['experts_checked']:,} checked, format {result['format'] or 'unknown'}"]
    for name, v in result["engines"].items():
        lines.append(f"{'engine':<12}{name} {v['version']}: " + ("loads it correctly" if v["loads"] else "does NOT load it "
                     "correctly") + (f"; MoE kernel: {v['kernel']['backend']}" if v.get("kernel") else ""))
    for f in result["findings"]:
        count = f" (x{f['count']:,})" if f["count"] > 1 else ""
        lines.append(f"{f['severity'].upper():<8}{f['code']}: {f['message']}{count}")
        lines += [f"          {ex}" for ex in f["examples"]]
    s = result["summary"]
    lines.append(f"{'OK' if result['ok'] else 'FAILED'}: {s['error']} errors, {s['warning']} warnings, {s['info']} notes")
    return "\n".join(lines)
