"""requant validate: run the same hidden states through one MoE layer of two checkpoints.

On a GPU both layers' routed experts go through requant's fused-MoE kernel, each in its stored
format (no full-precision copy of the experts is made); the router and the shared expert run in
torch. Per layer this reports the converted layer's error against the source layer, the routing
agreement, and the kernel's own error against the plain torch reference on the source layer.
One layer's experts are in memory at a time, so a full-size checkpoint fits one GPU.

On a CPU the kernel would run only through Triton's interpreter (hours for a full-size layer), so
the routed experts go through that plain torch reference instead (moe.py, FP32, the same
definition the kernel is judged by): each expert a token chose is read and decoded when first
needed. The kernel is then not measured (kernel_rel_err is None); tests run it at small shapes.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from tqdm import tqdm

from requant import formats
from requant.compute import compute_device, default_workers
from requant.errors import FormatError, RequantError, UnsupportedError
from requant.formats import fp8_block, int4, mxfp4, nvfp4
from requant.io.checkpoint import Checkpoint
from requant.moe import MoEConfig, MoELayer, route, routed_experts, swiglu_expert
from requant.report.build import parse_layers

# Converted against source: (max relative error, min cosine).
# A lossless NVFP4 cast (or an unchanged layer) decodes to the same weights, and the kernel then
# computes the same products scaled by powers of two, so only blocks re-quantized outside the
# E4M3 window (values below 2^-17 of the largest) and BF16 rounding can differ: 1e-3 is generous
# yet far below any real fault (a wrong w3 scale or nibble order gives errors of order 1).
LOSSLESS = (1e-3, 0.99999)
# W4A16 is a real re-quantization: MXFP4 -> INT4 weights have 20-25 dB SNR (formats.md section 3),
# i.e. 6-10% relative error, and a layer's output error is of the same order. 15% (16.5 dB) passes
# every group size and quantizer requant offers and still fails a broken conversion.
LOSSY = (0.15, 0.985)
# The kernel against the FP32 torch reference: with BF16 compute the intermediate activation and
# the output are rounded to BF16 (2^-9 relative each), measured ~2e-3 on an H200; FP32 compute
# (the CPU interpreter) is ~1e-3 from the output rounding alone.
KERNEL_VS_REFERENCE = 1e-2

_BLOCK = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.gate\.weight$")
_BLOCK_NAME = re.compile(r"^(?:layers|mtp)\.\d+$")


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


@dataclass
class ValidationResult:
    src: str
    dst: str
    device: str
    layers: list[LayerResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.layers)

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "device": self.device, "passed": self.passed,
                "thresholds": {"lossless": LOSSLESS, "lossy": LOSSY, "kernel_vs_reference": KERNEL_VS_REFERENCE},
                "layers": [asdict(r) for r in self.layers]}


def moe_blocks(ck: Checkpoint) -> list[str]:
    """Blocks with routed experts (`layers.L`, `mtp.N`), in layer order."""
    names = set(ck.names)
    blocks = [m[1] for n in names if (m := _BLOCK.match(n))
              and any(f"{m[1]}.ffn.experts.0.w1.{p}" in names for p in ("weight", "weight_packed"))]
    return sorted(blocks, key=lambda b: (b.startswith("mtp"), int(b.split(".")[1])))


def expert_format(ck: Checkpoint, block: str) -> str:
    """Format of a block's routed experts, as the kernel names it, from expert 0's w1 tensors."""
    prefix = f"{block}.ffn.experts.0.w1."
    parts = {n[len(prefix):]: ck.info(n).spec.dtype for n in ck.names if n.startswith(prefix)}
    fmt = formats.identify(parts)
    if fmt is None:
        raise UnsupportedError(f"{block}: routed experts in no format requant's kernel reads")
    return {"w4a16": "int4"}.get(fmt, fmt)   # the kernel calls compressed-tensors' INT4 "int4"


def load_experts(ck: Checkpoint, block: str, proj: str, fmt: str, experts: int | list[int], device):
    """One projection of every expert of a block (or of the listed experts), stacked as stored, on
    `device`."""
    from requant.kernels.fused_moe import ExpertWeights

    chosen = range(experts) if isinstance(experts, int) else experts
    experts = len(chosen)

    def stack(part, view=None):
        ts = [ck.tensor(f"{block}.ffn.experts.{e}.{proj}.{part}") for e in chosen]
        return torch.stack([t.view(view) if view else t for t in ts]).to(device)

    if fmt == "mxfp4":
        scale = stack("scale", torch.uint8)
        if bool((scale == mxfp4.E8M0_NAN).any()):
            raise FormatError(f"{block}.{proj}: an E8M0 scale is NaN (byte 0xFF)")
        return ExpertWeights("mxfp4", stack("weight", torch.uint8), scale)
    if fmt == "nvfp4":
        return ExpertWeights("nvfp4", stack("weight", torch.uint8), stack("weight_scale", torch.uint8),
                             stack("weight_scale_2").reshape(experts).float())
    zero = f"{block}.ffn.experts.{chosen[0]}.{proj}.weight_zero_point"
    return ExpertWeights("int4", stack("weight_packed"), stack("weight_scale"),
                         zero_point=stack("weight_zero_point") if zero in set(ck.names) else None)


def dense_expert(w, e: int) -> torch.Tensor:
    """Float32 [N, K] of expert e by requant's plain torch decoders (independent of the kernel)."""
    if w.format == "mxfp4":
        return mxfp4.decode(w.packed[e], w.scale[e])
    if w.format == "nvfp4":
        return nvfp4.decode(w.packed[e], w.scale[e], w.global_scale[e])
    return int4.decode(w.packed[e], w.scale[e], None if w.zero_point is None else w.zero_point[e])


def _shared(ck: Checkpoint, block: str, device):
    base = f"{block}.ffn.shared_experts"
    if f"{base}.w1.weight" not in set(ck.names):
        return None
    names = set(ck.names)

    def scale(p):  # W4A16 output keeps these FP8 blocks but names their scales compressed-tensors' way
        return ck.tensor(f"{base}.{p}.scale" if f"{base}.{p}.scale" in names else f"{base}.{p}.weight_scale")

    return tuple(fp8_block.decode(ck.tensor(f"{base}.{p}.weight"), scale(p)).to(device) for p in ("w1", "w3", "w2"))


def _router(ck: Checkpoint, block: str, device) -> MoELayer:
    names = set(ck.names)
    get = lambda n: ck.tensor(f"{block}.ffn.gate.{n}").to(device) if f"{block}.ffn.gate.{n}" in names else None  # noqa: E731
    return MoELayer(get("weight"), get("bias"), get("tid2eid"), experts=None, shared=_shared(ck, block, device))


def hidden_states(ck: Checkpoint, block: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """RMS-normalised Gaussian vectors times the block's ffn_norm weight: what the MoE sees, in BF16."""
    hidden = int(ck.config["hidden_size"])
    x = torch.randn(tokens, hidden, generator=gen)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    norm = f"{block}.ffn_norm.weight"
    if norm in set(ck.names):
        x = x * ck.tensor(norm).float()
    return x.bfloat16()


def load_activations(path: str) -> dict[str, torch.Tensor]:
    """A safetensors or torch file: one [T, H] tensor for every layer, or tensors named by block
    (`layers.3`, `mtp.0`); an optional `token_ids` [T] feeds hash-routed layers."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        data = load_file(path)
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
        data = data if isinstance(data, dict) else {"hidden_states": data}
    if not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise RequantError("activations file holds no tensors", file=path)
    return data


def _metrics(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(relative error of b against a, cosine, max abs error), over the whole [T, H] output."""
    a, b = a.double().flatten(), b.double().flatten()
    rel = float((b - a).norm() / a.norm().clamp(min=1e-30))
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=1e-30))
    return rel, cos, float((b - a).abs().max())


def _kernel_module(device: str):
    if device == "cpu":
        # The kernel runs on the CPU only through Triton's interpreter, chosen when it is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from requant.kernels import fused_moe
    if device == "cpu" and not fused_moe.interpreting():
        raise UnsupportedError("--device cpu needs TRITON_INTERPRET=1 set before the kernel is imported")
    return fused_moe


def validate(src: str, dst: str, layers: str | None = None, tokens: int = 64, device: str | None = None,
             activations: str | None = None, seed: int = 0, progress: bool = True, kernel: bool | None = None,
             notice: Callable[[str], None] | None = None) -> ValidationResult:
    """Compare the MoE layers of `dst` against `src` (see module doc). `kernel`: None runs requant's
    kernel on a GPU and the torch reference on a CPU; True forces the kernel (Triton's interpreter
    on a CPU: small shapes only). `notice` gets one line when the CPU reference runs."""
    device = compute_device(device)
    kernel = device == "cuda" if kernel is None else kernel
    fm = _kernel_module(device) if kernel else None
    acts = load_activations(activations) if activations else None
    with Checkpoint.open(src) as a, Checkpoint.open(dst) as b:
        cfg = MoEConfig.from_config(a.config)
        if MoEConfig.from_config(b.config) != cfg:
            raise RequantError("the two checkpoints' config.json disagree on the MoE shape")
        both = set(moe_blocks(b))
        blocks = parse_layers(layers, [blk for blk in moe_blocks(a) if blk in both])
        if fm is None and notice is not None:
            notice(cpu_notice(cfg, len(blocks), tokens if acts is None else None))
        gen = torch.Generator().manual_seed(seed)
        results = []
        for block in tqdm(blocks, desc="validate", unit="layer", disable=not progress):
            results.append(_validate_block(fm, a, b, block, cfg, tokens, device, gen, acts))
    return ValidationResult(src, dst, device, results)


# Seconds per decoded expert weight (both checkpoints counted) of the CPU reference on one core;
# decoding dominates. From one full-size layer on a 2-vCPU machine: 217 s while other jobs held
# it at load 4.5-6.5 (scripts/bench_throughput_results.md), so this errs long on a quiet machine.
_CPU_SECONDS_PER_WEIGHT = 1e-8


def cpu_notice(cfg: MoEConfig, layers: int, tokens: int | None) -> str:
    """One line: the CPU reference is running, about how long it takes, how to make it shorter."""
    pairs = (tokens or 64) * cfg.top_k
    used = cfg.n_routed_experts * (1 - (1 - 1 / cfg.n_routed_experts) ** pairs)   # expected distinct experts
    weights = 2 * layers * used * 3 * cfg.hidden_size * cfg.intermediate_size
    seconds = weights * _CPU_SECONDS_PER_WEIGHT * 2 / max(1, min(default_workers(), 16))
    return (f"validate: no GPU in use; running the torch reference on the CPU, about {seconds:.0f} s for {layers} "
            f"layer(s) x {tokens if tokens else 'the given'} tokens (--layers and --tokens choose fewer)")


def _reference_experts(ck: Checkpoint, block: str, fmt: str):
    """e -> float32 (w1, w3, w2) of expert e, read and decoded when first asked for."""
    return lambda e: tuple(dense_expert(load_experts(ck, block, p, fmt, [e], "cpu"), 0) for p in ("w1", "w3", "w2"))


def _validate_block(fm, a, b, block, cfg, tokens, device, gen, acts) -> LayerResult:
    if acts is not None:
        shared_x = [v for k, v in acts.items() if k != "token_ids" and not _BLOCK_NAME.match(k)]
        x = acts.get(block, shared_x[0] if shared_x else None)
        if x is None:
            raise RequantError(f"the activations file has no tensor for {block}")
        x = x.reshape(-1, cfg.hidden_size).bfloat16()
        token_ids = acts.get("token_ids")
    else:
        x, token_ids = hidden_states(a, block, tokens, gen), None
    x = x.to(device)
    ra, rb = _router(a, block, device), _router(b, block, device)
    if ra.tid2eid is not None and token_ids is None:
        token_ids = torch.randint(0, ra.tid2eid.shape[0], (x.shape[0],), generator=gen)
    token_ids = None if token_ids is None else token_ids.to(device)

    outputs, routed, fmts, kernel_rel = [], [], [], None
    for ck, router in ((a, ra), (b, rb)):
        fmt = expert_format(ck, block)
        ids, weights = route(x, router, cfg, token_ids)
        if fm is None:
            y = routed_experts(x, ids, weights, _reference_experts(ck, block, fmt), cfg.swiglu_limit)
        else:
            ws = [load_experts(ck, block, p, fmt, cfg.n_routed_experts, device) for p in ("w1", "w3", "w2")]
            y = fm.fused_moe(x, ids, weights, *ws, swiglu_limit=cfg.swiglu_limit).float()
            if ck is a:
                ref = routed_experts(x, ids, weights, lambda e: tuple(dense_expert(w, e) for w in ws),
                                     cfg.swiglu_limit)
                kernel_rel = _metrics(ref, y)[0]
            del ws
        shared = swiglu_expert(x.float(), *router.shared, cfg.swiglu_limit) if router.shared else 0.0
        outputs.append((y + shared).bfloat16())
        routed.append(y)
        fmts.append((fmt, ids))
    (fa, ids_a), (fb, ids_b) = fmts
    agreement = float((ids_a.sort(-1).values == ids_b.sort(-1).values).all(-1).float().mean())
    rel, cos, max_abs = _metrics(*outputs)
    routed_rel = _metrics(*routed)[0]
    lossless = {fa, fb} <= {"mxfp4", "nvfp4"} or fa == fb
    max_rel, min_cos = LOSSLESS if lossless else LOSSY
    kernel_ok = kernel_rel is None or (math.isfinite(kernel_rel) and kernel_rel <= KERNEL_VS_REFERENCE)
    passed = (rel <= max_rel and cos >= min_cos and agreement == 1.0 and kernel_ok
              and all(math.isfinite(v) for v in (rel, cos, max_abs)))
    return LayerResult(block, fa, fb, x.shape[0], ra.tid2eid is not None, rel, cos, max_abs, routed_rel, agreement,
                       kernel_rel, max_rel, min_cos, passed)


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
    return "\n".join(lines)
