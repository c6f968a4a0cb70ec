"""Whether each serving engine loads a checkpoint correctly, by the engine rules of its recipe.

`requant verify` asks this module once the checkpoint's structure is known. Every finding names
the engine release its rule was checked against (see requant/engines.py and tests/engines/).
A checkpoint that an engine would load as garbage is an error for the engine the user serves
with (--engine, or the one requant.json says the output was made for); when no engine is known,
each engine's verdict is a warning and only "no engine loads it" is an error.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from requant.engines import FROM_CODE, GPU_FAMILIES, EngineRules, releases_with_marlin_rule
from requant.engines import numerics
from requant.formats import nvfp4
from requant.model import ModelSpec
from requant.targets import w4a16

MARLIN_GPUS = ("sm_80", "sm_90")   # no FP4 tensor cores: NVFP4 experts run through Marlin
MARLIN_FP4_FORMATS = (nvfp4.CODEC.name,)   # the expert formats engines serve there through Marlin's FP4 path


@dataclass
class EngineVerdict:
    engine: str
    version: str
    label: str = ""               # the engine and release, as EngineRules.label says it
    checked: bool = True          # False: requant has no rules checked against this release
    rules_version: str = ""       # the release whose rules were applied
    loads: bool | None = True     # None: not judged (no rules, or the checkpoint has errors of its own)
    problems: list[str] = field(default_factory=list)
    kernel: dict | None = None
    marlin_flushed_blocks: int = 0   # NVFP4 blocks zeroed by the Marlin path (GPUs without FP4 tensor cores)


class MarlinSpan:
    """Smallest positive and largest block scale of one fused weight group across a layer's
    experts, and how many blocks hold each E4M3 value (for the flush count)."""

    def __init__(self):
        self.histogram = torch.zeros(256, dtype=torch.int64)   # blocks per E4M3 byte

    def update(self, scales: torch.Tensor) -> None:
        """Count one projection's block scales, E4M3 values as float32 (exact) or the stored bytes:
        a byte histogram, one pass (sorting the values with torch.unique took 30 ms a full-size
        projection, most of verify's time on an NVFP4 checkpoint)."""
        if scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
            scales = scales.to(torch.float8_e4m3fn)
        self.histogram += numerics.scale_histogram(scales)

    def _positive(self) -> list[tuple[float, int]]:
        """(value, blocks) of every positive scale some block holds, in increasing value (E4M3's
        positive bytes, 0x01-0x7E, order as their values)."""
        counts = self.histogram.tolist()
        held = [b for b in range(1, 0x7F) if counts[b]]
        values = torch.tensor(held, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
        return [(v, counts[b]) for v, b in zip(values, held)]

    @property
    def min(self) -> float:
        return next((v for v, _ in self._positive()), math.inf)

    @property
    def max(self) -> float:
        positive = self._positive()
        return positive[-1][0] if positive else 0.0

    @property
    def held(self) -> bool:
        """Whether any block scale is positive."""
        return bool(self._positive())

    def blocks_below(self, threshold: float) -> int:
        return sum(n for v, n in self._positive() if v < threshold)


def marlin_flush_threshold(layer_max: float) -> float:
    """Block scales below this are zero in vLLM 0.33.0's NVFP4 Marlin MoE (bf16 activations): a
    block survives iff scale * factor >= 2^-6 (formats/numerics.py has the rule)."""
    return numerics.MARLIN_MIN_SCALE / numerics.marlin_factor(layer_max)


def target_matches(target: str, name: str) -> bool:
    """compressed-tensors matching: 're:' regex, else an exact module name (or the Linear class)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


def w4a16_probe_misses(rules: EngineRules, model: ModelSpec, qc: dict, layers: list[int]) -> list[str]:
    """The expert modules, as this engine probes them, that no INT4 config group claims (or that
    `ignore` removes): the engine would build FP8 MoE layers for them and fail the load."""
    groups = w4a16.expert_groups(qc)
    ignore = [t for t in qc.get("ignore") or [] if isinstance(t, str)]
    misses = []
    for layer in layers:
        for probe in rules.expert_probes(layer, model.projections).values():
            claimed = any(target_matches(t, probe) for g in groups.values() for t in g.get("targets") or [])
            if not claimed or any(target_matches(t, probe) for t in ignore):
                misses.append(probe)
    return misses


def fp8_linear_problems(rules: EngineRules, qc: dict, scale_names: set[str]) -> list[str]:
    """How a W4A16 checkpoint's FP8-block linears fail this engine's rule for describing them."""
    style = rules.layout(w4a16.W4A16Target.name, "fp8_linears")
    has_group = any((g.get("weights") or {}).get("num_bits") == 8 and "Linear" in (g.get("targets") or [])
                    for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict))
    problems = []
    if style == "config_group":
        if not has_group:
            problems.append("no FP8 config group targets Linear, so the FP8-block attention and shared-expert "
                            "linears are not built as FP8")
        others = sorted(scale_names - {w4a16.FP8_SCALE})
        if others:
            problems.append(f"the FP8-block linears' scales are named .{'/.'.join(others)}; its compressed-tensors "
                            f"FP8 scheme loads .{w4a16.FP8_SCALE}")
    elif style == w4a16.LINEAR_FP8_CONFIG:
        if w4a16.LINEAR_FP8_CONFIG not in qc:
            problems.append(f"no {w4a16.LINEAR_FP8_CONFIG}: its DeepSeek-V4 model has no other FP8-block attention "
                            "path under compressed-tensors (wo_a is built in BF16 and gets raw FP8 bytes)")
        if w4a16.FP8_SCALE in scale_names:
            problems.append(f"the FP8-block linears' scales are named .{w4a16.FP8_SCALE}; its loader reads only "
                            ".scale / .weight_scale_inv there, so they are skipped (the fused wqkv_a scale stays "
                            "uninitialised)")
        if qc.get("format") != w4a16.PACKED:
            problems.append(f"top-level format is {qc.get('format')!r}; its INT4 MoE method requires {w4a16.PACKED!r} "
                            "and raises at model build")
    return problems


def drafter_loads(rules: EngineRules, model: ModelSpec, config: dict, formats_by_block: dict[str, str],
                  dominant: str) -> dict[str, tuple[str, str]]:
    """MTP/drafter block -> (the format its experts are stored in, the format this release loads
    them in), for a checkpoint whose main experts are `dominant`: the release's per-block rule,
    given the checkpoint's quantization_config.ignore (`EngineRules.mtp_format_for`). Blocks the
    rules say nothing of are left out."""
    ignore = (config.get("quantization_config") or {}).get("ignore")
    found = {}
    for block, fmt in formats_by_block.items():
        loaded = rules.mtp_format_for(dominant, block, ignore) if model.is_mtp(block) else None
        if loaded:
            found[block] = (fmt, loaded)
    return found


def judge(rules: EngineRules, model: ModelSpec, config: dict, formats_by_block: dict[str, str], dominant: str,
          spans: dict[tuple[str, str], MarlinSpan], gpu: str | None,
          fp8_scale_names: set[str] = frozenset()) -> tuple[EngineVerdict, list[tuple]]:
    """This engine's verdict on the checkpoint and its findings as (code, message, where, detail).
    `fp8_scale_names`: the suffixes the FP8-block linears' scales carry (scale, weight_scale, ...)."""
    verdict = EngineVerdict(rules.name, rules.version, rules.release_label, rules.checked, rules.checked_version)
    found: list[tuple] = []

    def problem(code, message, where=None, detail=None):
        verdict.loads = False
        verdict.problems.append(message)
        found.append((code, f"{rules.label}: {message}", where, detail))

    refusal = rules.refusal(dominant)
    if refusal:
        problem("engine-unsupported", f"cannot serve {dominant} experts: {refusal}")
    for block, (fmt, expected_mtp) in drafter_loads(rules, model, config, formats_by_block, dominant).items():
        if fmt != expected_mtp:
            problem("mtp-format", f"loads the MTP block's experts as {expected_mtp.upper()} but they are "
                    f"{fmt.upper()}: no error, garbage drafts ({rules.mtp_evidence(dominant)}); "
                    f"reconvert with --engine {rules.name}", model.experts_module(block))
    if dominant in FORMAT_PROBLEMS:
        qc = config.get("quantization_config") or {}
        for args in FORMAT_PROBLEMS[dominant](rules, model, qc, formats_by_block, set(fp8_scale_names)):
            problem(*args)
    if dominant in MARLIN_FP4_FORMATS and gpu in (None, *MARLIN_GPUS):
        found += _marlin_findings(rules, model, spans, verdict)
    if gpu is not None and rules.has_kernel_rules(dominant):
        how = rules.serving(dominant, gpu, has_mtp=any(model.is_mtp(b) for b in formats_by_block))
        verdict.kernel = asdict(how.kernel) | {"flags": how.flags, "speculative": how.speculative, "outcome": how.outcome}
        family = f"on {gpu} ({GPU_FAMILIES[gpu]})"
        auto = how.auto
        if how.starts and not how.flags:
            text = f"{family} selects {auto.method}: {auto.backend}" + (f" ({auto.note})" if auto.note else "")
        else:
            text = f"{family} without flags: {auto.outcome}: {auto.backend}" + (
                f"; with {how.flags}: {how.kernel.method}: {how.kernel.backend}" if how.starts else f"; {auto.fix}" if auto.fix else "")
        if how.note:
            text += f"; {how.note}"
        found.append(("kernel", f"{rules.label}: {text} ({FROM_CODE})", None, None))
    if rules.vision_summary:
        found.append(("vision", rules.vision_summary, None, None))
    return verdict, found


def _w4a16_problems(rules: EngineRules, model: ModelSpec, qc: dict, formats_by_block: dict[str, str],
                    fp8_scale_names: set[str]) -> list[tuple]:
    """How this engine fails to load W4A16 experts as the config describes them."""
    found = []
    mtp_layers = [model.value("num_layers") + model.block_index(b) for b in formats_by_block if model.is_mtp(b)]
    misses = w4a16_probe_misses(rules, model, qc, [0] + mtp_layers)
    if misses:
        found.append(("w4a16-targets", "no INT4 config group matches the expert modules it probes, so they fall to "
                      "the FP8 group and the load crashes", "config.json", ", ".join(misses[:3])))
    for text in fp8_linear_problems(rules, qc, fp8_scale_names):
        found.append(("w4a16-fp8-linears", text, "config.json"))
    refused = (rules.layout(w4a16.W4A16Target.name, "refuses") or {}).get("scheme", {})
    for group in w4a16.expert_groups(qc).values():
        scheme = w4a16.group_scheme(group)
        if scheme in refused:
            found.append(("w4a16-scheme", f"cannot load {scheme} INT4 experts: {refused[scheme]}", "config.json"))
    return found


# Load problems particular to one expert format, beyond those every format shares.
FORMAT_PROBLEMS = {w4a16.W4A16Target.name: _w4a16_problems}


def _marlin_findings(rules: EngineRules, model: ModelSpec, spans, verdict: EngineVerdict) -> list[tuple]:
    rule = rules.marlin_fp4_rule()
    found = []
    for (block, group), span in spans.items():
        where = f"{model.experts_module(block)} {group}"
        if rule == "largest" and span.held:
            flushed = span.blocks_below(marlin_flush_threshold(span.max))
            verdict.marlin_flushed_blocks += flushed
            if flushed:
                found.append(("marlin-flush", f"{rules.label}: where its Marlin NVFP4 MoE runs (no FP4 tensor cores: "
                              "sm_80, or sm_90 without humming-kernels or with --moe-backend marlin) block scales 15 or "
                              "more octaves below the layer's largest are flushed to zero",
                              where, f"{flushed} blocks, scales {span.min:g} .. {span.max:g}"))
        elif rule == "unguarded" and (unheld := span.blocks_below(numerics.MARLIN_MIN_SCALE)):
            found.append(("marlin-unguarded", f"{rules.label}: its Marlin NVFP4 MoE (--moe-runner-backend marlin on "
                          "sm_80/sm_90) passes block scales under 2^-6 to a scale format that cannot hold them (no "
                          "guard in srt/layers/quantization/marlin_utils_fp4.py; vLLM from "
                          f"{releases_with_marlin_rule('vllm', 'largest')[0]} zeroes these): those "
                          "blocks' weights decode wrongly", where,
                          f"{unheld} blocks, scales {span.min:g} .. {span.max:g}"))
    return found
