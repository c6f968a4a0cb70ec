"""vLLM's own gpt-oss loading code, executed on CPU over a checkpoint directory.

Like vllm_harness.py (whose stand-ins this module reuses), every engine definition named here is
read from the pinned vLLM wheel at test time and executed as the engine has it: nothing of vLLM
is installed, imported or copied. Executed:
- the quantization method choice: GptOssMxfp4Config / ModelOptNvFp4Config
  `override_quantization_method`, `from_config`, `apply_vllm_mapper` and `get_quant_method`
  (mxfp4.py, modelopt.py) for every expert layer and attention linear;
- the MoE methods' own `create_weights` (GptOssMxfp4MoEMethod, ModelOptNvFp4FusedMoE) with the
  gpt-oss FusedMoE config (gated, interleaved SwiGLU-OAI, expert biases);
- GptOssForCausalLM.hf_to_vllm_mapper, GptOssModel.load_weights with its three loaders
  (`_load_weights_mxfp4` / `_load_weights_other` / the per-expert "streamed" path),
  `remap_moe_expert_weights`, `default_weight_loader`, `load_attention_sink`, and
  GptOssRoutedExperts.weight_loader over RoutedExperts' own loader methods.

Stand-ins (each for something that would need a GPU or the engine's process groups): one GPU
(TP/EP/DP/PP of 1), the linear layers' QKV shard loader at TP 1, AutoWeightsLoader's routing of
`model.*` names to GptOssModel and of `lm_head.weight` to the LM head.

`gptoss_load(path)` loads every checkpoint tensor ONE AT A TIME through GptOssModel.load_weights
(so one failing tensor does not hide the others), twice, the parameters first filled with 0x00 and
then 0xFF bytes: a byte holding the fill both times was never written. Its `problems` are
sentences (raises / dropped / never written / wrong dispatch); empty means vLLM loads it.
vLLM itself does not notice a missing parameter of a quantized model:
model_loader/default_loader.py only tracks loaded weights when `model_config.quantization is
None` (DefaultModelLoader.load_weights), so anything reported here is silent in vLLM.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import typing
from collections.abc import Callable
from functools import lru_cache
from types import MappingProxyType, SimpleNamespace

import torch

from . import vllm_harness as vh
from . import wheels

ENGINE = vh.ENGINE
VERSION = vh.VERSION
GPT_OSS = "vllm/model_executor/models/gpt_oss.py"
WEIGHT_UTILS = "vllm/model_executor/model_loader/weight_utils.py"
OCP_MX = vh.QUANT + "utils/ocp_mx_utils.py"


# ---------------------------------------------------------------------------------- checkpoint
class Checkpoint(vh.Checkpoint):
    """A gpt-oss checkpoint directory as vLLM sees it, with what its gpt-oss model reads."""

    def hf_config(self) -> SimpleNamespace:
        """vLLM's hf_config: config.json's keys as attributes (quantization_config stays a dict)."""
        return SimpleNamespace(**self.config)

    @property
    def dims(self) -> SimpleNamespace:
        c = self.config
        return SimpleNamespace(layers=c["num_hidden_layers"], experts=c["num_local_experts"], hidden=c["hidden_size"],
                               intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                               kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], vocab=c["vocab_size"])


# --------------------------------------------------------------------------- GptOssForCausalLM
@lru_cache(maxsize=None)
def causal_lm_class() -> type:
    """GptOssForCausalLM, whole, on a plain base: its class attributes hf_to_vllm_mapper and
    packed_modules_mapping are what the loader and the quantization config use."""
    ns = dict(vh._mapper_ns(), typing=typing, Base=object)
    return vh.klass(GPT_OSS, "GptOssForCausalLM", ns, bases=("Base",))


def mapper():
    return causal_lm_class().hf_to_vllm_mapper


# ------------------------------------------------------------------------- quantization dispatch
class ParallelLMHead(torch.nn.Module):
    pass


class MLAAttention(torch.nn.Module):
    pass


def gpt_oss_moe_config(ckpt: Checkpoint) -> SimpleNamespace:
    """The FusedMoEConfig MLPBlock builds (gpt_oss.py: FusedMoEFactory(..., has_bias=True,
    activation="swigluoai")) on one GPU: the fields the methods and loaders read."""
    return vh.moe_config(ckpt.dims.experts, has_bias=True, activation="swigluoai")


@dataclasses.dataclass
class Dispatch:
    name: str                           # the quantization config vLLM picks ("gpt_oss_mxfp4", "modelopt_fp4")
    config: object                      # the engine's quantization config object
    moe: Callable[[str], object]        # layer prefix -> the MoE method (real class, constructed)
    linear: Callable[[str], object]     # layer prefix -> the linear method (recorder)


def _mxfp4_classes() -> dict:
    ns = vh._method_ns(select_mxfp4_moe_backend=vh._not_selected, MappingProxyType=MappingProxyType,
                       LinearBase=vh.LinearBase, RoutedExperts=vh.RoutedExperts, Attention=vh.Attention,
                       UnquantizedLinearMethod=vh.recorder("UnquantizedLinearMethod"),
                       QuantizationConfig=vh._quantization_config_stub())
    vh.extract(vh.QUANT_UTILS, ["is_layer_skipped"], ns)
    vh.klass(vh.MXFP4, "GptOssMxfp4MoEMethod", ns, bases=("FusedMoEMethodBase",))
    vh.klass(vh.MXFP4, "Mxfp4Config", ns, bases=("QuantizationConfig",))
    vh.klass(vh.MXFP4, "GptOssMxfp4Config", ns, bases=("Mxfp4Config",))
    return ns


def _modelopt_classes() -> dict:
    ns = dict(vh._method_ns(), fnmatch=fnmatch.fnmatch, MappingProxyType=MappingProxyType,
              LinearBase=vh.LinearBase, RoutedExperts=vh.RoutedExperts, Attention=vh.Attention,
              MLAAttention=MLAAttention, ParallelLMHead=ParallelLMHead,
              UnquantizedLinearMethod=vh.recorder("UnquantizedLinearMethod"),
              BaseKVCacheMethod=vh.recorder("BaseKVCacheMethod"),
              # ModelOptLinearMethod's construction picks GEMM kernels; which algo it was asked for is the answer
              build_linear_method=lambda config, algo, prefix: vh.recorder(f"ModelOptLinearMethod[{algo}]")(),
              get_marlin_input_dtype=lambda prefix: None, QuantizationConfig=vh._quantization_config_stub(),
              kNvfp4Dynamic="kNvfp4Dynamic", kNvfp4DynamicToken="kNvfp4DynamicToken")
    vh.extract(vh.QUANT_UTILS, ["is_layer_skipped"], ns)
    vh.extract(vh.MODELOPT, ["LINEAR_ALGOS", "QUANT_ALGOS", "algos_owned_by"], ns)
    vh.klass(vh.MODELOPT, "ModelOptQuantConfigBase", ns, bases=("QuantizationConfig",))
    cls = vh.klass(vh.MODELOPT, "ModelOptNvFp4Config", ns, bases=("ModelOptQuantConfigBase",))
    # modelopt.py, after the class: ModelOptNvFp4Config.FusedMoEMethodCls = ModelOptNvFp4FusedMoE
    cls.FusedMoEMethodCls = staticmethod(lambda quant_config, moe_config: vh._modelopt_nvfp4(
        (), dict(quant_config=quant_config, moe_config=moe_config)))
    return ns


def dispatch(ckpt: Checkpoint) -> Dispatch:
    """The quantization config vLLM builds for the checkpoint (each candidate's own
    override_quantization_method asked, as ModelConfig does) and its per-layer methods."""
    hf = ckpt.hf_config()
    mx, mo = _mxfp4_classes(), _modelopt_classes()
    candidates = {"gpt_oss_mxfp4": mx["GptOssMxfp4Config"], "modelopt_fp4": mo["ModelOptNvFp4Config"]}
    picked = [name for name, cls in candidates.items()
              if cls.override_quantization_method(dict(ckpt.quant), None, hf_config=hf) == name]
    if len(picked) != 1:
        raise AssertionError(f"{ckpt.path}: vLLM's gpt-oss / ModelOpt NVFP4 configs claim it {picked or 'none'}")
    cls = candidates[picked[0]]
    config = cls.from_config(dict(ckpt.quant))
    lm = causal_lm_class()
    config.packed_modules_mapping = lm.packed_modules_mapping   # configure_quant_config
    if hasattr(config, "apply_vllm_mapper"):
        config.apply_vllm_mapper(lm.hf_to_vllm_mapper)

    def moe(prefix):
        layer = vh.RoutedExperts()
        layer.moe_config = gpt_oss_moe_config(ckpt)
        return config.get_quant_method(layer, prefix)

    def linear(prefix):
        return config.get_quant_method(vh.LinearBase(), prefix)

    return Dispatch(picked[0], config, moe, linear)


# ------------------------------------------------------------------------------ the model's params
@lru_cache(maxsize=None)
def _experts_class() -> type:
    """GptOssRoutedExperts, whole (its weight_loader calls super()), on a module class carrying
    RoutedExperts' own loader methods."""
    ns = dict(vh._routed_ns(), typing=typing)
    ns["RoutedExpertsLoaders"] = vh._routed_experts_class()
    return vh.klass(GPT_OSS, "GptOssRoutedExperts", ns, bases=("RoutedExpertsLoaders",))


def experts_module(method, ckpt: Checkpoint, quant_config) -> torch.nn.Module:
    d = ckpt.dims
    layer = _experts_class()()
    layer.quant_config = quant_config
    return vh.place_experts(layer, method, gpt_oss_moe_config(ckpt), d.experts, d.hidden, d.intermediate,
                            layer.weight_loader)


@lru_cache(maxsize=None)
def _loader_fns() -> dict:
    ns = dict(torch=torch, logger=vh.LOG, get_tensor_model_parallel_world_size=lambda: 1,
              get_tensor_model_parallel_rank=lambda: 0, **vh.copy_weight(WEIGHT_UTILS))
    wheels.fake_module("vllm.distributed", get_tensor_model_parallel_world_size=lambda: 1)
    wheels.extract(ENGINE, WEIGHT_UTILS, ["default_weight_loader", "load_attention_sink",
                                          "maybe_remap_moe_expert_param_name", "remap_moe_expert_weights"], ns)
    return ns


def _qkv_loader(q_rows: int, kv_rows: int):
    """QKVParallelLinear's weight_loader at TP 1 (stand-in): shard q/k/v into its rows."""
    offsets = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}

    def load(param, weight, shard_id):
        start, rows = offsets[shard_id]
        if weight.shape[0] != rows or tuple(weight.shape[1:]) != tuple(param.shape[1:]):
            raise AssertionError(f"{shard_id} shard {tuple(weight.shape)} does not fit rows {start}:{start + rows} "
                                 f"of {tuple(param.shape)}")
        param.data[start:start + rows].copy_(weight)
    return load


def model_params(ckpt: Checkpoint, experts: dict[int, torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """GptOssModel's parameters as named_parameters() gives them: the dispatched MoE method's
    under layers.N.mlp.experts.routed_experts, the unquantized modules' (attention q/k/v fused
    in qkv_proj with biases, o_proj, sinks, router, norms, embedding) with the shapes
    gpt_oss.py builds them."""
    d, fns = ckpt.dims, _loader_fns()
    bf16 = torch.bfloat16

    def param(shape, loader=fns["default_weight_loader"], dtype=bf16):
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        p.weight_loader = loader
        return p

    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out: dict[str, torch.nn.Parameter] = {"embedding.weight": param((d.vocab, d.hidden)),
                                          "norm.weight": param((d.hidden,))}
    for i in range(d.layers):
        p = f"layers.{i}"
        out.update({
            f"{p}.attn.qkv_proj.weight": param((q + 2 * kv, d.hidden), _qkv_loader(q, kv)),
            f"{p}.attn.qkv_proj.bias": param((q + 2 * kv,), _qkv_loader(q, kv)),
            f"{p}.attn.o_proj.weight": param((d.hidden, q)),
            f"{p}.attn.o_proj.bias": param((d.hidden,)),
            # make_attention_sink(num_heads): float32 (dtype None), load_attention_sink
            f"{p}.attn.sinks": param((d.heads,), fns["load_attention_sink"], torch.float32),
            f"{p}.mlp.router.weight": param((d.experts, d.hidden)),
            f"{p}.mlp.router.bias": param((d.experts,)),
            f"{p}.input_layernorm.weight": param((d.hidden,)),
            f"{p}.post_attention_layernorm.weight": param((d.hidden,)),
        })
        out.update({f"{p}.mlp.experts.routed_experts.{n}": t for n, t in experts[i].named_parameters()})
    return out


class Params(dict):
    """params_dict for GptOssModel.load_weights: notes which parameter each checkpoint tensor reaches."""

    def __init__(self, params, record: dict[str, list[str]], current: list[str]):
        super().__init__(params)
        self.record, self.current = record, current

    def __getitem__(self, key):
        self.record.setdefault(self.current[0], []).append(key)
        return super().__getitem__(key)


def _model(ckpt: Checkpoint, params: dict, record, current) -> SimpleNamespace:
    """A GptOssModel whose load_weights and loaders are the engine's."""
    one = SimpleNamespace(world_size=1, rank_in_group=0)   # one GPU: EP, DP, PCP groups of one
    ns = dict(torch=torch, typing=typing, Callable=Callable, cdiv=lambda a, b: -(-a // b),
              dict=lambda _: Params(params, record, current),
              get_ep_group=lambda: one, get_dp_group=lambda: one, get_pcp_group=lambda: one,
              get_tensor_model_parallel_world_size=lambda: 1, get_tensor_model_parallel_rank=lambda: 0,
              FusedMoEParallelConfig=SimpleNamespace(flatten_tp_across_dp_and_pcp=lambda **kw: (1, 0)),
              is_pp_missing_parameter=lambda name, model: False,   # one pipeline stage
              **{k: _loader_fns()[k] for k in ("default_weight_loader", "remap_moe_expert_weights")})
    wheels.extract(ENGINE, OCP_MX, ["OCP_MX_BLOCK_SIZE"], ns)
    wheels.extract(ENGINE, GPT_OSS, ["_get_weight_loader", "_GPT_OSS_STREAMED_EXPERT_SUFFIX_TO_SHARD"], ns)
    fns = vh.methods(GPT_OSS, "GptOssModel", ["load_weights", "_load_weights_mxfp4", "_load_weights_other",
                                              "_get_streamed_expert_info", "_try_load_streamed_expert"], ns)
    cls = type("GptOssModel", (), fns)
    model = cls()
    model.config = ckpt.hf_config()
    model.parallel_config = SimpleNamespace(enable_expert_parallel=False)
    model.named_parameters = lambda: list(params.items())
    return model


# ------------------------------------------------------------------------------------ the checker
# How the engine's loaders fail on a checkpoint: a parameter it lacks (KeyError), a shape it
# rejects, or a loader called with arguments it does not take (TypeError: gpt_oss.py calls
# weight_loader(param, weight) on parameters whose loader is RoutedExperts'). A stand-in that no
# longer fits shows up here too, by its message, and fails the tests that name the expected ones.
LOADER_ERRORS = (*vh.LOADER_ERRORS, TypeError)


@dataclasses.dataclass
class LoadResult:
    dispatch: Dispatch
    methods: dict[str, str]                    # expert-layer prefix -> MoE method class
    linears: dict[str, str]                    # attention linear prefix -> linear method
    params: dict[str, torch.nn.Parameter]      # after the 0xFF-filled load
    targets: dict[str, list[str]]              # checkpoint tensor -> parameters it was looked up as
    problems: list[str]


def _fill(params, value: int) -> None:
    for p in params.values():
        p.detach().view(torch.uint8).fill_(value)


def gptoss_load(path, dispatcher: Callable[[Checkpoint], Dispatch] | None = None) -> LoadResult:
    """`dispatcher` replaces the engine's quantization-config choice (default: `dispatch`), for
    methods whose dispatch this tier does not execute yet."""
    ckpt = Checkpoint(path)
    d, engine = ckpt.dims, f"vLLM {VERSION}"
    disp = (dispatcher or dispatch)(ckpt)
    problems: list[str] = []
    methods, linears, experts = {}, {}, {}
    for i in range(d.layers):
        prefix = f"model.layers.{i}.mlp.experts"
        method = disp.moe(prefix)
        methods[prefix] = type(method).__name__
        experts[i] = experts_module(method, ckpt, disp.config)
        for name in ("qkv_proj", "o_proj"):
            linears[f"model.layers.{i}.attn.{name}"] = type(disp.linear(f"model.layers.{i}.attn.{name}")).__name__
    for prefix, name in linears.items():
        if name != "UnquantizedLinearMethod":
            problems.append(f"{prefix}: {engine} gives {name} to a BF16 attention linear")
    params = model_params(ckpt, experts)
    lm_head = torch.nn.Parameter(torch.empty((d.vocab, d.hidden), dtype=torch.bfloat16), requires_grad=False)
    everything = {**params, "lm_head.weight": lm_head}
    targets: dict[str, list[str]] = {}
    current = [""]
    model = _model(ckpt, params, targets, current)
    snapshots, raised = [], {}
    for sentinel in (0x00, 0xFF):
        _fill(everything, sentinel)
        for name in sorted(ckpt.header):
            mapped = mapper().map_name(name)
            current[0] = name
            targets.setdefault(name, [])
            if mapped is None:
                continue
            if not mapped.startswith("model."):   # AutoWeightsLoader: the LM's own parameter
                if mapped == "lm_head.weight":
                    targets[name].append(mapped)
                    _loader_fns()["default_weight_loader"](lm_head, ckpt.tensor(name))
                continue
            try:
                model.load_weights([(mapped[len("model."):], ckpt.tensor(name))])
            except LOADER_ERRORS as e:
                raised[name] = f"{type(e).__name__}: {e}"
        snapshots.append({k: p.detach().view(torch.uint8).clone() for k, p in everything.items()})
    for name, error in sorted(raised.items()):
        problems.append(f"{name}: {engine} GptOssModel.load_weights raises {error}")
    for name in sorted(ckpt.header):
        if name not in raised and not targets.get(name):
            problems.append(f"{name}: no {engine} parameter takes it (dropped at load)")
    for key in everything:
        never = (snapshots[0][key] == 0x00) & (snapshots[1][key] == 0xFF)
        if never.any():
            problems.append(f"{key}: never written by {engine}'s loader "
                            f"({int(never.sum())} of {never.numel()} bytes keep uninitialised memory)")
    return LoadResult(disp, methods, linears, everything, targets, problems)


def gptoss_load_report(path) -> list[str]:
    return gptoss_load(path).problems


def reset() -> None:
    for value in list(globals().values()):
        if hasattr(value, "cache_clear"):
            value.cache_clear()
    vh.reset()
