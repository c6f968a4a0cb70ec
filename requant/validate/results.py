"""What validate finds: its thresholds, per-layer and per-serving-mode results, the terminal table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# Converted against source: (max relative error, min cosine).
# A lossless NVFP4 cast (or an unchanged layer) decodes to the same weights, and the kernel then
# computes the same products scaled by powers of two, so only blocks re-quantized outside the
# E4M3 window (values below 2^-17 of the largest) and BF16 rounding can differ: 1e-3 is generous
# yet far below any real fault (a wrong w3 scale or nibble order gives errors of order 1).
LOSSLESS = (1e-3, 0.99999)
# W4A16 is a real re-quantization: MXFP4 -> INT4 weights have 20-25 dB SNR (docs/formats.md, W4A16),
# i.e. 6-10% relative error, and a layer's output error is of the same order. 15% (16.5 dB) passes
# every group size and quantizer requant offers and still fails a broken conversion.
LOSSY = (0.15, 0.985)
# The kernel against the FP32 torch reference: with BF16 compute the intermediate activation and
# the output are rounded to BF16 (2^-9 relative each), measured ~2e-3 on an H200; FP32 compute
# (the CPU interpreter) is ~1e-3 from the output rounding alone.
KERNEL_VS_REFERENCE = 1e-2


@dataclass
class ServingResult:
    mode: str                   # serve.MODES
    policy: str | None          # input_scale policy (nvfp4-w4a4 only)
    input_scales: tuple[float, float] | None  # (w1/w3 input, w2 input) the activations were quantized with
    rel_err: float              # against the source layer output, as LayerResult.rel_err
    cosine: float
    max_abs_err: float
    routed_rel_err: float
    flushed_blocks: int         # marlin-w4a16: NVFP4 block scales of the layer set to zero
    side: str = "candidate"     # whose layer: "candidate" (dst), or "source" (mxfp4-w4a8 on an MXFP4 source)


@dataclass
class LayerResult:
    layer: str
    src_format: str
    dst_format: str
    tokens: int
    hash_routed: bool
    rel_err: float              # ||y_dst - y_src|| / ||y_src|| on the layer output (routed + shared)
    cosine: float
    max_abs_err: float
    routed_rel_err: float       # the same on the routed experts alone, where the formats differ
    routing_agreement: float    # fraction of tokens whose expert set is the same in both
    kernel_rel_err: float | None  # kernel vs torch reference, routed experts of the source layer
                                  # (None: the reference alone ran, on a CPU)
    max_rel_err: float
    min_cosine: float
    passed: bool
    serving: list[ServingResult] = field(default_factory=list)


@dataclass
class ValidationResult:
    src: str
    dst: str
    device: str
    layers: list[LayerResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.layers)

    def failure(self) -> str | None:
        """None when every layer passed; else one line naming the layers past their limits."""
        failed = [r for r in self.layers if not r.passed]
        if not failed:
            return None
        first = failed[0]
        return (f"validate: {len(failed)} of {len(self.layers)} layers past their limits, first {first.layer}: "
                f"rel err {first.rel_err:.3g} (limit {first.max_rel_err:g}), cosine {first.cosine:.6f} "
                f"(limit {first.min_cosine:g})")

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "device": self.device, "passed": self.passed,
                "thresholds": {"lossless": LOSSLESS, "lossy": LOSSY, "kernel_vs_reference": KERNEL_VS_REFERENCE},
                "layers": [asdict(r) for r in self.layers]}


def metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(relative error of b against a, cosine, max abs error), over the whole [T, H] output."""
    a, b = a.double().flatten(), b.double().flatten()
    rel = float((b - a).norm() / a.norm().clamp(min=1e-30))
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=1e-30))
    return rel, cos, float((b - a).abs().max())


def format_table(result: ValidationResult) -> str:
    lines = [f"{'layer':10s} {'src':6s} {'dst':6s} {'rel err':>9s} {'cosine':>9s} {'max abs':>9s} "
             f"{'routing':>8s} {'kernel':>9s}  verdict"]
    for r in result.layers:
        lines.append(f"{r.layer:10s} {r.src_format:6s} {r.dst_format:6s} {r.rel_err:9.2e} {r.cosine:9.6f} "
                     f"{r.max_abs_err:9.2e} {r.routing_agreement:8.3f} "
                     f"{'-' if r.kernel_rel_err is None else format(r.kernel_rel_err, '9.2e'):>9s}  "
                     f"{'ok' if r.passed else 'FAIL'}")
    lines.append(f"rel err/cosine/max abs: converted vs source layer output; routing: tokens with the same experts; "
                 f"kernel: kernel vs torch reference on the source (limit {KERNEL_VS_REFERENCE:g}; - where the "
                 f"reference alone ran). "
                 f"Limits: lossless rel <= {LOSSLESS[0]:g}, cos >= {LOSSLESS[1]}; W4A16 rel <= {LOSSY[0]:g}, "
                 f"cos >= {LOSSY[1]}. {'PASSED' if result.passed else 'FAILED'} on {result.device}.")
    served = [(r.layer, s) for r in result.layers for s in r.serving]
    if served:
        lines += ["", "Served numerics: each layer as an engine computes it (candidate; source: the MXFP4 source "
                  "as W4A8 engines run it), against the source's reference path (BF16 activations).",
                  f"{'layer':10s} {'mode':13s} {'input_scale':11s} {'w1/w3 in':>9s} {'w2 in':>9s} {'rel err':>9s} "
                  f"{'routed':>9s} {'cosine':>9s} {'flushed':>8s} {'side':>9s}"]
        for layer, s in served:
            a13, a2 = (f"{v:9.3g}" for v in s.input_scales) if s.input_scales else ("", "")
            lines.append(f"{layer:10s} {s.mode:13s} {s.policy or '':11s} {a13:>9s} {a2:>9s} {s.rel_err:9.2e} "
                         f"{s.routed_rel_err:9.2e} {s.cosine:9.6f} {s.flushed_blocks:8d} {s.side:>9s}")
        lines.append("rel err: layer output (routed + shared experts); routed: routed experts alone; flushed: NVFP4 "
                     "block scales Marlin sets to zero; input_scale: written (the checkpoint's), 1.0, calibrated "
                     "(amax of --activations / 2688); mxfp4-w4a8: MXFP8 activations (SGLang on Blackwell).")
    return "\n".join(lines)
