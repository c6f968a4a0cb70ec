"""The release-file cells requant states about SGLang, derived from the engine's answers.

An engine answer (sglang_kernels.entry / sglang_selection.answer: method, NextN method, resolved
backend, arithmetic, starts, kernel built, fix, explicit backends) says what the release's code
selects; `kernel` turns one into the Kernel fields advise, verify, the cards and the README read
(runs, arithmetic, speed, mode, mtp, fix_flags, fix_kernel, opt_in). scripts/generate_sglang_cells.py
writes them into requant/engines/releases/sglang-*.json; the tier's tests compare the files with
`expected` (`differences`), so an edited field fails a test.

Where a release file is the loader tier's (scope "loader", 0.5.23), its cells were written with
prose of their own: only `engine_answer`, `opt_in` and `tp` are generated there, and the
advise-visible fields are compared with what `kernel` derives from the recorded answer.
"""

from __future__ import annotations

import re

import tempfile
from pathlib import Path

from tests.engines import sglang_kernels as K
from tests.engines import sglang_selection as S
from tests.engines import wheels

# the engine's arithmetic (sglang_kernels.arithmetic) -> requant's words, speed class when it runs, serving mode
ARITHMETIC = (
    ("MXFP4 x MXFP8 (W4A8)", "W4A8: MXFP4 weights x MXFP8 activations", "fp4-tensor-cores", "mxfp4-w4a8"),
    ("MXFP4 weight-only (W4A16)", "W4A16: MXFP4 weights dequantized to BF16", "weight-only", "bf16"),
    ("MXFP4 dequant + GEMV (W4A16)", "W4A16: MXFP4 weights dequantized to BF16 in a fused Triton GEMV (SM120 fallback, "
     "not Marlin)", "weight-only", "bf16"),
    ("none:", "none: MXFP4 bytes on an FP8 path with no FP4 support", "fallback", "bf16"),
    ("NVFP4 x NVFP4 (W4A4)", "W4A4: NVFP4 weights x NVFP4 activations (quantized under input_scale)", "fp4-tensor-cores",
     "nvfp4-w4a4"),
    ("NVFP4 weight-only (W4A16)", "W4A16: NVFP4 weights dequantized to BF16 (Marlin FP4)", "weight-only", "marlin-w4a16"),
    ("INT4 W4A16, Marlin", "W4A16: INT4 weights dequantized to BF16 (Marlin)", "weight-only", "bf16"),
    ("INT4 W4A16, Triton", "W4A16: INT4 weights dequantized to BF16 (Triton)", "weight-only", "bf16"),
)
NO_KERNEL = "; FlashInfer ships no kernel for this GPU (fails at first use, from code, not run)"
# the libraries each --moe-runner-backend value imports beyond SGLang itself (its wheel's Requires-Dist name)
BACKEND_PACKAGES = {"flashinfer_mxfp4": "flashinfer_python", "flashinfer_cutlass": "flashinfer_python",
                    "flashinfer_trtllm_routed": "flashinfer_python", "flashinfer_trtllm": "flashinfer_python",
                    "marlin": "sglang-kernel", "triton": None}
CUTLASS_MXFP4 = "Mxfp4FlashinferCutlassMoEMethod"   # the method with SGLang's own per-rank %128 condition
# fields a release file states that advise, verify, the cards and the README read
VISIBLE = ("method", "runs", "arithmetic", "speed", "mode", "selects", "mtp", "fix_flags")


def _runs(answer: dict, nextn: bool = False) -> bool:
    built = answer["nextn_kernel_built_for_gpu" if nextn else "kernel_built_for_gpu"]
    return answer["starts"] and built is not False and not answer["arithmetic"].startswith("none:")


def _words(arithmetic: str) -> tuple[str, str, str]:
    for prefix, words, speed, mode in ARITHMETIC:
        if arithmetic.startswith(prefix):
            return words, speed, mode
    raise KeyError(f"no words for the engine arithmetic {arithmetic!r}")


def kernel(answer: dict) -> dict:
    """The Kernel fields (without fix, engine_answer, opt_in) of one engine answer."""
    runs = _runs(answer)
    if not answer["starts"]:
        words, speed, mode = "", "none", ""
        backend = f"SGLang refuses to start ({answer['refusal']})"
    else:
        words, speed, mode = _words(answer["arithmetic"])
        speed = speed if runs or speed == "fallback" else "none"
        backend = f"{answer['backend']} runner: {answer['arithmetic']}" + (NO_KERNEL if answer["kernel_built_for_gpu"] is False
                                                                             and "FlashInfer" in answer["arithmetic"] else "")
    return {"method": answer["method"], "backend": backend, "runs": runs, "arithmetic": words, "speed": speed, "mode": mode,
            "selects": {"default": answer["backend"]},
            "mtp": {"method": answer["nextn_method"], "backend": answer["backend"], "runs": _runs(answer, nextn=True)},
            "evidence": list(answer["evidence"])}


def packages(backend: str) -> list[dict]:
    """What --moe-runner-backend `backend` needs installed, at the release's pin, and whether the
    sglang wheel's own Requires-Dist brings it."""
    name = BACKEND_PACKAGES.get(backend)
    if name is None:
        return []
    pin = requirement(name)
    return [{"name": name, "spec": pin or "", "in_requirements": pin is not None}]


def requirement(name: str) -> str | None:
    """The version spec the sglang wheel in use requires `name` at ("==0.7.2"), None if it does not."""
    z = wheels._zip("sglang")
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    pattern = re.escape(name).replace(r"\_", "[-_]").replace(r"\-", "[-_]")
    m = re.search(rf"^Requires-Dist: {pattern}(?:\[[^\]]*\])?\s*([^;\s]*)", meta, re.M | re.I)
    return m.group(1) if m else None


def opt_in(cell: dict, gpu: str) -> list[dict]:
    """Every explicit --moe-runner-backend other than the one auto resolves to, with what it runs."""
    out = []
    for backend, answer in cell["explicit"].items():
        if backend == cell["backend"]:
            continue
        entry = kernel(answer)
        entry.update(note=_nextn_note(answer, gpu), flags=f"--moe-runner-backend {backend}", env="",
                     packages=packages(backend))
        out.append(entry)
    return out


def _nextn_note(answer: dict, gpu: str) -> str:
    notes = []
    if answer["method"] == CUTLASS_MXFP4:   # tp_rules: its create_weights raises otherwise
        notes.append("needs hidden_size and each rank's share of moe_intermediate_size to be multiples of 128")
    if _runs(answer) and not _runs(answer, nextn=True):
        notes.append(f"no --speculative-algorithm: the NextN experts' {answer['nextn_method']} has no kernel built for {gpu}")
    return "; ".join(notes)


def tp_rules(table: dict) -> list[dict]:
    """SGLang's MXFP4 CUTLASS method refuses a per-rank intermediate size that is not a multiple of
    128 (create_weights raises): a rule for that method (`methods`: advise applies it to the paths
    that select it, by default or by flag) on the GPUs where any backend selects it."""
    gpus = [gpu for gpu, cell in table.get("mxfp4", {}).items()
            if CUTLASS_MXFP4 in {cell["method"], *(e["method"] for e in cell["explicit"].values())}]
    if not gpus:
        return []
    relpath = "layers/quantization/mxfp4_flashinfer_cutlass_moe.py"
    src = wheels.source("sglang", K.SRT + relpath)
    span = K._lines_of(src, "if hidden_size % 128 != 0 or intermediate_size_per_partition % 128 != 0:",
                       "intermediate={intermediate_size_per_partition}")
    return [{"format": "mxfp4", "when": "intermediate_per_rank_not_multiple_of_128", "gpus": gpus, "methods": [CUTLASS_MXFP4],
             "problem": "Mxfp4FlashinferCutlassMoEMethod.create_weights raises ValueError unless hidden_size and "
                        "each rank's share of moe_intermediate_size are multiples of 128",
             "works": "use a --tp that leaves a multiple of 128 per rank, expert parallelism, or --moe-runner-backend marlin",
             "evidence": [K.sg_ev(relpath, (span[0], span[1] + 1))]}]


def cells(table: dict, loader: bool) -> dict:
    """format -> GPU -> the generated cell of a release file. A loader release records the whole
    answer (with every explicit backend's) as engine_answer; a selection release only what Kernel
    reads from it (starts, kernel built), the rest being the cell's own fields and opt_in."""
    out = {}
    for fmt, gpus in table.items():
        for gpu, cell in gpus.items():
            answer = {k: v for k, v in cell.items() if k not in ("fix", "explicit")}
            entry = kernel(answer)
            flags = cell["fix"].split(" and ")[0] if cell["fix"].startswith("--") else ""
            fixed = kernel(cell["explicit"][flags.split()[-1]]) if flags else None
            recorded = cell if loader else {k: v for k, v in answer.items() if k != "evidence"}
            entry.update(fix=cell["fix"], fix_flags=flags, fix_kernel=fixed, opt_in=opt_in(cell, gpu), engine_answer=recorded)
            out.setdefault(fmt, {})[gpu] = entry
    return out


def delta(base, new):
    """The smallest overlay that release_data's merge turns `base` into `new` with (a null
    removes a key; lists are replaced whole)."""
    if not (isinstance(base, dict) and isinstance(new, dict)):
        return new
    out = {k: v if k not in base else delta(base[k], v) for k, v in new.items() if base.get(k) != v}
    out.update({k: None for k in base if k not in new})
    return out


def visible(entry: dict) -> dict:
    """The advise-visible fields of a kernel cell (mtp reduced to its method and whether it runs)."""
    out = {k: entry.get(k) for k in VISIBLE}
    out["fix_flags"] = out["fix_flags"] or ""
    out["mtp"] = {k: (entry.get("mtp") or {}).get(k) for k in ("method", "runs")}
    out["backend_runner"] = entry["backend"].split(" runner:")[0] if " runner:" in entry["backend"] else entry["backend"]
    return out


def differences(kernels: dict, tp: list, generated: dict, generated_tp: list, loader: bool) -> list[tuple]:
    """Where a release file's kernels (and tp rules) differ from what the tier generates: every
    generated field for a selection-scope file; for the loader-scope file, the recorded engine
    answers, opt_in and tp in full, and each cell's advise-visible fields against those derived
    from its recorded answer."""
    diffs = [("tp", tp, generated_tp)] if tp != generated_tp else []
    for fmt in sorted(set(kernels) | set(generated)):
        for gpu in sorted(set(kernels.get(fmt, {})) | set(generated.get(fmt, {}))):
            have, want = kernels.get(fmt, {}).get(gpu), generated.get(fmt, {}).get(gpu)
            if have is None or want is None:
                diffs.append((fmt, gpu, "cell", have is not None, want is not None))
                continue
            if loader:
                for key, absent in (("engine_answer", None), ("opt_in", []), ("fix", "")):
                    if have.get(key, absent) != want.get(key, absent):
                        diffs.append((fmt, gpu, key, have.get(key), want.get(key)))
                derived = dict(kernel(have["engine_answer"]), fix_flags=want["fix_flags"])
                got, exp = visible(have), visible(derived)
                diffs += [(fmt, gpu, k, got[k], exp[k]) for k in got if got[k] != exp[k]]
            else:
                diffs += [(fmt, gpu, k, have.get(k), want.get(k)) for k in sorted(set(have) | set(want))
                          if have.get(k) != want.get(k)]
    return diffs


# ---------------------------------------------------------------------------------------------
# a release's generated cells
# ---------------------------------------------------------------------------------------------
def missing_wheels() -> list[str]:
    """The wheels the release in use is read from (sglang, the FlashInfer it pins, the FlashInfer
    whose TRT-LLM-gen manifest stands for an older pin's) that cannot be had, downloading the others."""
    if not wheels.available("sglang"):
        return [f"sglang=={K.release()}"]
    pins = dict.fromkeys([K.flashinfer_pin(), K.TRTLLM_MANIFEST_FIRST])
    return [f"flashinfer-python=={pin}" for pin in pins if wheels.wheel("flashinfer-python", pin) is None]


def loader_table(version: str) -> dict:
    """The loader harness's kernel table of `version` (sglang_kernels.table)."""
    from tests.engines.outputs import SMALL, per_format, source_and_outputs
    with S.on_release(version), tempfile.TemporaryDirectory() as tmp:
        return K.table(source_and_outputs(Path(tmp), SMALL, 3, per_format("sglang")))


def selection_table(version: str) -> dict:
    """sglang_selection's table of `version`, W4A16 included."""
    with S.on_release(version):
        return {**S.table(), "w4a16": S.w4a16_table()}


def loader_release(version: str) -> tuple[dict, list]:
    """format -> GPU -> {engine_answer, opt_in, fix, fix_flags} and the tp rules of a loader release."""
    table = loader_table(version)
    with S.on_release(version):
        generated, tp = cells(table, loader=True), tp_rules(table)
    return generated, tp


def selection_release(version: str) -> tuple[dict, list, dict]:
    """The kernels, tp rules and release facts (pin, files present) of a selection release."""
    table = selection_table(version)
    with S.on_release(version):
        generated, tp = cells(table, loader=False), tp_rules(table)
        names = set(wheels._zip("sglang").namelist())
        facts = {"pin": K.flashinfer_pin(), "manifest": K.trtllm_manifest_pin(), "override": S.override_site()[0],
                 "nvfp4": S.serves_nvfp4(),
                 "dspark": f"{K.SRT}models/deepseek_v4_dspark.py" in names,
                 "v41": f"{K.SRT}configs/deepseek_v41.py" in names}
        if not facts["nvfp4"]:   # where an NVFP4 output's experts are taken for MXFP4 ones
            facts["fp4_detection"] = K.sg_ev("configs/model_config.py", K._lines_of(
                wheels.source("sglang", K.SRT + "configs/model_config.py"), "self.is_fp4_experts: bool = False",
                "self.is_fp4_experts = detected"))
    generated["w4a16"] = {gpu: dict(cell, engine_answer=None) for gpu, cell in generated["w4a16"].items()}   # read, not run
    if not facts["nvfp4"]:
        generated["nvfp4"] = {gpu: not_served(facts["fp4_detection"]) for gpu in K.GPUS}
    return generated, tp, facts


def not_served(evidence: str) -> dict:
    """The cell of an output format a release has no config for (NVFP4 before 0.5.14)."""
    what = ("not served: this release has no hybrid FP8+NVFP4 config, so the output's Fp8Config reads the NVFP4 "
            "experts as MXFP4 ones (from the engine's code, not run)")
    return {"method": "none (not served)", "backend": what, "runs": False, "arithmetic": "", "speed": "none", "mode": "",
            "selects": {"default": "auto"}, "mtp": {"method": "none (not served)", "backend": "auto", "runs": False},
            "evidence": [evidence], "fix": "upgrade SGLang to 0.5.14 or later", "fix_flags": "", "fix_kernel": None,
            "opt_in": [], "engine_answer": None}
