"""NVFP4 experts in the layout of NVIDIA's ModelOpt export (formats.md section 2)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from requant.errors import FormatError
from requant.formats import mxfp4, nvfp4
from requant.model import Expert
from requant.targets import PRODUCER, Stats, Target, register

GROUP = nvfp4.BLOCK


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

    def quantized_layers(self, blocks: list[str]) -> dict:
        return {self.model.experts_module(b): {"quant_algo": "NVFP4", "group_size": GROUP} for b in blocks}

    def config(self, blocks: list[str], stats: Stats) -> dict:
        config = copy.deepcopy(self.model.config)
        fp4 = {"num_bits": 4, "type": "float", "group_size": GROUP, "dynamic": False}
        modelopt = self.model.nvfp4_quantization_config
        if modelopt:   # the model's own quantization_config described only its source experts
            config["quantization_config"] = {
                "config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
                "ignore": self.ignore(),
                "quant_algo": modelopt["quant_algo"],
                "producer": dict(PRODUCER),
                "quant_method": modelopt["quant_method"],
            }
            return config
        # quant_method stays "fp8": engines dispatch DeepSeek-V4 on it, and the block-FP8
        # attention must keep loading as before.
        config.setdefault("quantization_config", {}).update({
            "quant_algo": "MIXED_PRECISION",
            "moe_quant_algo": "NVFP4",
            "group_size": GROUP,
            "kv_cache_quant_algo": None,
            "producer": dict(PRODUCER),
            "quantized_layers": self.quantized_layers(blocks),
            "config_groups": {"group_0": {"weights": dict(fp4), "input_activations": dict(fp4), "targets": ["Linear"]}},
            "ignore": self.ignore(),
        })
        return config

    def extra_files(self, blocks: list[str]) -> dict[str, dict]:
        modelopt = self.model.nvfp4_quantization_config
        if modelopt:
            return {"hf_quant_config.json": {"producer": dict(PRODUCER), "quantization": {
                "quant_algo": modelopt["quant_algo"], "kv_cache_quant_algo": None, "group_size": GROUP,
                "exclude_modules": self.ignore()}}}
        return {"hf_quant_config.json": {
            "producer": dict(PRODUCER),
            "quantization": {
                "quant_algo": "MIXED_PRECISION",
                "kv_cache_quant_algo": None,
                "group_size": GROUP,
                "quantized_layers": self.quantized_layers(blocks),
                "exclude_modules": self.ignore(),
            },
        }}

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
