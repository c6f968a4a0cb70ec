"""NVFP4 experts in the layout of NVIDIA's ModelOpt export (docs/formats.md, NVFP4), and the
config.json that describes them: written and checked here, from one set of constants."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from requant.errors import CheckpointError, FormatError
from requant.formats import mxfp4, nvfp4
from requant.io.checkpoint import CONFIG_NAME
from requant.model import ABSENT, Expert, config_value
from requant.targets import PRODUCER, Stats, Target, register

# What config.json and hf_quant_config.json say of NVFP4 experts (docs/formats.md, NVFP4 config.json),
# written by NVFP4Target.config and extra_files and checked by NVFP4Target.check_config.
GROUP = nvfp4.BLOCK
EXPERTS_ALGO = "NVFP4"             # moe_quant_algo, and each quantized_layers entry's quant_algo
MIXED_ALGO = "MIXED_PRECISION"     # quant_algo: block-FP8 linears beside NVFP4 experts
EXPERT_DTYPE = "fp4"               # config.json's expert_dtype for FP4 experts (vLLM reads it)
FP4_ARGS = {"num_bits": 4, "type": "float", "group_size": GROUP, "dynamic": False}   # a config group's
FP4_IDENTITY = ("num_bits", "type", "group_size")   # the FP4_ARGS that say what the weights are
LAYER_ENTRY = {"quant_algo": EXPERTS_ALGO, "group_size": GROUP}   # per experts module in quantized_layers
HF_QUANT_CONFIG = "hf_quant_config.json"
HF_SHARED_KEYS = ("quant_algo", "kv_cache_quant_algo", "group_size", "quantized_layers")   # as in config.json
MODELOPT_KEYS = ("quant_algo", "quant_method")   # what a ModelOpt-form output takes from its recipe


@dataclass(frozen=True)
class NVFP4Options:
    scale_headroom: int = 0    # the largest block scale sits at 2^(8 - scale_headroom)


@register(nvfp4.CODEC)
class NVFP4Target(Target):
    options_type = NVFP4Options

    def __init__(self, model, source, options, source_codec):
        super().__init__(model, source, options, source_codec)
        self.top = nvfp4.DEFAULT_TOP - self.target_options.scale_headroom

    def encode_expert(self, expert: Expert, tensors: dict[str, torch.Tensor]):
        sources = {p: self.read_source(expert, tensors, p) for p in self.model.projections}
        k_max = {p: mxfp4.max_exponent(scale) for p, (_, scale) in sources.items()}
        input_scales = self.input_scales(expert.block)
        out, stats = {}, Stats()
        for proj, (weight, scale) in sources.items():
            # Fused partners share one global scale: engines keep only one for the pair.
            shared = [k for k in (k_max[proj], k_max.get(self.model.fused_partner(proj) or "")) if k is not None]
            try:
                # The weight bytes are this unit's own read buffer (workers.py): cast over them.
                cast = self.encoder(weight, scale, max(shared) if shared else None, self.top, in_place=True)
            except FormatError as e:
                raise FormatError(str(e), tensor=expert.parts[proj]["weight"]) from None
            for part, value in (("weight", torch.from_numpy(cast.weight)),
                                ("weight_scale", torch.from_numpy(cast.weight_scale)),
                                ("weight_scale_2", torch.tensor(cast.weight_scale_2, dtype=torch.float32)),
                                ("input_scale", torch.tensor(input_scales[proj], dtype=torch.float32))):
                name, stored = self.output(expert, proj, part)
                out[name] = stored(value)
            stats.tensors_converted += 1
            stats.blocks += cast.blocks
            stats.exact_blocks += cast.exact_blocks
            stats.requantized_blocks += cast.requantized_blocks
        return out, stats

    def ignore(self) -> list[str]:
        return self.model.quantization_ignore(self.name, self.mtp == "convert")

    # description: what config.json and hf_quant_config.json say, and the check of it -------------
    def _mixed_precision(self, blocks: list[str]) -> dict:
        """The keys added to the source's quantization_config where it keeps its own form."""
        return {
            "quant_algo": MIXED_ALGO,
            "moe_quant_algo": EXPERTS_ALGO,
            "group_size": GROUP,
            "kv_cache_quant_algo": None,
            "producer": dict(PRODUCER),
            "quantized_layers": {self.model.experts_module(b): dict(LAYER_ENTRY) for b in blocks},
            "config_groups": _config_groups(),
            "ignore": self.ignore(),
        }

    def config(self, blocks: list[str], stats: Stats) -> dict:
        config = copy.deepcopy(self.model.config)
        modelopt = self.model.nvfp4_quantization_config
        if modelopt:   # the model's own quantization_config described only its source experts
            config["quantization_config"] = {
                "config_groups": _config_groups(),
                "ignore": self.ignore(),
                **{key: modelopt[key] for key in MODELOPT_KEYS},
                "producer": dict(PRODUCER),
            }
            return config
        # quant_method stays as the source has it ("fp8"): engines dispatch DeepSeek-V4 on it, and
        # the block-FP8 attention must keep loading as before (docs/formats.md, NVFP4 config.json).
        config.setdefault("quantization_config", {}).update(self._mixed_precision(blocks))
        return config

    def extra_files(self, blocks: list[str]) -> dict[str, dict]:
        modelopt = self.model.nvfp4_quantization_config
        if modelopt:
            return {HF_QUANT_CONFIG: {"producer": dict(PRODUCER), "quantization": {
                "quant_algo": modelopt["quant_algo"], "kv_cache_quant_algo": None, "group_size": GROUP,
                "exclude_modules": self.ignore()}}}
        qc = self._mixed_precision(blocks)
        return {HF_QUANT_CONFIG: {"producer": dict(PRODUCER), "quantization": {
            **{key: qc[key] for key in HF_SHARED_KEYS}, "exclude_modules": qc["ignore"]}}}

    @classmethod
    def check_config(cls, ctx, layout, seen) -> None:
        model, out = ctx.model, ctx.out
        config = ctx.ck.config
        qc = config.get("quantization_config")
        if not isinstance(qc, dict):
            out.add("error", "no-quantization-config", "config.json has no quantization_config", CONFIG_NAME)
            return
        if model.nvfp4_quantization_config:
            cls._check_modelopt_form(ctx, layout, qc, model.nvfp4_quantization_config)
            return
        method = qc.get("quant_method")
        if method not in model.nvfp4_quant_methods:
            kept = " or ".join(map(repr, model.nvfp4_quant_methods))
            out.add("error", "quant-method", f"quant_method must stay {kept}: "
                    "vLLM and SGLang dispatch DeepSeek-V4 NVFP4 experts through the FP8 config (block-FP8 attention + "
                    "moe_quant_algo)", CONFIG_NAME, repr(method))
        key, dtype = expert_dtype(model, config)
        if dtype is None:
            out.add("info", "expert-dtype-missing",
                    f"config.json has no {key}; vLLM defaults it to {EXPERT_DTYPE!r}", CONFIG_NAME)
        elif dtype != EXPERT_DTYPE:
            out.add("error", "expert-dtype", f"{key} must be {EXPERT_DTYPE!r} for FP4 experts (vLLM builds FP8 "
                    "experts for 'fp8' and rejects other values)", CONFIG_NAME, repr(dtype))
        algo = qc.get("moe_quant_algo")
        if algo is None:
            out.add("error", "moe-quant-algo", "quantization_config lacks moe_quant_algo: engines build MXFP4 expert "
                    "layers and the NVFP4 tensors do not load", CONFIG_NAME)
        elif str(algo).upper() != EXPERTS_ALGO:
            out.add("error", "moe-quant-algo", f"moe_quant_algo is not {EXPERTS_ALGO} but the experts are", CONFIG_NAME,
                    repr(algo))
        if qc.get("group_size", GROUP) != GROUP:
            out.add("error", "group-size", f"group_size must be {GROUP} for NVFP4 (vLLM hard-codes {GROUP})",
                    CONFIG_NAME, repr(qc.get("group_size")))
        if qc.get("quant_algo") != MIXED_ALGO:
            out.add("warning", "quant-algo", f"quant_algo is not {MIXED_ALGO} (FP8 attention + NVFP4 experts); "
                    "SGLang picks its ModelOpt config from it", CONFIG_NAME, repr(qc.get("quant_algo")))
        cls._check_quantized_layers(ctx, layout, CONFIG_NAME, qc.get("quantized_layers"))
        ignore = qc.get("ignore")
        if ignore is not None and not isinstance(ignore, list):
            out.add("error", "ignore", "quantization_config.ignore is not a list", CONFIG_NAME)
            ignore = None
        cls._check_ignore(ctx, layout, ignore or [])
        for block, codec in layout.codecs_by_block.items():
            module = model.experts_module(block)
            if codec is not cls.codec and str(algo).upper() == EXPERTS_ALGO and ignore is not None \
                    and not model.ignored(module, ignore):
                out.add("warning", "mxfp4-not-ignored", f"{codec.name.upper()} experts are not excluded by ignore",
                        module)
        fp4 = {key: FP4_ARGS[key] for key in FP4_IDENTITY}
        for name, group in (qc.get("config_groups") or {}).items():
            weights = (group or {}).get("weights") or {}
            if weights and {key: weights.get(key) for key in FP4_IDENTITY} != fp4:
                out.add("warning", "config-groups", f"config_groups weights are not {fp4}", CONFIG_NAME, name)
        cls._check_hf_quant_config(ctx, layout, qc)

    @classmethod
    def _check_ignore(cls, ctx, layout, ignore: list) -> None:
        for block, codec in layout.codecs_by_block.items():
            module = ctx.model.experts_module(block)
            if codec is cls.codec and ctx.model.ignored(module, ignore):
                ctx.out.add("error", "ignored-nvfp4", "an ignore pattern matches NVFP4 experts (engines honouring it "
                            "build unquantized experts)", module)

    @classmethod
    def _check_quantized_layers(cls, ctx, layout, label: str, layers) -> None:
        model, out = ctx.model, ctx.out
        if not isinstance(layers, dict) or not layers:
            out.add("warning", "quantized-layers-missing", f"{label} has no quantized_layers map (SGLang dispatches "
                    "ModelOpt mixed-precision checkpoints per layer from it)")
            return
        for block, codec in layout.codecs_by_block.items():
            module = model.experts_module(block)
            entry = layers.get(module)
            if codec is cls.codec:
                if not isinstance(entry, dict):
                    out.add("error", "quantized-layers", f"{label} quantized_layers omits NVFP4 experts", module)
                elif entry.get("quant_algo") != EXPERTS_ALGO or entry.get("group_size", GROUP) != GROUP:
                    out.add("error", "quantized-layers", f"{label} quantized_layers describes NVFP4 experts wrongly",
                            module, str(entry))
            elif entry is not None:
                out.add("error", "quantized-layers", f"{label} quantized_layers lists experts that are not NVFP4",
                        module, f"stored as {codec.name}")

    @classmethod
    def _check_modelopt_form(cls, ctx, layout, qc: dict, expected: dict) -> None:
        """A model whose NVFP4 output describes itself as ModelOpt exports it (gpt-oss): the method
        and algorithm engines select ModelOpt's NVFP4 config by, in config.json and
        hf_quant_config.json, and no ignore pattern over the NVFP4 experts."""
        out = ctx.out
        for key in MODELOPT_KEYS:
            if qc.get(key) != expected[key]:
                out.add("error", key.replace("_", "-"), f"quantization_config.{key} must be {expected[key]!r} for "
                        f"{ctx.model.name} NVFP4 experts", CONFIG_NAME, repr(qc.get(key)))
        cls._check_ignore(ctx, layout, qc.get("ignore") or [])
        try:
            hf = (ctx.side_file(HF_QUANT_CONFIG) or {}).get("quantization")
        except CheckpointError as e:
            out.add("error", "hf-quant-config", f"{HF_QUANT_CONFIG} cannot be read", detail=str(e))
            return
        if not isinstance(hf, dict) or hf.get("quant_algo") != expected["quant_algo"]:
            out.add("warning", "hf-quant-config", f"{HF_QUANT_CONFIG} does not say quant_algo "
                    f"{expected['quant_algo']!r} (ModelOpt writes it beside config.json)", HF_QUANT_CONFIG)

    @classmethod
    def _check_hf_quant_config(cls, ctx, layout, qc: dict) -> None:
        out = ctx.out
        try:
            side = ctx.side_file(HF_QUANT_CONFIG)
        except CheckpointError as e:
            out.add("error", "hf-quant-config", f"{HF_QUANT_CONFIG} cannot be read", detail=str(e))
            return
        if side is None:
            out.add("warning", "hf-quant-config-missing", f"no {HF_QUANT_CONFIG} (SGLang reads the NVFP4 details of "
                    "DeepSeek-V4 from it)", HF_QUANT_CONFIG)
            return
        hf = side.get("quantization")
        if not isinstance(hf, dict):
            out.add("error", "hf-quant-config", f"{HF_QUANT_CONFIG} has no 'quantization' object", HF_QUANT_CONFIG)
            return
        for key in HF_SHARED_KEYS:
            if key in hf and key in qc and hf[key] != qc[key]:
                out.add("error", "config-disagreement", f"{HF_QUANT_CONFIG} and {CONFIG_NAME} disagree on {key}",
                        HF_QUANT_CONFIG, f"{_short(hf[key])} vs {_short(qc[key])}")
        if "exclude_modules" in hf and "ignore" in qc \
                and sorted(hf["exclude_modules"] or []) != sorted(qc["ignore"] or []):
            out.add("error", "config-disagreement", f"{HF_QUANT_CONFIG} exclude_modules and {CONFIG_NAME} ignore "
                    "disagree", HF_QUANT_CONFIG, f"{hf['exclude_modules']} vs {qc['ignore']}")
        cls._check_quantized_layers(ctx, layout, HF_QUANT_CONFIG, hf.get("quantized_layers"))

    def summary(self, stats: Stats) -> str:
        return (f"exact scale blocks {stats.exact_blocks:,} / {stats.blocks:,}, "
                f"re-quantized scale blocks {stats.requantized_blocks:,}")

    format_label = "NVFP4: U8 E2M1 codes, E4M3 scale per 16, F32 weight_scale_2 and input_scale"

    def describe_options(self) -> dict:
        return {**super().describe_options(), "input_scale": self.options.input_scale,
                "scale_headroom": self.target_options.scale_headroom or None}

    def accuracy(self, stats: Stats) -> dict:
        return {"blocks": stats.blocks, "exact_blocks": stats.exact_blocks,
                "requantized_blocks": stats.requantized_blocks}


def expert_dtype(model, config: dict) -> tuple[str, object]:
    """(where the family's config.json says its experts' dtype, the value there; None where absent):
    the top level for DeepSeek-V4, inside quantization_config for V4.1 (the recipe's
    `outputs.nvfp4.expert_dtype_key`)."""
    key = model.output(nvfp4.CODEC.name).expert_dtype_key
    value = config_value(config, key)
    return key, None if value is ABSENT else value


def _config_groups() -> dict:
    return {"group_0": {"weights": dict(FP4_ARGS), "input_activations": dict(FP4_ARGS), "targets": ["Linear"]}}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
