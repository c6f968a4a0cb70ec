"""vLLM's own DeepSeek-V4 loading code, executed on CPU over a checkpoint directory.

Every engine function named here is read from the pinned vLLM release wheel at test time
(tests/engines/wheels.py) and executed as the engine has it; nothing of vLLM is installed or
imported, and no engine code lives in this repository. What vLLM would construct around those
functions (its platform, kernels, modules) is replaced by small stand-ins, each saying why.

`vllm_load_report(path)` is the one checker: it runs the weight-name remapping, the quantization
method dispatch per layer, the dispatched MoE method's and FP8 linear method's `create_weights`,
and the model's and the MTP draft's `load_weights` (with `RoutedExperts.weight_loader`) over every
tensor of the checkpoint, and returns what vLLM would get wrong, as sentences; an empty list means
it loads. Also here: vLLM's NVFP4 reference dequant and Marlin scale processing
(`nvfp4_dequantizer`, `marlin_scale_processing`) and its MoE kernel selectors (`kernel_selection`).

Not executed: the modules' constructors and process_weights_after_loading (GPU kernels), the
linear layers' TP weight loaders (their shapes are checked against create_weights instead), and
the non-quantized modules (norms, embeddings, router): their tensors are routed by the engine's
load_weights but not checked against a parameter.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import fnmatch
import functools
import itertools
import json
import math
import mmap
import os
import sys
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import numpy
import regex
import torch
from safetensors import safe_open

from requant.model import ModelSpec

from . import wheels

ENGINE = "vllm"
VERSION = wheels.version(ENGINE)
GPUS = ("sm_80", "sm_90", "sm_100", "sm_120")

MODEL = "vllm/models/deepseek_v4/nvidia/model.py"   # the CUDA build's classes (deepseek_v4/__init__.py)
MTP = "vllm/models/deepseek_v4/nvidia/mtp.py"
DSPARK = "vllm/models/deepseek_v4/nvidia/dspark.py"
DSPARK_V41 = "vllm/models/deepseek_v41/nvidia/dspark.py"
MODEL_V41 = "vllm/models/deepseek_v41/nvidia/model.py"
VL_MODEL_V41 = "vllm/models/deepseek_v41/nvidia/vl_model.py"
VL_MODEL = "vllm/models/deepseek_v4/common/vl_model.py"
ARCH_CONVERTOR = "vllm/transformers_utils/model_arch_config_convertor.py"
V41_CONFIG = "vllm/transformers_utils/configs/deepseek_v41.py"
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


def methods(relpath: str, cls: str, names: list[str], ns: dict, **how) -> dict:
    return wheels.methods(ENGINE, relpath, cls, names, ns, **how)


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
        raw = json.loads((self.path / "config.json").read_text())
        self.v41 = raw.get("model_type") == "deepseek_v41"
        # vLLM's hf_config: a V4.1 config.json through its DeepseekV41Config (text_config flattened)
        self.config = _v41_hf_config(raw) if self.v41 else raw
        self.quant = self.config.get("quantization_config") or {}
        self.weight_map = json.loads((self.path / "model.safetensors.index.json").read_text())["weight_map"]
        self.header: dict[str, tuple[str, tuple[int, ...]]] = {}
        for shard in sorted(set(self.weight_map.values())):
            with open(self.path / shard, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            self.header.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
        self.spec = ModelSpec.for_config(raw)

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path / self.weight_map[name]), "pt") as f:
            return f.get_tensor(name)

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

    @property
    def dspark(self) -> bool:
        """The checkpoint ships a DSpark drafter under mtp.* (config.json carries the dspark_* keys
        vLLM's DSpark draft reads, dspark_target_layer_ids among them), which vLLM serves with
        speculative method "dspark" (DSparkDeepseekV4ForCausalLM) rather than the MTP module."""
        return "dspark_target_layer_ids" in self.config

    def hf_config(self) -> SimpleNamespace:
        """vLLM's hf_config: config.json's keys as attributes."""
        return SimpleNamespace(**self.config)

    @functools.cached_property
    def architecture(self) -> str:
        """The model class vLLM builds for the checkpoint: config.json's architecture as
        DeepseekV4ModelArchConfigConvertor.__init__ leaves it (model_arch_config_convertor.py;
        Vision-Exp: DeepseekV4ForCausalLM becomes the VL wrapper DeepseekV4ForConditionalGeneration)."""
        hf = self.hf_config()
        base = type("ModelArchConfigConvertorBase", (), {"__init__": lambda self, *a: None})
        cls = klass(ARCH_CONVERTOR, "DeepseekV4ModelArchConfigConvertor", {"ModelArchConfigConvertorBase": base},
                    ("ModelArchConfigConvertorBase",))
        cls(hf, hf, None)
        return hf.architectures[0]

    @property
    def vl(self) -> bool:
        """V4 loaded through its VL wrapper (common/vl_model.py), the vision tower beside the text model."""
        return not self.v41 and self.architecture == "DeepseekV4ForConditionalGeneration"


def _v41_hf_config(raw: dict) -> dict:
    """transformers_utils/configs/deepseek_v41.py DeepseekV41Config(**config.json), on the
    transformers release installed here: its attributes."""
    import transformers
    cls = extract(V41_CONFIG, ["DeepseekV41Config"], dict(PreTrainedConfig=transformers.PreTrainedConfig,
                                                         Any=typing.Any))["DeepseekV41Config"]
    config = cls(**raw)
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


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


@lru_cache(maxsize=None)
def _v41_mapper_ns() -> dict:
    ns = dict(_mapper_ns())
    extract(MODEL_V41, ["_make_deepseek_v4_weights_mapper"], ns)
    extract(VL_MODEL_V41, ["_make_deepseek_v4_vl_weights_mapper"], ns)
    return ns


def v41_weights_mapper(ckpt: Checkpoint, linear_scale_name: str):
    """DeepseekV41ForCausalLM.hf_to_vllm_mapper (vl_model.py): the text rules re-rooted under
    language_model., with the scale name the 32x32 linears' method registers."""
    return _v41_mapper_ns()["_make_deepseek_v4_vl_weights_mapper"](ckpt.config.get("expert_dtype", "fp4"),
                                                                   linear_scale_name)


class _ImageLimit:
    """The wrapper's multimodal_config with no --limit-mm-per-prompt: images allowed."""

    @staticmethod
    def get_limit_per_prompt(modality: str) -> int:
        return 1


def vl_weights_mapper(ckpt: Checkpoint):
    """DeepseekV4ForConditionalGeneration.hf_to_vllm_mapper (common/vl_model.py): V4's text rules
    re-rooted under language_model., with image_enabled as its __init__ computes it for this config
    (vision., aligner. and image_ dropped only when it is off)."""
    ns = dict(_mapper_ns())
    extract(VL_MODEL, ["_make_deepseek_v4_vl_weights_mapper"], ns)
    init = next(n for n in wheels._class_node(ENGINE, VL_MODEL, "DeepseekV4ForConditionalGeneration").body
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    value = next(a.value for a in ast.walk(init) if isinstance(a, ast.Assign)
                 and any(getattr(t, "id", "") == "image_enabled" for t in a.targets))
    image_enabled = eval(compile(ast.Expression(value), VL_MODEL, "eval"),
                         dict(config=ckpt.hf_config(), self=SimpleNamespace(multimodal_config=_ImageLimit())))
    return ns["_make_deepseek_v4_vl_weights_mapper"](weights_mapper(ckpt), image_enabled)


def linear_scale_name(ckpt: Checkpoint, quant_config) -> str:
    """V4.1's _linear_scale_param_name (deepseek_v41/nvidia/model.py): weight_scale for 32x32 MXFP8
    linears beside fp4 experts, else weight_scale_inv."""
    fn = wheels.extract_closure(ENGINE, MODEL_V41, ["_linear_scale_param_name"], {})["_linear_scale_param_name"]
    return fn(SimpleNamespace(quant_config=quant_config), ckpt.config.get("expert_dtype", "fp4"))


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


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which part of a layer's routed experts one GPU holds: TP rank `tp_rank` of `tp_size`
    (vLLM's default for MoE under tensor parallelism: each rank holds every expert, a slice of its
    intermediate dimension), or with expert parallelism (--enable-expert-parallel) EP rank
    `ep_rank` of `ep_size`, whole experts, vLLM's linear placement. Default: one GPU."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __str__(self):
        return f"EP {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else f"TP {self.tp_rank}/{self.tp_size}"


ONE_GPU = Placement()


def moe_config(experts: int, placement: Placement = ONE_GPU, **fields) -> SimpleNamespace:
    """The FusedMoEConfig of a layer of `experts` routed experts (logical = physical: no
    redundant experts) as `placement` holds it: gated SiLU (act-and-mul, two w13 shards), no
    bias, unless `fields` say otherwise; the fields the methods and loaders read."""
    parallel = SimpleNamespace(tp_size=placement.tp_size, tp_rank=placement.tp_rank, ep_size=placement.ep_size,
                               ep_rank=placement.ep_rank, enable_eplb=False)
    return SimpleNamespace(**{**dict(is_act_and_mul=True, has_bias=False, w13_num_shards=2, max_capture_size=512,
                                     tp_shard_with_padding=False, tp_rank=placement.tp_rank,
                                     tp_size=placement.tp_size, num_experts=experts, num_logical_experts=experts,
                                     moe_parallel_config=parallel), **fields})


SCHEMES = ["CompressedTensorsW4A4Fp4", "CompressedTensorsW4A4Mxfp4", "CompressedTensorsW4A8Fp8",
           "CompressedTensorsW4A8Int", "CompressedTensorsW4A8Mxfp4", "CompressedTensorsW8A16Fp8",
           "CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Int8", "CompressedTensorsW8A8Mxfp8",
           "CompressedTensorsWNA16", "CompressedTensorsWNA4Int", "CompressedTensorsWNA8Int", "CompressedTensorsWNA8O8Int"]

PACKED_MODULES = {"gate_up_proj": ["w1", "w3"], "fused_wqa_wkv": ["wq_a", "wkv"],
                  "fused_wkv_wgate": ["wkv", "wgate"]}   # DeepseekV4ForCausalLM.packed_modules_mapping


@dataclasses.dataclass
class Dispatch:
    """What the quantization config vLLM builds for a checkpoint gives each layer."""

    config: object                     # the engine's quantization config object
    moe: Callable[[str], object]       # layer prefix -> the MoE method (recorder)
    linear: Callable[[str], object]    # layer prefix -> the linear method or scheme (recorder)


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


@lru_cache(maxsize=None)
def cuda_ds4_quant_file() -> str:
    """The file of the DeepseekV4FP8Config class vLLM registers as "deepseek_v4_fp8" on a CUDA
    GPU: get_quantization_config (quantization/__init__.py) imports it from the module named in
    its `if current_platform.is_cuda() ...` branch (vLLM 0.33.0 and 0.34.0: models/deepseek_v41,
    for every DeepSeek-V4 model type), else from models/deepseek_v4."""
    tree = wheels._tree(ENGINE, QUANT + "__init__.py")
    get = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_quantization_config")
    for node in ast.walk(get):
        if isinstance(node, ast.If) and "is_cuda" in ast.unparse(node.test):
            for imp in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if isinstance(imp, ast.ImportFrom) and any(a.name == "DeepseekV4FP8Config" for a in imp.names):
                    package = imp.module.replace(".", "/")
                    for top in wheels._tree(ENGINE, package + "/__init__.py").body:   # from .quant_config import
                        if isinstance(top, ast.ImportFrom) and any(a.name == "DeepseekV4FP8Config" for a in top.names):
                            base = package if top.level else ""
                            return "/".join(p for p in (base, (top.module or "").replace(".", "/")) if p) + ".py"
    return DS4_QUANT


def ds4_fp8_dispatch(ckpt: Checkpoint) -> Dispatch:
    """DeepseekV4FP8Config over Fp8Config (fp8.py), both whole classes, as vLLM builds it on a CUDA
    GPU for a `quant_method: fp8` DeepSeek-V4 checkpoint (the class of cuda_ds4_quant_file)."""
    ns = dict(ACTIVATION_SCHEMES=["static", "dynamic"], Literal=typing.Literal, logger=LOG, cast=typing.cast,
              LinearBase=LinearBase, RoutedExperts=RoutedExperts, Attention=Attention,
              MappingProxyType=MappingProxyType, Mapping=Mapping, get_marlin_input_dtype=lambda prefix: None,
              QuantizationConfig=_quantization_config_stub(), kMxfp8Dynamic="kMxfp8Dynamic",
              kMxfp8Static="kMxfp8Static", QuantSpec=lambda **kw: ("QuantSpec", kw), fnmatch=fnmatch, re=regex,
              **{n: recorder(n) for n in ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "Fp8LinearMethod",
                                          "Fp8MoEMethod", "Fp8KVCacheMethod", "Mxfp4MoEMethod")})
    extract(QUANT_UTILS, ["is_layer_skipped"], ns)
    klass(FP8, "Fp8Config", ns, bases=("QuantizationConfig",))
    hf = ckpt.hf_config()
    # get_current_vllm_config(): the running engine's config, of which these read the hf configs only
    ns["get_current_vllm_config"] = lambda: SimpleNamespace(model_config=SimpleNamespace(hf_config=hf,
                                                                                          hf_text_config=hf))
    quant_file = cuda_ds4_quant_file()
    for name in ("_DEEPSEEK_V4_EXPERT_DTYPES", "_EXPERTS_LAYER_RE"):   # the V4 file has no _EXPERTS_LAYER_RE
        _extract_where_defined(quant_file, name, ns)
    wheels.fake_module("vllm.logger", init_logger=lambda name: LOG)
    wheels.fake_module(MODELOPT[:-3].replace("/", "."), ModelOptNvFp4FusedMoE=recorder("ModelOptNvFp4FusedMoE"),
                       ModelOptNvFp4Config=_modelopt_nvfp4_config(),
                       ModelOptLinearMethod=recorder("ModelOptLinearMethod"), CkptCtx=lambda **kw: ("CkptCtx", kw))
    cls = klass(quant_file, "DeepseekV4FP8Config", ns, bases=("Fp8Config",))
    name = cls.override_quantization_method(dict(ckpt.quant), None, hf_config=hf)
    assert name == "deepseek_v4_fp8", f"vLLM does not take {ckpt.path} as DeepSeek-V4 FP8 ({name!r})"
    config = cls.from_config(dict(ckpt.quant))
    config.packed_modules_mapping = PACKED_MODULES
    config.apply_vllm_mapper(weights_mapper(ckpt).get_rename_mapper())   # configure_quant_config
    _mtp_prefix_mapper(ckpt)(config, hf)

    def moe(prefix):
        layer = RoutedExperts()
        layer.moe_config = moe_config(ckpt.config["n_routed_experts"])
        return config.get_quant_method(layer, prefix)

    def linear(prefix):
        return config.get_quant_method(LinearBase(), prefix)

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
        "_is_dynamic_token_w4a8_int", "_is_fp8_w4a8", "get_scheme", "_get_scheme_from_parts",
        "_is_fp8_w8a16", "_is_static_tensor_w8a8", "_is_wNa8o8_int", "_is_wNaM_int", "_is_fp8_w4a8_sm90",
        "_fp8_dynamic_input_key"], ns)
    # the scheme classes get_scheme may construct: recorders (their constructors pick kernels)
    ns.update({name: recorder(name) for name in SCHEMES},
              current_platform=SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False))   # a CUDA machine
    for name in SCHEMES:
        ns[name].get_min_capability = classmethod(lambda cls: 0)
    # _check_scheme_supported asks the GPU's capability: one with FP8 (sm_89 and up); its exact
    # sm90/sm100 questions lead to the same classes as the general FP8 one, so "not exactly that"
    fns["_check_scheme_supported"] = classmethod(
        lambda cls, capability, error=True, match_exact=False: not match_exact)
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
        layer.moe_config = moe_config(ckpt.config["n_routed_experts"])
        try:
            return get_moe_method(config, layer, layer_name=prefix)
        except Exception as e:   # the engine refusing the layer
            return recorder(f"refused ({type(e).__name__}: {e})")()

    def linear(prefix):
        # CompressedTensorsLinearMethod delegates create_weights to the layer's scheme
        return config.get_scheme(LinearBase(), prefix) or recorder("UnquantizedLinearMethod")()

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
    wheels.fake_module("vllm.distributed", get_tensor_model_parallel_world_size=lambda: 1)   # one GPU
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
                 "_narrow_expert_data_for_padding", "_load_w13", "_load_w2", "_load_single_value", "weight_loader",
                 "_map_global_expert_id_to_local_expert_id"]
EXPERT_MAP = "vllm/model_executor/layers/fused_moe/expert_map_manager.py"


@lru_cache(maxsize=None)
def _routed_experts_class() -> type:
    """A module class carrying RoutedExperts' own weight-loading methods (routed_experts.py); the
    real class's constructor builds kernels and needs the engine's parallel state."""
    ns = dict(_routed_ns())
    # weight_loader's isinstance() test for online-quantized methods, which none of these is
    wheels.fake_module("vllm.model_executor.layers.quantization.online.moe_base",
                       OnlineMoEMethodBase=type("OnlineMoEMethodBase", (), {}))
    ns.update(copy_weight(ROUTED))
    return type("RoutedExperts", (torch.nn.Module,), methods(ROUTED, "RoutedExperts", ROUTED_LOADER, ns))


def copy_weight(relpath: str) -> dict:
    """{"copy_weight_": vllm/model_executor/utils.py's copy_weight_} where engine file `relpath`
    imports it (vLLM 0.34's routed_experts.py and weight_utils.py copy through it, a plain copy_ off
    integrated GPUs; 0.33 and earlier call copy_ themselves), else {}."""
    if "copy_weight_" not in wheels.imports(ENGINE, relpath):
        return {}
    ns = dict(functools=functools, mmap=mmap, torch=torch,
              current_platform=SimpleNamespace(is_integrated_gpu=lambda index: False))   # a discrete GPU
    return {"copy_weight_": wheels.extract_closure(ENGINE, "vllm/model_executor/utils.py", ["copy_weight_"],
                                                   ns)["copy_weight_"]}


@lru_cache(maxsize=None)
def _expert_map_fns() -> dict:
    """expert_map_manager.py's determine_expert_map and ExpertMapManager.map_global_to_local."""
    ns = dict(torch=torch, logger=LOG)
    extract(EXPERT_MAP, ["determine_expert_map"], ns)
    ns.update(methods(EXPERT_MAP, "ExpertMapManager", ["map_global_to_local"], ns))
    return ns


def place_experts(layer: torch.nn.Module, method, config: SimpleNamespace, experts: int, hidden: int,
                  intermediate: int, weight_loader, placement: Placement = ONE_GPU) -> torch.nn.Module:
    """Give a RoutedExperts-like `layer` what its constructor would (routed_experts.py
    RoutedExperts.__init__) for `placement`: the FusedMoEConfig, the expert map vLLM's own
    determine_expert_map builds (linear placement, no fused shared experts), the parameters of
    `method`.create_weights for the local experts and the rank's intermediate size."""
    fns = _expert_map_fns()
    local, expert_map, _ = fns["determine_expert_map"](placement.ep_size, placement.ep_rank, experts)
    manager = SimpleNamespace(_expert_map=expert_map, num_fused_shared_experts=0)
    manager.map_global_to_local = lambda expert: fns["map_global_to_local"](manager, expert)
    layer.moe_config, layer.expert_map_manager, layer.local_num_experts = config, manager, local
    # no online-quantized fused shared expert: routed_experts.py keeps it as
    # _fused_shared_expert_quantizer up to 0.33, as shared_expert_online_loader from 0.34
    layer._fused_shared_expert_quantizer = layer.shared_expert_online_loader = None
    layer.layer_name = "routed_experts"
    layer._loaded_expert_biases = set()
    layer.quant_method = method
    if intermediate % placement.tp_size:
        raise ValueError(f"intermediate size {intermediate} does not split over TP {placement.tp_size}")
    method.create_weights(layer=layer, num_experts=local, hidden_size=hidden,
                          intermediate_size_per_partition=intermediate // placement.tp_size,
                          params_dtype=torch.bfloat16, weight_loader=weight_loader, global_num_experts=experts)
    return layer


class LoadRecord:
    """What the engine's loaders did with each checkpoint tensor."""

    def __init__(self):
        self.current = ""                              # the checkpoint tensor being loaded
        self.targets: dict[str, list[str]] = {}        # checkpoint name -> parameter names looked up
        self.by_value: dict[str, set[str]] = {}        # dtype change -> tensors copied by value
        self.others: dict[str, dict[str, tuple]] = {}  # non-expert parameter -> tensor -> (shard, dtype, shape)

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


def routed_experts(method, quant_config, experts: int, hidden: int, intermediate: int, record: LoadRecord,
                   placement: Placement = ONE_GPU):
    """A RoutedExperts module of the model's `quant_config` whose parameters are registered by
    the engine's `method`, as the GPU of `placement` holds them."""
    layer = _routed_experts_class()()
    layer.quant_config = quant_config
    return place_experts(layer, method, moe_config(experts, placement), experts, hidden, intermediate,
                         record.loader(layer.weight_loader), placement)


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
        return SimpleNamespace(weight_loader=lambda param, weight, shard=None: self.record.others.setdefault(
            key, {}).__setitem__(self.record.current, (shard, weight.dtype, tuple(weight.shape))))


def _decoder_layers(count):
    """DeepseekV4DecoderLayer stand-ins: load_weights asks only whether an MoE uses the native
    mega-MoE kernel (off on CPU) and fused shared experts (off unless that kernel is on)."""
    return [SimpleNamespace(ffn=SimpleNamespace(use_native_mega_moe=False, n_redundant_experts=0,
                                                experts=SimpleNamespace(has_fused_shared_experts=False)))
            for _ in range(count)]


def load_main(ckpt: Checkpoint, experts: dict[int, torch.nn.Module], record: LoadRecord, quant_config,
              placement: Placement = ONE_GPU):
    """DeepseekV4Model.load_weights (model.py) with get_expert_mapping, over every checkpoint
    tensor that hf_to_vllm_mapper maps into the model (what AutoWeightsLoader hands it), on the
    GPU of `placement`. V4.1: deepseek_v41/nvidia/model.py's, behind the VL wrapper's mapper
    (language_model.model.*); V4 with a vision tower (Checkpoint.vl): V4's, behind common/
    vl_model.py's mapper; the wrapper's own vision tower and image_* tensors are noted as taken,
    not loaded."""
    params = Params({f"layers.{layer}.ffn.experts.routed_experts": m for layer, m in experts.items()}, record)
    mapping = expert_params_mapping(ckpt.config["n_routed_experts"])
    ns = dict(torch=torch, typing=typing, Callable=Callable, default_weight_loader=None, dict=lambda _: params,
              islice=itertools.islice,
              is_pp_missing_parameter=lambda name, model: False,   # one pipeline stage
              extract_layer_index=lambda name: int(name.split(".")[1]),
              fused_moe_make_expert_params_mapping=lambda model, **kwargs: mapping,
              make_deepseek_v4_expert_params_mapping=None, cdiv=lambda a, b: -(-a // b),
              get_tensor_model_parallel_world_size=lambda: placement.tp_size)
    fns = methods(MODEL_V41 if ckpt.v41 else MODEL, "DeepseekV4Model",
                  ["load_weights", "get_expert_mapping", "_pad_shared_expert_weight"], ns)
    model = SimpleNamespace(layers=_decoder_layers(ckpt.layers), start_layer=0, end_layer=ckpt.layers,
                            quant_config=quant_config, use_sequence_parallel=False, named_parameters=lambda: [],
                            config=ckpt.hf_config())
    model.get_expert_mapping = lambda: fns["get_expert_mapping"](model)
    pad = fns["_pad_shared_expert_weight"]
    model._pad_shared_expert_weight = getattr(pad, "__func__", pad)
    if ckpt.v41:
        mapper, root = v41_weights_mapper(ckpt, linear_scale_name(ckpt, quant_config)), "language_model.model."
    else:
        mapper, root = (vl_weights_mapper(ckpt), "language_model.model.") if ckpt.vl else (weights_mapper(ckpt), "model.")
    names = []
    for name in sorted(ckpt.header):
        mapped = mapper.map_name(name)
        if mapped is not None and mapped.startswith(root):
            names.append((mapped[len(root):], name))
        elif mapped is not None:
            record.targets[name] = [mapped]   # lm_head, the V4.1 vision tower: outside the decoder model
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
    layer = SimpleNamespace(mtp_block=_decoder_layers(1)[0])
    mtp = SimpleNamespace(config=ckpt.hf_config(), quant_config=quant_config, pad_shared_expert=False,
                          model=SimpleNamespace(layers={str(L): layer}, mtp_start_layer_idx=L, num_mtp_layers=1),
                          named_parameters=lambda: [])
    mtp._to_spec_layer_name = lambda name: fns["_to_spec_layer_name"](mtp, name)
    mtp._rewrite_spec_layer_name = lambda spec, name: fns["_rewrite_spec_layer_name"](mtp, spec, name)
    names = [(name, name) for name in sorted(ckpt.header) if name.startswith("mtp.")]
    return fns["load_weights"](mtp, record.tensors(ckpt, names))


def _extract_where_defined(file: str, name: str, ns: dict) -> dict:
    """Top-level definition `name` as engine file `file` sees it: its own, else the one it imports
    (with the definitions it uses from its file), into `ns`; nothing where the file has neither
    (0.33.0's V4.1 draft has no context-WKV duplication)."""
    if name in {b for node in wheels._tree(ENGINE, file).body for b in wheels._binds(node)}:
        return wheels.extract_closure(ENGINE, file, [name], ns)
    module = wheels.imports(ENGINE, file).get(name)
    if module is None:
        return ns
    where = module.replace(".", "/") + ".py"
    return wheels.extract_closure(ENGINE, where if module.startswith("vllm.") else f"{file.rsplit('/', 1)[0]}/{where}",
                                  [name], ns)


def dspark_stage_count(ckpt: Checkpoint) -> int:
    """The DSpark stages DSparkDeepseekV4Model builds: n_mtp_layers, else 3 (V4: deepseek_v4/nvidia/
    dspark.py:106); V4.1 takes num_nextn_predict_layers before 3 (deepseek_v41/nvidia/dspark.py:85-89)."""
    config = ckpt.config
    return config.get("n_mtp_layers") or (config.get("num_nextn_predict_layers") if ckpt.v41 else None) or 3


def draft_experts(ckpt: Checkpoint) -> int:
    """Routed experts per DSpark stage: V4's draft uses the target's n_routed_experts (deepseek_v4/
    nvidia/dspark.py load_weights), V4.1's dspark_n_routed_experts where set (deepseek_v41)."""
    return (ckpt.v41 and ckpt.config.get("dspark_n_routed_experts")) or ckpt.config["n_routed_experts"]


def load_dspark(ckpt: Checkpoint, experts: dict[int, torch.nn.Module], record: LoadRecord, quant_config):
    """DSparkDeepseekV4ForCausalLM.load_weights (dspark.py) with its _remap_dspark_name and the
    context-WKV duplication, over the mtp.* tensors: stage s's decoder block loads as
    model.layers.<s>.*, the heads as model.<name>."""
    params = Params({f"model.layers.{stage}.ffn.experts.routed_experts": m for stage, m in experts.items()}, record)
    mapping = expert_params_mapping(draft_experts(ckpt))
    ns = dict(torch=torch, typing=typing, Iterable=Iterable, re=regex, logger=LOG, default_weight_loader=None,
              make_deepseek_v4_expert_params_mapping=None, dict=lambda _: params,
              fused_moe_make_expert_params_mapping=lambda model, **kwargs: mapping)
    extract(MODEL_UTILS, ["extract_layer_index"], ns)
    file = DSPARK_V41 if ckpt.v41 else DSPARK
    for name in ("_EXPERT_SCALE_RE", "_duplicate_context_wkv_weights"):
        _extract_where_defined(file, name, ns)
    fns = methods(file, "DSparkDeepseekV4ForCausalLM", ["load_weights", "_remap_dspark_name"], ns)
    stages = dspark_stage_count(ckpt)
    heads = SimpleNamespace(confidence_head=object() if ckpt.config.get("enable_confidence_head", True) else None)
    draft = SimpleNamespace(config=ckpt.hf_config(), quant_config=quant_config, pad_shared_expert=False,
                            model=SimpleNamespace(layers=_decoder_layers(stages), **vars(heads)),
                            named_parameters=lambda: [])
    if "_linear_scale_param_name" in wheels.imports(ENGINE, file):   # V4.1: the scale name of its linears
        scale_name = _extract_where_defined(file, "_linear_scale_param_name", {})["_linear_scale_param_name"]
        draft.linear_scale_name = scale_name(SimpleNamespace(quant_config=quant_config),
                                             ckpt.config.get("expert_dtype", "fp4"))
    draft._remap_dspark_name = lambda name: fns["_remap_dspark_name"](draft, name)
    names = [(name, name) for name in sorted(ckpt.header) if name.startswith("mtp.")]
    return fns["load_weights"](draft, record.tensors(ckpt, names))


# ------------------------------------------------------------------------------ the checker
def expert_blocks(ckpt: Checkpoint) -> list[tuple[str, str]]:
    """(checkpoint block, the module prefix vLLM builds its experts under): main layers, then the
    draft's, which mtp.py and dspark.py build as model.layers.<num_hidden_layers + i>."""
    blocks = [(f"layers.{layer}", f"model.layers.{layer}.ffn.experts") for layer in range(ckpt.layers)]
    drafts = dspark_stage_count(ckpt) if ckpt.dspark else ckpt.config.get("num_nextn_predict_layers", 0)
    return blocks + [(f"mtp.{i}", f"model.layers.{ckpt.layers + i}.ffn.experts") for i in range(drafts)]


def dims(ckpt: Checkpoint, block: str = "layers.0") -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of `block`'s experts as the MoE methods' create_weights take them."""
    experts = draft_experts(ckpt) if block.startswith("mtp.") and ckpt.dspark else ckpt.config["n_routed_experts"]
    return experts, ckpt.config["hidden_size"], ckpt.config["moe_intermediate_size"]


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
    the experts' format, and attention / shared-expert linears get an FP8-block method.

    V4.1 (model_type deepseek_v41): its own model.py / dspark.py loaders; the 32x32 linears get
    ModelOptLinearMethod (MXFP8), which this tier does not build, so their parameters are not
    checked, nor the Engram tables' and vision tower's (taken by name only)."""
    ckpt = Checkpoint(path)
    rules = ckpt.spec.engine(ENGINE, VERSION)
    engine = f"vLLM {VERSION}"
    problems: list[str] = []
    disp = dispatch(ckpt)
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
        experts[block] = routed_experts(method, disp.config, *dims(ckpt, block), record)

    main = {int(b.split(".")[1]): m for b, m in experts.items() if b.startswith("layers.")}
    mtp = {b: m for b, m in experts.items() if b.startswith("mtp.")}
    if ckpt.dspark:
        draft_label = "DSparkDeepseekV4ForCausalLM.load_weights"
        draft_load = lambda: load_dspark(ckpt, {int(b.split(".")[1]): m for b, m in mtp.items()},  # noqa: E731
                                         record, disp.config)
        stored = sorted({int(n.split(".")[1]) for n in ckpt.header if n.startswith("mtp.")})
        if stored != list(range(dspark_stage_count(ckpt))):
            problems.append(f"the checkpoint's DSpark stages are mtp.{stored}, {engine} builds "
                            f"{dspark_stage_count(ckpt)} (n_mtp_layers, else 3: dspark.py)")
    else:
        draft_label = "DeepSeekV4MTP.load_weights"
        draft_load = lambda: load_mtp(ckpt, next(iter(mtp.values())), record, disp.config)  # noqa: E731
    failed: set[str] = set()
    snapshots = []
    # Two loads, the parameters first filled with 0x00 bytes, then 0xFF: a byte that still holds
    # the fill both times was never written (vLLM allocates them with torch.empty).
    for sentinel in (0x00, 0xFF):
        _fill(experts.values(), sentinel)
        for label, run, blocks in (
                ("DeepseekV4Model.load_weights", lambda: load_main(ckpt, main, record, disp.config), main),
                (draft_label, draft_load, mtp)):
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
        if (draft_label if block.startswith("mtp.") else "DeepseekV4Model.load_weights") in failed:
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
    if not ckpt.v41:   # V4.1's 32x32 linears get ModelOptLinearMethod (MXFP8), which this tier does not build
        problems += fp8_linear_problems(ckpt, disp, record, engine)
    return problems


# --------------------------------------------------------------- multi-GPU loads, rank by rank
def rank_experts(path, placement: Placement) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """The routed-expert parameters of every main layer of the checkpoint at `path` as the GPU of
    `placement` holds them after DeepseekV4Model.load_weights, with the dispatched method's
    create_weights for that rank and RoutedExperts.weight_loader's TP slicing / expert map:
    ({block: {param: tensor}}, problems). Problems: the loader or create_weights refusing (the
    message), bytes the loader never wrote (loaded twice, over 0x00 and 0xFF fills)."""
    ckpt = Checkpoint(path)
    disp, record = dispatch(ckpt), LoadRecord()
    experts: dict[int, torch.nn.Module] = {}
    try:
        for block, prefix in expert_blocks(ckpt):
            if block.startswith("layers."):
                experts[int(block.split(".")[1])] = routed_experts(build_moe_method(disp.moe(prefix)), disp.config,
                                                                   *dims(ckpt), record, placement)
        snapshots = []
        for sentinel in (0x00, 0xFF):
            _fill(experts.values(), sentinel)
            load_main(ckpt, experts, record, disp.config, placement)
            snapshots.append({layer: _bytes(module) for layer, module in experts.items()})
    except LOADER_ERRORS as e:
        return {}, [f"vLLM {VERSION} on {placement}: {type(e).__name__}: {e}"]
    problems = []
    for layer, module in experts.items():
        for name in snapshots[0][layer]:
            never = (snapshots[0][layer][name] == 0x00) & (snapshots[1][layer][name] == 0xFF)
            if never.any():
                problems.append(f"layers.{layer}: {name} on {placement}: {int(never.sum())} of {never.numel()} "
                                "bytes never written")
    params = {f"layers.{layer}": {name: p.detach().clone() for name, p in module.named_parameters()}
              for layer, module in experts.items()}
    return params, problems


MARLIN_UTILS = QUANT + "utils/marlin_utils.py"


@lru_cache(maxsize=None)
def _marlin_wna16_ns() -> dict:
    """int_wna16.py's _process_weights_marlin (the MARLIN backend's W4A16 MoE post-processing)
    with marlin_utils.py's scale and zero-point permutations, run on CPU. The repack of the packed
    weights (ops.gptq_marlin_moe_repack, a CUDA op) is the identity: only the scales are checked."""
    repack = lambda w, size_k, size_n, num_bits, **kwargs: w   # noqa: E731
    ns = dict(torch=torch, logger=LOG, math=math, numpy=numpy, current_platform=FakePlatform(90),
              scalar_types=None, ops=SimpleNamespace(gptq_marlin_moe_repack=repack))
    extract("vllm/utils/math_utils.py", ["round_up"], ns)
    wheels.extract_closure(ENGINE, MARLIN_UTILS, ["marlin_moe_padded_intermediate", "marlin_moe_permute_scales",
                                                 "marlin_permute_bias", "moe_packed_to_marlin_zero_points"], ns)
    return wheels.extract_closure(ENGINE, ORACLE + "int_wna16.py", ["_process_weights_marlin"], ns)


def marlin_wna16_scales(params: dict[str, torch.Tensor], intermediate_per_rank: int,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) group scales as the release's _process_weights_marlin hands them to the Marlin
    MoE kernel, from one rank's loaded CompressedTensorsWNA16MoEMethod parameters."""
    process = _marlin_wna16_ns()["_process_weights_marlin"]
    kwargs = dict(layer=SimpleNamespace(intermediate_size_per_partition=intermediate_per_rank), num_bits=4,
                  pack_factor=8, group_size=group_size, w13_qweight=params["w13_weight_packed"],
                  w2_qweight=params["w2_weight_packed"], w13_scales=params["w13_weight_scale"],
                  w2_scales=params["w2_weight_scale"])
    if "input_dtype" in process.__code__.co_varnames:
        # 0.33's int_wna16.py _process_weights_marlin takes the activations' Marlin dtype
        # (None: bf16, as get_marlin_input_dtype gives without an override); 0.34 dropped it
        kwargs["input_dtype"] = None
    out = process(**kwargs)
    return out[2], out[3]


def marlin_permuted_scales(scales: torch.Tensor, size_k: int, group_size: int) -> torch.Tensor:
    """marlin_utils.py marlin_moe_permute_scales of N-first group scales [E, N, K/group] of a
    weight whose K is `size_k`."""
    permute = _marlin_wna16_ns()["marlin_moe_permute_scales"]
    k_first = scales.transpose(1, 2).contiguous()
    return permute(s=k_first, size_k=size_k, size_n=k_first.shape[2], group_size=group_size)


# ------------------------------------------------------------------- MoE kernel selection
FUSED_MOE = "vllm/model_executor/layers/fused_moe/"
EXPERTS = FUSED_MOE + "experts/"
HUMMING = QUANT + "utils/humming/"
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
ON_DEVICE, ON_SCHEME, ON_ROUTING = KERNEL_CHECKS[:1], KERNEL_CHECKS[:2], KERNEL_CHECKS
# The kernel classes the selectors' backend_to_kernel_cls import for the backends DeepSeek-V4's
# formats reach: which of the engine's own support checks each runs (found on the class or its
# bases in its file), its activation format and whether it is monolithic. Checks left out answer
# yes: Humming's and the emulation's quant-scheme checks inspect QuantKey fields the tokens lack
# (their lists hold the NVFP4, MXFP4 and INT4 keys the three formats use). A class a release's
# backend_to_kernel_cls imports that is not here fails the selection loudly (KeyError).
KERNELS = {
    "TrtLlmNvFp4ExpertsMonolithic": (ON_ROUTING, False, True),
    "TrtLlmNvFp4ExpertsModular": (ON_SCHEME, False, False),
    "FlashInferCuteDSLExperts": (ON_SCHEME, False, False),
    "FlashInferCuteDSLBatchedExperts": (ON_DEVICE, True, False),
    "FlashInferExperts": (ON_SCHEME, False, False),
    "CutlassExpertsFp4": (ON_SCHEME, False, False),
    "MarlinExperts": (ON_SCHEME, False, False),
    "BatchedMarlinExperts": (ON_SCHEME, True, False),
    "HummingGroupedExperts": (ON_DEVICE, False, False),
    "HummingIndexedExperts": (ON_DEVICE, False, False),
    "BatchedHummingGroupedExperts": (ON_DEVICE, True, False),
    "Nvfp4QuantizationEmulationTritonExperts": (ON_DEVICE, False, False),
    "TrtLlmMxfp4ExpertsMonolithic": (ON_ROUTING, False, True),
    "TrtLlmMxfp4ExpertsModular": (ON_SCHEME, False, False),
    "TrtLlmMxfp4Mxfp8ExpertsModular": (ON_SCHEME, False, False),
    "DeepGemmFP4Experts": (ON_SCHEME, False, False),
    "TrtLlmMxint4ExpertsMonolithic": (ON_ROUTING, False, True),
    "TritonWNA16Experts": (ON_DEVICE, False, False),
    "Rdna3WNA16Experts": (ON_DEVICE, False, False),
    # opt-in backends (--moe-backend): b12x (0.34), vLLM's CUTLASS MXFP4 and FlashInfer's CUTLASS
    # MXFP4 x MXFP8, the OAI Triton MXFP4 kernels (SwiGLU-OAI only: their activation check runs)
    "B12xExperts": (ON_SCHEME, False, False),
    "CutlassExpertsMxfp4": (ON_SCHEME, False, False),
    "OAITritonMxfp4ExpertsMonolithic": (ON_SCHEME + ["_supports_activation"], False, True),
    "OAITritonExperts": (ON_SCHEME + ["_supports_activation"], False, False),
    "UnfusedOAITritonExperts": (ON_SCHEME + ["_supports_activation"], False, False),
    # ROCm's and the expert-parallel megakernels: their device checks turn a CUDA GPU down
    "AiterMxfp4Experts": (ON_DEVICE, False, False),
    "AiterW4A16ExpertsMonolithic": (ON_DEVICE, False, True),
    "AiterW4A4ExpertsMonolithic": (ON_DEVICE, False, True),
    "AiterW4A8ExpertsMonolithic": (ON_DEVICE, False, True),
    "FlashInferMoeEpExperts": (ON_DEVICE, False, True),
    "OCP_MXQuantizationEmulationTritonExperts": (ON_DEVICE, False, False),
}


def _kernel(ns, base, module: str, cls: str):
    """Kernel class `cls` of engine module `module` with the engine's own support checks
    (KERNELS) and FusedMoEExperts.is_supported_config (`base`). Checks about activation function,
    parallel layout, shapes, router-logit dtype and LoRA answer yes: DeepSeek-V4's SiLU, TP-only,
    its shapes (the tier asks which kernel a supported deployment gets, not whether one exists)."""
    checks, batched, monolithic = KERNELS[cls]
    relpath = module.replace(".", "/") + ".py"
    # a check the class takes from a base in another file (modular_kernel.py's defaults) answers yes
    defined = {item.name for owner in wheels._file_mro(ENGINE, relpath, cls)
               for item in wheels._class_node(ENGINE, relpath, owner).body if isinstance(item, ast.FunctionDef)}
    checks = [c for c in checks if c in defined]
    attrs = {k: staticmethod(v.__func__ if isinstance(v, staticmethod) else v)
             for k, v in methods(relpath, cls, checks, dict(ns), inherited=True, helpers=True).items()}
    attrs.setdefault("_supports_current_device", staticmethod(lambda: True))
    attrs.setdefault("_supports_quant_scheme", staticmethod(lambda weight, activation: True))
    attrs.setdefault("_supports_routing_method", staticmethod(lambda routing, weight, activation: True))
    for check in {"_supports_no_act_and_mul", "_supports_activation", "_supports_parallel_config",
                  "_supports_router_logits_dtype", "_supports_shape", "_supports_batch_invariance",
                  "supports_lora"} - set(checks):
        attrs[check] = staticmethod(lambda *args: True)
    fmt = ns["mk"].FusedMoEActivationFormat
    attrs.update(is_monolithic=staticmethod(lambda: monolithic), _supports_hash_routing=staticmethod(lambda: False),
                 activation_format=staticmethod(lambda: fmt.BatchedExperts if batched else fmt.Standard),
                 is_supported_config=base)
    return type(cls, (), attrs)


def _kernel_modules(ns, base) -> None:
    """The experts modules the selectors' backend_to_kernel_cls import from, as stand-in modules
    that build each kernel class on first import (_kernel)."""
    kernels: dict[tuple[str, str], type] = {}

    def module(name):
        def attr(cls):
            if cls.startswith("__"):
                raise AttributeError(cls)
            if (name, cls) not in kernels:
                # a class the selectors import without selecting it (a base class for issubclass
                # checks) is a bare type; asked for its support, it fails as an unknown kernel would
                kernels[name, cls] = _kernel(ns, base, name, cls) if cls in KERNELS else type(cls, (), {
                    "is_supported_config": staticmethod(lambda *args: KERNELS[cls])})
            return kernels[name, cls]
        wheels.fake_module(name, __getattr__=attr)

    # the kernels live in fused_moe/experts/ from 0.22; before, some in fused_moe/ itself
    for folder in (EXPERTS, FUSED_MOE):
        for relpath in wheels.zip_names(ENGINE, folder):
            if relpath.endswith(".py") and (folder == EXPERTS or _defines_kernel(folder + relpath)):
                module((folder + relpath.removesuffix(".py")).replace("/", "."))


def _defines_kernel(relpath: str) -> bool:
    return any(isinstance(node, ast.ClassDef) and node.name in KERNELS for node in wheels._tree(ENGINE, relpath).body)


# The backend selector of each expert format and the oracle file defining it; DeepSeek-V4's MXFP4
# experts have a selector of their own from 0.32 (before it, Mxfp4MoEMethod's for every non-gpt-oss
# model: quantization/mxfp4.py).
SELECTORS = {"nvfp4": ("select_nvfp4_moe_backend",),
             "mxfp4": ("select_deepseek_v4_mxfp4_moe_backend", "select_mxfp4_moe_backend"),
             "w4a16": ("select_wna16_moe_backend",)}
ORACLE_FILES = {"nvfp4": "nvfp4.py", "mxfp4": "mxfp4.py", "w4a16": "int_wna16.py"}


def selector(fmt: str) -> str:
    """The release's backend selector for DeepSeek-V4's `fmt` experts: the first of SELECTORS[fmt]
    its oracle file defines."""
    defined = {name for node in wheels._tree(ENGINE, ORACLE + ORACLE_FILES[fmt]).body for name in wheels._binds(node)}
    return next(name for name in SELECTORS[fmt] if name in defined)


class ReleaseEnvs:
    """vllm.envs as the release defines it (its envs.py environment_variables, executed), reading
    the environment `state.env` (a dict: the switches a user sets) instead of the process's."""

    def __init__(self, state):
        self._state = state
        ns = {"__name__": "vllm_envs"}
        exec(compile(wheels.source(ENGINE, "vllm/envs.py"), f"{ENGINE}/vllm/envs.py", "exec"), ns)
        environ = lambda: state.env   # noqa: E731
        ns["os"] = SimpleNamespace(**{k: getattr(os, k) for k in ("path", "sep", "cpu_count", "pathsep")},
                                   getenv=lambda key, default=None: environ().get(key, default),
                                   environ=_EnvironView(environ))
        self._variables = ns["environment_variables"]

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._variables:
            raise AttributeError(name)
        with warnings.catch_warnings():   # the release's deprecation notices for switches it still reads
            warnings.simplefilter("ignore", FutureWarning)
            return self._variables[name]()

    def is_set(self, name):
        return name in self._state.env


class _EnvironView(Mapping):
    """os.environ for the release's envs.py: the dict `get()` returns at the time of the lookup."""

    def __init__(self, get):
        self._get = get

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())


@lru_cache(maxsize=None)
def _selection_env() -> tuple[dict, SimpleNamespace, SimpleNamespace]:
    """The selectors, each with what it uses of its oracle file, built once; `state` holds the
    GPU and the installed optional kernels that the stand-in flags read at call time."""
    state = SimpleNamespace(platform=None, installed=frozenset(), env={})
    routing = extract("vllm/model_executor/layers/fused_moe/config.py", ["RoutingMethodType"],
                      dict(IntEnum=enum.IntEnum))["RoutingMethodType"]
    fmt = extract("vllm/model_executor/layers/fused_moe/modular_kernel.py", ["FusedMoEActivationFormat"],
                  dict(Enum=enum.Enum))["FusedMoEActivationFormat"]
    fi = lambda: "flashinfer" in state.installed   # noqa: E731
    ns = dict({k: k for k in QUANT_KEYS}, current_platform=_CurrentPlatform(state), RoutingMethodType=routing,
              torch=torch, cast=typing.cast, Any=typing.Any,
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
              envs=ReleaseEnvs(state),
              # the optional kernel packages: b12x (utils/b12x.py get_b12x_fused_moe: None unless
              # importable) and OpenAI's triton_kernels (import_utils.has_triton_kernels)
              get_b12x_fused_moe=lambda: SimpleNamespace(is_supported=lambda: True) if "b12x" in state.installed
              else None, has_triton_kernels=lambda: "triton_kernels" in state.installed,
              # no --quantization-config moe.activation override
              user_activation_override=lambda kind, config: (None, False),
              get_current_vllm_config=lambda: None, get_current_vllm_config_or_none=lambda: None)
    wheels.fake_module("vllm.model_executor.layers.quantization.utils.flashinfer_mxint4_moe",
                       is_flashinfer_mxint4_moe_available=fi)
    # a model loaded for serving, not as the source of an online requantization (0.34 nvfp4.py)
    wheels.fake_module("vllm.model_executor.layers.quantization.online.requantization",
                       is_requantization_source=lambda: False)
    base = methods("vllm/model_executor/layers/fused_moe/modular_kernel.py", "FusedMoEExperts",
                   ["is_supported_config"], dict(ns))["is_supported_config"]
    _kernel_modules(ns, base)
    if wheels.zip_names(ENGINE, HUMMING).count("priority.py"):   # Humming ranked by GPU from 0.32
        extract(HUMMING + "priority.py", ["_HUMMING_PREFERRED_CAPABILITIES", "prefers_humming", "prioritize_humming"], ns)
    # vLLM 0.34 moved the selection loop into MoEKernelOracle (fused_moe/oracle/base.py), whose
    # per-format subclasses the selectors construct; 0.33 and earlier loop in the selectors.
    if "MoEKernelOracle" in wheels.imports(ENGINE, ORACLE + "nvfp4.py"):
        extract(ORACLE + "base.py", ["_UNSET"], ns)
        oracle_base = klass(ORACLE + "base.py", "MoEKernelOracle", ns)
        oracle_base.__class_getitem__ = classmethod(lambda cls, item: cls)   # MoEKernelOracle[Backend]
        ns["MoEKernelOracle"] = oracle_base
    activation = extract(FUSED_MOE + "activation.py", ["MoEActivation"], dict(Enum=enum.Enum))["MoEActivation"]
    ns["MoEActivation"] = activation
    config = SimpleNamespace(swiglu_limit=10.0, moe_backend="auto", routing_method=routing.DeepseekV4,
                             has_hash_routing=False, require_decomposed_backend=False, is_act_and_mul=True,
                             activation=activation.SILU, router_logits_dtype=torch.float32, hidden_dim=4096,
                             is_lora_enabled=False, activation_format=fmt.Standard,   # TP only: no DeepEP
                             moe_parallel_config=SimpleNamespace(use_batched_activation_format=False))

    # one namespace per oracle file: they define helpers of the same name (_get_priority_backends)
    oracles = {name: dict(ns) for name in ORACLE_FILES}
    oracles["mxfp4"]["QuantizationConfigArgs"] = type("QuantizationConfigArgs", (), {})
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
    oracles["w4a16"].update(QuantizationArgs=QuantizationArgs, QuantizationStrategy=QuantizationStrategy,
              # marlin_utils.py check_moe_marlin_supports_config: the group sizes Marlin MoE runs
              check_moe_marlin_supports_config=lambda moe, group, allow_tile_padding=False: group in (-1, 32, 64, 128))
    for module, name in (("auto_awq", "AutoAWQConfig"), ("auto_gptq", "AutoGPTQConfig"), ("moe_wna16", "MoeWNA16Config")):
        wheels.fake_module(f"vllm.model_executor.layers.quantization.{module}", **{name: type(name, (), {})})
    if "FlashinferMoeBackend" in wheels.imports(ENGINE, ORACLE + "nvfp4.py"):   # up to 0.2x: FlashInfer's own enum
        extract(QUANT + "utils/flashinfer_utils.py", ["FlashinferMoeBackend"], oracles["nvfp4"])
    for fmt_name, relpath in ORACLE_FILES.items():
        # kernel classes the file imports at its top level, then the selector and what it uses
        # of its file, backend_to_kernel_cls included
        for name, module in wheels.imports(ENGINE, ORACLE + relpath).items():
            if module.startswith(EXPERTS.replace("/", ".")):
                oracles[fmt_name][name] = getattr(sys.modules[module], name)
        wheels.extract_closure(ENGINE, ORACLE + relpath, [selector(fmt_name), "backend_to_kernel_cls"],
                               oracles[fmt_name])
    return oracles, config, state


def kernel_selection(cap: int, installed: frozenset[str], moe_backend: str = "auto",
                     env: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The MoE backend vLLM's own selectors pick for DeepSeek-V4's routed experts on a GPU of
    capability `cap` with the optional kernels `installed` (subset of flashinfer, humming,
    deep_gemm), the serve flag `--moe-backend moe_backend` and the environment switches `env`, per
    expert format: select_nvfp4_moe_backend (ModelOptNvFp4FusedMoE), the release's MXFP4 selector
    (Mxfp4MoEMethod), select_wna16_moe_backend (CompressedTensorsWNA16MoEMethod, for g32/g128
    sym/asym), each for a hash-routed and a normally routed layer. Returns format -> the backend
    enum names (or "refuses: ...")."""
    oracles, config, state = _selection_env()
    state.platform, state.installed, state.env = FakePlatform(cap), installed, dict(env or {})
    wheels.fake_module("vllm.platforms", current_platform=state.platform)

    def run(fmt, **candidates):
        select = oracles[fmt][selector(fmt)]
        # the arguments this release's selector takes, by name (their lists changed between releases)
        names = select.__code__.co_varnames[1:select.__code__.co_argcount]
        picks = []
        for hashed in (False, True):   # DeepSeek-V4's first layers are hash-routed
            layer = SimpleNamespace(**{**vars(config), "has_hash_routing": hashed, "moe_backend": moe_backend})
            try:
                picks.append(select(layer, **{n: candidates[n] for n in names if n in candidates})[0].name)
            except (ValueError, NotImplementedError) as e:   # the engine refusing to start is an answer
                picks.append(f"refuses: {e}")
        return picks

    out = {"nvfp4": run("nvfp4", weight_key="kNvfp4Static", activation_key="kNvfp4Dynamic"),
           "mxfp4": run("mxfp4"), "w4a16": []}
    from compressed_tensors.quantization import QuantizationArgs
    keys = {name for node in wheels._tree(ENGINE, QUANT_UTILS).body for name in wheels._binds(node)}
    for group, symmetric in ((32, True), (128, True), (32, False), (128, False)):
        key = "kInt4Static" + ("32" if group == 32 else "") + ("" if symmetric else "Asym")
        if key not in keys:   # before 0.24 the release has no key for this group/zero-point scheme
            continue
        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
        out["w4a16"] += run("w4a16", weight_key=key, quant_config=args, may_have_zp=not symmetric,
                            may_have_bias=False, allow_tile_padding=True, weight_bits=4)
    return out


def moe_backend_choices() -> list[str]:
    """The values --moe-backend takes in this release: its config/kernel.py MoEBackend Literal."""
    for node in wheels._tree(ENGINE, "vllm/config/kernel.py").body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MoEBackend" for t in node.targets):
            return [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    raise KeyError(f"{wheels.where(ENGINE, 'vllm/config/kernel.py')} defines no MoEBackend")


def selector_env_switches() -> dict[str, list[str]]:
    """format -> the boolean VLLM_* switches (envs.<name>) its oracle file reads, in file order."""
    out = {}
    for fmt, relpath in ORACLE_FILES.items():
        names = [n.attr for n in ast.walk(wheels._tree(ENGINE, ORACLE + relpath))
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "envs"]
        out[fmt] = list(dict.fromkeys(names))
    return out


def fp8_linear_problems(ckpt: Checkpoint, disp: Dispatch, record: LoadRecord, engine: str) -> list[str]:
    """Every linear whose checkpoint weight is FP8 (attention, shared experts, MTP projections)
    must get an FP8-block method, and each tensor loaded into it must meet a parameter that
    method's create_weights registers, of the same dtype, the fused shards adding up to its shape."""
    problems = []
    modules: dict[str, dict[str, dict[str, tuple]]] = {}
    for param, loads in record.others.items():
        module, _, leaf = param.rpartition(".")
        modules.setdefault(module, {})[leaf] = loads
    for module, leaves in sorted(modules.items()):
        weights = leaves.get("weight", {})
        if not any(ckpt.header[name][0] == "F8_E4M3" for name in weights):
            continue
        prefix = module.replace(".mtp_block.", ".") if module.startswith("model.") else f"model.{module}"
        chosen = disp.linear(prefix)
        method = build_linear_method(chosen)
        if method is None or getattr(method, "weight_block_size", None) is None:
            problems.append(f"{module}: FP8 weights, but {engine} gives {prefix} {type(chosen).__name__}")
            continue
        shards = sorted(weights.values(), key=lambda load: load[0] or 0)
        params = linear_params(method, [shape[0] for _, _, shape in shards], shards[0][2][1])
        for leaf in sorted(set(params) - set(leaves)):
            problems.append(f"{module}.{leaf}: no checkpoint tensor loads it ({engine} leaves it uninitialised)")
        for leaf, loads in sorted(leaves.items()):
            param = params.get(leaf)
            if param is None:
                problems.append(f"{module}: {engine}'s {type(method).__name__} registers no {leaf} "
                                f"(it has {', '.join(params)}) for {', '.join(sorted(loads))}")
                continue
            for name, (_, dtype, shape) in sorted(loads.items()):
                if dtype != param.dtype:
                    problems.append(f"{name} ({dtype}) copied by value into {module}.{leaf} ({param.dtype})")
            rows = sum(shape[0] for _, _, shape in loads.values())
            if (rows, *next(iter(loads.values()))[2][1:]) != tuple(param.shape):
                problems.append(f"{module}.{leaf}: {engine} registers {tuple(param.shape)}, the checkpoint's "
                                f"{', '.join(sorted(loads))} add up to {rows} rows")
    return problems


# ------------------------------------------------------------------ NVFP4 numerics references
def nvfp4_dequantizer() -> Callable:
    """nvfp4_emulation_utils.dequantize_to_dtype(fp4, scales, global_scale, dtype, block_size,
    swizzle): vLLM's reference NVFP4 dequant. Off CUDA it takes its torch path."""
    ns = dict(torch=torch, SimpleNamespace=SimpleNamespace,
              current_platform=SimpleNamespace(is_cuda_alike=lambda: False))   # the CPU it runs on
    extract(EMULATION, ["kE2M1ToFloat_handle", "break_fp4_bytes", "convert_swizzled_to_linear",
                        "dequantize_to_dtype"], ns)
    return ns["dequantize_to_dtype"]


def marlin_scale_processing() -> tuple[Callable, Callable]:
    """marlin_utils_fp4.py's _nvfp4_compute_scale_factor(scales, a_dtype) and
    nvfp4_marlin_process_scales(scales, scale_factor, a_dtype): how the Marlin NVFP4 MoE path
    (prepare_nvfp4_moe_layer_for_marlin: one factor per layer and fused group) turns E4M3 block
    scales into its S0E5M3 ones."""
    ns = dict(torch=torch, logger=LOG)
    extract(MARLIN_FP4, ["_nvfp4_compute_scale_factor", "nvfp4_marlin_process_scales"], ns)
    return ns["_nvfp4_compute_scale_factor"], ns["nvfp4_marlin_process_scales"]


# --------------------------------------------------------- FP8 linear methods and their parameters
def _param_class(name: str) -> type:
    """One of vLLM's parameter classes (vllm/model_executor/parameter.py), told apart by class as
    create_fp8_scale_parameter does; the TP-sharding loaders they carry are not executed."""
    return type(name, (Param,), {})


@lru_cache(maxsize=None)
def _fp8_linear_ns() -> dict:
    """What the FP8 linear methods' constructors and create_weights use: fp8_utils.py's parameter
    factories (run), the parameter classes, and stand-ins for the kernel they pick."""
    from compressed_tensors.quantization import QuantizationStrategy
    params = {n: _param_class(n) for n in ("ModelWeightParameter", "BlockQuantScaleParameter",
                                           "ChannelQuantScaleParameter", "PerTensorScaleParameter")}
    wheels.fake_module("vllm.model_executor.parameter", **params)
    wheels.fake_module("vllm.distributed", get_tensor_model_parallel_world_size=lambda: 1)   # one GPU
    ns = dict(torch=torch, logger=LOG, set_weight_attrs=set_weight_attrs, QuantizationStrategy=QuantizationStrategy,
              Callable=Callable, **params,
              # the running engine's config: bf16 activations
              get_current_vllm_config=lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)),
              # kernel choice (init_fp8_linear_kernel and what it keys on) does not change the parameters
              init_fp8_linear_kernel=lambda **kwargs: SimpleNamespace(**kwargs), is_deep_gemm_supported=lambda: False,
              create_fp8_quant_key=lambda **kwargs: ("fp8", tuple(sorted(kwargs.items()))),
              GroupShape=lambda *args: args, expose_input_quant_key=lambda layer, kernel: None,
              cutlass_fp8_supported=lambda: True, MarlinFP8ScaledMMLinearKernel=type("Marlin", (), {}),
              rocm_aiter_ops=SimpleNamespace(is_linear_fp8_enabled=lambda: False),   # a CUDA machine
              LinearMethodBase=object, CompressedTensorsScheme=object)
    extract(QUANT + "utils/fp8_utils.py", ["create_fp8_weight_parameter", "create_fp8_scale_parameter",
                                            "create_fp8_input_scale", "validate_fp8_block_shape"], ns)
    extract(CT_UTILS, ["STRATEGY_TO_PARAMETER_TYPE"], ns)
    return ns


def build_linear_method(recorded):
    """The engine's FP8 linear method (Fp8LinearMethod, or the compressed-tensors W8A8 FP8 scheme)
    for a dispatch's recorder, constructed with the arguments the dispatch passed; None for others."""
    ns = dict(_fp8_linear_ns())
    name = type(recorded).__name__
    if name == "Fp8LinearMethod":
        for key in ("kFp8StaticTensorSym", "kFp8DynamicTokenSym", "kFp8DynamicTensorSym"):
            ns[key] = key
        cls = klass(FP8, name, ns, bases=("LinearMethodBase",))
    elif name == "CompressedTensorsW8A8Fp8":
        for key in ("kFp8StaticTensorSym", "kFp8DynamicTokenSym", "kFp8StaticChannelSym"):
            ns[key] = key
        relpath = QUANT + "compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py"
        extract(relpath, ["STATIC_QUANT", "DYNAMIC_QUANT", "activation_quant_key_mapping",
                          "weight_quant_key_mapping"], ns)
        cls = klass(relpath, name, ns, bases=("CompressedTensorsScheme",))
    else:
        return None
    return cls(*recorded.args, **recorded.kwargs)


def linear_params(method, partitions: list[int], input_size: int) -> dict[str, torch.nn.Parameter]:
    """The parameters `method`.create_weights registers for a linear of these output partitions
    (one per fused checkpoint tensor) and input size."""
    layer = torch.nn.Module()
    method.create_weights(layer=layer, input_size_per_partition=input_size, output_partition_sizes=partitions,
                          input_size=input_size, output_size=sum(partitions), params_dtype=torch.bfloat16,
                          weight_loader=None)
    return dict(layer.named_parameters())


def reset() -> None:
    """Forget every engine definition built so far and take the stand-in modules out of
    sys.modules (wheels.remove_fakes); the next call builds them again."""
    for value in list(globals().values()):
        if hasattr(value, "cache_clear"):
            value.cache_clear()
    wheels.remove_fakes()
