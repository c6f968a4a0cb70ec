"""SGLang's MoE selection for the unconverted MXFP4 source, executed from any DeepSeek-V4 release.

The loader harness (sglang_harness.py) follows one release's whole start-up and loader; older
releases are laid out differently (0.5.12-0.5.14 set DeepSeek-V4's defaults in
arg_groups/deepseek_v4_hook.py, 0.5.15-0.5.18 in arg_groups/overrides.py, 0.5.19 on in
arg_groups/model_overrides/deepseek_v4.py). What decides the MXFP4 source's kernel is the same
two pieces in every release, and those are executed here from the release's own files:

- the DeepSeek-V4 default for `--moe-runner-backend auto`: the `if ... moe_runner_backend == "auto"`
  statements of the release's DeepSeek-V4 override (or hook), run on a stand-in server config;
- Fp8Config.get_quant_method's routed-experts branch (layers/quantization/fp8.py), from
  `fp8_method = Fp8MoEMethod(self)` to its end, run for FP4 experts with the resolved backend and
  the GPU's capability answers (is_sm90_supported()... or get_platform().is_sm90..., as the
  release asks them).

What the selected method computes and whether FlashInfer builds its kernel for the GPU are
sglang_kernels.arithmetic / kernel_built, on the FlashInfer the release pins.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import os
import types

from tests.engines import sglang_kernels as K
from tests.engines import wheels
from tests.engines.sglang_harness import GPU_CAPABILITY, _Backend, _Platform

SRT = K.SRT
FP8 = "layers/quantization/fp8.py"
# where each layout of the releases keeps DeepSeek-V4's start-up defaults: (file, function)
OVERRIDES = (("arg_groups/model_overrides/deepseek_v4.py", "_deepseek_v4_overrides"),
             ("arg_groups/overrides.py", "_deepseek_v4_overrides"),
             ("arg_groups/deepseek_v4_hook.py", "apply_deepseek_v4_defaults"))
# the MoE method modules get_quant_method imports in its body
METHOD_MODULES = {"mxfp4_marlin_moe": "Mxfp4MarlinMoEMethod", "mxfp4_humming_moe": "Mxfp4HummingMoEMethod",
                  "mxfp4_flashinfer_cutlass_moe": "Mxfp4FlashinferCutlassMoEMethod",
                  "mxfp4_flashinfer_trtllm_moe": "Mxfp4FlashinferTrtllmMoEMethod"}


@contextlib.contextmanager
def on_release(version: str):
    """Read sglang==`version` (and the FlashInfer it pins) inside the block; the tier's choice after."""
    before = dict(wheels._chosen), os.environ.get(wheels.ENV)
    wheels.use([f"sglang=={version}"])
    try:
        yield
    finally:
        wheels._chosen.clear()
        if before[1] is None:
            os.environ.pop(wheels.ENV, None)
        else:
            os.environ[wheels.ENV] = before[1]
        wheels.use([f"{e}=={v}" for e, v in before[0].items()])


def _file(relpath: str) -> ast.Module:
    """The parsed file, cached per release by wheels (nodes are copied before they are changed)."""
    return wheels._tree("sglang", SRT + relpath)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def override_site() -> tuple[str, ast.FunctionDef]:
    """The release's DeepSeek-V4 defaults function and its file."""
    names = set(wheels._zip("sglang").namelist())
    for relpath, name in OVERRIDES:
        if SRT + relpath in names and (fn := _function(_file(relpath), name)) is not None:
            return relpath, fn
    raise KeyError(f"sglang {K.release()}: no DeepSeek-V4 defaults function among {OVERRIDES}")


def _is_auto_test(node: ast.If) -> bool:
    return any(isinstance(c, ast.Compare) and isinstance(c.left, ast.Attribute) and c.left.attr == "moe_runner_backend"
               and any(isinstance(v, ast.Constant) and v.value == "auto" for v in c.comparators)
               for c in ast.walk(node.test))


def _auto_statements() -> tuple[str, list[ast.If]]:
    relpath, fn = override_site()
    return relpath, [copy.deepcopy(n) for n in fn.body if isinstance(n, ast.If) and _is_auto_test(n)]


class _Config(types.SimpleNamespace):
    """The server config the defaults read (`server_args` or `cfg`), with its model config."""

    def get_model_config(self):
        return self.model_config


def auto_backend(gpu: str, fp4_experts: bool = True, nvfp4_meta: bool = False) -> tuple[str, list[str]]:
    """What `--moe-runner-backend auto` becomes for DeepSeek-V4 on `gpu`, and the lines that say so."""
    relpath, statements = _auto_statements()
    if not statements:
        _, fn = override_site()
        return "auto", [K.sg_ev(relpath, (fn.lineno, fn.end_lineno))]
    model_config = types.SimpleNamespace(is_fp4_experts=fp4_experts, nvfp4_moe_meta={} if nvfp4_meta else None)
    config = _Config(moe_runner_backend="auto", device="cuda", moe_a2a_backend="none", model_config=model_config)
    platform = _Platform(gpu)
    major = GPU_CAPABILITY[gpu][0]
    ns = {"server_args": config, "cfg": config, "overrides": {}, "model_arch": "DeepseekV4ForCausalLM",
          "model_config_of": lambda _: model_config, "get_platform": lambda: platform,
          "envs": types.SimpleNamespace(SGLANG_DSV4_FP4_DEQUANT=types.SimpleNamespace(get=lambda: False)),
          "logger": types.SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None),
          "is_sm90_supported": lambda: major == 9, "is_sm100_supported": lambda: major == 10,
          "is_sm120_supported": lambda: major == 12, "is_hip": lambda: False}
    body = ast.fix_missing_locations(ast.Module(body=statements, type_ignores=[]))
    exec(compile(body, f"sglang/{SRT}{relpath}", "exec"), ns)
    backend = ns["overrides"].get("moe_runner_backend", config.moe_runner_backend)
    return backend, [K.sg_ev(relpath, (n.lineno, n.end_lineno)) for n in statements]


def _experts_branch() -> list[ast.stmt]:
    """Fp8Config.get_quant_method's statements for a routed-experts layer, from fp8_method on."""
    cls = next(n for n in _file(FP8).body if isinstance(n, ast.ClassDef) and n.name == "Fp8Config")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_quant_method")
    branch = next(n for n in ast.walk(fn) if isinstance(n, ast.If) and "FusedMoE" in ast.unparse(n.test))
    start = next(i for i, s in enumerate(branch.body) if "fp8_method = Fp8MoEMethod(self)" in ast.unparse(s))
    return [copy.deepcopy(s) for s in branch.body[start:]]


def quant_method(gpu: str, backend: str) -> tuple[str, list[str]]:
    """The MoE method class Fp8Config gives DeepSeek-V4's FP4 routed experts (main layers and the
    NextN block alike: both are built with the checkpoint's Fp8Config) on `gpu` under `backend`."""
    statements = _experts_branch()
    major = GPU_CAPABILITY[gpu][0]
    for module, cls in METHOD_MODULES.items():
        wheels.fake_module(f"sglang.srt.layers.quantization.{module}", **{cls: type(cls, (), {"__init__": lambda *a, **k: None})})
    fn = ast.FunctionDef(name="_select", args=ast.arguments(posonlyargs=[], args=[ast.arg("self"), ast.arg("prefix")],
                                                          kwonlyargs=[], kw_defaults=[], defaults=[]),
                         body=statements, decorator_list=[], returns=None, type_params=[])
    ns = {"Fp8MoEMethod": type("Fp8MoEMethod", (), {"__init__": lambda *a, **k: None}),
          "get_moe_runner_backend": lambda: _Backend(backend), "get_platform": lambda: _Platform(gpu),
          "is_sm90_supported": lambda: major == 9, "is_sm100_supported": lambda: major == 10,
          "is_sm120_supported": lambda: major == 12, "is_npu_arch35": lambda: False, "_is_npu": False}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), f"sglang/{SRT}{FP8}", "exec"), ns)
    me = types.SimpleNamespace(is_fp4_experts=True, dequant_fp4_to_fp8=False, is_dsv4_fp4_experts=True)
    chosen = type(ns["_select"](me, "model.layers.0.mlp.experts")).__name__
    return chosen, [K.sg_ev(FP8, (statements[0].lineno, statements[-1].end_lineno))]


def answer(gpu: str, backend_flag: str) -> dict:
    """One cell of the MXFP4 source, as sglang_kernels.entry records it for the loader releases."""
    backend, ev = auto_backend(gpu) if backend_flag == "auto" else (backend_flag, [])
    method, ev_method = quant_method(gpu, backend)
    arithmetic, lib, needs, ev_ar = K.arithmetic(method, backend, gpu)
    built = False if lib == "none" else K.kernel_built(lib, gpu, needs)
    evidence = ev + ev_method + ev_ar + (K.kernel_evidence(lib, gpu) if lib not in (None, "none") else [])
    return K.refuse_at_load({"method": method, "nextn_method": method, "backend": backend, "arithmetic": arithmetic,
                             "starts": True, "kernel_built_for_gpu": built, "nextn_kernel_built_for_gpu": built,
                             "refusal": "", "evidence": list(dict.fromkeys(evidence))}, gpu)


# ---------------------------------------------------------------------------------------------
# requant's NVFP4 output: SGLang's hybrid FP8 + NVFP4 config (0.5.14 on)
# ---------------------------------------------------------------------------------------------
MODELOPT = "layers/quantization/modelopt_quant.py"
LOADER = "model_loader/loader.py"


def _method_node(relpath: str, cls: str, name: str) -> ast.FunctionDef:
    klass = next((n for n in _file(relpath).body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if klass is None:
        raise KeyError(f"sglang {K.release()}: {relpath} defines no class {cls}")
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _run(statements: list[ast.stmt], relpath: str, ns: dict, args: tuple[str, ...], *values):
    fn = ast.FunctionDef(name="_run", args=ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in args], kwonlyargs=[],
                                                       kw_defaults=[], defaults=[]),
                         body=statements + [ast.Return(value=ast.Constant(value=None))], decorator_list=[], returns=None,
                         type_params=[])
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), f"sglang/{SRT}{relpath}", "exec"), ns)
    return ns["_run"](*values)


def serves_nvfp4() -> bool:
    """Whether the release detects requant's NVFP4 output (quant_algo MIXED_PRECISION, NVFP4 experts)
    as a hybrid FP8 + NVFP4 checkpoint at all."""
    return "class HybridFp8NvFp4Config" in wheels.source("sglang", SRT + MODELOPT)


def nvfp4_refusal(gpu: str, backend: str) -> tuple[str, list[str]]:
    """ModelOptNvFp4FusedMoEMethod.__init__'s platform check, executed: its ValueError, or ""."""
    init = _method_node(MODELOPT, "ModelOptNvFp4FusedMoEMethod", "__init__")
    start = next(i for i, s in enumerate(init.body) if "moe_runner_backend = get_moe_runner_backend()" in ast.unparse(s))
    end = next(i for i, s in enumerate(init.body) if "Blackwell and above" in ast.unparse(s))
    statements = [copy.deepcopy(s) for s in init.body[start:end + 1]]
    platform = _Platform(gpu)
    ns = {"get_moe_runner_backend": lambda: _Backend(backend), "is_cuda": lambda: True,
          "get_device_capability": lambda: GPU_CAPABILITY[gpu], "is_blackwell_supported": lambda: platform.is_blackwell,
          "get_platform": lambda: platform}
    evidence = [K.sg_ev(MODELOPT, (statements[0].lineno, statements[-1].end_lineno))]
    try:
        _run(statements, MODELOPT, ns, ("self",), types.SimpleNamespace())
    except ValueError as refused:
        return f"ValueError: {refused}", evidence
    return "", evidence


def hybrid_methods() -> tuple[str, str, list[str]]:
    """HybridFp8NvFp4Config.get_quant_method's routed-experts branch, executed for a main layer and
    for the NextN block the loader excludes (model.decoder.*): (main method, NextN method, evidence)."""
    fn = _method_node(MODELOPT, "HybridFp8NvFp4Config", "get_quant_method")
    branch = next(n for n in ast.walk(fn) if isinstance(n, ast.If) and "FusedMoE" in ast.unparse(n.test))
    names = ("ModelOptNvFp4FusedMoEMethod", "Fp8MoEMethod", "Mxfp4FlashinferTrtllmMoEMethod")
    stand_ins = {n: type(n, (), {"__init__": lambda *a, **k: None}) for n in names}
    wheels.fake_module("sglang.srt.layers.quantization.fp8", Fp8MoEMethod=stand_ins["Fp8MoEMethod"])
    wheels.fake_module("sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe",
                       Mxfp4FlashinferTrtllmMoEMethod=stand_ins["Mxfp4FlashinferTrtllmMoEMethod"])
    me = types.SimpleNamespace(is_fp4_experts=True, nvfp4_config=types.SimpleNamespace(
        is_layer_excluded=lambda prefix: prefix.startswith("model.decoder.")))
    ns = dict(stand_ins)
    picked = [type(_run([copy.deepcopy(s) for s in branch.body], MODELOPT, ns, ("self", "prefix"), me, prefix)).__name__
              for prefix in ("model.layers.0.mlp.experts", "model.decoder.mlp.experts")]
    loader = wheels.source("sglang", SRT + LOADER)
    evidence = [K.sg_ev(MODELOPT, (branch.lineno, branch.end_lineno)),
                K.sg_ev(LOADER, K._lines_of(loader, '+ ["model.decoder.*"'))]
    return picked[0], picked[1], evidence


def nvfp4_answer(gpu: str, backend_flag: str) -> dict:
    """One cell of requant's NVFP4 output, as sglang_kernels.entry records it."""
    backend, ev = auto_backend(gpu, fp4_experts=True, nvfp4_meta=True) if backend_flag == "auto" else (backend_flag, [])
    refusal, ev_refusal = nvfp4_refusal(gpu, backend)
    method, nextn, ev_methods = hybrid_methods()
    starts = not refusal
    if not starts:
        method = "REFUSED ValueError"
    ar, lib, needs, ev_ar = K.arithmetic(method, backend, gpu) if starts else ("", None, (), [])
    _, nlib, nneeds, _ = K.arithmetic(nextn, backend, gpu) if starts else ("", None, (), [])
    built = K.kernel_built(lib, gpu, needs) if starts else None
    nbuilt = K.kernel_built(nlib, gpu, nneeds) if starts else None
    evidence = ev + ev_methods + ev_refusal + ev_ar + (K.kernel_evidence(lib, gpu) if lib else [])
    if nlib not in (None, lib):
        evidence += K.kernel_evidence(nlib, gpu)
    return {"method": method, "nextn_method": nextn, "backend": backend, "arithmetic": ar, "starts": starts,
            "kernel_built_for_gpu": built, "nextn_kernel_built_for_gpu": nbuilt, "refusal": refusal,
            "evidence": list(dict.fromkeys(evidence))}


def table() -> dict:
    """format -> GPU -> the auto cell with `fix` and `explicit` (sglang_kernels.table's shape) for
    the formats whose selection this module executes: the MXFP4 source, and NVFP4 where served."""
    answers = {"mxfp4": answer, **({"nvfp4": nvfp4_answer} if serves_nvfp4() else {})}
    out = {}
    for fmt, answer_of in answers.items():
        for gpu in K.GPUS:
            cell = answer_of(gpu, "auto")
            explicit = {b: answer_of(gpu, b) for b in K.EXPLICIT[fmt]}
            cell["fix"] = K.fix(cell, explicit, gpu)
            cell["explicit"] = explicit
            out.setdefault(fmt, {})[gpu] = cell
    return out


# ---------------------------------------------------------------------------------------------
# requant's W4A16 output: compressed-tensors' WNA16 MoE dispatch, read (not executed)
# ---------------------------------------------------------------------------------------------
COMPRESSED = "layers/quantization/compressed_tensors/compressed_tensors.py"
WNA16 = {"triton": "CompressedTensorsWNA16TritonMoE"}   # the --moe-runner-backend values the dispatch tests; else Marlin


def w4a16_answer(gpu: str, backend_flag: str) -> dict:
    """The WNA16 MoE scheme compressed-tensors gives INT4 group experts, from the lines that return
    it (the CUDA branch: triton -> the Triton scheme, any other backend -> the Marlin one); the
    resolved backend is the DeepSeek-V4 auto default, executed."""
    backend, ev = auto_backend(gpu, fp4_experts=True) if backend_flag == "auto" else (backend_flag, [])
    method = WNA16.get(backend, "CompressedTensorsWNA16MoE")
    lines = wheels.source("sglang", SRT + COMPRESSED).splitlines()
    marlin = next(i for i, l in enumerate(lines) if "return CompressedTensorsWNA16MoE(" in l)
    last = max(i for i in range(marlin + 1) if f"return {method}(" in lines[i])   # the CUDA branch's, not ROCm's
    first = max(i for i in range(last) if "_is_wNa16_group_channel(weight_quant, input_quant)" in lines[i])
    arithmetic, *_ = K.arithmetic(method, backend, gpu)
    return {"method": method, "nextn_method": method, "backend": backend, "arithmetic": arithmetic, "starts": True,
            "kernel_built_for_gpu": None, "nextn_kernel_built_for_gpu": None, "refusal": "",
            "evidence": ev + [K.sg_ev(COMPRESSED, (first + 1, last + 1))]}


def w4a16_table() -> dict:
    out = {}
    for gpu in K.GPUS:
        cell = w4a16_answer(gpu, "auto")
        explicit = {b: w4a16_answer(gpu, b) for b in K.EXPLICIT["w4a16"]}
        cell["fix"] = K.fix(cell, explicit, gpu)
        cell["explicit"] = explicit
        out[gpu] = cell
    return out
