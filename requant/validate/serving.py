"""The converted layer recomputed as serving engines compute it: requant's kernel where it runs,
else the torch reference, with W4A4 activations under each input_scale policy, Marlin's scale rule,
or MXFP8 activations. validate's client of requant.engines: the modes and their numbers are
engines/serve.py's and engines/numerics.py's; this module only runs a layer through them."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from requant.engines import numerics, serve
from requant.compute import default_workers
from requant.errors import UnsupportedError
from requant.extras import require
from requant.moe import routed_experts_variants
from requant.validate.side import ROLES, LayerExperts, Side, fused_roles, layer_scales, reference_layer, \
    written_input_scales


def kernel_module(device: str):
    if device == "cpu":
        # The kernel runs on the CPU only through Triton's interpreter, chosen when it is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    require("triton")
    from requant.kernels import fused_moe
    if device == "cpu" and not fused_moe.interpreting():
        raise UnsupportedError("--device cpu needs TRITON_INTERPRET=1 set before the kernel is imported")
    return fused_moe


def kernel_layout(fm, layer: LayerExperts) -> LayerExperts:
    """The layer with its weights in the kernel's layout (`kernel_weights`), made once for the
    layer's several kernel runs instead of on each."""
    return layer.with_weights({r: fm.kernel_weights(w) for r, w in zip(ROLES, layer.weights)})


def run_kernel(fm, x, ids, weights, layer: LayerExperts, cfg, **kwargs) -> torch.Tensor:
    """The routed experts through requant's kernel, with the recipe's activation and the biases, in
    the kernel's default compute dtype (the same for every format, so that a lossless conversion
    compares equal)."""
    return fm.fused_moe(x, ids, weights, *layer.weights, activation=cfg.activation, **layer.kernel_biases(), **kwargs)


def w4a4_inputs(x: torch.Tensor, scales: tuple[float, float]):
    """(x, intermediate hook) of the torch reference for W4A4 under (w1/w3, w2) input scales."""
    a13, a2 = scales
    quantize = numerics.fake_quantize_activations
    return quantize(x, a13), lambda h: quantize(h.bfloat16(), a2).float()


def w4a8_inputs(x: torch.Tensor):
    """(x, intermediate hook) of the torch reference for W4A8: both GEMM inputs quantized to MXFP8
    (the w2 input after BF16 rounding, as FlashInfer's activation kernel does)."""
    quantize = numerics.fake_quantize_mxfp8
    return quantize(x), lambda h: quantize(h.bfloat16())


def w4a4_policies(side: Side, block: str, calibrated) -> dict[str, tuple[float, float]]:
    """policy -> (w1/w3, w2) input scales, for the policies that apply to this layer."""
    policies = {"written": written_input_scales(side, block), "1.0": (1.0, 1.0)}
    if calibrated is not None:
        policies["calibrated"] = tuple(serve.calibrated_input_scale(m) for m in calibrated)
    return {policy: scales for policy, scales in policies.items() if scales is not None}


@dataclass
class Runner:
    """The converted layer's routed experts, recomputed for a serving mode: through the kernel where
    it ran, else through the torch reference (a CPU), with the same numerics."""

    fm: object                   # the kernel module; None: the torch reference
    side: Side
    block: str
    fmt: str
    cfg: object                  # moe.MoEConfig
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    y_bf16: torch.Tensor         # the layer's routed output with BF16 activations
    ws: LayerExperts | None      # the layer as stored (None without the kernel)
    kernel_layer: LayerExperts | None   # ws in the kernel's layout (None without the kernel)
    w4a4_outputs: dict           # CPU: input scales -> output, computed with y_bf16, each expert decoded once
    w4a8_output: torch.Tensor | None = None   # MXFP8 activations (torch, either device), when asked for

    def w4a4(self, scales: tuple[float, float]) -> torch.Tensor:
        if self.fm is None:
            return self.w4a4_outputs[scales]
        return run_kernel(self.fm, self.x, self.ids, self.weights, self.kernel_layer, self.cfg,
                          activation_scales=scales).float()

    def marlin(self) -> tuple[torch.Tensor, int]:
        if self.fm is not None:
            served, flushed = serve.marlin_weights(dict(zip(ROLES, self.kernel_layer.weights)), self.ws.fused)
            if not flushed:
                return self.y_bf16, 0
            return (run_kernel(self.fm, self.x, self.ids, self.weights, self.kernel_layer.with_weights(served),
                               self.cfg).float(), flushed)
        if not serve.rescaled_by_marlin(self.fmt):
            return self.y_bf16, 0
        # Marlin's factor spans the layer: every expert's scales are read (not their weights), then
        # the experts the tokens chose are decoded with the blocks it flushes zeroed.
        scales = layer_scales(self.side, self.block, self.fmt)
        histograms = {r: numerics.scale_histogram(s) for r, s in scales.items()}
        factors = serve.marlin_factors(histograms, fused_roles(self.side))
        flushed = sum(numerics.marlin_flushed_blocks(histograms[r], factors[r]) for r in ROLES)
        if not flushed:
            return self.y_bf16, 0
        stored = reference_layer(self.side, self.block, self.fmt)

        def served(e):
            layer = stored(e)
            return layer.with_weights({r: serve.marlin_served(w, factors[r])[0]
                                       for r, w in zip(ROLES, layer.weights)}).dense(0)

        return routed_experts_variants([(self.x, None)], self.ids, self.weights, served, self.cfg.activation,
                                       workers=default_workers())[0], flushed

    def served(self, modes, calibrated):
        """(mode, policy, input scales, flushed blocks, routed output) for each serving mode of the
        converted layer; `calibrated` is the (x, intermediate) absolute maxima of real inputs, or None."""
        for mode in modes:
            if mode == "bf16":
                yield mode, None, None, 0, self.y_bf16
            elif mode == "marlin-w4a16":
                y, flushed = self.marlin()
                yield mode, None, None, flushed, y
            elif mode == serve.W4A8:
                yield mode, None, None, 0, self.w4a8_output
            else:
                for policy, scales in w4a4_policies(self.side, self.block, calibrated).items():
                    yield mode, policy, scales, 0, self.w4a4(scales)
