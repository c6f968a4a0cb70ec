"""requant validate, a forward comparison (verify is the static lint): the same hidden states
through one MoE layer of two checkpoints.

On a GPU both layers' routed experts go through requant's fused-MoE kernel, each in its stored
format (no full-precision copy of the experts is made); the router and the shared expert run in
torch. Per layer this reports the converted layer's error against the source layer, the routing
agreement, and the kernel's own error against the plain torch reference on the source layer;
then, for each serving mode (engines/serve.py), the error of the converted layer computed as that engine
computes it (W4A4 activations under each input_scale policy, Marlin's scale rule) against the same
source output; and the source itself as W4A8 engines compute MXFP4 experts (MXFP8 activations,
`mxfp4-w4a8`, side "source"), against its own exact path. Those MXFP8 runs are torch (moe.py) on
either device: requant's kernel has no MXFP8 activations. The verdict rests on the weight-only comparison and on every mode staying finite.
One layer's experts are in memory at a time, so a full-size checkpoint fits one GPU.

On a CPU the kernel would run only through Triton's interpreter (hours for a full-size layer), so
the routed experts go through that plain torch reference instead (moe.py, FP32, the same
definition the kernel is judged by): each expert a token chose is read and decoded when first
needed (a stacked layer, whose tensors hold every expert, is read once). Router, activation and
biases are the recipe's (moe.py), in the kernel as in the reference. The kernel is then not measured (kernel_rel_err is None); tests run it at small shapes.

The package: side.py reads one checkpoint's experts, router and inputs; layer.py compares one
layer; serving.py recomputes it per serving mode; results.py holds the result types and the table.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Callable

import torch
from tqdm import tqdm

from requant.compute import default_workers, kernel_device, torch_threads
from requant.errors import RequantError, UnsupportedError
from requant.experts import model_difference
from requant.io.checkpoint import Checkpoint
from requant.moe import MoEConfig
from requant.validate.layer import Comparison, validate_block
from requant.validate.results import (KERNEL_VS_REFERENCE, LOSSLESS, LOSSY, LayerResult, ServingResult,
                                      ValidationResult, format_table)
from requant.validate.serving import kernel_module
from requant.validate.side import (ROLES, LayerExperts, Side, fused_roles, hidden_states, is_block_name,
                                   kernel_format, layer_scales, load_activations, load_layer, reference_experts,
                                   reference_layer, router)

log = logging.getLogger(__name__)

__all__ = ["KERNEL_VS_REFERENCE", "LOSSLESS", "LOSSY", "ROLES", "LayerExperts", "LayerResult", "ServingResult",
           "Side", "ValidationResult", "cpu_notice", "format_table", "fused_roles", "hidden_states",
           "is_block_name", "kernel_format", "layer_scales", "load_activations", "load_layer",
           "reference_experts", "reference_layer", "router", "validate"]


def validate(src: str, dst: str, layers: str | None = None, tokens: int = 64, device: str | None = None,
             activations: str | None = None, seed: int = 0, progress: bool = True, kernel: bool | None = None,
             notice: Callable[[str], None] | None = None, serve_modes: list[str] | None = None) -> ValidationResult:
    """Compare the MoE layers of `dst` against `src` (see module doc). `kernel`: None runs requant's
    kernel on a GPU and the torch reference on a CPU; True forces the kernel (Triton's interpreter
    on a CPU: small shapes only). `notice` gets one line when the CPU reference runs.
    serve_modes: serve.MODES to report; None picks them from each layer's format and the GPU."""
    device = kernel_device(device)
    kernel_forced = kernel is True
    kernel = device == "cuda" if kernel is None else kernel
    fm = kernel_module(device) if kernel else None
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    acts = load_activations(activations) if activations else None
    with Checkpoint.open(src) as ck_a, Checkpoint.open(dst) as ck_b:
        a, b = Side(ck_a, src), Side(ck_b, dst)
        differs = model_difference(a.index, b.index)
        if differs:
            raise RequantError(f"{src} and {dst} are not the same model: {differs}")
        cfg = MoEConfig.from_model(a.model)
        if fm is not None and not fm.fits(cfg.hidden_size, cfg.intermediate_size):
            why = (f"requant's kernel takes K in multiples of {fm.K_STEP} (whole int32 words), not hidden "
                   f"{cfg.hidden_size} / intermediate {cfg.intermediate_size}")
            if kernel_forced:
                raise UnsupportedError(why)
            fm, device = None, "cpu"
            if notice is not None:
                notice(f"validate: {why}")
        both = set(b.moe_blocks())
        blocks = a.model.select_blocks(layers, [blk for blk in a.moe_blocks() if blk in both])
        configs = {blk: MoEConfig.from_model(a.model, blk) for blk in blocks}   # each kind of block its own
        differing = next((blk for blk in blocks if MoEConfig.from_model(b.model, blk) != configs[blk]), None)
        if differing is not None:
            raise RequantError(f"the two checkpoints' config.json disagree on the MoE shape of {differing}")
        if fm is None and notice is not None:
            notice(cpu_notice(list(configs.values()), tokens if acts is None else None))
        run = Comparison(fm, a, b, cfg, tokens, device, torch.Generator().manual_seed(seed), acts, serve_modes,
                         capability)
        results = []
        # the CPU reference spreads experts over threads: torch's own on top oversubscribe the cores
        with torch_threads(1) if fm is None else contextlib.nullcontext():
            for block in tqdm(blocks, desc="validate", unit="layer", disable=not progress):
                started = time.monotonic()
                results.append(validate_block(run, block))
                r = results[-1]
                log.info("%s: %s -> %s, rel err %.3g, cosine %.6f, %s, %d serving modes, %.2f s on %s", block,
                         r.src_format, r.dst_format, r.rel_err, r.cosine, "passed" if r.passed else "FAILED",
                         len(r.serving), time.monotonic() - started, device)
    return ValidationResult(src, dst, device, results)


# Seconds per decoded expert weight (both checkpoints counted) of the CPU reference on one core,
# every mode included; decoding dominates. From one full-size layer on a 2-vCPU machine: 32-52 s
# (benchmarks/results/2026-12-03-2vcpu-throughput.json), so this errs long on a quiet machine.
_CPU_SECONDS_PER_WEIGHT = 5e-9


def cpu_notice(cfgs: list[MoEConfig], tokens: int | None) -> str:
    """One line: the CPU reference is running over blocks that run `cfgs` (each its own expert
    count and top-k), about how long it takes, how to make it shorter."""
    weights = 0
    for cfg in cfgs:
        pairs = (tokens or 64) * cfg.router.top_k
        used = cfg.n_routed_experts * (1 - (1 - 1 / cfg.n_routed_experts) ** pairs)   # expected distinct experts
        weights += 2 * used * 3 * cfg.hidden_size * cfg.intermediate_size
    seconds = weights * _CPU_SECONDS_PER_WEIGHT * 2 / max(1, min(default_workers(), 16))
    estimate = f"about {math.ceil(seconds)} s" if seconds >= 1 else "about 1 s or less"   # never "about 0 s"
    return (f"validate: no GPU in use; running the torch reference on the CPU, {estimate} for {len(cfgs)} "
            f"layer(s) x {tokens if tokens else 'the given'} tokens (--layers and --tokens choose fewer)")
