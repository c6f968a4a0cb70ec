"""The kernel cells of a vLLM release, derived by executing that release's own selection code.

For each expert format requant writes or reads (the MXFP4 source, NVFP4 and W4A16 outputs) and
each GPU family, `derive()` runs the release's backend selectors (vllm_harness.kernel_selection:
its oracle/*.py select functions, the kernel classes' own device, quant-scheme and routing checks,
its envs.py) under every install condition, every `--moe-backend` value its config/kernel.py
accepts and every VLLM_* switch its oracle files read, and turns what they pick into the fields
requant's release files state: `selects`, `runs`, `arithmetic`, `speed`, `mode`, `opt_in` (and
for a family whose drafter experts take another format, its `mtp` path). Which packages each
backend needs, and whether vLLM's own Requires-Dist brings them, is read from the wheel's METADATA.

What the enum names compute (PATHS) is requant's reading of the kernel families, kept in one
table here; which enum a release picks, and whether it refuses, is the release's own answer.
scripts/generate_engine_cells.py writes the result into requant/engines/releases/vllm-*.json;
test_vllm_kernels.py holds the files to it.
"""

from __future__ import annotations

import itertools
import re
import zipfile

from requant import engines
from requant.engines import INSTALL_CONDITIONS

from . import vllm_harness as vllm
from . import wheels

CAPS = {gpu: int(gpu.removeprefix("sm_")) for gpu in vllm.GPUS}
FORMATS = ("mxfp4", "nvfp4", "w4a16")

# What a backend computes, per expert format: (arithmetic, speed class, requant.engines.serve mode).
_NV_W4A4 = ("W4A4: NVFP4 weights x NVFP4 activations (quantized under input_scale)", "fp4-tensor-cores", "nvfp4-w4a4")
_NV_W4A16 = ("W4A16: NVFP4 weights dequantized to BF16 (Marlin's scale rule)", "weight-only", "marlin-w4a16")
_MX_W4A8 = ("W4A8: MXFP4 weights x MXFP8 activations", "fp4-tensor-cores", "mxfp4-w4a8")
_MX_W4A8_FP8 = ("W4A8: MXFP4 weights x FP8 activations (per-128 dynamic scales)", "fp4-tensor-cores", "")
_MX_W4A4 = ("W4A4: MXFP4 weights x MXFP4 activations", "fp4-tensor-cores", "")
_MX_W4A16 = ("W4A16: MXFP4 weights dequantized to BF16", "weight-only", "bf16")
_INT4_W4A16 = ("W4A16: INT4 weights dequantized to BF16 (Marlin)", "weight-only", "bf16")
_EMULATED = ("emulated: weights dequantized in a Triton reference kernel", "fallback", "")
PATHS = {
    "nvfp4": {**dict.fromkeys(("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "FLASHINFER_CUTEDSL",
                               "FLASHINFER_CUTEDSL_BATCHED", "FLASHINFER_B12X", "VLLM_CUTLASS", "B12X"), _NV_W4A4),
              "MARLIN": _NV_W4A16, "HUMMING": _NV_W4A16, "EMULATION": _EMULATED},
    "mxfp4": {**dict.fromkeys(("FLASHINFER_TRTLLM_MXFP4_MXFP8", "FLASHINFER_CUTLASS_MXFP4_MXFP8",
                               "B12X_MXFP4_MXFP8"), _MX_W4A8),
              "DEEPGEMM_MXFP4": _MX_W4A8_FP8, "CUTLASS_MXFP4_MXFP4": _MX_W4A4,
              **dict.fromkeys(("MARLIN", "BATCHED_MARLIN", "HUMMING", "FLASHINFER_TRTLLM_MXFP4_BF16",
                               "FLASHINFER_CUTLASS_MXFP4_BF16", "B12X_MXFP4_BF16", "TRITON", "TRITON_UNFUSED"),
                              _MX_W4A16),
              "EMULATION": _EMULATED},
    "w4a16": {**dict.fromkeys(("MARLIN", "BATCHED_MARLIN", "HUMMING"), _INT4_W4A16),
              "TRITON": ("W4A16: INT4 weights dequantized to BF16 (Triton)", "weight-only", "bf16"),
              "FLASHINFER_TRTLLM": ("W4A16: INT4 weights dequantized to BF16 (FlashInfer TRT-LLM)", "weight-only",
                                    "bf16"),
              "EMULATION": _EMULATED},
}
# How the opt-in entries name a backend.
NAMES = {
    "FLASHINFER_TRTLLM": "FlashInfer TRT-LLM FP4 grouped GEMM", "FLASHINFER_CUTLASS": "FlashInfer CUTLASS FP4 grouped GEMM",
    "FLASHINFER_CUTEDSL": "FlashInfer CuTe-DSL FP4 grouped GEMM", "VLLM_CUTLASS": "vLLM's CUTLASS FP4 grouped GEMM",
    "B12X": "b12x NVFP4 grouped GEMM", "FLASHINFER_B12X": "FlashInfer b12x FP4 grouped GEMM",
    "MARLIN": "Marlin (weights dequantized to BF16)", "HUMMING": "Humming (weights dequantized to BF16)",
    "EMULATION": "Triton emulation", "TRITON": "Triton grouped GEMM",
    "FLASHINFER_TRTLLM_MXFP4_MXFP8": "FlashInfer TRT-LLM MXFP4 x MXFP8 grouped GEMM",
    "FLASHINFER_CUTLASS_MXFP4_MXFP8": "FlashInfer CUTLASS MXFP4 x MXFP8 grouped GEMM",
    "FLASHINFER_TRTLLM_MXFP4_BF16": "FlashInfer TRT-LLM MXFP4 x BF16 grouped GEMM",
    "FLASHINFER_CUTLASS_MXFP4_BF16": "FlashInfer CUTLASS MXFP4 x BF16 grouped GEMM",
    "B12X_MXFP4_MXFP8": "b12x MXFP4 x MXFP8 grouped GEMM", "B12X_MXFP4_BF16": "b12x MXFP4 x BF16 grouped GEMM",
    "DEEPGEMM_MXFP4": "DeepGEMM MXFP4 x FP8 grouped GEMM",
    "TRITON_UNFUSED": "OpenAI triton_kernels MXFP4 grouped GEMM, activation unfused (weights dequantized to BF16)", "CUTLASS_MXFP4_MXFP4": "vLLM's CUTLASS MXFP4 x MXFP4 grouped GEMM",
}
# The optional packages a backend needs (None: built into vLLM's wheel); "flashinfer" counts as
# usable only with flashinfer-cubin or nvcc + ninja (vllm/utils/flashinfer.py has_flashinfer).
NEEDS = {"FLASHINFER": ("flashinfer-python", "flashinfer-cubin"), "B12X": ("b12x",), "DEEPGEMM": ("deep_gemm",),
         "HUMMING": ("humming-kernels",), "mxfp4 TRITON": ("triton_kernels",)}   # OpenAI's, for MXFP4
OPTIONAL = frozenset({"flashinfer", "humming", "deep_gemm", "b12x", "triton_kernels"})   # kernel_selection's names
# --moe-backend values not evaluated: ROCm's, CPU's and XPU's kernels, the expert-parallel
# megakernels and batched formats (they need --enable-expert-parallel), and the emulation
# kernels (Triton references that dequantize, never a serving path).
NOT_EVALUATED = re.compile(r"^(aiter.*|flydsl|hpc|rdna3|cpu|xpu|zen_cpu|.*mega.*|flashinfer_moe_ep.*|batched_.*|"
                           r"emulation)$")

DEVIATIONS = [frozenset(c) for n in range(len(INSTALL_CONDITIONS) + 1)
              for c in itertools.combinations(INSTALL_CONDITIONS, n)]


def installed(deviations: frozenset[str]) -> frozenset[str]:
    """INSTALL_CONDITIONS deviations -> the optional kernels present."""
    present = set(vllm.DEFAULT_INSTALL)
    present -= {"flashinfer"} if "no_flashinfer" in deviations else set()
    present -= {"humming"} if "no_humming" in deviations else set()
    present |= {"deep_gemm"} if "deep_gemm" in deviations else set()
    return frozenset(present)


def oracle_takes(fmt: str) -> bool:
    """Whether this release's compressed-tensors W4A16 MoE method asks the oracle (0.23 on); before,
    CompressedTensorsWNA16MarlinMoEMethod runs Marlin without a selector. NVFP4/MXFP4: always."""
    if fmt != "w4a16":
        return True
    ct = vllm.CT_MOE
    return any("select_wna16_moe_backend" in wheels.source("vllm", ct + name)
               for name in wheels.zip_names("vllm", ct) if name.endswith(".py"))


def _picks(cap: int, present: frozenset[str], moe_backend: str = "auto", env: dict | None = None) -> dict[str, str]:
    """format -> the one backend the release picks for every layer (hash-routed or not, every W4A16
    scheme it has a key for), or "refuses: ..."; a disagreement between layers fails loudly."""
    out = {}
    for fmt, picks in vllm.kernel_selection(cap, present, moe_backend, env).items():
        if not oracle_takes(fmt):
            picks = ["MARLIN"]   # compressed_tensors_moe.py: CompressedTensorsWNA16MarlinMoEMethod
        distinct = sorted(set(p if not p.startswith("refuses") else "refuses" for p in picks))
        if len(distinct) != 1:
            raise AssertionError(f"vLLM {wheels.version('vllm')} sm_{cap} {fmt}: layers disagree: {sorted(set(picks))}")
        out[fmt] = picks[0]
    return out


def path(fmt: str, backend: str) -> dict:
    """runs, arithmetic, speed, mode of `backend` (an enum name or "refuses: ...") for `fmt`."""
    if backend.startswith("refuses"):
        return {"runs": False, "arithmetic": "", "speed": "none", "mode": ""}
    arithmetic, speed, mode = PATHS[fmt][backend]
    return {"runs": speed not in ("fallback", "none"), "arithmetic": arithmetic, "speed": speed, "mode": mode}


def selects_for(answers: dict[frozenset, str]) -> dict[str, str]:
    """The smallest `selects` map (install condition -> backend) from which Kernel.selected gives
    every answer: "default", then each combination of deviations that changes the pick."""
    out = {"default": answers[frozenset()]}
    for deviations in sorted(answers, key=lambda d: (len(d), sorted(d))):
        if deviations and engines.Kernel("", "", True, selects=out).selected(set(deviations)) != answers[deviations]:
            out["+".join(sorted(deviations))] = answers[deviations]
    return out


def requirements() -> dict[str, tuple[str, str]]:
    """vLLM's Requires-Dist from the wheel's METADATA: name -> (version spec, extra or "")."""
    with zipfile.ZipFile(wheels.fetch("vllm")) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(meta).decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*([^;]*)(?:;\s*extra == \"([^\"]+)\")?", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = (m.group(2).strip(), m.group(3) or "")
    return out


def packages(fmt: str, backend: str) -> list[dict]:
    """What must be installed for `backend` of `fmt`, at the release's pins, and whether a plain
    `pip install vllm==X` brings it (in_requirements; an extra such as vllm[b12x] does not count)."""
    reqs = requirements()
    needed = next((names for prefix, names in NEEDS.items()
                   if backend.startswith(prefix) or f"{fmt} {backend}".startswith(prefix)), ())
    # FlashInfer's cubins must match its Python package (vLLM pins the latter only, from 0.2x on)
    reqs.setdefault("flashinfer-cubin", (reqs.get("flashinfer-python", ("", ""))[0], "not a requirement"))
    out = []
    for name in needed:
        spec, extra = reqs.get(name.replace("_", "-"), ("", ""))
        entry = {"name": name, "spec": spec, "in_requirements": name.replace("_", "-") in reqs and not extra}
        if extra and extra != "not a requirement":
            entry["extra"] = extra
        if name == "flashinfer-cubin":
            entry["note"] = "or nvcc + ninja, for FlashInfer to compile its kernels at first use (utils/flashinfer.py)"
        out.append(entry)
    return out


def _flag_line(fmt: str, choice: str) -> str:
    """file:line of `choice` in the release's map_<fmt>_backend (the --moe-backend mapping)."""
    relpath = vllm.ORACLE + vllm.ORACLE_FILES[fmt]
    for number, line in enumerate(wheels.source("vllm", relpath).splitlines(), 1):
        if re.match(rf'\s*"{re.escape(choice)}"\s*:', line):
            return f"vllm {wheels.version('vllm')}: {relpath.removeprefix('vllm/')}:{number}"
    return f"vllm {wheels.version('vllm')}: {relpath.removeprefix('vllm/')} ({vllm.selector(fmt)})"


def opt_ins(cap: int, default: dict[str, str]) -> dict[str, list[dict]]:
    """format -> the backends a user can ask for on this GPU that differ from the default: every
    --moe-backend value (with each VLLM_* switch the format's oracle reads, where it changes the
    pick) and each switch alone, with every optional package present."""
    switches = vllm.selector_env_switches()
    found: dict[str, dict[str, dict]] = {fmt: {} for fmt in FORMATS}
    choices = [c for c in vllm.moe_backend_choices() if not NOT_EVALUATED.match(c)]
    for choice in choices:
        envs = [{}] + [{name: "1"} for name in sorted({s for f in switches.values() for s in f if s.startswith("VLLM_")})]
        plain = None
        for env in envs:
            try:
                picks = _picks(cap, OPTIONAL, choice, env)
            except (TypeError, ValueError, KeyError) as e:   # a switch that is not a boolean
                if env:
                    continue
                raise AssertionError(f"--moe-backend {choice}: {type(e).__name__}: {e}") from e
            plain = plain or picks
            for fmt, pick in picks.items():
                if pick.startswith("refuses") or pick == default[fmt] or pick in found[fmt] or not oracle_takes(fmt):
                    continue   # refused, what auto picks anyway, already listed, or no selector
                if env and pick == plain[fmt] or not env and choice == "auto":
                    continue   # the switch changes nothing here; auto's other picks are `selects`
                flags = "" if choice == "auto" else f"--moe-backend {choice}"
                entry = {"backend": NAMES.get(pick, pick), "selects": pick, **path(fmt, pick),
                         "flags": flags, "env": " ".join(f"{k}={v}" for k, v in env.items()),
                         "packages": packages(fmt, pick),
                         "evidence": [_flag_line(fmt, choice) if flags else
                                      f"vllm {wheels.version('vllm')}: {(vllm.ORACLE + vllm.ORACLE_FILES[fmt]).removeprefix('vllm/')} "
                                      f"({', '.join(env)})"]}
                found[fmt][pick] = entry
    return {fmt: list(entries.values()) for fmt, entries in found.items()}


def derive() -> dict[str, dict[str, dict]]:
    """format -> GPU -> the generated fields of the release in use (wheels.version("vllm"))."""
    cells: dict[str, dict[str, dict]] = {fmt: {} for fmt in FORMATS}
    for gpu, cap in CAPS.items():
        answers = {d: _picks(cap, installed(d)) for d in DEVIATIONS}
        default = answers[frozenset()]
        extra = opt_ins(cap, default)
        for fmt in FORMATS:
            cell = path(fmt, default[fmt])
            cell["selects"] = selects_for({d: a[fmt] for d, a in answers.items()})
            cell["opt_in"] = extra[fmt]
            cells[fmt][gpu] = cell
    return cells


# The fields derive() fills, as release files state them; a selection-scope release (whose loader
# code the tier does not run, so none of its prose was held to it) also gets its `backend` prose
# and `evidence` from here, and every release its fix where the default does not run.
GENERATED = ("runs", "arithmetic", "speed", "mode", "selects", "opt_in", "fix", "fix_flags", "fix_kernel")
SELECTION_GENERATED = GENERATED + ("backend", "evidence", "note")   # note: none (a base's would be stale)
_CONDITIONS = {"no_flashinfer": "FlashInfer is not usable", "no_humming": "humming-kernels is not importable",
               "deep_gemm": "deep_gemm is installed"}
_RANK = {"fp4-tensor-cores": 0, "weight-only": 1, "fallback": 2, "none": 3}


def backend_prose(fmt: str, selects: dict[str, str]) -> str:
    """The cell's `backend` in words: the default's name, then each install condition's."""
    def name(pick):
        return f"no backend ({pick.removeprefix('refuses: ')})" if pick.startswith("refuses") else NAMES.get(pick, pick)
    parts = [name(selects["default"])]
    for cond, pick in selects.items():
        if cond != "default":
            parts.append(f"{name(pick)} when {' and '.join(_CONDITIONS[c] for c in cond.split('+'))}")
    return "; ".join(parts)


def fix_for(cell: dict) -> dict:
    """fix, fix_flags, fix_kernel of a cell whose default does not run: the fastest opt-in that runs."""
    if cell["runs"]:
        return {"fix": "", "fix_flags": "", "fix_kernel": None}
    runs = sorted((o for o in cell["opt_in"] if o["runs"]), key=lambda o: (_RANK[o["speed"]], not o["flags"]))
    if not runs:
        return {"fix": "", "fix_flags": "", "fix_kernel": None}
    best = runs[0]
    how = " ".join(p for p in (best["flags"], f"environment {best['env']}" if best["env"] else "") if p)
    kernel = {k: best[k] for k in ("backend", "runs", "arithmetic", "speed", "mode")}
    return {"fix": f"{how}: {best['backend']} ({best['arithmetic']})", "fix_flags": best["flags"],
            "fix_kernel": kernel if best["flags"] else None}


def selector_evidence(fmt: str) -> str:
    """file:line of the selector the release runs for `fmt` (executed by the tier)."""
    if not oracle_takes(fmt):
        relpath = vllm.CT_MOE + "compressed_tensors_moe.py"
        text = wheels.source("vllm", relpath)
        line = next(i for i, l in enumerate(text.splitlines(), 1) if "CompressedTensorsWNA16MarlinMoEMethod(" in l)
        return f"vllm {wheels.version('vllm')}: {relpath.removeprefix('vllm/')}:{line} (Marlin MoE method, no selector)"
    relpath = vllm.ORACLE + vllm.ORACLE_FILES[fmt]
    name = vllm.selector(fmt)
    line = next(i for i, l in enumerate(wheels.source("vllm", relpath).splitlines(), 1) if l.startswith(f"def {name}("))
    return f"vllm {wheels.version('vllm')}: {relpath.removeprefix('vllm/')}:{line} ({name}, executed by the tier)"


def expected(derived: dict, data: dict) -> dict[str, dict[str, dict[str, dict]]]:
    """family -> format -> GPU -> the generated fields of the release whose merged data is `data`
    (engines.release_data) and whose derive() answer is `derived`: the main layers' fields for every
    cell the release has, and `mtp` where a family loads its drafter's experts in another format."""
    scope = data.get("scope", "loader")
    fields = SELECTION_GENERATED if scope == "selection" else GENERATED
    out: dict = {}
    for family, rules in data["models"].items():
        for fmt, cells in (rules.get("kernels") or {}).items():
            if not cells or fmt not in derived:
                continue
            for gpu in cells:
                cell = dict(derived[fmt][gpu])
                cell.update(fix_for(cell))
                if scope == "selection":
                    cell["backend"] = backend_prose(fmt, cell["selects"])
                    cell["evidence"] = [selector_evidence(fmt)]
                    cell["note"] = ""
                want = {k: cell[k] for k in fields}
                drafter = (rules.get("formats", {}).get(fmt) or {}).get("mtp_experts")
                if drafter and drafter != fmt and drafter in derived and cells.get(gpu):
                    other = rules["kernels"][drafter][gpu] if drafter in rules["kernels"] else None
                    path_ = derived[drafter][gpu]
                    want["mtp"] = {"method": (other or {}).get("method", ""), "backend": (other or {}).get("backend", ""),
                                   "runs": path_["runs"], "arithmetic": path_["arithmetic"]}
                out.setdefault(family, {}).setdefault(fmt, {})[gpu] = want
    return out


def mismatches(data: dict, want: dict) -> list[str]:
    """Where the release data's cells differ from `want` (expected()): "family fmt gpu field: file
    says X, the release's code gives Y"."""
    out = []
    for family, fmts in want.items():
        for fmt, gpus in fmts.items():
            for gpu, fields in gpus.items():
                cell = data["models"][family]["kernels"][fmt][gpu]
                for key, value in fields.items():
                    have = cell.get(key)
                    if not have and not value and not isinstance(value, bool):
                        continue   # absent, "", [] and null all say "none"
                    if have != value:
                        out.append(f"{family} {fmt} {gpu} {key}: file says {have!r}, the release's code gives {value!r}")
    return out
