"""requant validate, a forward comparison (verify is the static lint): the same hidden states
through one MoE layer of two checkpoints.

On a GPU both layers' routed experts go through requant's fused-MoE kernel, each in its stored
format (no full-precision copy of the experts is made); the router and the shared expert run in
torch. Per layer this reports the converted layer's error against the source layer, the routing
agreement, and the kernel's own error against the plain torch reference on the source layer;
then, for each serving mode (serve.py), the error of the converted layer computed as that engine
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
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from requant import formats, serve, sources
from requant.compute import default_workers, kernel_device, torch_threads
from requant.errors import FormatError, RequantError, UnsupportedError
from requant.extras import require
from requant.formats import engine_numerics, fp8_block
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.moe import MoEConfig, MoELayer, expert_forward, route, routed_experts, routed_experts_variants

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

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "device": self.device, "passed": self.passed,
                "thresholds": {"lossless": LOSSLESS, "lossy": LOSSY, "kernel_vs_reference": KERNEL_VS_REFERENCE},
                "layers": [asdict(r) for r in self.layers]}


class _Side:
    """One of the two checkpoints, with its model and its routed experts by (block, expert)."""

    def __init__(self, ck: Checkpoint, where: str):
        self.ck = ck
        self.model = ModelSpec.for_config(ck.config, os.path.join(where, "config.json"))
        self.reader = sources.reader(self.model)
        # (block, expert), or (block, None) for a layer's stacked [E, ...] tensors
        self.experts = {(e.block, e.expert): e for e in self.reader.experts(ck.names)}

    def moe_blocks(self) -> list[str]:
        """Blocks with a router and routed experts, in layer order (the MTP blocks last)."""
        names = set(self.ck.names)
        blocks = {b for b, _ in self.experts if self.model.router_tensor(b, "weight") in names}
        return sorted(blocks, key=self.model.block_position)

    def tensor(self, block: str, expert: int, proj: str, part: str) -> torch.Tensor:
        return self.ck.tensor(self.reader.tensor_name(block, expert, proj, part))


def kernel_format(side: _Side, block: str) -> str:
    """Format of a block's routed experts, as the kernel names it, from expert 0's first projection."""
    expert = side.experts.get((block, 0)) or side.experts.get((block, None))
    parts = expert.parts.get(side.model.projections[0], {}) if expert else {}
    codec = formats.identify({part: side.ck.info(name).spec.dtype for part, name in parts.items()})
    if codec is None:
        raise UnsupportedError(f"{block}: routed experts in no format requant's kernel reads")
    return codec.name


def load_experts(side: _Side, block: str, proj: str, fmt: str, experts: int | list[int], device):
    """One projection of every expert of a block (or of the listed experts), stacked as stored, on
    `device`, as the codec's parts say."""
    codec = formats.get(fmt)
    chosen = range(experts) if isinstance(experts, int) else experts
    present = side.experts[(block, chosen[0])].parts[proj]

    def read(role):
        part = codec.part(role)
        if part is None or part.suffix not in present:
            return None
        return torch.stack([side.tensor(block, e, proj, part.suffix) for e in chosen])

    return _expert_weights(codec, read, len(chosen), f"{block}.{proj}", device)


_BYTE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _expert_weights(codec, read, experts: int, where: str, device):
    """ExpertWeights from `read(role)`: that part of every expert stacked on dim 0 as stored (None:
    absent); byte-coded parts viewed as bytes, their scales checked."""
    from requant.kernels.weights import ExpertWeights

    def part(role):
        t = read(role)
        return t.view(torch.uint8) if t is not None and t.dtype in _BYTE_DTYPES else t

    scale = part(formats.SCALE)
    if scale.dtype == torch.uint8:   # byte-coded scales (E8M0, E4M3) can hold bytes no valid file has
        try:
            codec.check_scales(scale.numpy())
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
    global_scale, zero_point = part(formats.GLOBAL_SCALE), part(formats.ZERO_POINT)
    return ExpertWeights(codec.name, part(formats.WEIGHT).view(codec.packed_dtype).to(device), scale.to(device),
                         None if global_scale is None else global_scale.reshape(experts).float().contiguous().to(device),
                         None if zero_point is None else zero_point.to(device))


def dense_expert(w, e: int) -> torch.Tensor:
    """Float32 [N, K] of expert e by requant's plain torch decoders (independent of the kernel)."""
    codec = formats.get(w.format)
    stored = {formats.WEIGHT: w.packed, formats.SCALE: w.scale, formats.GLOBAL_SCALE: w.global_scale,
              formats.ZERO_POINT: w.zero_point}
    return codec.decode({codec.part(role).suffix: t[e] for role, t in stored.items() if t is not None})


ROLES = ("gate", "up", "down")


@dataclass
class LayerExperts:
    """A layer's routed experts as the kernel and the reference take them: gate, up and down
    projections stacked over experts, per-expert biases where the model has them."""

    gate: object                 # kernels.weights.ExpertWeights
    up: object
    down: object
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # [E, I], [E, I], [E, H]
    fused: list[list[str]]       # groups of ROLES engines load as one tensor (one Marlin factor each)

    @property
    def weights(self) -> list:
        return [self.gate, self.up, self.down]

    def with_weights(self, weights: dict) -> "LayerExperts":
        return LayerExperts(*(weights[r] for r in ROLES), self.biases, self.fused)

    def expert(self, e: int) -> "LayerExperts":
        """Expert e alone, as views."""
        from requant.kernels.weights import ExpertWeights

        def one(t):
            return None if t is None else t[e:e + 1]

        return LayerExperts(*(ExpertWeights(w.format, *(one(t) for t in (w.packed, w.scale, w.global_scale, w.zero_point)))
                              for w in self.weights),
                            None if self.biases is None else tuple(one(b) for b in self.biases), self.fused)

    def dense(self, e: int) -> tuple[torch.Tensor, ...]:
        """Float32 (gate, up, down[, their biases]) of expert e, decoded by the plain torch decoders."""
        found = tuple(dense_expert(w, e) for w in self.weights)
        return found + tuple(b[e].float() for b in self.biases) if self.biases else found

    def kernel_biases(self) -> dict:
        return dict(zip(("b1", "b3", "b2"), self.biases)) if self.biases else {}


def fused_roles(side: _Side, block: str) -> list[list[str]]:
    """Groups of ROLES engines load as one tensor."""
    if (block, None) in side.experts:   # stacked: gate and up are one interleaved tensor
        return [["gate", "up"]]
    role = dict(zip(side.model.projections, ROLES))
    return [[role[p] for p in group] for group in side.model.fused_projections]


def layer_scales(side: _Side, block: str, fmt: str) -> dict[str, torch.Tensor]:
    """role -> the block scales of every expert of a block [E, N, K/g] as stored (bytes where
    byte-coded), without reading the weights: all a layer-wide scale rule (Marlin's) needs."""
    suffix = formats.get(fmt).part(formats.SCALE).suffix
    model = side.model
    if (block, None) in side.experts:
        unit = side.experts[(block, None)]
        gate_up, down = (side.reader.as_matrices(side.ck.tensor(unit.parts[p][suffix]), fmt)
                         for p in (model.interleaved_gate_up, model.down_projection))
        found = {"gate": gate_up[:, 0::2], "up": gate_up[:, 1::2], "down": down}
    else:
        experts = int(model.value("num_experts"))
        found = {r: torch.stack([side.tensor(block, e, p, suffix) for e in range(experts)])
                 for r, p in zip(ROLES, model.projections)}
    return {r: t.view(torch.uint8) if t.dtype in _BYTE_DTYPES else t for r, t in found.items()}


def load_layer(side: _Side, block: str, fmt: str, experts: int | list[int], device) -> LayerExperts:
    """Every (or the listed) routed expert of a block, as stored, on `device`."""
    model = side.model
    if (block, None) not in side.experts:   # one tensor per expert and projection
        ws = [load_experts(side, block, p, fmt, experts, device) for p in model.projections]
        return LayerExperts(*ws, None, fused_roles(side, block))
    if model.interleaved_gate_up is None:
        raise UnsupportedError(f"{model.name}: stacked experts without an interleaved gate/up projection")
    chosen = torch.arange(experts) if isinstance(experts, int) else torch.tensor(experts)
    unit = side.experts[(block, None)]
    (gate_up, b13), (down, b2) = (_stacked(side, block, unit.parts[p], fmt, chosen, device)
                                  for p in (model.interleaved_gate_up, model.down_projection))
    gate, up = (type(gate_up)(gate_up.format, gate_up.packed[:, i::2], gate_up.scale[:, i::2], gate_up.global_scale)
                for i in (0, 1))   # row views, no copy
    biases = None if b13 is None else (b13[:, 0::2], b13[:, 1::2], b2)
    return LayerExperts(gate, up, down, biases, fused_roles(side, block))


def _stacked(side: _Side, block: str, parts: dict[str, str], fmt: str, chosen: torch.Tensor, device):
    """(ExpertWeights, bias or None) of one stacked projection: [E, rows, ...] tensors, stored
    (E, in, out) where the recipe says the format is, a per-tensor scalar for all experts."""
    codec = formats.get(fmt)

    def read(role):
        part = codec.part(role)
        if part is None or part.suffix not in parts:
            return None
        t = side.reader.as_matrices(side.ck.tensor(parts[part.suffix]), fmt)
        if t.dim() < 2:   # one scalar for the stacked tensor
            return t.reshape(-1)[:1].expand(len(chosen))
        return t.index_select(0, chosen).contiguous()

    weights = _expert_weights(codec, read, len(chosen), parts.get(codec.part(formats.SCALE).suffix, block), device)
    bias = side.ck.tensor(parts["bias"]).index_select(0, chosen).float().to(device) if "bias" in parts else None
    return weights, bias


def _shared(side: _Side, block: str, device):
    names = set(side.ck.names)
    bases = [side.model.shared_expert(block, p) for p in side.model.projections]
    if bases[0] is None or f"{bases[0]}.weight" not in names:
        return None

    def scale(base):  # W4A16 output keeps these FP8 blocks but names their scales compressed-tensors' way
        return side.ck.tensor(f"{base}.scale" if f"{base}.scale" in names else f"{base}.weight_scale")

    return tuple(fp8_block.decode(side.ck.tensor(f"{base}.weight"), scale(base)).to(device) for base in bases)


def _router(side: _Side, block: str, device) -> MoELayer:
    names = set(side.ck.names)
    found = {role: side.ck.tensor(n).to(device) for role in side.model.router_roles
             if (n := side.model.router_tensor(block, role)) in names}
    return MoELayer(found.get("weight"), found.get("bias"), found.get("token_table"), experts=None,
                    shared=_shared(side, block, device))


def hidden_states(ck: Checkpoint, block: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """RMS-normalised Gaussian vectors times the block's MoE input norm weight: what the MoE sees, in BF16."""
    model = ModelSpec.for_config(ck.config)
    x = torch.randn(tokens, int(model.value("hidden_size")), generator=gen)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    norm = model.moe_input_norm(block)
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
    require("triton")
    from requant.kernels import fused_moe
    if device == "cpu" and not fused_moe.interpreting():
        raise UnsupportedError("--device cpu needs TRITON_INTERPRET=1 set before the kernel is imported")
    return fused_moe


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
    fm = _kernel_module(device) if kernel else None
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    acts = load_activations(activations) if activations else None
    with Checkpoint.open(src) as ck_a, Checkpoint.open(dst) as ck_b:
        a, b = _Side(ck_a, src), _Side(ck_b, dst)
        cfg = MoEConfig.from_model(a.model)
        if MoEConfig.from_model(b.model) != cfg:
            raise RequantError("the two checkpoints' config.json disagree on the MoE shape")
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
        if fm is None and notice is not None:
            notice(cpu_notice(cfg, len(blocks), tokens if acts is None else None))
        gen = torch.Generator().manual_seed(seed)
        results = []
        # the CPU reference spreads experts over threads: torch's own on top oversubscribe the cores
        with torch_threads(1) if fm is None else contextlib.nullcontext():
            for block in tqdm(blocks, desc="validate", unit="layer", disable=not progress):
                results.append(_validate_block(fm, a, b, block, cfg, tokens, device, gen, acts, serve_modes, capability))
    return ValidationResult(src, dst, device, results)


# Seconds per decoded expert weight (both checkpoints counted) of the CPU reference on one core,
# every mode included; decoding dominates. From one full-size layer on a 2-vCPU machine: 32-52 s
# (scripts/bench_throughput_results.md), so this errs long on a quiet machine.
_CPU_SECONDS_PER_WEIGHT = 5e-9


def cpu_notice(cfg: MoEConfig, layers: int, tokens: int | None) -> str:
    """One line: the CPU reference is running, about how long it takes, how to make it shorter."""
    pairs = (tokens or 64) * cfg.router.top_k
    used = cfg.n_routed_experts * (1 - (1 - 1 / cfg.n_routed_experts) ** pairs)   # expected distinct experts
    weights = 2 * layers * used * 3 * cfg.hidden_size * cfg.intermediate_size
    seconds = weights * _CPU_SECONDS_PER_WEIGHT * 2 / max(1, min(default_workers(), 16))
    estimate = f"about {math.ceil(seconds)} s" if seconds >= 1 else "about 1 s or less"   # never "about 0 s"
    return (f"validate: no GPU in use; running the torch reference on the CPU, {estimate} for {layers} "
            f"layer(s) x {tokens if tokens else 'the given'} tokens (--layers and --tokens choose fewer)")


def _reference_layer(side: _Side, block: str, fmt: str) -> Callable[[int], LayerExperts]:
    """e -> a LayerExperts whose expert 0 is expert e as stored, read when asked for (a stacked
    layer is one read: its tensors hold every expert)."""
    if (block, None) in side.experts:
        layer = load_layer(side, block, fmt, side.model.value("num_experts"), "cpu")
        return layer.expert
    return lambda e: load_layer(side, block, fmt, [e], "cpu")


def _reference_experts(side: _Side, block: str, fmt: str):
    """e -> float32 (gate, up, down[, biases]) of expert e, read and decoded when first asked for."""
    stored = _reference_layer(side, block, fmt)
    return lambda e: stored(e).dense(0)


def _is_block_name(model: ModelSpec, name: str) -> bool:
    try:
        model.block_position(name)
    except FormatError:
        return False
    return True


def _validate_block(fm, a, b, block, cfg, tokens, device, gen, acts, serve_modes, capability) -> LayerResult:
    if acts is not None:
        shared_x = [v for k, v in acts.items() if k != "token_ids" and not _is_block_name(a.model, k)]
        x = acts.get(block, shared_x[0] if shared_x else None)
        if x is None:
            raise RequantError(f"the activations file has no tensor for {block}")
        x = x.reshape(-1, cfg.hidden_size).bfloat16()
        token_ids = acts.get("token_ids")
    else:
        x, token_ids = hidden_states(a.ck, block, tokens, gen), None
    x = x.to(device)
    ra, rb = _router(a, block, device), _router(b, block, device)
    if ra.tid2eid is not None and token_ids is None:
        token_ids = torch.randint(0, ra.tid2eid.shape[0], (x.shape[0],), generator=gen)
    token_ids = None if token_ids is None else token_ids.to(device)

    dst_fmt = kernel_format(b, block)
    modes = [m for m in (serve_modes or serve.default_modes(dst_fmt, capability)) if serve.applies(m, dst_fmt)]
    src_modes = serve.source_modes(serve_modes, kernel_format(a, block), capability)
    h_amax = []   # the source's intermediate (w2 input) range, for the calibrated input_scale

    def observe(h):
        h_amax.append(float(h.abs().max()) if h.numel() else 0.0)
        return h

    outputs, routed, fmts, serving, kernel_rel = [], [], [], [], None
    reference = None   # (source output, its routed part) by the torch reference: what W4A8 is judged against
    source_served = []
    for side, router in ((a, ra), (b, rb)):
        fmt = kernel_format(side, block)
        ids, weights = route(x, router, cfg, token_ids)
        calibrated = None if acts is None else (float(x.abs().max()), max(h_amax, default=0.0))
        w4a8 = bool(src_modes) if side is a else serve.W4A8 in modes
        w4a4, y_w4a8 = {}, None   # input scales -> W4A4 output; the MXFP8-activation output
        shared = expert_forward(x.float(), router.shared, cfg.activation) if router.shared else 0.0
        if fm is None:
            scales = []
            if side is b and "nvfp4-w4a4" in modes:
                scales = list(dict.fromkeys(_w4a4_policies(side, block, cfg, calibrated).values()))
            variants = ([(x, observe if side is a else None)] + [_w4a4_inputs(x, s) for s in scales]
                        + ([_w4a8_inputs(x)] if w4a8 else []))
            ys = routed_experts_variants(variants, ids, weights, _reference_experts(side, block, fmt),
                                         cfg.activation, workers=default_workers())
            y, ws, kernel_layer = ys[0], None, None
            w4a4 = dict(zip(scales, ys[1:1 + len(scales)]))
            y_w4a8 = ys[-1] if w4a8 else None
            if side is a:
                reference = ((y + shared).bfloat16(), y)
        else:
            ws = load_layer(side, block, fmt, cfg.n_routed_experts, device)
            kernel_layer = _kernel_layout(fm, ws)
            y = _kernel(fm, x, ids, weights, kernel_layer, cfg).float()
            if side is a or w4a8:
                variants = ([(x, observe)] if side is a else []) + ([_w4a8_inputs(x)] if w4a8 else [])
                ys = routed_experts_variants(variants, ids, weights, ws.dense, cfg.activation)
                y_w4a8 = ys[-1] if w4a8 else None
                if side is a:
                    kernel_rel = _metrics(ys[0], y)[0]
                    reference = ((ys[0] + shared).bfloat16(), ys[0])
        outputs.append((y + shared).bfloat16())
        routed.append(y)
        fmts.append((fmt, ids))

        def result(mode, policy, scales, flushed, y_mode, against, side_name="candidate"):
            out = (y_mode + shared).bfloat16()
            rel_m, cos_m, max_m = _metrics(against[0], out)
            return ServingResult(mode, policy, scales, rel_m, cos_m, max_m, _metrics(against[1], y_mode)[0], flushed,
                                 side_name)

        if side is a and y_w4a8 is not None:
            source_served.append(result(serve.W4A8, None, None, 0, y_w4a8, reference, "source"))
        if side is b:
            runner = _Runner(fm, side, block, fmt, cfg, x, ids, weights, y, ws, kernel_layer, w4a4, y_w4a8)
            for mode, policy, scales, flushed, y_mode in _served(runner, side, block, cfg, modes, calibrated):
                # MXFP8 runs are torch's: judged against the source's torch reference, not its kernel run
                against = reference if mode == serve.W4A8 else (outputs[0], routed[0])
                serving.append(result(mode, policy, scales, flushed, y_mode, against))
        del ws, kernel_layer
    serving += source_served
    (fa, ids_a), (fb, ids_b) = fmts
    agreement = float((ids_a.sort(-1).values == ids_b.sort(-1).values).all(-1).float().mean())
    rel, cos, max_abs = _metrics(*outputs)
    routed_rel = _metrics(*routed)[0]
    lossless = formats.get(fa).elements == formats.get(fb).elements
    max_rel, min_cos = LOSSLESS if lossless else LOSSY
    kernel_ok = kernel_rel is None or (math.isfinite(kernel_rel) and kernel_rel <= KERNEL_VS_REFERENCE)
    passed = (rel <= max_rel and cos >= min_cos and agreement == 1.0 and kernel_ok
              and all(math.isfinite(v) for v in (rel, cos, max_abs))
              and all(math.isfinite(s.rel_err) and math.isfinite(s.max_abs_err) for s in serving))
    return LayerResult(block, fa, fb, x.shape[0], ra.tid2eid is not None, rel, cos, max_abs, routed_rel, agreement,
                       kernel_rel, max_rel, min_cos, passed, serving)


def written_input_scales(side: _Side, block: str, experts: int) -> tuple[float, float] | None:
    """(gate/up input_scale, down input_scale) as engines load them: the largest over the layer's
    experts (and over gate and up, which see the same input); None when the checkpoint writes none."""
    found = []
    down = side.model.down_projection
    for projs in ([p for p in side.model.projections if p != down], [down]):
        parts = ([side.experts[(block, None)]] if (block, None) in side.experts   # stacked: one unit
                 else [side.experts.get((block, e), None) for e in range(experts)])
        if not all(x is not None and "input_scale" in x.parts.get(p, {}) for x in parts for p in projs):
            return None
        found.append(max(float(side.ck.tensor(x.parts[p]["input_scale"]).float().max()) for x in parts for p in projs))
    return found[0], found[1]


class _Runner:
    """The converted layer's routed experts, recomputed for a serving mode: through the kernel where
    it ran, else through the torch reference (a CPU), with the same numerics."""

    def __init__(self, fm, side, block, fmt, cfg, x, ids, weights, y_bf16, ws, kernel_layer, w4a4_outputs,
                 w4a8_output=None):
        self.fm, self.side, self.block, self.fmt, self.cfg = fm, side, block, fmt, cfg
        self.x, self.ids, self.weights, self.y_bf16, self.ws = x, ids, weights, y_bf16, ws
        self.kernel_layer = kernel_layer   # ws in the kernel's layout (None without the kernel)
        self.w4a4_outputs = w4a4_outputs   # CPU: computed with y_bf16, each expert decoded once
        self.w4a8_output = w4a8_output     # MXFP8 activations (torch, either device), when asked for

    def w4a4(self, scales: tuple[float, float]) -> torch.Tensor:
        if self.fm is None:
            return self.w4a4_outputs[scales]
        return _kernel(self.fm, self.x, self.ids, self.weights, self.kernel_layer, self.cfg,
                       activation_scales=scales).float()

    def marlin(self) -> tuple[torch.Tensor, int]:
        if self.fm is not None:
            served, flushed = serve.marlin_weights(dict(zip(ROLES, self.kernel_layer.weights)), self.ws.fused)
            if not flushed:
                return self.y_bf16, 0
            return (_kernel(self.fm, self.x, self.ids, self.weights, self.kernel_layer.with_weights(served),
                            self.cfg).float(), flushed)
        if not serve.rescaled_by_marlin(self.fmt):
            return self.y_bf16, 0
        # Marlin's factor spans the layer: every expert's scales are read (not their weights), then
        # the experts the tokens chose are decoded with the blocks it flushes zeroed.
        scales = layer_scales(self.side, self.block, self.fmt)
        histograms = {r: engine_numerics.scale_histogram(s) for r, s in scales.items()}
        factors = serve.marlin_factors(histograms, fused_roles(self.side, self.block))
        flushed = sum(engine_numerics.marlin_flushed_blocks(histograms[r], factors[r]) for r in ROLES)
        if not flushed:
            return self.y_bf16, 0
        stored = _reference_layer(self.side, self.block, self.fmt)

        def served(e):
            layer = stored(e)
            return layer.with_weights({r: serve.marlin_served(w, factors[r])[0]
                                       for r, w in zip(ROLES, layer.weights)}).dense(0)

        return routed_experts_variants([(self.x, None)], self.ids, self.weights, served, self.cfg.activation,
                                       workers=default_workers())[0], flushed


def _kernel_layout(fm, layer: LayerExperts) -> LayerExperts:
    """The layer with its weights in the kernel's layout (`kernel_weights`), made once for the
    layer's several kernel runs instead of on each."""
    return layer.with_weights({r: fm.kernel_weights(w) for r, w in zip(ROLES, layer.weights)})


def _kernel(fm, x, ids, weights, layer: LayerExperts, cfg, **kwargs) -> torch.Tensor:
    """The routed experts through requant's kernel, with the recipe's activation and the biases, in
    the kernel's default compute dtype (the same for every format, so that a lossless conversion
    compares equal)."""
    act = cfg.activation
    return fm.fused_moe(x, ids, weights, *layer.weights, swiglu_limit=act.limit, activation=act.kind,
                        swiglu_alpha=act.alpha, **layer.kernel_biases(), **kwargs)


def _w4a4_inputs(x: torch.Tensor, scales: tuple[float, float]):
    """(x, intermediate hook) of the torch reference for W4A4 under (w1/w3, w2) input scales."""
    a13, a2 = scales
    quantize = engine_numerics.fake_quantize_activations
    return quantize(x, a13), lambda h: quantize(h.bfloat16(), a2).float()


def _w4a8_inputs(x: torch.Tensor):
    """(x, intermediate hook) of the torch reference for W4A8: both GEMM inputs quantized to MXFP8
    (the w2 input after BF16 rounding, as FlashInfer's activation kernel does)."""
    quantize = engine_numerics.fake_quantize_mxfp8
    return quantize(x), lambda h: quantize(h.bfloat16())


def _w4a4_policies(side, block, cfg, calibrated) -> dict[str, tuple[float, float]]:
    """policy -> (w1/w3, w2) input scales, for the policies that apply to this layer."""
    policies = {"written": written_input_scales(side, block, cfg.n_routed_experts), "1.0": (1.0, 1.0)}
    if calibrated is not None:
        policies["calibrated"] = tuple(serve.calibrated_input_scale(m) for m in calibrated)
    return {policy: scales for policy, scales in policies.items() if scales is not None}


def _served(run: _Runner, side, block, cfg, modes, calibrated):
    """(mode, policy, input scales, flushed blocks, routed output) for each serving mode of the
    converted layer; `calibrated` is the (x, intermediate) absolute maxima of real inputs, or None."""
    for mode in modes:
        if mode == "bf16":
            yield mode, None, None, 0, run.y_bf16
        elif mode == "marlin-w4a16":
            y, flushed = run.marlin()
            yield mode, None, None, flushed, y
        elif mode == serve.W4A8:
            yield mode, None, None, 0, run.w4a8_output
        else:
            for policy, scales in _w4a4_policies(side, block, cfg, calibrated).items():
                yield mode, policy, scales, 0, run.w4a4(scales)


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
