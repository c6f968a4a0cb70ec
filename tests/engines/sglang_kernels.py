"""Which MoE kernel SGLang runs for each checkpoint kind, GPU family and --moe-runner-backend,
and whether the kernel library SGLang pins ships that kernel for the GPU.

The engine's part is executed (sglang_harness.sglang_load_report, load=False): the DeepSeek-V4
model override that resolves --moe-runner-backend (arg_groups/model_overrides/deepseek_v4.py),
the quant config's per-layer get_quant_method (fp8.py, modelopt_quant.py, compressed_tensors.py),
and each method's constructor and create_weights, where SGLang refuses what it cannot start.

Which arithmetic a selected method runs, and which kernel library carries it, is the harness's
reading of the method classes, named per case in ARITHMETIC with the lines it reads; whether
that kernel is built for the GPU is read from the FlashInfer wheel SGLang pins (the pin taken from
the sglang wheel's own METADATA): the TRT-LLM-gen batched-GEMM cubin manifest filter
(jit/trtllm_gen_metainfo.py) with the runtime's isArchCompatible (data/csrc/
trtllm_batched_gemm_runner.cu), and the CUTLASS fused-MoE module per device arch
(fused_moe/core.py get_cutlass_fused_moe_module, jit/fused_moe.py gen_cutlass_fused_moe_sm*_module).
Marlin (sgl-kernel) and Triton kernels are not read: null.
Runtime outcomes (a kernel missing at the first forward) are inferred from code, not run.
"""

from __future__ import annotations

import ast
import re
import types
import zipfile
from functools import lru_cache

from tests.engines import wheels
from tests.engines.sglang_harness import GPU_CAPABILITY, sglang_load_report

FORMATS = ("mxfp4", "nvfp4", "w4a16")
GPUS = tuple(GPU_CAPABILITY)
# the explicit --moe-runner-backend values that matter per checkpoint kind, in the order a fix is sought
EXPLICIT = {"mxfp4": ("flashinfer_mxfp4", "marlin", "flashinfer_cutlass", "triton"),
            "nvfp4": ("flashinfer_trtllm_routed", "flashinfer_cutlass", "marlin"),
            "w4a16": ("marlin", "triton")}
SRT = "sglang/srt/"


def release() -> str:
    return wheels.version("sglang")


# ---------------------------------------------------------------------------------------------
# FlashInfer, as pinned by the sglang wheel
# ---------------------------------------------------------------------------------------------
def flashinfer_pin() -> str:
    """flashinfer_python's version from the sglang wheel's Requires-Dist."""
    z = wheels._zip("sglang")
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    m = re.search(r"^Requires-Dist: flashinfer[_-]python(?:\[[^\]]*\])?==([\w.]+)", z.read(meta).decode(), re.M)
    return m.group(1)


@lru_cache(maxsize=None)
def _fi_zip(version: str) -> zipfile.ZipFile | None:
    path = wheels.wheel("flashinfer-python", version)
    return zipfile.ZipFile(path) if path else None


def flashinfer_available() -> bool:
    return _fi_zip(flashinfer_pin()) is not None


def fi_source(relpath: str, pin: str | None = None) -> str:
    return _fi_zip(pin or flashinfer_pin()).read(relpath).decode()


# FlashInfer wheels before 0.6.18 fetch the TRT-LLM-gen cubins and their manifest at build time
# (jit/fused_moe.py get_artifact), so they do not say which GPUs the kernels cover; for those pins
# the first wheel that carries the manifest is read instead, and the evidence names it.
TRTLLM_MANIFEST = "flashinfer/jit/trtllm_gen_metainfo.py"
TRTLLM_MANIFEST_FIRST = "0.6.18"


def trtllm_manifest_pin() -> str:
    """The FlashInfer release whose TRT-LLM-gen manifest is read for the pin in use."""
    pin = flashinfer_pin()
    return pin if TRTLLM_MANIFEST in _fi_zip(pin).namelist() else TRTLLM_MANIFEST_FIRST


def _span(src: str, qualname: str) -> tuple[int, int]:
    """First and last line of a top-level def/class or Class.method of a Python file."""
    body, node = ast.parse(src).body, None
    for part in qualname.split("."):
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign))
                    and (getattr(n, "name", None) == part or any(getattr(t, "id", None) == part
                                                                  for t in getattr(n, "targets", []))))
        body = getattr(node, "body", [])
    return node.lineno, node.end_lineno


def _lines_of(src: str, first: str, last: str | None = None, after: str | None = None) -> tuple[int, int]:
    """Lines from the one containing `first` (after the one containing `after`) to the next containing `last`."""
    lines = src.splitlines()
    start = next(i for i, l in enumerate(lines) if after in l) if after else 0
    a = next(i for i in range(start, len(lines)) if first in lines[i])
    b = next(i for i in range(a, len(lines)) if (last or first) in lines[i])
    return a + 1, b + 1


def sg_ev(relpath: str, span: tuple[int, int]) -> str:
    return f"sglang {release()}: {SRT}{relpath}:{span[0]}-{span[1]}"


def fi_ev(relpath: str, span: tuple[int, int], pin: str | None = None) -> str:
    return f"flashinfer {pin or flashinfer_pin()}: flashinfer/{relpath}:{span[0]}-{span[1]}"


@lru_cache(maxsize=None)
def trtllm_gen_sms(pin: str) -> frozenset[int]:
    """SM versions the TRT-LLM-gen MoE module can dispatch to: the cubin archs its manifest is
    filtered to (BLACKWELL_CUBIN_ARCHS), mapped through isArchCompatible's switch."""
    meta = fi_source(TRTLLM_MANIFEST, pin)
    archs = next(ast.literal_eval(n.value) for n in ast.parse(meta).body
                 if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "BLACKWELL_CUBIN_ARCHS" for t in n.targets)
                 or isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == "BLACKWELL_CUBIN_ARCHS")
    cu = fi_source("flashinfer/data/csrc/trtllm_batched_gemm_runner.cu", pin)
    switch = cu[cu.index("bool isArchCompatible"):]
    switch = switch[:switch.index("\n}\n")]
    sms = set()
    for arch, cond in re.findall(r"case tg::CudaArch::(Sm\w+):\s*return ([^;]+);", switch):
        if arch in archs:
            sms |= {int(v) for v in re.findall(r"smVersion == (\d+)", cond)}
    return frozenset(sms)


@lru_cache(maxsize=None)
def cutlass_moe_modules(pin: str) -> dict[str, str]:
    """device arch ("90", "120", ...) -> the gen_cutlass_fused_moe_sm*_module that
    get_cutlass_fused_moe_module builds for it (fused_moe/core.py); other archs raise ValueError."""
    src = fi_source("flashinfer/fused_moe/core.py")
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "get_cutlass_fused_moe_module")
    out = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            arches = [c.value for c in ast.walk(node.test.comparators[0]) if isinstance(c, ast.Constant)]
            gen = next((c.func.value.func.id for c in ast.walk(node.body[0]) if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Attribute) and c.func.attr == "build_and_load"), None)
            if gen:
                out.update({a: gen for a in arches if isinstance(a, str)})
    return out


def cutlass_module_flags(gen: str) -> str:
    src = fi_source("flashinfer/jit/fused_moe.py")
    a, b = _span(src, gen)
    return "\n".join(src.splitlines()[a - 1:b])


def _sm(gpu: str) -> int:
    major, minor = GPU_CAPABILITY[gpu]
    return major * 10 + minor


def kernel_built(library: str | None, gpu: str, needs: tuple[str, ...] = ()) -> bool | None:
    pin = flashinfer_pin()
    if library == "trtllm_gen":
        return _sm(gpu) in trtllm_gen_sms(trtllm_manifest_pin())
    if library == "cutlass":
        gen = cutlass_moe_modules(pin).get(str(_sm(gpu)))
        return gen is not None and all(f"-D{flag}" in cutlass_module_flags(gen) for flag in needs)
    return None


def kernel_evidence(library: str | None, gpu: str) -> list[str]:
    if library == "trtllm_gen":
        pin = trtllm_manifest_pin()
        meta, cu = fi_source(TRTLLM_MANIFEST, pin), fi_source("flashinfer/data/csrc/trtllm_batched_gemm_runner.cu", pin)
        return [fi_ev("jit/trtllm_gen_metainfo.py", _lines_of(meta, "BLACKWELL_CUBIN_ARCHS: "), pin),
                fi_ev("data/csrc/trtllm_batched_gemm_runner.cu", _lines_of(cu, "bool isArchCompatible", "default:"), pin),
                fi_ev("data/csrc/trtllm_batched_gemm_runner.cu", _lines_of(cu, "contains no kernels runnable on sm",
                                                                           "FLASHINFER_CHECK(anyArchCompatible"), pin)]
    if library == "cutlass":
        core = fi_source("flashinfer/fused_moe/core.py")
        ev = [fi_ev("fused_moe/core.py", _lines_of(core, "def get_cutlass_fused_moe_module", 'raise ValueError(f"Invalid backend'))]
        gen = cutlass_moe_modules(flashinfer_pin()).get(str(_sm(gpu)))
        if gen:
            ev.append(fi_ev("jit/fused_moe.py", _span(fi_source("flashinfer/jit/fused_moe.py"), gen)))
        return ev
    return []


# ---------------------------------------------------------------------------------------------
# what a selected method computes (the harness's reading of the method classes, with the lines)
# ---------------------------------------------------------------------------------------------
def arithmetic(method: str, backend: str, gpu: str) -> tuple[str, str | None, tuple[str, ...], list[str]]:
    """(arithmetic, kernel library or None, FlashInfer module flags it needs, evidence) of `method`
    under resolved `backend` on `gpu`."""
    q = "layers/quantization/"
    src = lambda rel: wheels.source("sglang", SRT + rel)  # noqa: E731
    if method == "Mxfp4FlashinferTrtllmMoEMethod":
        s = src(q + "mxfp4_flashinfer_trtllm_moe.py")
        default = s[s.index('elif precision == "default":'):]   # quantizes the input to MXFP8 (0.5.22 on: in a helper)
        quantize = min(("quantize_routed_input(", "mxfp8_quantize("), key=lambda c: default.find(c) % len(default))
        return ("MXFP4 x MXFP8 (W4A8), FlashInfer TRT-LLM-gen", "trtllm_gen", (),
                [sg_ev(q + "mxfp4_flashinfer_trtllm_moe.py", _lines_of(s, 'elif precision == "default":', quantize))])
    if method == "Mxfp4FlashinferCutlassMoEMethod":
        # MXFP8 activations where the release turns them on for sm_120 (0.5.16 on); before, only
        # the sm90 mixed-input (weight-only) GEMM, whatever the GPU
        s = src(q + "mxfp4_flashinfer_cutlass_moe.py")
        mxfp8 = "self._use_mxfp8_act_scaling =" in s
        ev = [sg_ev(q + "mxfp4_flashinfer_cutlass_moe.py",
                    _lines_of(s, "self._use_mxfp8_act_scaling =", "self._use_sm90_humming =" if "self._use_sm90_humming =" in s else None)
                    if mxfp8 else _lines_of(s, "# SM90 mixed-input GEMM"))]
        if gpu == "sm_120" and mxfp8:
            return "MXFP4 x MXFP8 (W4A8), FlashInfer CUTLASS sm120", "cutlass", ("ENABLE_FP4", "ENABLE_FP8"), ev
        return "MXFP4 weight-only (W4A16), FlashInfer CUTLASS sm90 mixed GEMM", "cutlass", ("ENABLE_FP4",), ev
    if method == "Mxfp4MarlinMoEMethod":
        sm120_triton, ev = marlin_mxfp4(gpu)[1:]
        if sm120_triton:
            return "MXFP4 dequant + GEMV (W4A16), fused Triton SM120 fallback (no Marlin)", None, (), ev
        return "MXFP4 weight-only (W4A16), Marlin", None, (), ev
    if method == "Fp8MoEMethod":
        f8, tu = src(q + "fp8.py"), src("layers/moe/moe_runner/triton_utils/fused_moe.py")
        return ("none: the MXFP4 bytes go to the Triton FP8 W8A8 block path, which has no FP4 path "
                "(its 'Hidden size mismatch' assert fails at the first forward; from code, not run)", "none", (),
                [sg_ev(q + "fp8.py", _lines_of(f8, "if moe_runner_backend.is_auto():", "moe_runner_backend = MoeRunnerBackend.TRITON",
                                               after="def create_moe_runner")),
                 sg_ev(q + "fp8.py", _lines_of(f8, "def get_triton_quant_info", "use_fp8_w8a8=")),
                 sg_ev("layers/moe/moe_runner/triton_utils/fused_moe.py",
                       _lines_of(tu, "if use_int4_w4a16:", "w1.shape[2] - padded_size", after="padded_size = padding_size"))])
    if method == "ModelOptNvFp4FusedMoEMethod":
        if backend == "marlin":
            return "NVFP4 weight-only (W4A16), Marlin FP4", None, (), []
        if backend in ("flashinfer_trtllm_routed", "flashinfer_trtllm"):
            return "NVFP4 x NVFP4 (W4A4), FlashInfer TRT-LLM-gen routed", "trtllm_gen", (), []
        if backend == "flashinfer_cutlass":
            return "NVFP4 x NVFP4 (W4A4), FlashInfer CUTLASS fused MoE", "cutlass", ("ENABLE_FP4",), []
        return f"NVFP4 on the {backend} runner (not established)", None, (), []
    if method == "CompressedTensorsWNA16MoE":
        return "INT4 W4A16, Marlin", None, (), []
    if method == "CompressedTensorsWNA16TritonMoE":
        return "INT4 W4A16, Triton WNA16", None, (), []
    return "", None, (), []


MARLIN_MXFP4 = "layers/quantization/mxfp4_marlin_moe.py"


def marlin_mxfp4(gpu: str) -> tuple[str, bool, list[str]]:
    """Mxfp4MarlinMoEMethod.process_weights_after_loading on `gpu`, its platform statements
    executed: (the error it raises at load, or ""; whether it keeps the weights for its SM120
    Triton dequant+GEMV kernel instead of Marlin (0.5.13); the lines)."""
    tree = wheels._tree("sglang", SRT + MARLIN_MXFP4)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Mxfp4MarlinMoEMethod")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "process_weights_after_loading")
    major = GPU_CAPABILITY[gpu][0]
    platform = types.SimpleNamespace(is_sm90=major == 9, is_sm100=major == 10, is_sm120=major == 12)
    ns = {"is_sm90_supported": lambda: major == 9, "is_sm100_supported": lambda: major == 10,
          "is_sm120_supported": lambda: major == 12, "get_platform": lambda: platform}
    test = lambda node: eval(compile(ast.Expression(node.test), f"sglang/{SRT}{MARLIN_MXFP4}", "eval"), ns)  # noqa: E731
    ifs = [n for n in fn.body if isinstance(n, ast.If)]
    guard = next(n for n in ifs if any(isinstance(r, ast.Raise) for r in n.body) and "sm90" in ast.unparse(n.test))
    sm120 = next((n for n in ifs if "sm120_triton" in ast.unparse(n)), None)
    src = wheels.source("sglang", SRT + MARLIN_MXFP4)
    evidence = [sg_ev(MARLIN_MXFP4, (guard.lineno, guard.end_lineno))]
    if test(guard):
        message = ast.literal_eval(ast.unparse(guard.body[0].exc.args[0])) if guard.body[0].exc.args else ""
        return f"RuntimeError: {message}", False, evidence
    if sm120 is not None and test(sm120):
        return "", True, evidence + [sg_ev(MARLIN_MXFP4, _lines_of(src, "# SM120: use Triton fused dequant", "mxfp4_moe_forward_triton,"))]
    return "", False, evidence


def refuse_at_load(answer: dict, gpu: str) -> dict:
    """`answer` as the release leaves it after loading: the MXFP4 Marlin method raises there on the
    GPUs its platform check refuses (both its main and NextN layers)."""
    if answer["method"] != "Mxfp4MarlinMoEMethod" or not answer["starts"]:
        return answer
    refusal, _, evidence = marlin_mxfp4(gpu)
    if not refusal:
        return answer
    return dict(answer, method="REFUSED RuntimeError", nextn_method="REFUSED RuntimeError", arithmetic="", starts=False,
                kernel_built_for_gpu=None, nextn_kernel_built_for_gpu=None, refusal=refusal,
                evidence=list(dict.fromkeys(answer["evidence"] + evidence)))


def selection_evidence(fmt: str, backend_flag: str) -> list[str]:
    """The engine lines that resolve the backend and pick the method for checkpoint kind `fmt`."""
    q = "layers/quantization/"
    ov = wheels.source("sglang", SRT + "arg_groups/model_overrides/deepseek_v4.py")
    ev = [sg_ev("arg_groups/model_overrides/deepseek_v4.py", _lines_of(ov, 'if cfg.moe_runner_backend == "auto":',
                                                                       'overrides["moe_runner_backend"] = "flashinfer_mxfp4"'))] \
        if backend_flag == "auto" else []
    if backend_flag == "auto" and fmt == "w4a16":   # why the override sees FP4 experts in an INT4 checkpoint
        mc = wheels.source("sglang", SRT + "configs/model_config.py")
        ev.append(sg_ev("configs/model_config.py", _lines_of(mc, "if is_deepseek_v4(self.hf_config) and routed_experts_quant_method is None:",
                                                             "self.is_fp4_experts = detected")))
    f8 = wheels.source("sglang", SRT + q + "fp8.py")
    fp8_sel = sg_ev(q + "fp8.py", _lines_of(f8, "if self.is_fp4_experts and get_moe_runner_backend().is_marlin():",
                                            "return fp8_method", after="def get_quant_method"))
    if fmt == "mxfp4":
        return ev + [fp8_sel]
    if fmt == "nvfp4":
        mo = wheels.source("sglang", SRT + q + "modelopt_quant.py")
        return ev + [sg_ev(q + "modelopt_quant.py", _span(mo, "HybridFp8NvFp4Config.get_quant_method")),
                     sg_ev(q + "modelopt_quant.py", _lines_of(mo, "moe_runner_backend = get_moe_runner_backend()",
                                                              "Blackwell and above", after="class ModelOptNvFp4FusedMoEMethod"))]
    ct = wheels.source("sglang", SRT + q + "compressed_tensors/compressed_tensors.py")
    return ev + [sg_ev(q + "compressed_tensors/compressed_tensors.py",
                       _lines_of(ct, "if self._is_wNa16_group_channel(weight_quant, input_quant):",
                                 "return CompressedTensorsWNA16MoE(self, weight_quant=weight_quant)",
                                 after="# MXFP4 MoE on NPU is served by NPUCompressedTensorsW4A8mxfp4MoE"))]


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
def _first_method(report, nextn: bool) -> str:
    ms = sorted(report.method(nextn))
    return ms[0].split(":")[0] if len(ms) == 1 else " | ".join(ms)


def entry(ckpt, fmt: str, gpu: str, backend_flag: str) -> dict:
    """One cell: what SGLang does with `ckpt` (kind `fmt`) on `gpu` with --moe-runner-backend `backend_flag`."""
    report = sglang_load_report(ckpt, gpu, backend_flag, load=False)
    method, nextn = _first_method(report, False), _first_method(report, True)
    starts = not any("refuses to start" in p for p in report.problems)
    ar, lib, needs, ev_ar = arithmetic(method, report.backend, gpu) if starts else ("", None, (), [])
    _, nlib, nneeds, _ = arithmetic(nextn, report.backend, gpu) if starts else ("", None, (), [])
    built = False if lib == "none" else kernel_built(lib, gpu, needs) if starts else None
    nbuilt = False if nlib == "none" else kernel_built(nlib, gpu, nneeds) if starts else None
    evidence = selection_evidence(fmt, backend_flag) + ev_ar + (kernel_evidence(lib, gpu) if lib not in (None, "none") else [])
    if nlib not in (None, "none", lib):
        evidence += kernel_evidence(nlib, gpu)
    refusals = [p.split("refuses to start: ", 1)[1] for p in report.problems if "refuses to start" in p]
    return refuse_at_load({"method": method, "nextn_method": nextn, "backend": report.backend, "arithmetic": ar,
                           "starts": starts, "kernel_built_for_gpu": built, "nextn_kernel_built_for_gpu": nbuilt,
                           "refusal": refusals[0] if refusals else "", "evidence": list(dict.fromkeys(evidence))}, gpu)


def _runs(e: dict) -> bool:
    return e["starts"] and e["kernel_built_for_gpu"] is not False


def table(ckpts: dict[str, str]) -> dict:
    """format -> GPU -> the --moe-runner-backend auto cell, with `fix` (the explicit backend that
    makes the main layers run where auto does not, with what it leaves for the NextN draft) and
    `explicit` (every backend of EXPLICIT[format], each a cell without fix)."""
    out = {}
    for fmt in FORMATS:
        for gpu in GPUS:
            cell = entry(ckpts[fmt], fmt, gpu, "auto")
            explicit = {b: entry(ckpts[fmt], fmt, gpu, b) for b in EXPLICIT[fmt]}
            cell["fix"] = fix(cell, explicit, gpu)
            cell["explicit"] = explicit
            out.setdefault(fmt, {})[gpu] = cell
    return out


def fix(cell: dict, explicit: dict, gpu: str) -> str:
    """The explicit backend that makes the main layers run where auto does not (with what it
    leaves for the NextN draft), or what the draft needs where only it lacks a kernel; "" if none."""
    if _runs(cell) and cell["nextn_kernel_built_for_gpu"] is not False:
        return ""
    ok = [b for b, e in explicit.items() if _runs(e)]
    best = ([b for b in ok if explicit[b]["kernel_built_for_gpu"] and explicit[b]["nextn_kernel_built_for_gpu"]]
            or [b for b in ok if explicit[b]["kernel_built_for_gpu"]] or ok)
    if best and (not _runs(cell) or explicit[best[0]]["nextn_kernel_built_for_gpu"] is not False):
        flags = f"--moe-runner-backend {best[0]}"
        if explicit[best[0]]["nextn_kernel_built_for_gpu"] is False:
            flags += (f" and no --speculative-algorithm: the NextN experts' {explicit[best[0]]['nextn_method']} "
                      f"has no kernel built for {gpu}")
        return flags
    if _runs(cell):
        return f"no --speculative-algorithm: the NextN experts' {cell['nextn_method']} has no kernel built for {gpu}"
    return ""


def without_lines(t: dict) -> dict:
    """The table with evidence reduced to the files it cites (line numbers move between releases
    without the rule changing)."""
    def strip(e):
        e = dict(e, evidence=sorted({re.sub(r":\d+-\d+$", "", x) for x in e["evidence"]}))
        if "explicit" in e:
            e["explicit"] = {b: strip(x) for b, x in e["explicit"].items()}
        return e
    return {f: {g: strip(c) for g, c in gpus.items()} for f, gpus in t.items()}
