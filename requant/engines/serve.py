"""Serving modes: the numbers an engine computes a converted layer's routed experts with.

validate and report run the converted layer once per requested mode and compare it with the
source's own reference path (its weights decoded exactly, BF16 activations):

- `nvfp4-w4a4`: Blackwell's FP4 tensor cores. Weights as stored; each GEMM input quantized to NVFP4
  under the layer's input_scale (engines.numerics), once per input_scale policy:
  `written` (the checkpoint's), `1.0` (NVIDIA's calibration-free constant) and, given real MoE
  inputs, `calibrated` (their absolute maximum / (6 * 448), ModelOpt's rule; the w2 input's range
  comes from the source's reference pass). It is calibrated on the very tokens it is then judged
  on, so it is the best case for calibration.
- `marlin-w4a16`: vLLM 0.33.0's Marlin kernel (Hopper, Ampere). BF16 activations; NVFP4 block scales
  pass its fp16 rule, which zeroes blocks far below the layer's largest. MXFP4 and INT4 scales
  reach Marlin unchanged, so for them this is `bf16`.
- `mxfp4-w4a8`: MXFP4 weights as stored, each GEMM input quantized to MXFP8 (E4M3, one E8M0
  scale per 32 along K, exponent rounded up: engines.numerics): SGLang 0.5.23 serving the
  unconverted MXFP4 source on Blackwell (sm_120: FlashInfer's CUTLASS MXFP8 x MXFP4 MoE; sm_100:
  FlashInfer's TRT-LLM MXFP4 x MXFP8 MoE). It applies to MXFP4 experts, i.e. to the source: validate
  runs it on the source side (ServingResult.side "source"), against the same reference.
- `bf16`: the weights decoded exactly, BF16 activations: the weight-only comparison validate's
  verdict rests on (Hopper's W4A16 on the MXFP4 source is this too).

`compare_paths` (engines/serve_paths.py) runs every path, source and in-memory conversions, on one layer.
"""

from __future__ import annotations

from dataclasses import replace

from requant.errors import RequantError
from requant import formats
from requant.engines import numerics
from requant.formats import mxfp4

MODES = ("nvfp4-w4a4", "marlin-w4a16", "mxfp4-w4a8", "bf16")
W4A8 = "mxfp4-w4a8"
SOURCE_MODES = (W4A8,)     # modes validate also runs on the source side (its format permitting)
POLICIES = ("written", "1.0", "calibrated")
HELP = ("Serving modes to compute the converted layers in, comma-separated or 'all': nvfp4-w4a4 (Blackwell: "
        "NVFP4 activations under each input_scale policy), marlin-w4a16 (Hopper/Ampere: vLLM's Marlin scale "
        "rule), mxfp4-w4a8 (MXFP4 experts with MXFP8 activations, SGLang on Blackwell: run on the MXFP4 "
        "source), bf16 (weight-only). Default: what the GPU present serves each side's format with; without "
        "a GPU both NVFP4 modes, and mxfp4-w4a8 on an MXFP4 source.")


def default_modes(dst_format: str, capability: tuple[int, int] | None) -> list[str]:
    """The modes the GPU present would serve `dst_format` with; both NVFP4 modes without a GPU,
    since the serving GPU is then unknown. MXFP4: W4A8 on Blackwell (SGLang), weight-only before."""
    if _mxfp4(dst_format):
        if capability is None:
            return [W4A8, "bf16"]
        return [W4A8] if capability[0] >= 10 else ["bf16"]
    if not _w4a4(dst_format):
        return ["bf16"]
    if capability is None:
        return ["nvfp4-w4a4", "marlin-w4a16"]
    return ["nvfp4-w4a4"] if capability[0] >= 10 else ["marlin-w4a16"]


def parse_modes(spec: str | None) -> list[str] | None:
    """--serve: comma-separated modes, or `all`; None (not given) means the defaults."""
    if spec is None:
        return None
    modes = list(MODES) if spec.strip() == "all" else [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise RequantError(f"--serve {spec!r}: choose from {', '.join(MODES)} or all")
    return list(dict.fromkeys(modes))


def _w4a4(fmt: str) -> bool:
    """Whether engines quantize the activations for this format: it stores an input_scale for it."""
    return formats.get(fmt).part(formats.INPUT_SCALE) is not None


def _mxfp4(fmt: str) -> bool:
    """Whether the experts are MXFP4 (E2M1 under E8M0 block scales), which W4A8 engines take as stored."""
    return fmt == mxfp4.CODEC.name


def applies(mode: str, dst_format: str) -> bool:
    if mode == W4A8:
        return _mxfp4(dst_format)
    return mode != "nvfp4-w4a4" or _w4a4(dst_format)


def source_modes(modes: list[str] | None, src_format: str, capability: tuple[int, int] | None) -> list[str]:
    """The modes validate runs on the source side: the SOURCE_MODES among `modes` (None: the
    defaults for the source's format) that apply to it. bf16 on the source is the reference itself."""
    chosen = default_modes(src_format, capability) if modes is None else modes
    return [m for m in chosen if m in SOURCE_MODES and applies(m, src_format)]


def marlin_factors(histograms: dict, fused: list[list[str]]) -> dict[str, float]:
    """proj -> vLLM 0.33.0's Marlin factor, from the `scale_histogram` of every expert's NVFP4 block
    scales of each projection: one factor for each group of projections it loads as one tensor,
    over all experts together (`fused`: the model's, e.g. DeepSeek-V4's w1 and w3 as w13), one for
    each other."""
    groups = fused + [[p] for p in histograms if not any(p in g for g in fused)]
    return {p: numerics.marlin_scale_factor(sum(histograms[q] for q in group))
            for group in groups for p in group}


def marlin_served(w, factor: float):
    """(w with the block scales Marlin zeroes under `factor` set to 0, how many): ExpertWeights, or
    the kernel's KernelWeights, whose weights keep their layout."""
    scale, flushed = numerics.marlin_flush(w.scale, factor)
    return replace(w, scale=scale), flushed


def rescaled_by_marlin(fmt: str) -> bool:
    """Whether Marlin rescales this format's block scales: against a global scale (NVFP4); others run as stored."""
    return formats.get(fmt).part(formats.GLOBAL_SCALE) is not None


def marlin_weights(weights: dict, fused: list[list[str]]) -> tuple[dict, int]:
    """({proj: weights}, blocks flushed) as vLLM 0.33.0's Marlin serves the layer's experts (weights
    as `marlin_served` takes them)."""
    if not rescaled_by_marlin(next(iter(weights.values())).format):
        return weights, 0
    factors = marlin_factors({p: numerics.scale_histogram(w.scale) for p, w in weights.items()}, fused)
    out, flushed = {}, 0
    for p, w in weights.items():
        out[p], n = marlin_served(w, factors[p])
        flushed += n
    return out, flushed


def calibrated_input_scale(amax: float) -> float:
    """ModelOpt's calibrated input_scale for activations whose absolute maximum is amax."""
    return amax / (6.0 * numerics.E4M3_MAX)
