"""W4A16 INT4 experts in compressed-tensors' pack-quantized layout, for the engines' Marlin MoE on
Ampere/Hopper (docs/formats.md, W4A16; the engine facts it relies on are listed in docs/w4a16.md).

Routed experts (MTP block included) become INT4. The FP8-block linears keep their E4M3 bytes; how
the config describes them is the engine's rule (`fp8_linears`):
- "config_group" (vLLM): an FP8-block compressed-tensors group targeting `Linear`, the E8M0
  `.scale` re-typed, exactly, as compressed-tensors' F32 `.weight_scale`;
- "linear_fp8_config" (SGLang): SGLang's own `linear_fp8_config` key, the `.scale` tensors kept as
  they are (its DeepSeek-V4 loader reads no other name there).
Everything else is copied byte for byte.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from requant import formats
from requant.errors import FormatError, UnsupportedError
from requant.formats import fp8_block, int4, int4_search, mxfp4
from requant.io.checkpoint import CONFIG_NAME
from requant.io.safetensors import TensorSpec
from requant.model import Expert
from requant.targets import PRODUCER, Stats, Target, Unit, register

DEFAULT_GROUP = 128
DEFAULT_SCHEME = "sym"
ACCURACY_KEY = "requant_accuracy"   # inside quantization_config; no loader reads it
# What quantization_config says of W4A16 experts (docs/formats.md, W4A16 config.json), written by
# W4A16Target.config and checked by W4A16Target.check_config and the engine rules (engines/check.py).
QUANT_METHOD = "compressed-tensors"
STATUS = "compressed"
PACKED = "pack-quantized"            # the INT4 group's format; SGLang also needs it at the top level
MIXED = "mixed-precision"            # the top-level format beside an FP8-block config group
FLOAT_QUANTIZED = "float-quantized"  # the FP8-block config group's format
LINEAR_FP8_CONFIG = "linear_fp8_config"   # SGLang's key for the FP8-block linears' settings
FP8_SCALE = "weight_scale"           # the FP8-block scale's name in compressed-tensors
INT4_IDENTITY = {"num_bits": 4, "type": "int"}   # what makes a config group the experts' INT4 one
FP8_BLOCK = [fp8_block.BLOCK, fp8_block.BLOCK]


def int4_weights(group: int, scheme: str) -> dict:
    """The INT4 group's `weights` quantization args."""
    return {**INT4_IDENTITY, "symmetric": scheme == "sym", "strategy": "group", "group_size": group,
            "dynamic": False, "actorder": None, "observer": "minmax"}


def expert_groups(qc: dict) -> dict[str, dict]:
    """The config groups of `qc` that describe INT4 weights, by name."""
    groups = {n: g for n, g in (qc.get("config_groups") or {}).items() if isinstance(g, dict)}
    return {n: g for n, g in groups.items()
            if all((g.get("weights") or {}).get(k) == v for k, v in INT4_IDENTITY.items())}


def group_scheme(group: dict) -> str:
    """"sym" or "asym", as an INT4 config group says (compressed-tensors' default: symmetric)."""
    return DEFAULT_SCHEME if (group.get("weights") or {}).get("symmetric", True) else "asym"


def sqnr_db(signal: float, error: float) -> float | None:
    if error <= 0:
        return None if signal <= 0 else math.inf
    return 10 * math.log10(signal / error)


@dataclass(frozen=True)
class W4A16Options:
    group_size: int = DEFAULT_GROUP
    scheme: str = DEFAULT_SCHEME       # "sym" or "asym" (a zero point per group)


@register(int4.CODEC)
class W4A16Target(Target):
    cpu_heavy = True          # the scale search: ~0.02-0.1 s per projection and core
    options_type = W4A16Options

    def __init__(self, model, source, options, source_codec):
        super().__init__(model, source, options, source_codec)
        self.fp8_linears = self.engine.layout(self.name, "fp8_linears")
        self.group, self.scheme = self.target_options.group_size, self.target_options.scheme
        self.cpu_encoder = ""   # set where worker processes encode (ready_workers)
        if options.input_scale is not None:
            raise UnsupportedError("--input-scale applies to W4A4 targets; W4A16 keeps activations in BF16")
        if self.group not in self.codec.group_sizes or self.scheme not in int4.SCHEMES:
            raise UnsupportedError(f"--group-size must be one of {self.codec.group_sizes} and --scheme one of "
                                   f"{int4.SCHEMES}")
        self.params = formats.Params(self.group, zero_points=self.scheme == "asym")
        for role in ("hidden_size", "intermediate_size"):
            name, size = model.config_key(role), model.value(role)
            if size % self.group:
                raise UnsupportedError(f"--group-size {self.group} does not divide {name}={size}; "
                                       "Marlin needs whole groups")

    def ready_workers(self) -> None:
        # The C encoder and its tables, shared by the forked workers; the summary says which ran
        # (the torch passes write the same bytes, 1.5-2x slower).
        self.cpu_encoder = int4_search.ready_cpu(self.scheme)

    # planning -------------------------------------------------------------------------------
    def plan_tensor(self, spec: TensorSpec) -> Unit:
        """FP8-block scales (E8M0 `.scale`) become compressed-tensors' F32 `.weight_scale`; the
        scales of experts kept in the source format (--mtp keep --force) stay as they are, and so do
        all of them where the engine reads FP8 linears through linear_fp8_config."""
        source = fp8_block.CODEC.part(formats.SCALE)
        is_fp8_scale = spec.name.endswith("." + source.suffix) and spec.dtype in source.dtypes
        if self.fp8_linears != "config_group" or not is_fp8_scale or self.model.expert_tensor(spec.name):
            return super().plan_tensor(spec)
        out = TensorSpec(spec.name[: -len(source.suffix)] + FP8_SCALE, "F32", spec.shape)
        return Unit([spec.name], [out], lambda tensors: self.encode_block_scale(spec.name, out.name, tensors))

    # encoding -------------------------------------------------------------------------------
    def encode_expert(self, expert: Expert, tensors: dict[str, torch.Tensor]):
        out, stats = {}, Stats()
        sources = {}   # weight name -> (weight, scale)
        for proj in self.model.projections:
            weight, scale = self.read_source(expert, tensors, proj)
            sources[expert.parts[proj]["weight"]] = torch.from_numpy(weight), torch.from_numpy(scale)
        # The expert's projections in one call: one batch on a GPU; the same bytes on any device (int4_search.py).
        encoded = self.encoder(sources, self.group, self.scheme, self.options.device)
        for proj in self.model.projections:
            enc = encoded[expert.parts[proj]["weight"]]
            rows, k = enc.packed.shape[0], enc.packed.shape[1] * int4.PACK
            prefix = expert.prefixes[proj]
            out[f"{prefix}.weight_packed"] = enc.packed
            out[f"{prefix}.weight_scale"] = enc.scale
            out[f"{prefix}.weight_shape"] = torch.tensor([rows, k], dtype=torch.int64)
            if enc.zero_point is not None:
                out[f"{prefix}.weight_zero_point"] = enc.zero_point
            stats.tensors_converted += 1
            stats.blocks += rows * k // mxfp4.BLOCK
            stats.signal_energy += enc.signal_energy
            stats.error_energy += enc.error_energy
            acc = stats.per_layer.setdefault(expert.block, [0.0, 0.0])
            acc[0] += enc.signal_energy
            acc[1] += enc.error_energy
        return out, stats

    def encode_block_scale(self, name: str, out_name: str, tensors: dict[str, torch.Tensor]):
        scale = tensors[name].view(torch.uint8)
        try:
            mxfp4.check_scales(scale.numpy())
        except FormatError as e:
            raise FormatError(str(e), tensor=name) from None
        return {out_name: e8m0_to_f32(scale)}, Stats()

    # description ----------------------------------------------------------------------------
    def expert_target(self) -> str:
        """One regex matching the per-expert module names every engine of the recipe probes
        (each release's probes in requant/engines: `model.layers.L.ffn.experts.0.w1` or `...experts.0.gate_proj`)
        and nothing else: shared experts and attention must stay in the FP8 group."""
        modules, names = set(), set()
        for engine in self.model.engine_names:
            probes = self.model.engine(engine).expert_probes(0, self.model.projections).values()
            modules.update(p.split(".")[-3] for p in probes)    # "<...>.experts.0.<name>"
            names.update(p.split(".")[-1] for p in probes)
        return rf"re:.*\.({'|'.join(sorted(modules))})\.\d+\.({'|'.join(sorted(names))})$"

    def config(self, blocks: list[str], stats: Stats) -> dict:
        config = copy.deepcopy(self.model.config)
        source_qc = config.get("quantization_config") or {}
        int4_args = int4_weights(self.group, self.scheme)
        fp8_weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                       "block_structure": FP8_BLOCK, "dynamic": False, "observer": "minmax"}
        fp8_inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                      "group_size": FP8_BLOCK[1], "dynamic": True, "observer": None}
        groups = {"group_0": {"targets": [self.expert_target()], "weights": int4_args,
                              "input_activations": None, "output_activations": None, "format": PACKED}}
        qc = {"quant_method": QUANT_METHOD}
        if self.fp8_linears == "config_group":
            # vLLM names the MTP e_proj/h_proj with an empty prefix, so only the class target
            # reaches them; experts match group_0 by name first.
            groups["group_1"] = {"targets": ["Linear"], "weights": fp8_weights, "input_activations": fp8_inputs,
                                 "output_activations": None, "format": FLOAT_QUANTIZED}
            qc["format"] = MIXED
        else:
            # SGLang's INT4 MoE method checks the top-level format; its linears take the source's
            # FP8-block settings from linear_fp8_config.
            qc["format"] = PACKED
            qc[LINEAR_FP8_CONFIG] = {k: v for k, v in source_qc.items() if k != "quantization_config"}
        qc.update({
            "quantization_status": STATUS,
            "config_groups": groups,
            "ignore": self.model.quantization_ignore(self.name, self.mtp == "convert"),
            "kv_cache_scheme": None,
            "producer": dict(PRODUCER),
            ACCURACY_KEY: self.accuracy(stats),
        })
        # DeepSeek-V4's attention reads quantization_config["scale_fmt"] directly.
        if "scale_fmt" in source_qc:
            qc["scale_fmt"] = source_qc["scale_fmt"]
        config["quantization_config"] = qc
        return config

    @classmethod
    def check_config(cls, ctx, layout, seen) -> None:
        out = ctx.out
        qc = ctx.ck.config.get("quantization_config")
        if not isinstance(qc, dict):
            out.add("error", "no-quantization-config", "config.json has no quantization_config", CONFIG_NAME)
            return
        if qc.get("quant_method") != QUANT_METHOD:
            out.add("error", "quant-method", f"W4A16 experts need quant_method {QUANT_METHOD!r}", CONFIG_NAME,
                    repr(qc.get("quant_method")))
        if qc.get("quantization_status") not in (None, STATUS):
            out.add("warning", "quantization-status", f"quantization_status is not {STATUS!r}", CONFIG_NAME,
                    repr(qc.get("quantization_status")))
        groups = expert_groups(qc)
        if not groups:
            out.add("error", "config-groups", "config_groups has no 4-bit int weight group for the experts",
                    CONFIG_NAME)
            return
        # Which engine probes reach these groups is each engine's rule (engines/check.py); here, the
        # groups themselves.
        expected = int4_weights(DEFAULT_GROUP, DEFAULT_SCHEME)
        for group in groups.values():
            weights = group.get("weights") or {}
            size = weights.get("group_size")
            if weights.get("strategy") not in (None, expected["strategy"]):
                out.add("warning", "strategy", f"expert weights strategy is not {expected['strategy']!r}", CONFIG_NAME,
                        repr(weights.get("strategy")))
            if size not in cls.codec.group_sizes:
                out.add("warning", "group-size", "group_size is not one vLLM's Marlin WNA16 MoE accepts "
                        f"({', '.join(map(str, cls.codec.group_sizes))})", CONFIG_NAME, repr(size))
            if seen.group_sizes and size not in seen.group_sizes:
                out.add("error", "group-size", "config group_size disagrees with the weight_scale shapes", CONFIG_NAME,
                        f"config {size}, tensors {sorted(seen.group_sizes)}")
            symmetric = group_scheme(group) == "sym"
            if symmetric and seen.zero_points:
                out.add("warning", "zero-point", "symmetric scheme but weight_zero_point tensors are present",
                        CONFIG_NAME)
            if not symmetric and not seen.zero_points:
                out.add("error", "zero-point", "asymmetric scheme but no weight_zero_point tensors", CONFIG_NAME)
            fmt = group.get("format") or qc.get("format")
            if fmt not in (PACKED, MIXED):
                out.add("warning", "ct-format", f"experts' compressed-tensors format is not {PACKED}", CONFIG_NAME,
                        repr(fmt))

    @property
    def format_label(self) -> str:
        return (f"INT4 W4A16: compressed-tensors pack-quantized, group {self.group}, "
                f"{'symmetric' if self.scheme == 'sym' else 'asymmetric (zero points)'}, BF16 scales")

    def describe_options(self) -> dict:
        return {**super().describe_options(), "group_size": self.group, "scheme": self.scheme}

    def other_tensor_groups(self) -> dict[str, str]:
        if self.fp8_linears == "config_group":
            fp8 = "E4M3 bytes unchanged; E8M0 .scale re-typed exactly as F32 .weight_scale (compressed-tensors FP8 group)"
        else:
            fp8 = "E4M3 bytes and E8M0 .scale unchanged, described by SGLang's linear_fp8_config"
        return {"FP8-block linears": fp8, **super().other_tensor_groups()}

    def accuracy(self, a: Stats) -> dict:
        return {
            "reference": "dequantized MXFP4 source",
            "group_size": self.group,
            "scheme": self.scheme,
            "tensors": a.tensors_converted,
            "sqnr_db": _rounded(sqnr_db(a.signal_energy, a.error_energy)),
            "per_block_sqnr_db": {b: _rounded(sqnr_db(s, e)) for b, (s, e) in a.per_layer.items()},
        }

    def summary(self, stats: Stats) -> str:
        db = sqnr_db(stats.signal_energy, stats.error_energy)
        worst = min(((sqnr_db(s, e), b) for b, (s, e) in stats.per_layer.items() if e > 0), default=None)
        text = f"INT4 g{self.group} {self.scheme}: SQNR {db:.2f} dB vs the MXFP4 source" if db is not None \
            else f"INT4 g{self.group} {self.scheme}: no expert data"
        text += f", worst layer {worst[1]} {worst[0]:.2f} dB" if worst else ""
        return text + (f"; CPU encoder: {self.cpu_encoder}" if self.cpu_encoder else "")


def _rounded(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else round(x, 3)


def e8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> the same powers of two as F32, bit-exact: byte b >= 1 is exponent field b,
    byte 0 (2^-127) is the F32 subnormal with only mantissa bit 22 set."""
    b = scale.view(torch.uint8).to(torch.int32)
    return torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22)).view(torch.float32)
