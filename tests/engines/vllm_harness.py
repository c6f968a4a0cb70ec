"""vLLM's own DeepSeek-V4 loading code, executed on CPU over a checkpoint directory.

Every engine function named here is read from the pinned vLLM release wheel at test time
(tests/engines/wheels.py) and executed as the engine has it; nothing of vLLM is installed or
imported, and no engine code lives in this repository. What vLLM would construct around those
functions (its platform, kernels, modules) is replaced by small stand-ins, each saying why.

`vllm_load_report(path)` is the one checker: it runs the weight-name remapping, the quantization
method dispatch per layer, the dispatched MoE method's `create_weights`, and the model's and the
MTP draft's `load_weights` (with `RoutedExperts.weight_loader`) over every tensor of the
checkpoint, and returns what vLLM would get wrong, as sentences; an empty list means it loads.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import itertools
import json
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import regex
import torch
from safetensors import safe_open

from requant.model import ModelSpec

from . import wheels

ENGINE = "vllm"
VERSION = wheels.ENGINES[ENGINE]
GPUS = ("sm_80", "sm_90", "sm_100", "sm_120")

MODEL = "vllm/models/deepseek_v4/nvidia/model.py"   # the CUDA build's classes (deepseek_v4/__init__.py)
MTP = "vllm/models/deepseek_v4/nvidia/mtp.py"
DS4_QUANT = "vllm/models/deepseek_v4/quant_config.py"
MODEL_UTILS = "vllm/model_executor/models/utils.py"
ROUTED = "vllm/model_executor/layers/fused_moe/routed_experts.py"
QUANT = "vllm/model_executor/layers/quantization/"
FP8 = QUANT + "fp8.py"
MODELOPT = QUANT + "modelopt.py"
MXFP4 = QUANT + "mxfp4.py"
QUANT_UTILS = QUANT + "utils/quant_utils.py"
CONFIG_UTILS = QUANT + "utils/config_utils.py"
CT = QUANT + "compressed_tensors/compressed_tensors.py"
CT_UTILS = QUANT + "compressed_tensors/utils.py"
CT_MOE = QUANT + "compressed_tensors/compressed_tensors_moe/"
EMULATION = QUANT + "utils/nvfp4_emulation_utils.py"
MARLIN_FP4 = QUANT + "utils/marlin_utils_fp4.py"


def extract(relpath: str, names: list[str], ns: dict) -> dict:
    return wheels.extract(ENGINE, relpath, names, ns)


def methods(relpath: str, cls: str, names: list[str], ns: dict) -> dict:
    return wheels.methods(ENGINE, relpath, cls, names, ns)


def klass(relpath: str, cls: str, ns: dict, bases: tuple[str, ...] = ()) -> type:
    return wheels.klass(ENGINE, relpath, cls, ns, bases)


class _Silent:
    """vLLM's logger: what it logs is not under test."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


LOG = _Silent()


def recorder(name: str) -> type:
    """A class named like an engine class whose constructor would select and load GPU kernels:
    constructing it records the arguments the engine passed, so the test can tell which class a
    dispatch chose and build the engine's real class with the same arguments where it can."""
    def init(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    return type(name, (), {"__init__": init, "__repr__": lambda self: name})


# ---------------------------------------------------------------------------------- checkpoint
class Checkpoint:
    """A checkpoint directory as vLLM sees it: config.json, tensor names, dtypes, shapes, data."""

    def __init__(self, path):
        self.path = Path(path)
        self.config = json.loads((self.path / "config.json").read_text())
        self.quant = self.config.get("quantization_config") or {}
        self.weight_map = json.loads((self.path / "model.safetensors.index.json").read_text())["weight_map"]
        self.header: dict[str, tuple[str, tuple[int, ...]]] = {}
        for shard in sorted(set(self.weight_map.values())):
            with open(self.path / shard, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            self.header.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
        self.spec = ModelSpec.for_config(self.config)

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path / self.weight_map[name]), "pt") as f:
            return f.get_tensor(name)

    def tensors(self, names: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensor(name)

    @property
    def layers(self) -> int:
        return self.config["num_hidden_layers"]

    def expert_format(self, block: str) -> str:
        """How the routed experts of `block` ("layers.3", "mtp.0") are stored, by the tensor
        parts the formats have: nvfp4 (weight_scale_2), w4a16 (weight_packed), mxfp4 (scale)."""
        parts = {ref.part for ref in map(self.spec.expert_tensor, self.header) if ref and ref.block == block}
        for fmt, part in (("nvfp4", "weight_scale_2"), ("w4a16", "weight_packed"), ("mxfp4", "scale")):
            if part in parts:
                return fmt
        raise AssertionError(f"{self.path}: no routed experts in {block}")

    def hf_config(self) -> SimpleNamespace:
        """vLLM's hf_config: config.json's keys as attributes."""
        return SimpleNamespace(**self.config)


# --------------------------------------------------------------------------- name remapping
@lru_cache(maxsize=None)
def _mapper_ns() -> dict:
    ns = dict(dataclass=dataclasses.dataclass, field=dataclasses.field, replace=dataclasses.replace, re=regex,
              Mapping=Mapping, ShardIds=typing.Any, Iterable=Iterable, Any=typing.Any, torch=torch, logger=LOG)
    extract(MODEL_UTILS, ["WeightsMapper", "get_spec_layer_idx_from_weight_name"], ns)
    extract(MODEL, ["_make_deepseek_v4_weights_mapper"], ns)
    return ns


def weights_mapper(ckpt: Checkpoint):
    """DeepseekV4ForCausalLM.hf_to_vllm_mapper: made for "fp4" experts unless config.json says
    otherwise (model.py, DeepseekV4ForCausalLM.__init__)."""
    return _mapper_ns()["_make_deepseek_v4_weights_mapper"](ckpt.config.get("expert_dtype", "fp4"))


def expert_params_mapping(experts: int) -> list[tuple[str, str, int, str]]:
    """RoutedExperts.build_expert_params_mapping with the checkpoint names DeepSeek-V4 passes
    (w1, w2, w3): what fused_moe_make_expert_params_mapping returns for the model. EplbState is
    replaced by the identity physical->logical map it builds without redundant experts."""
    ns = dict(logger=LOG, EplbState=SimpleNamespace(
        build_initial_global_physical_to_logical_map=lambda n, redundant: list(range(n + redundant))))
    build = methods(ROUTED, "RoutedExperts", ["build_expert_params_mapping"], ns)["build_expert_params_mapping"]
    return build("w1", "w2", "w3", experts, 0, "routed_experts",
                 lora_base_layer_prefix="", lora_base_layer_prefix_on_param_name="")


# ---------------------------------------------------------------------- quant-method dispatch
class RoutedExperts(torch.nn.Module):
    """Stand-in for vLLM's RoutedExperts, LinearBase, Attention in the dispatchers' isinstance()
    checks; building the real modules needs a GPU platform."""


class LinearBase(torch.nn.Module):
    pass


class Attention(torch.nn.Module):
    pass


def moe_config() -> SimpleNamespace:
    """The FusedMoEConfig of DeepSeek-V4's routed experts on one GPU (TP 1, no expert parallelism):
    gated SiLU (act-and-mul, two w13 shards), no bias; the fields the methods read."""
    return SimpleNamespace(is_act_and_mul=True, has_bias=False, w13_num_shards=2, max_capture_size=512,
                           tp_shard_with_padding=False, tp_rank=0, tp_size=1,
                           moe_parallel_config=SimpleNamespace(tp_size=1, enable_eplb=False))


PACKED_MODULES = {"gate_up_proj": ["w1", "w3"], "fused_wqa_wkv": ["wq_a", "wkv"],
                  "fused_wkv_wgate": ["wkv", "wgate"]}   # DeepseekV4ForCausalLM.packed_modules_mapping


@dataclasses.dataclass
class Dispatch:
    """What the quantization config vLLM builds for a checkpoint gives each layer."""

    config: object                     # the engine's quantization config object
    moe: Callable[[str], object]       # layer prefix -> the method instance (recorder)
    linear: Callable[[str], str]       # layer prefix -> the linear method, described


def _quantization_config_stub() -> type:
    class QuantizationConfig:
        """vLLM's QuantizationConfig base: only the state and key lookups Fp8Config uses."""

        def __init__(self):
            self.packed_modules_mapping = {}
            self.online_quantization_config = None

        @staticmethod
        def get_from_keys(config, keys):
            for key in keys:
                if key in config:
                    return config[key]
            raise ValueError(f"none of {keys} in the quantization config")

        @classmethod
        def get_from_keys_or(cls, config, keys, default):
            try:
                return cls.get_from_keys(config, keys)
            except ValueError:
                return default

    return QuantizationConfig


def _mtp_prefix_mapper(ckpt: Checkpoint):
    """align_mtp_quant_config's re-keying of MTP entries onto the draft's module prefixes, run."""
    ns = _mapper_ns()
    wheels.fake_module("vllm.model_executor.models.utils", WeightsMapper=ns["WeightsMapper"])
    extract(DS4_QUANT, ["align_mtp_quant_config"], ns)
    return ns["align_mtp_quant_config"]


def ds4_fp8_dispatch(ckpt: Checkpoint) -> Dispatch:
    """DeepseekV4FP8Config (quant_config.py) over Fp8Config (fp8.py), both whole classes, as vLLM
    builds it for a `quant_method: fp8` DeepSeek-V4 checkpoint."""
    ns = dict(ACTIVATION_SCHEMES=["static", "dynamic"], Literal=typing.Literal, logger=LOG, cast=typing.cast,
              LinearBase=LinearBase, RoutedExperts=RoutedExperts, Attention=Attention,
              MappingProxyType=MappingProxyType, Mapping=Mapping, get_marlin_input_dtype=lambda prefix: None,
              QuantizationConfig=_quantization_config_stub(), kMxfp8Dynamic="kMxfp8Dynamic",
              **{n: recorder(n) for n in ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "Fp8LinearMethod",
                                          "Fp8MoEMethod", "Fp8KVCacheMethod", "Mxfp4MoEMethod")})
    extract(QUANT_UTILS, ["is_layer_skipped"], ns)
    klass(FP8, "Fp8Config", ns, bases=("QuantizationConfig",))
    hf = ckpt.hf_config()
    # get_current_vllm_config(): the running engine's config, of which these read hf_config only
    ns["get_current_vllm_config"] = lambda: SimpleNamespace(model_config=SimpleNamespace(hf_config=hf))
    extract(DS4_QUANT, ["_DEEPSEEK_V4_EXPERT_DTYPES"], ns)
    wheels.fake_module("vllm.logger", init_logger=lambda name: LOG)
    wheels.fake_module(MODELOPT[:-3].replace("/", "."), ModelOptNvFp4FusedMoE=recorder("ModelOptNvFp4FusedMoE"),
                       ModelOptNvFp4Config=_modelopt_nvfp4_config())
    cls = klass(DS4_QUANT, "DeepseekV4FP8Config", ns, bases=("Fp8Config",))
    name = cls.override_quantization_method(dict(ckpt.quant), None, hf_config=hf)
    assert name == "deepseek_v4_fp8", f"vLLM does not take {ckpt.path} as DeepSeek-V4 FP8 ({name!r})"
    config = cls.from_config(dict(ckpt.quant))
    config.packed_modules_mapping = PACKED_MODULES
    config.apply_vllm_mapper(weights_mapper(ckpt).get_rename_mapper())   # configure_quant_config
    _mtp_prefix_mapper(ckpt)(config, hf)

    def moe(prefix):
        layer = RoutedExperts()
        layer.moe_config = moe_config()
        return config.get_quant_method(layer, prefix)

    def linear(prefix):
        method = config.get_quant_method(LinearBase(), prefix)
        block = getattr(method.args[0] if method.args else None, "weight_block_size", None)
        return f"{type(method).__name__}" + (f" (FP8 block {block})" if block else "")

    return Dispatch(config, moe, linear)


def _modelopt_nvfp4_config() -> type:
    """ModelOptNvFp4Config as DeepseekV4FP8Config._get_nvfp4_config constructs it: the keyword
    arguments it passes, the two attributes its __init__ sets from defaults that call leaves alone
    (quant_method "NVFP4", no activation override: modelopt.py ModelOptNvFp4Config.__init__), and
    its own get_name; the real class's base pulls the whole quantization registry."""
    def init(self, **kwargs):
        self.__dict__.update(kwargs)
        self.quant_method = "NVFP4"
        self.moe_activation_override = None

    return type("ModelOptNvFp4Config", (), dict(methods(MODELOPT, "ModelOptNvFp4Config", ["get_name"], {}),
                                                 __init__=init))


def compressed_tensors_dispatch(ckpt: Checkpoint) -> Dispatch:
    """CompressedTensorsConfig's own scheme map, vLLM mapper, target matching and
    CompressedTensorsMoEMethod.get_moe_method, run on the checkpoint's quantization_config
    (only __init__ is bypassed: it validates the whole config against kernel support)."""
    from compressed_tensors import CompressionFormat
    from compressed_tensors.quantization import (ActivationOrdering, QuantizationArgs, QuantizationStrategy,
                                                 QuantizationType)
    ns = dict(re=regex, fnmatch=fnmatch.fnmatch, MappingProxyType=MappingProxyType, Iterable=Iterable,
              Mapping=Mapping, Module=torch.nn.Module, logger=LOG, torch=torch, QuantizationArgs=QuantizationArgs,
              ActivationOrdering=ActivationOrdering, cast=typing.cast, QuantizationType=QuantizationType,
              QuantizationStrategy=QuantizationStrategy, CompressionFormat=CompressionFormat, Any=typing.Any)
    extract(CONFIG_UTILS, ["find_matching_patterns", "is_equal_or_regex_match"], ns)
    extract(CT_UTILS, ["should_ignore_layer", "find_matched_target", "_find_first_match", "_match_fused_layer",
                       "is_activation_quantization_format"], ns)
    fns = methods(CT, "CompressedTensorsConfig", [
        "get_name", "_quantization_scheme_map_from_config", "apply_vllm_mapper", "get_scheme_dict",
        "_add_fused_moe_to_target_scheme_map", "_is_fp8_w8a8_sm90", "_is_fp8_w8a8_sm100", "_is_wNa16_group_channel",
        "_is_mxfp4", "_is_mxfp8", "_is_mxfp4_w4a8_fp8", "_is_nvfp4_format", "_is_fp8_w8a8", "_is_dynamic_token_w8a8",
        "_is_dynamic_token_w4a8_int", "_is_fp8_w4a8"], ns)
    # _check_scheme_supported asks the GPU's capability; the sm90/sm100-exact FP8 variants lead to
    # the same method class as plain _is_fp8_w8a8 (compressed_tensors_moe.py), so "not that GPU"
    fns["_check_scheme_supported"] = classmethod(lambda cls, *args, **kwargs: False)
    cls = type("CompressedTensorsConfig", (), fns)
    config = object.__new__(cls)
    config.target_scheme_map = cls._quantization_scheme_map_from_config(dict(ckpt.quant))
    config.ignore = list(ckpt.quant.get("ignore", []))
    config.quant_format = ckpt.quant.get("format")
    config.kv_cache_scheme = None
    config.packed_modules_mapping = PACKED_MODULES
    config.apply_vllm_mapper(weights_mapper(ckpt).get_rename_mapper())
    _mtp_prefix_mapper(ckpt)(config, ckpt.hf_config())

    package = "requant_vllm_ct_moe"   # get_moe_method imports its method classes relatively
    wheels.fake_module(package).__path__ = []
    for module, name in (("compressed_tensors_moe_wna16", "CompressedTensorsWNA16MoEMethod"),
                         ("compressed_tensors_moe_w8a8_fp8", "CompressedTensorsW8A8Fp8MoEMethod"),
                         ("compressed_tensors_moe_w8a8_int8", "CompressedTensorsW8A8Int8MoEMethod"),
                         ("compressed_tensors_moe_w4a4_nvfp4", "CompressedTensorsW4A4Nvfp4MoEMethod"),
                         ("compressed_tensors_moe_w4a4_mxfp4", "CompressedTensorsW4A4Mxfp4MoEMethod"),
                         ("compressed_tensors_moe_w8a8_mxfp8", "CompressedTensorsW8A8Mxfp8MoEMethod"),
                         ("compressed_tensors_moe_w4a8_mxfp4", "CompressedTensorsW4A8Mxfp4MoEMethod"),
                         ("compressed_tensors_moe_w4a8_fp8", "CompressedTensorsW4A8Fp8MoEMethod")):
        wheels.fake_module(f"{package}.{module}", **{name: recorder(name)})
    moe_ns = dict(__package__=package, torch=torch, CompressionFormat=CompressionFormat, logger=LOG,
                  QuantizationStrategy=QuantizationStrategy, QuantizationType=QuantizationType,
                  WNA16_SUPPORTED_BITS=[4, 8], UnquantizedFusedMoEMethod=recorder("UnquantizedFusedMoEMethod"),
                  current_platform=SimpleNamespace(is_rocm=lambda: False))   # a CUDA machine
    get_moe_method = methods(CT_MOE + "compressed_tensors_moe.py", "CompressedTensorsMoEMethod",
                             ["get_moe_method"], moe_ns)["get_moe_method"]

    def moe(prefix):
        layer = RoutedExperts()
        # DeepseekV4MoE builds RoutedExperts with ckpt_names=("w1", "w2", "w3")
        layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name, layer.ckpt_up_proj_name = "w1", "w2", "w3"
        layer.moe_config = moe_config()
        try:
            return get_moe_method(config, layer, layer_name=prefix)
        except Exception as e:   # the engine refusing the layer
            return recorder(f"refused ({type(e).__name__}: {e})")()

    def linear(prefix):
        if ns["should_ignore_layer"](prefix, ignore=config.ignore, fused_mapping=PACKED_MODULES):
            return "UnquantizedLinearMethod"
        scheme = config.get_scheme_dict(LinearBase(), prefix)
        if scheme is None:
            return "no scheme"
        weights = scheme["weights"]
        fp8_block = config._is_fp8_w8a8(weights, scheme["input_activations"]) and weights.strategy == "block"
        return "CompressedTensorsW8A8Fp8" + (f" (FP8 block {weights.block_structure})" if fp8_block else "")

    return Dispatch(config, moe, linear)


def dispatch(ckpt: Checkpoint) -> Dispatch:
    method = ckpt.quant.get("quant_method")
    if method == "compressed-tensors":
        return compressed_tensors_dispatch(ckpt)
    return ds4_fp8_dispatch(ckpt)


# ------------------------------------------------------------ MoE methods and their parameters
class Param(torch.nn.Parameter):
    """ModelWeightParameter / PerTensorScaleParameter: vLLM's Parameter subclasses carrying the
    weight_loader; their TP-sharding methods are not used by the MoE loader."""

    def __new__(cls, data=None, weight_loader=None, **kwargs):
        param = torch.nn.Parameter._make_subclass(cls, data, False)
        param.weight_loader = weight_loader
        return param


def set_weight_attrs(tensor, attrs):
    """vllm/model_executor/utils.py set_weight_attrs, less its assertion that no attribute is set twice."""
    for key, value in (attrs or {}).items():
        setattr(tensor, key, value)


class FusedMoEMethodBase:
    """The MoE methods' base (fused_moe_method_base.py): it keeps the layer's FusedMoEConfig."""

    def __init__(self, moe):
        self.moe = moe


def _not_selected(*args, **kwargs):
    """The MoE kernel oracles (select_*_moe_backend), which the methods' constructors call: the
    kernel choice is tested on its own (kernel_selection), the parameters do not depend on it."""
    return None, None


@lru_cache(maxsize=None)
def _routed_ns() -> dict:
    ns = dict(torch=torch, Enum=enum.Enum, cdiv=lambda a, b: -(-a // b), Literal=typing.Literal, logger=LOG)
    extract(ROUTED, ["FusedMoeWeightScaleSupported"], ns)
    return ns


def _method_ns(**extra) -> dict:
    from compressed_tensors.quantization import QuantizationStrategy
    ns = dict(torch=torch, logger=LOG, Fraction=Fraction, math=math, set_weight_attrs=set_weight_attrs,
              ModelWeightParameter=Param, PerTensorScaleParameter=Param, FusedMoEMethodBase=FusedMoEMethodBase,
              FusedMoeWeightScaleSupported=_routed_ns()["FusedMoeWeightScaleSupported"],
              QuantizationStrategy=QuantizationStrategy, Enum=enum.Enum, **extra)
    return ns


def _modelopt_nvfp4(args, kwargs):
    ns = _method_ns(select_nvfp4_moe_backend=_not_selected, kNvfp4Static="kNvfp4Static",
                    kNvfp4Dynamic="kNvfp4Dynamic", kNvfp4DynamicToken="kNvfp4DynamicToken")
    extract("vllm/model_executor/layers/fused_moe/oracle/nvfp4.py",
            ["NvFp4MoeBackend", "FLASHINFER_NVFP4_MOE_BACKENDS", "is_global_sf_supported_for_nvfp4_backend"], ns)
    return klass(MODELOPT, "ModelOptNvFp4FusedMoE", ns, bases=("FusedMoEMethodBase",))(*args, **kwargs)


def _mxfp4(args, kwargs):
    ns = _method_ns(select_deepseek_v4_mxfp4_moe_backend=_not_selected)
    # a CUDA machine: the ROCm-only Kimi-K3 paths of the constructor answer no
    wheels.fake_module("vllm.platforms", current_platform=SimpleNamespace(is_rocm=lambda: False))
    extract(MXFP4, ["_use_k3_situ_aiter", "_use_k3_situ_int4_gfx942"], ns)
    return klass(MXFP4, "Mxfp4MoEMethod", ns, bases=("FusedMoEMethodBase",))(*args, **kwargs)


def _ct_wna16(args, kwargs):
    from compressed_tensors.quantization import QuantizationArgs
    # scalar types and quant keys are compared, never computed with, on the way to create_weights
    ns = _method_ns(select_wna16_moe_backend=_not_selected, QuantKey=lambda *a, **k: ("QuantKey", a, k),
                    WNA16_SUPPORTED_TYPES_MAP={4: "uint4b8", 8: "uint8b128"},
                    WNA16_ZP_SUPPORTED_TYPES_MAP={4: "uint4", 8: "uint8"},
                    kInt4Static32GroupScale="kInt4Static32GroupScale", kInt4StaticGroupScale="kInt4StaticGroupScale",
                    kInt8StaticGroupScale="kInt8StaticGroupScale", QuantizationArgs=QuantizationArgs,
                    CompressedTensorsMoEMethod=FusedMoEMethodBase)
    extract("vllm/model_executor/layers/fused_moe/oracle/int_wna16.py", ["WNA16MoEBackend"], ns)
    return klass(CT_MOE + "compressed_tensors_moe_wna16.py", "CompressedTensorsWNA16MoEMethod", ns,
                 bases=("CompressedTensorsMoEMethod",))(*args, **kwargs)


def _ct_w8a8_fp8(args, kwargs):
    ns = _method_ns(select_fp8_moe_backend=_not_selected, CompressedTensorsMoEMethod=FusedMoEMethodBase,
                    **{k: k for k in ("kFp8StaticChannelSym", "kFp8StaticTensorSym", "kFp8Static128BlockSym",
                                      "kFp8DynamicTokenSym", "kFp8Dynamic128Sym")})
    extract(QUANT + "utils/fp8_utils.py", ["validate_fp8_block_shape_moe"], ns)
    return klass(CT_MOE + "compressed_tensors_moe_w8a8_fp8.py", "CompressedTensorsW8A8Fp8MoEMethod", ns,
                 bases=("CompressedTensorsMoEMethod",))(*args, **kwargs)


METHOD_BUILDERS = {"ModelOptNvFp4FusedMoE": _modelopt_nvfp4, "Mxfp4MoEMethod": _mxfp4,
                   "CompressedTensorsWNA16MoEMethod": _ct_wna16, "CompressedTensorsW8A8Fp8MoEMethod": _ct_w8a8_fp8}


def build_moe_method(recorded):
    """The engine's real MoE method class for a dispatch's recorder, constructed with the
    arguments the dispatch passed; None where the tier has no stand-ins for its constructor."""
    build = METHOD_BUILDERS.get(type(recorded).__name__)
    return build(recorded.args, recorded.kwargs) if build else None


ROUTED_LOADER = ["_to_scalar", "_load_per_tensor_weight_scale", "_load_combined_w13_weight_scale",
                 "_load_model_weight_or_group_weight_scale", "_load_per_channel_weight_scale", "_get_hidden_dim",
                 "_narrow_expert_data_for_padding", "_load_w13", "_load_w2", "_load_single_value", "weight_loader"]


@lru_cache(maxsize=None)
def _routed_experts_class() -> type:
    """A module class carrying RoutedExperts' own weight-loading methods (routed_experts.py); the
    real class's constructor builds kernels and needs the engine's parallel state."""
    ns = dict(_routed_ns())
    # weight_loader's isinstance() test for online-quantized methods, which none of these is
    wheels.fake_module("vllm.model_executor.layers.quantization.online.moe_base",
                       OnlineMoEMethodBase=type("OnlineMoEMethodBase", (), {}))
    return type("RoutedExperts", (torch.nn.Module,), methods(ROUTED, "RoutedExperts", ROUTED_LOADER, ns))


class LoadRecord:
    """What the engine's loaders did with each checkpoint tensor."""

    def __init__(self):
        self.current = ""                              # the checkpoint tensor being loaded
        self.targets: dict[str, list[str]] = {}        # checkpoint name -> parameter names looked up
        self.by_value: dict[str, set[str]] = {}        # dtype change -> tensors copied by value

    def tensors(self, ckpt: Checkpoint, pairs):
        """(loader name, checkpoint name) -> what load_weights iterates, noting the current tensor."""
        for loader_name, name in pairs:
            self.current = name
            self.targets.setdefault(name, [])
            yield loader_name, ckpt.tensor(name)

    def loader(self, inner):
        """RoutedExperts.weight_loader, noting a dtype change: copy_ converts by value, so a
        tensor whose dtype differs from the parameter's keeps its bits only between int8 and
        uint8 (two's complement) and for weight_shape (integers loaded as values)."""
        def load(param, loaded_weight, weight_name, *args, **kwargs):
            same_bits = {param.dtype, loaded_weight.dtype} <= {torch.int8, torch.uint8}
            if param.dtype != loaded_weight.dtype and not same_bits and not weight_name.endswith("weight_shape"):
                tensor = regex.sub(r"experts\.\d+\.", "experts.*.", self.current)
                change = (f"{tensor} ({loaded_weight.dtype}) copied by value into "
                          f"{weight_name.rsplit('.', 1)[-1]} ({param.dtype})")
                self.by_value.setdefault(change, set()).add(self.current)
            return inner(param, loaded_weight, weight_name, *args, **kwargs)
        return load


def routed_experts(method, quant_config, experts: int, hidden: int, intermediate: int, record: LoadRecord):
    """A RoutedExperts module of the model's `quant_config` whose parameters are registered by
    the engine's `method`."""
    layer = _routed_experts_class()()
    layer.moe_config = moe_config()
    layer.quant_config = quant_config
    layer._fused_shared_expert_quantizer = None
    layer._loaded_expert_biases = set()
    layer._map_global_expert_id_to_local_expert_id = lambda expert: expert   # no expert parallelism
    layer.quant_method = method
    method.create_weights(layer=layer, num_experts=experts, hidden_size=hidden,
                          intermediate_size_per_partition=intermediate, params_dtype=torch.bfloat16,
                          weight_loader=record.loader(layer.weight_loader), global_num_experts=experts)
    return layer


class Params(dict):
    """params_dict for the engine's load_weights (`dict(self.named_parameters())`): routed-expert
    names resolve to the parameters the dispatched method registered (KeyError otherwise, as in
    vLLM); other names (attention, norms, shared experts: modules this tier does not build) are
    accepted and noted, so their names can be checked against the linear dispatch."""

    def __init__(self, experts: dict[str, torch.nn.Module], record: LoadRecord):
        super().__init__()
        self.experts, self.record = experts, record

    def __missing__(self, key):
        self.record.targets[self.record.current].append(key)
        for prefix, layer in self.experts.items():
            if key.startswith(prefix + "."):
                param = dict(layer.named_parameters()).get(key[len(prefix) + 1:])
                if param is None:
                    raise KeyError(key)
                return param
        if ".experts." in key and ".shared_experts." not in key:
            raise KeyError(key)
        return SimpleNamespace(weight_loader=lambda *args, **kwargs: None)


def _identity_layers(count):
    """DeepseekV4DecoderLayer stand-ins: load_weights asks only whether an MoE uses the native
    mega-MoE kernel (off on CPU) and fused shared experts (off unless that kernel is on)."""
    return [SimpleNamespace(ffn=SimpleNamespace(use_native_mega_moe=False, n_redundant_experts=0,
                                                experts=SimpleNamespace(has_fused_shared_experts=False)))
            for _ in range(count)]


def load_main(ckpt: Checkpoint, experts: dict[int, torch.nn.Module], record: LoadRecord, quant_config):
    """DeepseekV4Model.load_weights (model.py) with get_expert_mapping, over every checkpoint
    tensor that hf_to_vllm_mapper maps into the model (what AutoWeightsLoader hands it)."""
    params = Params({f"layers.{layer}.ffn.experts.routed_experts": m for layer, m in experts.items()}, record)
    mapping = expert_params_mapping(ckpt.config["n_routed_experts"])
    ns = dict(torch=torch, typing=typing, Callable=Callable, default_weight_loader=None, dict=lambda _: params,
              islice=itertools.islice,
              is_pp_missing_parameter=lambda name, model: False,   # one pipeline stage
              extract_layer_index=lambda name: int(name.split(".")[1]),
              fused_moe_make_expert_params_mapping=lambda model, **kwargs: mapping,
              make_deepseek_v4_expert_params_mapping=None, cdiv=lambda a, b: -(-a // b),
              get_tensor_model_parallel_world_size=lambda: 1)
    fns = methods(MODEL, "DeepseekV4Model", ["load_weights", "get_expert_mapping", "_pad_shared_expert_weight"], ns)
    model = SimpleNamespace(layers=_identity_layers(ckpt.layers), start_layer=0, end_layer=ckpt.layers,
                            quant_config=quant_config, use_sequence_parallel=False, named_parameters=lambda: [],
                            config=ckpt.hf_config())
    model.get_expert_mapping = lambda: fns["get_expert_mapping"](model)
    pad = fns["_pad_shared_expert_weight"]
    model._pad_shared_expert_weight = getattr(pad, "__func__", pad)
    mapper = weights_mapper(ckpt)
    names = []
    for name in sorted(ckpt.header):
        mapped = mapper.map_name(name)
        if mapped is not None and mapped.startswith("model."):
            names.append((mapped[len("model."):], name))
        elif mapped is not None:
            record.targets[name] = [mapped]   # lm_head: outside the decoder model
    return fns["load_weights"](model, record.tensors(ckpt, names))


def load_mtp(ckpt: Checkpoint, experts: torch.nn.Module, record: LoadRecord, quant_config):
    """DeepSeekV4MTP.load_weights (mtp.py) with its own spec-layer renaming, over the mtp.* tensors."""
    L = ckpt.layers
    params = Params({f"model.layers.{L}.mtp_block.ffn.experts.routed_experts": experts}, record)
    mapping = expert_params_mapping(ckpt.config["n_routed_experts"])
    ns = dict(torch=torch, typing=typing, Callable=Callable, re=regex, logger=LOG, default_weight_loader=None,
              is_mtp_completeness_check_enabled=lambda: True, make_deepseek_v4_expert_params_mapping=None,
              fused_moe_make_expert_params_mapping=lambda model, **kwargs: mapping, dict=lambda _: params,
              get_spec_layer_idx_from_weight_name=_mapper_ns()["get_spec_layer_idx_from_weight_name"])
    extract(MTP, ["_EXPERT_SCALE_RE"], ns)
    fns = methods(MTP, "DeepSeekV4MTP", ["load_weights", "_to_spec_layer_name", "_rewrite_spec_layer_name"], ns)
    layer = SimpleNamespace(mtp_block=_identity_layers(1)[0])
    mtp = SimpleNamespace(config=ckpt.hf_config(), quant_config=quant_config, pad_shared_expert=False,
                          model=SimpleNamespace(layers={str(L): layer}, mtp_start_layer_idx=L, num_mtp_layers=1),
                          named_parameters=lambda: [])
    mtp._to_spec_layer_name = lambda name: fns["_to_spec_layer_name"](mtp, name)
    mtp._rewrite_spec_layer_name = lambda spec, name: fns["_rewrite_spec_layer_name"](mtp, spec, name)
    names = [(name, name) for name in sorted(ckpt.header) if name.startswith("mtp.")]
    return fns["load_weights"](mtp, record.tensors(ckpt, names))


# ------------------------------------------------------------------------------ the checker
def expert_blocks(ckpt: Checkpoint) -> list[tuple[str, str]]:
    """(checkpoint block, the module prefix vLLM builds its experts under): main layers, then the
    MTP draft's, which mtp.py builds as model.layers.<num_hidden_layers + i>."""
    blocks = [(f"layers.{layer}", f"model.layers.{layer}.ffn.experts") for layer in range(ckpt.layers)]
    return blocks + [(f"mtp.{i}", f"model.layers.{ckpt.layers + i}.ffn.experts")
                     for i in range(ckpt.config.get("num_nextn_predict_layers", 0))]


def _bytes(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().view(torch.uint8).clone() for name, p in layer.named_parameters()}


def _fill(layers, value: int) -> None:
    for layer in layers:
        for p in layer.parameters():
            p.detach().view(torch.uint8).fill_(value)


# How the engine's loaders fail on a checkpoint: a parameter name it lacks (KeyError), a shape
# or value it rejects. Other exceptions (NameError, AttributeError, TypeError) mean a stand-in
# no longer fits the engine's code, and propagate.
LOADER_ERRORS = (KeyError, ValueError, AssertionError, RuntimeError, IndexError)


def vllm_load_report(path) -> list[str]:
    """What vLLM (the pinned release) gets wrong loading the checkpoint at `path`, one sentence
    per problem; empty when every tensor, MTP block included, lands in a parameter of the method
    vLLM dispatches for its layer, with its bits, that method is the one requant's rules name for
    the experts' format, and attention / shared-expert linears get an FP8-block method."""
    ckpt = Checkpoint(path)
    rules = ckpt.spec.engine(ENGINE)
    engine = f"vLLM {VERSION}"
    problems: list[str] = []
    disp = dispatch(ckpt)
    dims = (ckpt.config["n_routed_experts"], ckpt.config["hidden_size"], ckpt.config["moe_intermediate_size"])

    record = LoadRecord()
    experts: dict[str, torch.nn.Module] = {}
    for block, prefix in expert_blocks(ckpt):
        fmt = ckpt.expert_format(block)
        chosen = disp.moe(prefix)
        name = type(chosen).__name__
        wanted = {rules.kernel(fmt, gpu).method for gpu in GPUS}
        if wanted != {name}:
            problems.append(f"{block} ({fmt} experts): {engine} gives {prefix} {name}; "
                            f"requant's rules say {' / '.join(sorted(wanted))}")
        method = build_moe_method(chosen)
        if method is None:
            problems.append(f"{block}: {engine}'s {name} is not built by this tier, its loading is unchecked")
            continue
        experts[block] = routed_experts(method, disp.config, *dims, record)

    main = {int(b.split(".")[1]): m for b, m in experts.items() if b.startswith("layers.")}
    mtp = {b: m for b, m in experts.items() if b.startswith("mtp.")}
    failed: set[str] = set()
    snapshots = []
    # Two loads, the parameters first filled with 0x00 bytes, then 0xFF: a byte that still holds
    # the fill both times was never written (vLLM allocates them with torch.empty).
    for sentinel in (0x00, 0xFF):
        _fill(experts.values(), sentinel)
        for label, run, blocks in (
                ("DeepseekV4Model.load_weights", lambda: load_main(ckpt, main, record, disp.config), main),
                ("DeepSeekV4MTP.load_weights", lambda: load_mtp(ckpt, next(iter(mtp.values())), record, disp.config),
                 mtp)):
            if not blocks:
                continue
            try:
                run()
            except LOADER_ERRORS as e:   # the engine's loader refusing the checkpoint
                failed.add(label)
                if sentinel == 0x00:
                    problems.append(f"{engine} {label} raises {type(e).__name__}: {e} (loading {record.current})")
        snapshots.append({block: _bytes(layer) for block, layer in experts.items()})
    problems += [f"{change}: {len(names)} tensors" for change, names in sorted(record.by_value.items())]

    for block, layer in experts.items():
        if ("DeepSeekV4MTP.load_weights" if block.startswith("mtp.") else "DeepseekV4Model.load_weights") in failed:
            continue
        for name in snapshots[0][block]:
            never = (snapshots[0][block][name] == 0x00) & (snapshots[1][block][name] == 0xFF)
            if never.any():
                problems.append(f"{block}: {name} never written by {engine}'s loader "
                                f"({int(never.sum())} of {never.numel()} bytes keep uninitialised memory)")

    if not failed:
        for name, (dtype, _) in sorted(ckpt.header.items()):
            if not record.targets.get(name):
                problems.append(f"{name}: no {engine} parameter takes it (dropped at load)")
    for name, (dtype, _) in sorted(ckpt.header.items()):
        if dtype != "F8_E4M3" or ckpt.spec.expert_tensor(name) or not record.targets.get(name):
            continue
        module = record.targets[name][0].rsplit(".", 1)[0]
        prefix = module.replace(".mtp_block.", ".") if module.startswith("model.") else f"model.{module}"
        method = disp.linear(prefix)
        if "FP8 block" not in method:
            problems.append(f"{name}: FP8 weights, but {engine} gives {prefix} {method}")
    return problems


# ------------------------------------------------------------------- MoE kernel selection
EXPERTS = "vllm/model_executor/layers/fused_moe/experts/"
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/"
# Quant keys as tokens: the selectors and the kernels' _supports_quant_scheme compare keys by
# equality and membership only (quant_utils.py builds them as dataclasses).
QUANT_KEYS = ["kNvfp4Static", "kNvfp4Dynamic", "kNvfp4DynamicToken", "kMxfp4Static", "kMxfp4Dynamic",
              "kMxfp8Dynamic", "kMxfp8Static", "kFp8Dynamic128Sym", "kFp8StaticTensorSym", "kFp8Static128BlockSym",
              "kFp8StaticChannelSym", "kFp8DynamicTokenSym", "kFp8DynamicTensorSym", "kInt4Static", "kInt8Static",
              "kInt4Static32", "kInt4StaticAsym", "kInt4Static32Asym"]
# What an installation may or may not provide that changes vLLM's choice (requant.engines
# INSTALL_CONDITIONS names the deviations from the default).
DEFAULT_INSTALL = frozenset({"flashinfer", "humming"})


class _CurrentPlatform:
    """vllm.platforms.current_platform as the extracted functions see it: the GPU of the
    selection being run."""

    def __init__(self, state):
        self._state = state

    def __getattr__(self, name):
        return getattr(self._state.platform, name)


@lru_cache(maxsize=None)
def _support_deep_gemm():
    return methods("vllm/platforms/cuda.py", "CudaPlatformBase", ["support_deep_gemm"], {})["support_deep_gemm"].__func__


class FakePlatform:
    """vllm.platforms.current_platform of a CUDA GPU of compute capability `cap` (e.g. 90): the
    capability arithmetic of CudaPlatformBase, with support_deep_gemm the engine's own."""

    def __init__(self, cap: int):
        self.cap = cap
        self.device_name = f"sm_{cap}"
        support = _support_deep_gemm()
        self.support_deep_gemm = lambda: support(self)

    def is_cuda(self):
        return True

    is_cuda_alike = is_cuda

    def is_rocm(self):
        return False

    is_xpu = is_cpu = is_rocm

    def _int(self, cap):
        return cap if isinstance(cap, int) else cap[0] * 10 + cap[1]

    def is_device_capability(self, cap):
        return self.cap == self._int(cap)

    def is_device_capability_family(self, family):
        return self.cap // 10 == self._int(family) // 10

    def has_device_capability(self, cap):
        return self.cap >= self._int(cap)

    def get_device_capability(self):
        return SimpleNamespace(major=self.cap // 10, minor=self.cap % 10, to_int=lambda: self.cap)


KERNEL_CHECKS = ["_supports_current_device", "_supports_quant_scheme", "_supports_routing_method"]


def _kernel(ns, base, name, relpath, cls, checks, batched=False, monolithic=False):
    """A kernel class with the engine's own support checks `checks` of class `cls` and
    FusedMoEExperts.is_supported_config (`base`). Checks about activation function, parallel
    layout, shapes, router-logit dtype and LoRA answer yes: DeepSeek-V4's SiLU, TP-only, its shapes
    (the tier asks which kernel a supported deployment gets, not whether one exists)."""
    attrs = {k: staticmethod(v.__func__ if isinstance(v, staticmethod) else v)
             for k, v in methods(EXPERTS + relpath, cls, checks, ns).items()}
    # Humming's _supports_quant_scheme inspects QuantKey fields the tokens lack; its list
    # (fused_humming_moe.py) holds the NVFP4, MXFP4 and INT4 keys the three formats use
    attrs.setdefault("_supports_quant_scheme", staticmethod(lambda weight, activation: True))
    attrs.setdefault("_supports_routing_method", staticmethod(lambda routing, weight, activation: True))
    for check in ("_supports_no_act_and_mul", "_supports_activation", "_supports_parallel_config",
                  "_supports_router_logits_dtype", "_supports_shape", "_supports_batch_invariance", "supports_lora"):
        attrs[check] = staticmethod(lambda *args: True)
    fmt = ns["mk"].FusedMoEActivationFormat
    attrs.update(is_monolithic=staticmethod(lambda: monolithic), _supports_hash_routing=staticmethod(lambda: False),
                 activation_format=staticmethod(lambda: fmt.BatchedExperts if batched else fmt.Standard),
                 is_supported_config=base)
    return type(name, (), attrs)


@lru_cache(maxsize=None)
def _selection_env() -> tuple[dict, dict, SimpleNamespace]:
    """The selectors and kernel classes, built once; `state` holds the GPU and the installed
    optional kernels that the stand-in flags read at call time."""
    state = SimpleNamespace(platform=None, installed=frozenset())
    fmt = enum.Enum("FusedMoEActivationFormat", {"Standard": "standard", "BatchedExperts": "batched"})
    routing = enum.Enum("RoutingMethodType", {n: i for i, n in enumerate(
        ["DeepSeekV3", "Renormalize", "RenormalizeNaive", "Llama4", "SigmoidRenorm", "Sigmoid", "MiniMax2",
         "DeepseekV4", "Unspecified"])})
    fi = lambda: "flashinfer" in state.installed   # noqa: E731
    ns = dict({k: k for k in QUANT_KEYS}, current_platform=_CurrentPlatform(state), RoutingMethodType=routing,
              torch=torch,
              logger=LOG, Enum=enum.Enum, replace=dataclasses.replace, GroupShape=None,
              mk=SimpleNamespace(FusedMoEActivationFormat=fmt),
              # vllm/utils/flashinfer.py: usable = importable and (cubin or nvcc+ninja)
              has_flashinfer=fi, has_flashinfer_trtllm_fused_moe=fi, has_flashinfer_cutedsl_moe_nvfp4=fi,
              has_flashinfer_cutedsl_grouped_gemm_nt_masked=fi, has_flashinfer_cutlass_fused_moe=fi,
              has_humming=lambda: "humming" in state.installed,   # utils/import_utils.py: humming importable
              # deep_gemm.py is_deep_gemm_supported: the platform's support_deep_gemm, VLLM_USE_DEEP_GEMM
              # (default on) and deep_gemm importable
              is_deep_gemm_supported=lambda: "deep_gemm" in state.installed and state.platform.support_deep_gemm(),
              # CUTLASS grouped GEMM builds (csrc): sm90 and sm100
              cutlass_group_gemm_supported=lambda: state.platform.cap in (90, 100),
              # the custom op that reports the MXFP4 experts quant kernel: built for sm100 family
              ops=SimpleNamespace(mxfp4_experts_quant_supported=lambda c: c // 10 == 10),
              envs=SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_B12X_MOE_FP4_FORCE_A16=False,
                                   VLLM_CPU_INT4_W4A8=False))
    wheels.fake_module("vllm.model_executor.layers.quantization.utils.flashinfer_mxint4_moe",
                       is_flashinfer_mxint4_moe_available=fi)
    base = methods("vllm/model_executor/layers/fused_moe/modular_kernel.py", "FusedMoEExperts",
                   ["is_supported_config"], dict(ns))["is_supported_config"]
    device, quant, routed = KERNEL_CHECKS[:1], KERNEL_CHECKS[:2], KERNEL_CHECKS
    k = lambda *args, **kw: _kernel(ns, base, *args, **kw)   # noqa: E731
    kernels = dict(
        trtllm_nvfp4_mono=k("TrtLlmNvFp4ExpertsMonolithic", "trtllm_nvfp4_moe.py", "TrtLlmNvFp4ExpertsBase", quant,
                            monolithic=True),
        trtllm_nvfp4=k("TrtLlmNvFp4ExpertsModular", "trtllm_nvfp4_moe.py", "TrtLlmNvFp4ExpertsBase", quant),
        cutedsl=k("FlashInferCuteDSLExperts", "flashinfer_cutedsl_moe.py", "FlashInferCuteDSLExperts", quant),
        cutedsl_batched=k("FlashInferCuteDSLBatchedExperts", "flashinfer_cutedsl_batched_moe.py",
                          "FlashInferCuteDSLBatchedExperts", device, batched=True),
        fi_cutlass=k("FlashInferExperts", "flashinfer_cutlass_moe.py", "FlashInferExperts", quant),
        cutlass_fp4=k("CutlassExpertsFp4", "cutlass_moe.py", "CutlassExpertsFp4", quant),
        marlin=k("MarlinExperts", "marlin_moe.py", "MarlinExpertsBase", quant),
        batched_marlin=k("BatchedMarlinExperts", "marlin_moe.py", "MarlinExpertsBase", quant, batched=True),
        humming=k("HummingGroupedExperts", "fused_humming_moe.py", "HummingExpertsBase", device),
        emulation=k("Nvfp4QuantizationEmulationTritonExperts", "triton_moe.py", "TritonExperts", device),
        trtllm_mxfp4_mono=k("TrtLlmMxfp4ExpertsMonolithic", "trtllm_mxfp4_moe.py", "TrtLlmMxfp4ExpertsBase", quant,
                            monolithic=True),
        trtllm_mxfp4=k("TrtLlmMxfp4ExpertsModular", "trtllm_mxfp4_moe.py", "TrtLlmMxfp4ExpertsBase", quant),
        deepgemm_fp4=k("DeepGemmFP4Experts", "deep_gemm_moe.py", "DeepGemmFP4Experts", quant),
        trtllm_int4_mono=k("TrtLlmMxint4ExpertsMonolithic", "trtllm_mxint4_moe.py", "TrtLlmMxint4ExpertsMonolithic",
                           routed, monolithic=True),
        triton_wna16=k("TritonWNA16Experts", "triton_moe.py", "TritonWNA16Experts", device),
    )
    # the monolithic TRT-LLM kernels' routing lists live on the monolithic subclasses
    for key, relpath, cls in (("trtllm_nvfp4_mono", "trtllm_nvfp4_moe.py", "TrtLlmNvFp4ExpertsMonolithic"),
                              ("trtllm_mxfp4_mono", "trtllm_mxfp4_moe.py", "TrtLlmMxfp4ExpertsMonolithic")):
        check = methods(EXPERTS + relpath, cls, ["_supports_routing_method"], ns)["_supports_routing_method"]
        kernels[key]._supports_routing_method = staticmethod(getattr(check, "__func__", check))
    extract("vllm/model_executor/layers/quantization/utils/humming/priority.py",
            ["_HUMMING_PREFERRED_CAPABILITIES", "prefers_humming", "prioritize_humming"], ns)
    config = SimpleNamespace(swiglu_limit=10.0, moe_backend="auto", routing_method=routing.DeepseekV4,
                             has_hash_routing=False, require_decomposed_backend=False, is_act_and_mul=True,
                             activation="silu", router_logits_dtype=torch.float32, hidden_dim=4096,
                             is_lora_enabled=False,
                             moe_parallel_config=SimpleNamespace(use_batched_activation_format=False))

    # one namespace per oracle file: they define helpers of the same name (_get_priority_backends)
    oracles = {name: dict(ns) for name in ("nvfp4", "mxfp4", "w4a16")}
    extract(ORACLE + "nvfp4.py", ["NvFp4MoeBackend", "map_nvfp4_backend", "_use_a16", "select_nvfp4_moe_backend"],
            oracles["nvfp4"])
    oracles["mxfp4"]["QuantizationConfigArgs"] = type("QuantizationConfigArgs", (), {})
    extract(ORACLE + "mxfp4.py", ["Mxfp4MoeBackend", "_get_priority_backends", "_backend_activation_key",
                                  "_make_log_backend", "_make_log_unsupported",
                                  "select_deepseek_v4_mxfp4_moe_backend"], oracles["mxfp4"])
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
    oracles["w4a16"].update(QuantizationArgs=QuantizationArgs, QuantizationStrategy=QuantizationStrategy,
              # marlin_utils.py check_moe_marlin_supports_config: the group sizes Marlin MoE runs
              check_moe_marlin_supports_config=lambda moe, group, allow_tile_padding=False: group in (-1, 32, 64, 128))
    for module, name in (("auto_awq", "AutoAWQConfig"), ("auto_gptq", "AutoGPTQConfig"), ("moe_wna16", "MoeWNA16Config")):
        wheels.fake_module(f"vllm.model_executor.layers.quantization.{module}", **{name: type(name, (), {})})
    extract(ORACLE + "int_wna16.py", ["WNA16MoEBackend", "_get_priority_backends", "_backend_incompatibility_reason",
                                      "map_wna16_backend", "select_wna16_moe_backend"], oracles["w4a16"])
    return oracles, kernels, config, state


def kernel_selection(cap: int, installed: frozenset[str]) -> dict[str, list[str]]:
    """The MoE backend vLLM's own selectors pick for DeepSeek-V4's routed experts on a GPU of
    capability `cap` with the optional kernels `installed` (subset of flashinfer, humming,
    deep_gemm), per expert format: select_nvfp4_moe_backend (ModelOptNvFp4FusedMoE),
    select_deepseek_v4_mxfp4_moe_backend (Mxfp4MoEMethod), select_wna16_moe_backend
    (CompressedTensorsWNA16MoEMethod, for g32/g128 sym/asym), each for a hash-routed and a
    normally routed layer. Returns format -> the backend enum names (or "refuses: ...")."""
    oracles, kernels, config, state = _selection_env()
    state.platform, state.installed = FakePlatform(cap), installed
    wheels.fake_module("vllm.platforms", current_platform=state.platform)

    def run(oracle, select, table, *args):
        """backend_to_kernel_cls (which imports the kernel modules) answered from `table`."""
        ns = oracles[oracle]
        ns["backend_to_kernel_cls"] = lambda backend: [kernels[name] for name in table[backend.name]]
        picks = []
        for hashed in (False, True):   # DeepSeek-V4's first layers are hash-routed
            layer = SimpleNamespace(**{**vars(config), "has_hash_routing": hashed})
            try:
                picks.append(ns[select](layer, *args)[0].name)
            except (ValueError, NotImplementedError) as e:   # the engine refusing to start is an answer
                picks.append(f"refuses: {e}")
        return picks

    out = {}
    out["nvfp4"] = run("nvfp4", "select_nvfp4_moe_backend", {
        "FLASHINFER_TRTLLM": ["trtllm_nvfp4_mono", "trtllm_nvfp4"], "FLASHINFER_CUTEDSL": ["cutedsl"],
        "FLASHINFER_CUTEDSL_BATCHED": ["cutedsl_batched"], "FLASHINFER_CUTLASS": ["fi_cutlass"],
        "VLLM_CUTLASS": ["cutlass_fp4"], "MARLIN": ["marlin"], "HUMMING": ["humming"], "EMULATION": ["emulation"]},
        "kNvfp4Static", "kNvfp4Dynamic")
    out["mxfp4"] = run("mxfp4", "select_deepseek_v4_mxfp4_moe_backend", {
        "FLASHINFER_TRTLLM_MXFP4_MXFP8": ["trtllm_mxfp4_mono", "trtllm_mxfp4"], "DEEPGEMM_MXFP4": ["deepgemm_fp4"],
        "MARLIN": ["marlin"], "BATCHED_MARLIN": ["batched_marlin"], "HUMMING": ["humming"]})
    from compressed_tensors.quantization import QuantizationArgs
    wna16 = {"RDNA3": [], "FLASHINFER_TRTLLM": ["trtllm_int4_mono"], "MARLIN": ["marlin"],
             "BATCHED_MARLIN": ["batched_marlin"], "TRITON": ["triton_wna16"], "HUMMING": ["humming"],
             "EMULATION": ["emulation"]}
    out["w4a16"] = []
    for group, symmetric in ((32, True), (128, True), (32, False), (128, False)):
        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
        key = "kInt4Static" + ("32" if group == 32 else "") + ("" if symmetric else "Asym")
        out["w4a16"] += run("w4a16", "select_wna16_moe_backend", wna16, key, args, not symmetric, False, True)
    return out
