"""SGLang's own DeepSeek-V4 loading code, executed on CPU over a checkpoint directory.

Everything that decides a result is SGLang 0.5.23's code, read from its release wheel at test time
(tests/engines/wheels.py) and executed definition by definition: the model config's FP4/NVFP4
detection, the DeepSeek-V4 server-args override that picks the MoE runner, the quantization-config
classes and their per-layer method dispatch, the methods' create_weights, the model's
load_weights (name remapping, fusions, wo_a dequant, expert mapping) and FusedMoE's weight loader.

What is NOT the engine's, and why (each stand-in is named where it is made):
- the GPU: get_platform()/get_device_capability() answer for one GPU family (no GPU here);
- the module tree: the routed experts are SGLang's own FusedMoE class with a stand-in __init__
  that sets what the real one would for one GPU at TP=EP=1 (the real constructor needs CUDA,
  distributed groups and kernels); LinearBase is an empty class (only isinstance looks at it);
- the parameters of non-expert modules (_model_params): modelled from the checkpoint's names,
  because building DeepseekV4ForCausalLM needs CUDA; which parameters an FP8 linear has follows
  the linear method the quant config's own get_quant_method picks for it; routed-expert
  parameters are exactly what the chosen MoE method's create_weights registered;
- non-expert weight loaders check the kind of data (raw FP8 into a BF16 parameter, integers into
  floats) instead of running the linear layers' loaders (CUDA-bound classes); their shapes are
  not checked;
- ModelConfig: only the statements of its __init__ that read quantization_config run (the rest
  reads the hub); get_quant_config is config.json's quantization_config handed to from_config;
- the process: server args at their defaults, envs at their defaults, flashinfer importable.
Any other name the executed definitions use becomes a `Missing` object that raises, naming itself,
when touched, so a missing stand-in fails loudly instead of answering wrongly.
"""

from __future__ import annotations

import ast
import builtins
import concurrent.futures
import contextlib
import copy
import enum
import functools
import json
import logging
import os
import re
import importlib.util
import struct
import types
import typing
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace as NS

import torch
from safetensors import safe_open

from tests.engines import wheels

ENGINE = "sglang"
SRT = "sglang/srt/"
GPU_CAPABILITY = {"sm_80": (8, 0), "sm_90": (9, 0), "sm_100": (10, 0), "sm_120": (12, 0)}


# ---------------------------------------------------------------------------------------------
# picking engine definitions
# ---------------------------------------------------------------------------------------------
class Missing:
    """A name the picked engine code uses but no stand-in provides: raises when used."""

    def __init__(self, name):
        self._name = name

    def __getitem__(self, _):  # annotations such as Optional[Missing] evaluate harmlessly
        return self

    def __or__(self, _):
        return self

    __ror__ = __or__

    def __call__(self, *a, **k):
        raise RuntimeError(f"SGLang code called {self._name}, which the harness does not stand in for")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"SGLang code read {self._name}.{attr}, which the harness does not stand in for")


def _tree(relpath: str) -> ast.Module:
    return wheels._tree(ENGINE, SRT + relpath)   # parsed once, shared with wheels.extract/klass


def _stand_in_missing(nodes, ns):
    """Every name `nodes` read that `ns` and builtins lack becomes a Missing in `ns`."""
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in ns and not hasattr(builtins, n.id):
                ns[n.id] = Missing(n.id)


def ext(relpath, names, ns):
    """wheels.extract of top-level definitions `names`, the names they use but `ns` lacks
    (annotations included) standing in as Missing."""
    _stand_in_missing([n for n in _tree(relpath).body if wheels._binds(n) & set(names)], ns)
    return wheels.extract(ENGINE, SRT + relpath, names, ns)


def ext_class(relpath, cls, ns, bases=()):
    """wheels.klass (the whole class on stand-in bases named in `ns`), Missing for what `ns` lacks."""
    _stand_in_missing([n for n in _tree(relpath).body if isinstance(n, ast.ClassDef) and n.name == cls], ns)
    return wheels.klass(ENGINE, SRT + relpath, cls, ns, bases=bases)


def ext_statements(relpath, cls, method, first, last, ns):
    """The run of statements of `cls.method` from the one containing `first` to the one
    containing `last`, executed in `ns` (for ModelConfig.__init__, whose rest reads the hub)."""
    body = _statements(relpath, cls, method, first, last)
    _stand_in_missing(body, ns)
    exec(_compiled_statements(relpath, cls, method, first, last), ns)
    return ns


@lru_cache(maxsize=None)
def _statements(relpath, cls, method, first, last):
    src = wheels.source(ENGINE, SRT + relpath)
    c = next(n for n in _tree(relpath).body if isinstance(n, ast.ClassDef) and n.name == cls)
    f = next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == method)
    segs = [ast.get_source_segment(src, s) for s in f.body]
    i = next(k for k, s in enumerate(segs) if first in s)
    j = next(k for k, s in enumerate(segs) if k >= i and last in s)
    return tuple(f.body[i:j + 1])


@lru_cache(maxsize=None)
def _compiled_statements(relpath, cls, method, first, last):
    body = list(_statements(relpath, cls, method, first, last))
    return compile(ast.Module(body=body, type_ignores=[]), f"sglang/{SRT}{relpath}", "exec")


# ---------------------------------------------------------------------------------------------
# stand-ins for the process: GPU, flags, environment, logging
# ---------------------------------------------------------------------------------------------
class Ctx:
    """What the engine code asks the process about, set per report."""
    gpu = "sm_100"
    backend = "auto"
    warnings: list[str] = []


class _Log:
    """logger stand-in: warnings are what the load check reads; the rest is dropped."""

    def __getattr__(self, level):
        def emit(msg, *a, **k):
            if level.startswith("warning"):
                Ctx.warnings.append((msg % a) if a else str(msg))
        return emit


class _Flag:
    def __init__(self, v):
        self.v = v

    def get(self):
        return self.v

    def is_set(self):
        return False


class _Envs:
    """sglang.srt.environ.envs at its defaults: SGLANG_DSV4_FP4_EXPERTS and
    SGLANG_OPT_FUSE_WQA_WKV are True (environ.py), every other flag the executed code reads is False."""

    SGLANG_DSV4_FP4_EXPERTS = _Flag(True)
    SGLANG_OPT_FUSE_WQA_WKV = _Flag(True)

    def __getattr__(self, name):
        return _Flag(False)


class _Backend:
    """MoeRunnerBackend: is_<name>() compares with the resolved --moe-runner-backend."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("is_"):
            return lambda: self.name == attr[3:]
        raise AttributeError(attr)


class _Platform:
    """get_platform() for one GPU family: is_blackwell is majors 10, 11, 12 as in
    utils/common.py; every other capability question (hip, npu, ...) answers False."""

    def __init__(self, gpu):
        major = GPU_CAPABILITY[gpu][0]
        self.is_blackwell = major in (10, 11, 12)
        self.is_sm100, self.is_sm120, self.is_sm90 = major == 10, major == 12, major == 9
        self.is_cuda = True

    def __getattr__(self, name):
        return False


def _base_ns(**extra):
    ns = {k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Tuple", "Iterable", "Set", "Union",
                                          "Callable", "cast", "TYPE_CHECKING", "Mapping")}
    ns.update(torch=torch, re=re, os=os, json=json, enum=enum, Enum=enum.Enum, logging=logging, logger=_Log(),
              envs=_Envs(), nn=torch.nn, cached_property=functools.cached_property, lru_cache=lru_cache, Parameter=torch.nn.Parameter, concurrent=concurrent,
              get_platform=lambda: _Platform(Ctx.gpu), get_device_capability=lambda: GPU_CAPABILITY[Ctx.gpu],
              get_moe_runner_backend=lambda: _Backend(Ctx.backend), get_moe_a2a_backend=lambda: _Backend("none"),
              is_cuda=lambda: True, is_npu=lambda: False, is_npu_arch35=lambda: False, is_xpu=lambda: False,
              is_hip=lambda: False, _is_npu=False, _is_hip=False, _is_cuda=True, _is_cpu=False, _use_aiter=False,
              _is_xpu=False, _is_musa=False, log_info_on_rank0=lambda lg, msg: None,
              # flashinfer is a dependency of the sglang wheel; the methods only ask whether it imports
              is_flashinfer_available=lambda: True,
              set_weight_attrs=_set_weight_attrs, round_up=lambda x, y: (x + y - 1) // y * y,  # utils.round_up
              # engine base classes: only their subclasses' own methods are executed
              FusedMoEMethodBase=object, LinearMethodBase=object, QuantizeMethodBase=object, BaseKVCacheMethod=object)
    ns.update(extra)
    return ns


class _TorchOnGpu:
    """torch, except that torch.cuda.get_device_capability() answers for the GPU family of the
    report (compressed_tensors.py _check_scheme_supported asks torch directly)."""

    cuda = NS(get_device_capability=lambda *a: GPU_CAPABILITY[Ctx.gpu], is_available=lambda: True)

    def __getattr__(self, name):
        return getattr(torch, name)


def _set_weight_attrs(weight, attrs):
    for k, v in (attrs or {}).items():
        setattr(weight, k, v)


class _WeightParam(torch.nn.Parameter):
    """layers/parameter.py ModelWeightParameter / PerTensorScaleParameter: a Parameter keeping its
    keyword attributes (weight_loader, ...); their TP-sharding loaders are not used by FusedMoE."""

    def __new__(cls, data=None, **kw):
        p = super().__new__(cls, data, requires_grad=False)
        _set_weight_attrs(p, kw)
        return p


class _NotBuilt:
    """A method/scheme class the harness does not build (FP8 linears, other MoE schemes): its
    name is the finding; creating weights with it raises."""

    def __init__(self, *a, **k):
        pass

    def create_weights(self, *a, **k):
        raise NotImplementedError(f"the harness does not build {type(self).__name__}")


def _not_built(name):
    return type(name, (_NotBuilt,), {"get_min_capability": classmethod(lambda cls: 0),
                                     "load_up_proj_weight_first": False})


# ---------------------------------------------------------------------------------------------
# the module stand-ins the dispatch and the weight loader look at
# ---------------------------------------------------------------------------------------------
class LinearBase(torch.nn.Module):
    """layers/linear.py LinearBase: only its class matters (isinstance in get_quant_method)."""


def _fused_moe_class(eng):
    """FusedMoE: SGLang's own weight-loading methods (layers/moe/fused_moe_triton/layer.py) on a
    bare nn.Module that carries the attributes __init__ would set for one GPU, TP=EP=1."""
    eng.layer_ns["Module"] = torch.nn.Module
    engine_class = ext_class("layers/moe/fused_moe_triton/layer.py", "FusedMoE", eng.layer_ns, bases=("Module",))

    class FusedMoE(engine_class):
        # layer.py declares it @cached_property; wheels.klass keeps only builtin decorators
        use_padded_loading = functools.cached_property(engine_class.use_padded_loading)

        def __init__(self, num_experts, hidden, inter, prefix, tp=(1, 0), ep=(1, 0)):
            # tp/ep: (moe_tp_size, moe_tp_rank), (moe_ep_size, moe_ep_rank), set as layer.py __init__
            # sets them from get_parallel() (no fused shared experts, ep_join_mode not "scale")
            torch.nn.Module.__init__(self)
            (self.moe_tp_size, self.moe_tp_rank), (self.moe_ep_size, self.moe_ep_rank) = tp, ep
            assert num_experts % self.moe_ep_size == 0 and inter % self.moe_tp_size == 0   # layer.py asserts
            self.prefix, self.hidden_size = prefix, hidden
            self.intermediate_size_per_partition = inter // self.moe_tp_size
            self.num_experts, self._num_global_routed = num_experts, num_experts
            self._num_local_routed = self.num_local_experts = num_experts // self.moe_ep_size
            self._expert_storage_rank, self._has_fused_shared, self.num_fused_shared_experts = self.moe_ep_rank, False, 0
            self.use_presharded_weights, self.uses_expert_location = False, False
            self.moe_runner_config = NS(is_gated=True, intermediate_size_per_partition=self.intermediate_size_per_partition,
                                        swiglu_limit=10.0)
            self.runner_backend = _Backend(Ctx.backend)
            self._set_runner_flags()
            self.quant_method = self.scheme = self.quant_config = None

    FusedMoE.__name__ = FusedMoE.__qualname__ = "FusedMoE"
    return FusedMoE


# ---------------------------------------------------------------------------------------------
# the engine, extracted once per session
# ---------------------------------------------------------------------------------------------
class Engine:
    def __init__(self):
        import compressed_tensors.config as ctc
        import compressed_tensors.quantization as ctq
        from pydantic import BaseModel

        self.modules: dict[str, dict] = {}
        # --- model config: configs/model_config.py, configs/deepseek_v4.py, weight_utils.py
        wu = ext("model_loader/weight_utils.py", ["_ROUTED_EXPERT_KEY_RE", "probe_routed_expert_weight_dtype",
                                                  "narrow_padded_param_and_loaded_weight", "get_actual_shard_size",
                                                  "reset_param_data_if_needed"],
                 _base_ns(struct=struct, Path=Path))
        self.modules["sglang.srt.model_loader.weight_utils"] = {
            "probe_routed_expert_weight_dtype": wu["probe_routed_expert_weight_dtype"]}
        # find_local_repo_dir resolves hub ids; the harness always hands a local directory
        self.modules["sglang.srt.utils"] = {"find_local_repo_dir": lambda p: None}
        cfg = ext("configs/deepseek_v4.py", ["try_detect_fp4_experts"], _base_ns())
        self.modules["sglang.srt.configs.deepseek_v4"] = {"try_detect_fp4_experts": cfg["try_detect_fp4_experts"]}
        self.mc_ns = ext("configs/model_config.py", ["_hf_arch", "is_deepseek_v4", "_quant_config_to_dict"], _base_ns())
        self.modules["sglang.srt.configs.model_config"] = {"is_deepseek_v4": self.mc_ns["is_deepseek_v4"]}

        # --- quantization configs and MoE methods
        qbase = ext_class("layers/quantization/base_config.py", "QuantizationConfig", _base_ns())
        self.moe_utils = ext("layers/moe/utils.py", ["get_moe_padding_size", "get_moe_weight_sizes"], _base_ns())
        unq_linear = _not_built("UnquantizedLinearMethod")
        unq_moe = _not_built("UnquantizedFusedMoEMethod")
        skipped = ext("layers/quantization/utils.py", ["_module_path_match", "_FALLBACK_FUSED_SHARDS", "is_layer_skipped"],
                      _base_ns(MappingProxyType=types.MappingProxyType))["is_layer_skipped"]
        fp8 = ext("layers/quantization/fp8.py", ["Fp8Config", "Fp8MoEMethod"], _base_ns(
            QuantizationConfig=qbase, UnquantizedLinearMethod=unq_linear, UnquantizedFusedMoEMethod=unq_moe,
            Fp8LinearMethod=_not_built("Fp8LinearMethod"), ACTIVATION_SCHEMES=["static", "dynamic"],
            is_layer_skipped=skipped, _mxfp8_to_block_fp8_required=False, _use_hip_int4=False,
            get_moe_weight_sizes=self.moe_utils["get_moe_weight_sizes"],
            get_moe_padding_size=self.moe_utils["get_moe_padding_size"]))
        self.fp8 = fp8
        mx_exec = lambda: NS(moe=NS(flashinfer_mxfp4_moe_precision="default"))  # noqa: E731  server-args default
        for mod, cls in [("mxfp4_flashinfer_trtllm_moe", "Mxfp4FlashinferTrtllmMoEMethod"),
                         ("mxfp4_flashinfer_cutlass_moe", "Mxfp4FlashinferCutlassMoEMethod"),
                         ("mxfp4_marlin_moe", "Mxfp4MarlinMoEMethod"), ("mxfp4_humming_moe", "Mxfp4HummingMoEMethod")]:
            m = ext(f"layers/quantization/{mod}.py", [cls], _base_ns(get_exec=mx_exec, Fp8MoEMethod=fp8["Fp8MoEMethod"]))
            self.modules[f"sglang.srt.layers.quantization.{mod}"] = {cls: m[cls]}
        self.modules["sglang.srt.layers.quantization.fp8"] = {"Fp8Config": fp8["Fp8Config"],
                                                              "Fp8MoEMethod": fp8["Fp8MoEMethod"]}
        mo = ext("layers/quantization/modelopt_quant.py",
                 ["_compile_exclusion_pattern", "ModelOptQuantConfig", "ModelOptFp4Config", "HybridFp8NvFp4Config",
                  "ModelOptNvFp4FusedMoEMethod", "_make_per_tensor_scale_parameter"],
                 _base_ns(QuantizationConfig=qbase, Fp8Config=fp8["Fp8Config"], Fp8MoEMethod=fp8["Fp8MoEMethod"],
                          UnquantizedLinearMethod=unq_linear, is_layer_skipped=skipped,
                          ModelWeightParameter=_WeightParam,
                          PerTensorScaleParameter=_WeightParam,
                          # swizzling reorders the block scales for the CUTLASS kernels; shape kept
                          swizzle_blockscale=lambda t: t.clone(),
                          RadixAttention=type("RadixAttention", (), {})))
        self.mo = mo
        self.modules["sglang.srt.layers.quantization.modelopt_quant"] = {
            "HybridFp8NvFp4Config": mo["HybridFp8NvFp4Config"], "ModelOptFp4Config": mo["ModelOptFp4Config"]}
        # compressed-tensors (the Python package compressed-tensors is SGLang's own dependency)
        u = ext("layers/quantization/compressed_tensors/utils.py",
                ["is_activation_quantization_format", "should_ignore_layer", "check_equal_or_regex_match",
                 "find_matched_target", "_find_first_match", "_is_equal_or_regex_match", "_match_fused_layer"],
                _base_ns(CompressionFormat=ctc.CompressionFormat, MappingProxyType=types.MappingProxyType,
                         Module=torch.nn.Module))
        sch = ext("layers/quantization/compressed_tensors/schemes/compressed_tensors_scheme.py",
                  ["CompressedTensorsMoEScheme"], _base_ns(BaseMoEScheme=object, abstractmethod=lambda f: f))
        wna16 = ext("layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py",
                    ["GPTQMarlinState", "CompressedTensorsWNA16MoE", "CompressedTensorsWNA16TritonMoE"],
                    _base_ns(CompressionFormat=ctc.CompressionFormat,
                             # schemes/compressed_tensors_wNa16.py: the keys of {4: uint4b8, 8: uint8b128}
                             WNA16_SUPPORTED_BITS=[4, 8], CompressedTensorsMoEScheme=sch["CompressedTensorsMoEScheme"]))
        not_built = {n: _not_built(n) for n in [
            "CompressedTensorsMxInt4MoE", "CompressedTensorsW4A4Fp4", "CompressedTensorsW4A4Nvfp4MoE",
            "CompressedTensorsW4A16Fp4", "CompressedTensorsW4A16Nvfp4MoE", "CompressedTensorsW4AFP8MoE",
            "CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Int8",
            "CompressedTensorsW8A16Fp8", "CompressedTensorsWNA16", "XPUCompressedTensorsWNA16"]}
        # the FP8 MoE scheme experts fall to when no INT4 group claims them (M2): built and loaded for real
        fp8_moe = ext("layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8_moe.py",
                      ["CompressedTensorsW8A8Fp8MoE"],
                      _base_ns(QuantizationStrategy=ctq.QuantizationStrategy,
                               CompressedTensorsMoEScheme=sch["CompressedTensorsMoEScheme"],
                               get_moe_weight_sizes=self.moe_utils["get_moe_weight_sizes"]))
        ct = ext("layers/quantization/compressed_tensors/compressed_tensors.py",
                 ["DeviceCapability", "CompressedTensorsConfig", "CompressedTensorsLinearMethod",
                  "CompressedTensorsFusedMoEMethod"],
                 _base_ns(**{k: u[k] for k in ("should_ignore_layer", "check_equal_or_regex_match",
                                               "find_matched_target", "is_activation_quantization_format")},
                          **not_built, BaseModel=BaseModel, suppress=contextlib.suppress,
                          QuantizationConfig=qbase, CompressionFormat=ctc.CompressionFormat,
                          SparsityCompressionConfig=ctc.SparsityCompressionConfig,
                          QuantizationArgs=ctq.QuantizationArgs, QuantizationStrategy=ctq.QuantizationStrategy,
                          QuantizationType=ctq.QuantizationType, SPARSITY_CONFIG_NAME="sparsity_config",
                          CompressedTensorsWNA16MoE=wna16["CompressedTensorsWNA16MoE"],
                          CompressedTensorsW8A8Fp8MoE=fp8_moe["CompressedTensorsW8A8Fp8MoE"],
                          CompressedTensorsWNA16TritonMoE=wna16["CompressedTensorsWNA16TritonMoE"],
                          Fp8LinearMethod=_not_built("Fp8LinearMethod"), UnquantizedLinearMethod=unq_linear,
                          UnquantizedFusedMoEMethod=unq_moe, NamedTuple=typing.NamedTuple, torch=_TorchOnGpu()))
        self.ct = ct
        self.modules["sglang.srt.layers.quantization.compressed_tensors.compressed_tensors"] = {
            "CompressedTensorsConfig": ct["CompressedTensorsConfig"]}

        # --- FusedMoE's weight loader
        self.layer_ns = _base_ns(
            FusedMoeWeightScaleSupported=ext("layers/moe/fused_moe_triton/layer.py", ["FusedMoeWeightScaleSupported"],
                                             _base_ns())["FusedMoeWeightScaleSupported"],
            narrow_padded_param_and_loaded_weight=wu["narrow_padded_param_and_loaded_weight"],
            Fp8MoEMethod=fp8["Fp8MoEMethod"], ModelOptNvFp4FusedMoEMethod=mo["ModelOptNvFp4FusedMoEMethod"],
            UnquantizedFusedMoEMethod=unq_moe, CompressedTensorsMxInt4MoE=not_built["CompressedTensorsMxInt4MoE"],
            KTEPWrapperMethod=_not_built("KTEPWrapperMethod"), get_global_expert_location_metadata=lambda: None)
        ext("layers/moe/fused_moe_triton/layer.py", ["_weight_layout_method", "_maybe_copy_weight_view_before_h2d",
                                                     "_copy_weight_view_before_h2d"], self.layer_ns)
        self.FusedMoE = _fused_moe_class(self)
        self.modules["sglang.srt.layers.linear"] = {"LinearBase": LinearBase}
        self.modules["sglang.srt.layers.moe.fused_moe_triton"] = {
            "FusedMoE": self.FusedMoE, "FusedMoeWeightScaleSupported": self.layer_ns["FusedMoeWeightScaleSupported"]}
        self.modules["sglang.srt.layers.vocab_parallel_embedding"] = {
            "ParallelLMHead": type("ParallelLMHead", (torch.nn.Module,), {})}
        self.modules["sglang.srt.layers.radix_attention"] = {"RadixAttention": type("RadixAttention", (), {})}
        if importlib.util.find_spec("einops") is None:  # a dependency of the sglang wheel, not of requant
            self.modules["einops"] = {"rearrange": _rearrange}  # the two patterns _dequant_fp8 uses

        # --- the model's load_weights and the loader's quant-config construction
        self.model_ns = _base_ns(
            FusedMoE=self.FusedMoE, get_layer_id=ext("layers/utils/common.py", ["get_layer_id"], _base_ns())["get_layer_id"],
            is_wint4afp8_or_wint4a16_config=ext("models/deepseek_common/utils.py", ["is_wint4afp8_or_wint4a16_config"],
                                                _base_ns())["is_wint4afp8_or_wint4a16_config"],
            # synchronous loading (model_loader/utils.py should_async_load is False on CPU tensors)
            should_async_load=lambda w: False, RUNAI_STREAMER_TENSOR_ATTR="_runai",
            use_npu_arch35_mxfp8_wo_a=lambda q: False, Fp8Config=fp8["Fp8Config"],
            _FP8_WO_A_GEMM=True,  # envs SGLANG_OPT_FP8_WO_A_GEMM default (environ.py)
            _is_quark_checkpoint=lambda c: (getattr(c, "quantization_config", None) or {}).get("quant_method") == "quark")
        ext("model_loader/utils.py", ["maybe_executor_submit"], self.model_ns)
        ext("models/deepseek_v4.py",
            ["DEEPSEEK_V4_STACKED_PARAMS_MAPPING", "wo_a_fp8_gemm_enabled", "_prepare_deepseek_v4_weights",
             "_dequant_fp8_wo_a_streaming", "_dequant_fp8", "_clone_if_runai_streamed_tensor",
             "_rename_quark_fp8_block_scales", "_fuse_deepseek_v4_wqkv_a_pair"], self.model_ns)
        # the class is defined, never instantiated: load_weights runs on a stand-in `self` (see _load)
        self.model_ns["Module"] = torch.nn.Module
        self.model = ext_class("models/deepseek_v4.py", "DeepseekV4ForCausalLM", self.model_ns, bases=("Module",))
        self.model.packed_modules_mapping = {}
        # --- the DSpark draft (models/deepseek_v4_dspark.py): which checkpoints bundle one
        # (dspark_config.py), the stages' expert count, the confidence head's presence (None while
        # SGLANG_RAGGED_VERIFY_MODE is at its default, static: environ.py), and its load_weights,
        # run on a stand-in `self` as DeepseekV4ForCausalLM's is
        self.bundles_dspark = ext("speculative/dspark_components/dspark_config.py",
                                  ["checkpoint_bundles_dspark_draft", "_cfg_get"], _base_ns())["checkpoint_bundles_dspark_draft"]
        ragged = ext("speculative/ragged_verify.py", ["RaggedVerifyMode", "read_ragged_verify_mode"],
                     _base_ns(envs=NS(SGLANG_RAGGED_VERIFY_MODE=_Flag("static"))))
        self.model_ns.update(copy=copy, RaggedVerifyMode=ragged["RaggedVerifyMode"],
                             read_ragged_verify_mode=ragged["read_ragged_verify_mode"])
        ext("models/deepseek_v4_dspark.py", ["_dspark_stage_config", "build_dspark_v4_confidence_head"], self.model_ns)
        dspark_cls = "DeepseekV4ForCausalLMDSpark"   # its class body builds parallel-layout enums: the methods only
        _stand_in_missing([n for n in _tree("models/deepseek_v4_dspark.py").body
                           if isinstance(n, ast.ClassDef) and n.name == dspark_cls], self.model_ns)
        self.dspark_model = NS(**wheels.methods(ENGINE, SRT + "models/deepseek_v4_dspark.py", dspark_cls, [
            "load_weights", "_remap_dspark_weight_name", "_assert_confidence_head_loaded"], self.model_ns))
        classes = {"fp8": fp8["Fp8Config"], "compressed-tensors": ct["CompressedTensorsConfig"]}

        def get_quant_config(model_config, load_config, packed_modules_mapping, remap_prefix):
            # model_loader/weight_utils.py get_quant_config for a local checkpoint: config.json's
            # quantization_config plus packed_modules_mapping and hf_config, to the class's from_config
            qc = dict(model_config.hf_config.quantization_config)
            qc["packed_modules_mapping"] = packed_modules_mapping
            qc["hf_config"] = model_config.hf_config
            return classes[model_config.quantization].from_config(qc)

        self.loader_ns = ext("model_loader/loader.py", ["_get_quantization_config"], _base_ns(
            get_model_architecture=lambda m: (self.model, None), get_quant_config=get_quant_config,
            Fp8Config=fp8["Fp8Config"]))
        self.override_ns = ext("arg_groups/model_overrides/deepseek_v4.py", ["_deepseek_v4_overrides"], _base_ns(
            _register_for=lambda *a: (lambda f: f), resolving_view=lambda sa: sa,
            model_config_of=lambda sa: sa.model_config))
        # function bodies import these themselves (`from sglang.srt... import X` at call time)
        for name, attrs in self.modules.items():
            wheels.fake_module(name, **attrs)


def _rearrange(t, pattern, **k):
    if pattern == "(sn bn) (sk bk) -> sn bn sk bk":
        return t.reshape(t.shape[0] // k["bn"], k["bn"], t.shape[1] // k["bk"], k["bk"])
    if pattern == "sn bn sk bk -> (sn bn) (sk bk)":
        a, b, c, d = t.shape
        return t.reshape(a * b, c * d)
    raise NotImplementedError(f"einops stand-in has no pattern {pattern!r}")


@lru_cache(maxsize=1)
def engine() -> Engine:
    return Engine()


def reset() -> None:
    """Forget the extracted engine and take its stand-in modules out of sys.modules
    (wheels.remove_fakes): left there, `import sglang` / find_spec would find a fake."""
    engine.cache_clear()
    wheels.remove_fakes()


# ---------------------------------------------------------------------------------------------
# one report: what SGLang does with a checkpoint on one GPU family with one --moe-runner-backend
# ---------------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    gpu: str
    backend: str                      # --moe-runner-backend after the DeepSeek-V4 override
    quant_config: str = ""            # the config class the loader built
    methods: dict[str, str] = field(default_factory=dict)     # experts module -> MoE method (or REFUSED: why)
    params: dict[str, dict] = field(default_factory=dict)     # experts module -> {param: (dtype, shape)}
    loads: Counter = field(default_factory=Counter)           # "param <- checkpoint dtype" counts
    tensors: dict[str, dict] = field(default_factory=dict)    # experts module -> {param: tensor} after loading
    global_experts: set[str] = field(default_factory=set)     # "module.param" the method keeps for all experts on every EP rank
    skipped: set[str] = field(default_factory=set)             # checkpoint tensors load_weights loads into nothing
    problems: list[str] = field(default_factory=list)

    def method(self, nextn: bool) -> set[str]:
        """The methods of the main layers' experts, or (nextn) of the draft's: NextN's
        model.decoder or DSpark's stages."""
        return {m for p, m in self.methods.items() if (not p.startswith("model.layers.")) == nextn}


def method_name(method, layer) -> str:
    """The class a layer's MoE work runs through: the compressed-tensors scheme where the method
    is CompressedTensorsFusedMoEMethod (which only delegates to it), else the method's class."""
    return type(layer.scheme).__name__ if getattr(layer, "scheme", None) is not None else type(method).__name__


@lru_cache(maxsize=None)
def _normalize_v41():
    return ext("configs/deepseek_v41.py", ["_VISION_FIELDS", "_config_dict", "normalize_deepseek_v41_config"],
               _base_ns(PretrainedConfig=type("PretrainedConfig", (), {})))["normalize_deepseek_v41_config"]


def hf_config(ckpt: Path) -> dict:
    """config.json as SGLang's config class holds it: a V4.1 one (model_type deepseek_v41) through
    configs/deepseek_v41.py normalize_deepseek_v41_config (text_config flattened, vision_config as
    vision_*, architectures DeepseekV4ForCausalLM), which DeepseekV41Config.__init__ applies."""
    config = json.loads((Path(ckpt) / "config.json").read_text())
    return _normalize_v41()(config) if config.get("model_type") == "deepseek_v41" else config


def _model_config(eng: Engine, ckpt: Path):
    """ModelConfig's quantization facts: the statements of ModelConfig.__init__ that read the
    checkpoint's quantization_config (is_fp4_experts, nvfp4_moe_meta, moe_quant_algo, ...)."""
    hf = hf_config(ckpt)
    self = NS(hf_config=NS(**hf), model_path=str(ckpt))
    ns = dict(eng.mc_ns, self=self, MIMO_V2_MODEL_ARCHS=(), hybrid_quant_cfg=None)
    ext_statements("configs/model_config.py", "ModelConfig", "__init__", "quantization_config = (", "moe_quant_algo", ns)
    # ModelConfig._verify_quantization: for fp8 / compressed-tensors no override_quantization_method
    # fires (base_config.py reacts only to modelopt quant methods), so quantization = quant_method
    self.quantization = (hf.get("quantization_config") or {}).get("quant_method")
    self.dtype = torch.bfloat16
    return self


def _read(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    out = []
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out += [(k, h.get_tensor(k)) for k in h.keys()]
    return out


def dspark_draft(eng: Engine, hf) -> NS | None:
    """The DSpark draft SGLang builds for a checkpoint that bundles one, drafting with --speculative-
    algorithm DSPARK (or none: model_config.py gives such a checkpoint DeepseekV4ForCausalLMDSpark as
    its draft architecture): stage_config (the stages' config, dspark_n_routed_experts applied),
    stages (one per dspark_target_layer_ids entry), the confidence head; None for a NextN draft."""
    if not eng.bundles_dspark(hf):
        return None
    return NS(stage_config=eng.model_ns["_dspark_stage_config"](hf), stages=len(hf.dspark_target_layer_ids),
              confidence_head=eng.model_ns["build_dspark_v4_confidence_head"](
                  config=hf, markov_rank=int(getattr(hf, "dspark_markov_rank", 0) or 0)))


def sglang_load_report(ckpt, gpu: str = "sm_100", moe_runner_backend: str = "auto", load: bool = True,
                       tp: tuple[int, int] = (1, 0), ep: tuple[int, int] = (1, 0)) -> LoadReport:
    """Run SGLang's start-up and weight loading for DeepSeek-V4 (main model and its draft: NextN,
    or the DSpark stages where the checkpoint bundles them) over checkpoint directory `ckpt`; every
    way the engine would refuse, skip a tensor, leave a parameter unloaded or copy bytes of the
    wrong kind is a problem in the report.

    tp / ep: (moe_tp_size, moe_tp_rank) and (moe_ep_size, moe_ep_rank) of the rank whose routed
    experts are built and loaded (FusedMoE's weight loader slices for that rank); the loaded
    expert parameters are in report.tensors."""
    eng = engine()
    ckpt = Path(ckpt)
    Ctx.gpu, Ctx.backend, Ctx.warnings = gpu, moe_runner_backend, []
    mc = _model_config(eng, ckpt)
    server_args = NS(device="cuda", fp8_gemm_runner_backend="auto", swa_full_tokens_ratio=None,
                     moe_runner_backend=moe_runner_backend, moe_a2a_backend="none", model_config=mc)
    overrides = eng.override_ns["_deepseek_v4_overrides"](server_args, mc.hf_config)
    Ctx.backend = overrides.get("moe_runner_backend", moe_runner_backend)
    report = LoadReport(gpu, Ctx.backend)
    qc = eng.loader_ns["_get_quantization_config"](mc, NS())
    report.quant_config = type(qc).__name__
    hf = mc.hf_config
    tensors = _read(ckpt) if load else []
    dspark = dspark_draft(eng, hf)
    for nextn in (False, True):
        layer_config = dspark.stage_config if nextn and dspark else hf
        if not nextn:
            prefixes = [f"model.layers.{i}.mlp.experts" for i in range(hf.num_hidden_layers)]
        elif dspark:
            prefixes = [f"stages.{s}.mlp.experts" for s in range(dspark.stages)]
        else:
            prefixes = ["model.decoder.mlp.experts"]
        experts = {}
        for prefix in prefixes:
            layer = _build_experts(eng, qc, prefix, layer_config, report, tp, ep)
            if layer is not None:
                experts[prefix] = layer
        if load and len(experts) == len(prefixes):
            _load(eng, qc, hf, tensors, experts, nextn, report, dspark if nextn else None)
            for prefix, layer in experts.items():
                report.tensors[prefix] = {n: p.data for n, p in layer.named_parameters()}
                report.global_experts |= {f"{prefix}.{n}" for n, p in layer.named_parameters()
                                          if getattr(p, "_sglang_require_global_experts", False)}
    return report


def _build_experts(eng, qc, prefix, hf, report, tp=(1, 0), ep=(1, 0)):
    """FusedMoE.__init__'s quantization part (layer.py): get_quant_method, then create_weights
    with the rank's num_local_experts and intermediate_size_per_partition, as layer.py passes them."""
    layer = eng.FusedMoE(hf.n_routed_experts, hf.hidden_size, hf.moe_intermediate_size, prefix, tp, ep)
    try:
        method = qc.get_quant_method(layer, prefix)
        if method is None:
            raise ValueError("no quant method (unquantized experts)")
        report.methods[prefix] = method_name(method, layer)
        layer.quant_method, layer.quant_config = method, qc
        method.create_weights(layer, num_experts=layer.num_local_experts, hidden_size=hf.hidden_size,
                              intermediate_size_per_partition=layer.intermediate_size_per_partition,
                              params_dtype=torch.bfloat16, weight_loader=layer.weight_loader)
    except Exception as e:  # the engine refusing to build the layer is the finding
        report.methods.setdefault(prefix, f"REFUSED {type(e).__name__}: {e}")
        report.problems.append(f"{prefix}: refuses to start: {type(e).__name__}: {e}")
        return None
    report.params[prefix] = {n: (str(p.dtype).removeprefix("torch."), tuple(p.shape))
                             for n, p in layer.named_parameters()}
    return layer


# ---------------------------------------------------------------------------------------------
# DeepseekV4ForCausalLM.load_weights over the checkpoint
# ---------------------------------------------------------------------------------------------
class _Stream:
    """The (name, tensor) stream load_weights iterates, remembering which name is current, so a
    loader call (or the engine buffering a tensor for a fusion) is attributed to its tensor."""

    current: str | None = None

    def __init__(self, items, sink: list):
        self.items, self.sink = items, sink

    def __iter__(self):
        for name, t in self.items:
            _Stream.current = name
            self.sink.append(name)
            yield name, t


def _model_params(eng, qc, tensors, nextn, num_layers, problems, dspark=None, builds=None):
    """name -> dtype of the parameters DeepseekV4ForCausalLM(NextN) would have outside the routed
    experts. Modelled from the checkpoint, because building the model needs CUDA: each tensor
    under its remapped name (NextN: under model.decoder / model, as load_weights moves them), with
    the model's fusions (wq_a+wkv -> wqkv_a when SGLANG_OPT_FUSE_WQA_WKV, shared experts' gate/up
    -> gate_up_proj). Each FP8 linear gets the parameters of the linear method the quant config's
    own get_quant_method gives it (Fp8LinearMethod: FP8 weight + weight_scale_inv, fp8.py;
    compressed-tensors W8A8Fp8 block: weight_scale, schemes/compressed_tensors_w8a8_fp8.py;
    unquantized: a BF16 weight); wo_a is built without quant_config, a BF16 weight, unless
    wo_a_fp8_gemm_enabled (models/deepseek_v4.py MQALayer). Shapes are not modelled. `builds`
    (main_model_builds) leaves out the tensors whose module the model does not build."""
    remap = eng.model.remap_weight_name_to_dpsk_hf_format
    wo_a_fp8 = eng.model_ns["wo_a_fp8_gemm_enabled"](qc)
    if dspark is not None:
        remap = lambda name, **k: eng.dspark_model._remap_dspark_weight_name(dspark.self, name)  # noqa: E731
        wo_a_fp8 = False   # DSparkAttention builds wo_a with wo_a_fp8=False, no quant_config (deepseek_v4_dspark.py)
    fp8_modules = {n.rsplit(".", 1)[0] for n, t in tensors if t.dtype == torch.float8_e4m3fn}
    out = {}
    for name, t in tensors:
        if ".experts." in name.replace(".shared_experts.", "") or nextn != name.startswith("mtp."):
            continue
        n = remap(name, is_nextn=nextn, num_hidden_layers=num_layers)
        if n is None:   # a tensor the draft's own remap drops (DSpark: a confidence head it did not build)
            continue
        if builds is not None and not builds(n):   # a module the model does not build for this config
            continue
        if nextn and dspark is None:
            outside = any(w in n for w in ("shared_head.norm", "shared_head.head", "embed_tokens", ".e_proj", "h_proj",
                                           "enorm", "hnorm", "hc_head_base", "hc_head_fn", "hc_head_scale"))
            n = n.replace(f"model.layers.{num_layers}", "model" if outside else "model.decoder")
        if t.dtype != torch.float8_e4m3fn:
            if name.rsplit(".", 1)[0] not in fp8_modules:  # an FP8 linear's scale comes with its weight below
                out[n] = t.dtype
            continue
        mod = n.rsplit(".", 1)[0]
        # the DSpark stages build their attention with fuse_wqa_wkv=False (deepseek_v4_dspark.py)
        if ".compressor." not in mod and mod.endswith((".wq_a", ".wkv")) and dspark is None:
            mod = mod.rsplit(".", 1)[0] + ".wqkv_a"
        mod = mod.replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj")
        if mod.endswith(".wo_a") and not wo_a_fp8:
            out[mod + ".weight"] = torch.bfloat16
            continue
        layer = LinearBase()
        try:
            method = qc.get_quant_method(layer, mod)
        except Exception as e:  # the engine refusing to build the linear is the finding
            problems.append(f"{mod}: refuses to start: {type(e).__name__}: {e}")
            continue
        kind = type(getattr(layer, "scheme", None) or method).__name__
        if kind in ("Fp8LinearMethod", "CompressedTensorsW8A8Fp8"):
            out[mod + ".weight"] = torch.float8_e4m3fn
            out[mod + (".weight_scale_inv" if kind == "Fp8LinearMethod" else ".weight_scale")] = torch.float32
        elif method is None or kind == "UnquantizedLinearMethod":
            out[mod + ".weight"] = torch.bfloat16
        else:
            problems.append(f"{mod}: gets {kind}, which the harness does not model for FP8-block weights")
    return out


def _assigns_self(node: ast.AST, attribute: str) -> bool:
    """`node` holds `self.<attribute> = <something other than None>`."""
    return any(isinstance(a, ast.Assign) and not (isinstance(a.value, ast.Constant) and a.value.value is None)
               and any(isinstance(t, ast.Attribute) and t.attr == attribute and getattr(t.value, "id", "") == "self"
                       for t in a.targets) for a in ast.walk(node))


@lru_cache(maxsize=None)
def _built_when(relpath: str, cls: str, attribute: str):
    """The condition under which `cls.__init__` builds `self.<attribute>`: the tests of the `if`s
    whose body holds its assignment, all of them, compiled from the engine's source."""
    c = next(n for n in _tree(relpath).body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    if not _assigns_self(init, attribute):
        raise KeyError(f"{SRT}{relpath}: {cls}.__init__ never sets self.{attribute}")
    tests = [n.test for n in ast.walk(init) if isinstance(n, ast.If) and any(_assigns_self(b, attribute) for b in n.body)]
    test = ast.BoolOp(ast.And(), tests) if len(tests) > 1 else tests[0] if tests else ast.Constant(True)
    return compile(ast.fix_missing_locations(ast.Expression(test)), f"{SRT}{relpath}:{cls}.__init__", "eval")


@lru_cache(maxsize=None)
def _passed_as(relpath: str, cls: str, keyword: str):
    """The expression `cls.__init__` passes as argument `keyword` (a sub-module's constructor flag)."""
    c = next(n for n in _tree(relpath).body if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    value = next(k.value for n in ast.walk(init) if isinstance(n, ast.Call) for k in n.keywords if k.arg == keyword)
    return compile(ast.Expression(value), f"{SRT}{relpath}:{cls}.__init__", "eval")


def main_model_builds(hf) -> typing.Callable[[str], bool]:
    """Whether DeepseekV4ForCausalLM, built for config `hf`, has parameter `name` (a remapped name)
    among those a checkpoint may carry beside the text model: the vision tower, aligner and image
    vectors, a gate's e_score_correction_bias(_vl). Each answer evaluates the engine's own
    condition from its constructors' source (deepseek_v4.py DeepseekV4ForCausalLM and the decoder
    layer's DeepseekV2MoE flag; deepseek_v2.py's hash-layer test and MoEGate) on `hf`."""
    env = dict(config=hf, getattr=getattr)
    vision = eval(_built_when("models/deepseek_v4.py", "DeepseekV4ForCausalLM", "vision"), env)
    bias_vl = eval(_passed_as("models/deepseek_v4.py", "DeepseekV4DecoderLayerBase", "vl_correction_bias"), env)
    n_hash = getattr(hf, "num_hash_layers", 0)

    def gate_builds(attribute: str, layer: int) -> bool:
        is_hash = layer < n_hash   # DeepseekV2MoE.__init__: self.is_hash for a main (not NextN) layer
        gate_env = dict(env, is_hash_moe=is_hash, vl_correction_bias=bias_vl)
        return bool(eval(_built_when("models/deepseek_v2.py", "MoEGate", attribute), gate_env))

    def builds(name: str) -> bool:
        if name.startswith(("vision.", "aligner.", "image_")):
            return bool(vision)
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.(e_score_correction_bias(?:_vl)?)", name)
        return gate_builds(m[2], int(m[1])) if m else True
    return builds


def _kind_problem(param_dtype, loaded_dtype) -> str | None:
    """Bytes of one kind copied into a parameter of another: raw FP8 codes read as numbers, or
    integer codes into a float parameter (and back)."""
    if loaded_dtype == torch.float8_e4m3fn and param_dtype not in (torch.float8_e4m3fn, torch.uint8, torch.int8):
        return f"raw FP8 bytes ({loaded_dtype}) copied into a {param_dtype} parameter"
    if loaded_dtype.is_floating_point != param_dtype.is_floating_point and loaded_dtype != torch.float8_e4m3fn:
        return f"{loaded_dtype} data copied into a {param_dtype} parameter"
    return None


def _load(eng, qc, hf, tensors, experts, nextn, report, dspark=None):
    consumed, seen, problems, written = set(), [], report.problems, set()

    def note(pname, loaded):
        consumed.add(_Stream.current)
        written.add(pname)
        short = pname.rsplit(".", 1)[-1] if ".mlp.experts." in pname else re.sub(r"^model\.(layers\.\d+\.|decoder\.)?", "", pname)
        report.loads[f"{short} <- {str(loaded.dtype).removeprefix('torch.')}"] += 1

    params = {}
    for prefix, layer in experts.items():
        for pn, p in layer.named_parameters():
            engine_loader = getattr(p, "weight_loader", None)
            if engine_loader is None:   # derived copies (blockscale_swizzled) load nothing
                continue

            def load(param, loaded, *a, _name=f"{prefix}.{pn}", _load=engine_loader, **k):
                note(_name, loaded)
                try:
                    _load(param, loaded, *a, **k)   # FusedMoE.weight_loader: SGLang's own copy into the parameter
                except Exception as e:
                    problems.append(f"{_name}: SGLang's weight loader fails on {tuple(loaded.shape)} "
                                    f"{loaded.dtype}: {type(e).__name__}: {e}")
            p.weight_loader = load
            params[f"{prefix}.{pn}"] = p
    if dspark is not None:   # the stand-in `self` DeepseekV4ForCausalLMDSpark's methods run on
        dspark.self = NS(config=hf, quant_config=qc, num_fused_shared_experts=0, confidence_head=dspark.confidence_head,
                         named_parameters=lambda: params.items(), post_load_weights=lambda **k: None)
        dspark.self._remap_dspark_weight_name = lambda name: eng.dspark_model._remap_dspark_weight_name(dspark.self, name)
        dspark.self._assert_confidence_head_loaded = lambda **k: eng.dspark_model._assert_confidence_head_loaded(
            dspark.self, **k)
    builds = main_model_builds(hf) if not nextn else None
    for pname, dtype in _model_params(eng, qc, tensors, nextn, hf.num_hidden_layers, problems, dspark, builds).items():
        p = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

        def load(param, loaded, *a, _name=pname, **k):
            note(_name, loaded)
            why = _kind_problem(param.dtype, loaded.dtype)
            if why:
                problems.append(f"{_name}: {why}")
        p.weight_loader = load
        params[pname] = p
    eng.model_ns["default_weight_loader"] = lambda p, w: p.weight_loader(p, w)
    clone = eng.model_ns["_clone_if_runai_streamed_tensor"]
    prepare = eng.model_ns["_prepare_deepseek_v4_weights"]
    prepared = []

    def buffer_for_fusion(t):   # load_weights buffers one half of a fused pair through this function
        consumed.add(_Stream.current)
        return clone(t)

    def prepare_stream(weights, quant_config):   # the wo_a dequant pass: its output is what gets loaded
        return _Stream(prepare(weights, quant_config), prepared)

    L = hf.num_hidden_layers
    model = NS(config=hf, quant_config=qc, wo_a_fp8=eng.model_ns["wo_a_fp8_gemm_enabled"](qc),
               num_fused_shared_experts=0, vision=None, named_parameters=lambda: params.items(),
               # DeepseekV4ModelNextN has no start_layer (deepseek_v4_nextn.py), DeepseekV4Model does
               model=NS(decoder=None) if nextn else NS(start_layer=0, end_layer=L, layers=[NS(engram=None)] * L),
               pp_group=NS(is_first_rank=True, is_last_rank=True),
               remap_weight_name_to_dpsk_hf_format=eng.model.remap_weight_name_to_dpsk_hf_format,
               post_load_weights=lambda **k: None, _prewarm_mhc_kernels=lambda: None)
    part = [(n, t) for n, t in tensors if n.startswith("mtp.") == nextn]
    dequant = eng.model_ns["_dequant_fp8_wo_a_streaming"]

    def dequant_stream(weights):   # DSpark's load_weights runs the wo_a dequant pass itself
        return _Stream(dequant(weights), prepared)

    eng.model_ns.update(_clone_if_runai_streamed_tensor=buffer_for_fusion, _prepare_deepseek_v4_weights=prepare_stream,
                        _dequant_fp8_wo_a_streaming=dequant_stream if dspark is not None else dequant)
    Ctx.warnings = []
    label = "DSpark" if dspark is not None else "NextN" if nextn else "main model"
    try:
        if dspark is not None:
            eng.dspark_model.load_weights(dspark.self, _Stream(part, seen))
        else:
            eng.model.load_weights(model, _Stream(part, seen), is_nextn=nextn)
    except Exception as e:
        problems.append(f"{label} load_weights raises {type(e).__name__}: {e}")
        return
    finally:
        eng.model_ns.update(_clone_if_runai_streamed_tensor=clone, _prepare_deepseek_v4_weights=prepare,
                            _dequant_fp8_wo_a_streaming=dequant)
    # names the wo_a dequant pass folded into another tensor were consumed by the engine there
    folded = set(seen) - set(prepared) if prepared else set()
    # DSpark: names its own remap drops on purpose (a confidence head the draft does not build)
    dropped = {n for n, _ in part if dspark is not None and dspark.self._remap_dspark_weight_name(n) is None}
    report.skipped |= {n for n, _ in part if n not in consumed and n not in folded}
    for name in [n for n, _ in part if n not in consumed and n not in folded and n not in dropped]:
        problems.append(f"{name}: reaches no parameter (SGLang skips it)")
    if dspark is not None:   # its load_weights logs no 'not initialized' warning: check the parameters here
        problems.append(_unloaded_problem([n for n in params if n not in written], experts))
    for w in Ctx.warnings:
        problems.append(_unloaded_problem(re.findall(r"'([^']+)'", w), experts) if "not initialized" in w else w)
    problems[:] = [p for p in problems if p]


def _unloaded_problem(unloaded, experts) -> str | None:
    """The parameters no checkpoint tensor loaded (load_weights' 'Some weights are not initialized'
    warning; DSpark: the harness's own count), less the g_idx parameters a compressed-tensors WNA16
    layer without act-order replaces with empty tensors after loading
    (schemes/compressed_tensors_wNa16_moe.py process_weights_after_loading)."""
    names = set(unloaded)
    benign = {n for n in names if "g_idx" in n and getattr(
        getattr(experts.get(n.rsplit(".", 1)[0]), "scheme", None), "actorder", "group") != "group"}
    rest = sorted(names - benign)
    return f"parameters left at their initial values (no checkpoint tensor loads them): {rest}" if rest else None


def loaded_format(params: dict) -> str:
    """The expert format a layer's registered parameters hold: what SGLang loads it as."""
    if "w13_weight_packed" in params:
        return "w4a16"
    if "w13_weight_scale_2" in params:
        return "nvfp4"
    dtype = params.get("w13_weight", ("?",))[0]
    if dtype in ("int8", "uint8") and "w13_weight_scale_inv" in params:
        return "mxfp4"
    return f"other ({dtype} weights)"
