"""Random expert weights in every format the kernel reads, with independent float decodings."""

from __future__ import annotations

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from requant.formats import mxfp4, nvfp4
from requant.kernels.weights import ExpertWeights


def random_mxfp4(experts: int, n: int, k: int, gen: torch.Generator):
    """MXFP4 encodings of Gaussian weights with per-row magnitudes spread over a few octaves."""
    packed, scales = [], []
    for _ in range(experts):
        w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-3, 2, (n, 1), generator=gen).float()) * 0.05
        p, s = mxfp4.encode(w.numpy())
        packed.append(torch.from_numpy(p))
        scales.append(torch.from_numpy(s))
    return torch.stack(packed), torch.stack(scales)


def mxfp4_weights(packed, scales) -> tuple[ExpertWeights, torch.Tensor]:
    dense = torch.stack([mxfp4.decode(p, s) for p, s in zip(packed, scales)])
    return ExpertWeights("mxfp4", packed, scales), dense


def nvfp4_cast(packed1, scales1, packed3, scales3):
    """NVFP4 w1/w3 by the lossless cast, w1 and w3 sharing k_max as engines need."""
    out1, out3 = [], []
    for p1, s1, p3, s3 in zip(packed1, scales1, packed3, scales3):
        k_max = mxfp4.max_exponent(np.maximum(s1.numpy(), s3.numpy()))
        out1.append(nvfp4.cast_from_mxfp4(p1.numpy(), s1.numpy(), k_max))
        out3.append(nvfp4.cast_from_mxfp4(p3.numpy(), s3.numpy(), k_max))
    return [_stack_cast(out) for out in (out1, out3)]


def nvfp4_cast_single(packed, scales):
    return _stack_cast([nvfp4.cast_from_mxfp4(p.numpy(), s.numpy(), mxfp4.max_exponent(s.numpy()))
                        for p, s in zip(packed, scales)])


def _stack_cast(results) -> tuple[ExpertWeights, torch.Tensor]:
    w = ExpertWeights("nvfp4", torch.stack([torch.as_tensor(r.weight) for r in results]),
                      torch.stack([torch.as_tensor(r.weight_scale) for r in results]),
                      torch.tensor([r.weight_scale_2 for r in results], dtype=torch.float32))
    return w, nvfp4_dense(w)


def random_nvfp4(experts: int, n: int, k: int, gen: torch.Generator) -> tuple[ExpertWeights, torch.Tensor]:
    """Arbitrary NVFP4 bytes: any codes (-0 included), E4M3 block scales with full mantissas
    (subnormals included), and a non-power-of-two global scale per expert."""
    packed = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    exponent = torch.randint(0, 11, (experts, n, k // 16), generator=gen)  # 0 = subnormal
    mantissa = torch.randint(0, 8, (experts, n, k // 16), generator=gen)
    mantissa = torch.where(exponent == 0, mantissa.clamp(min=1), mantissa)
    scale = ((exponent << 3) | mantissa).to(torch.uint8)
    global_scale = torch.rand(experts, generator=gen) * 0.02 + 0.001
    w = ExpertWeights("nvfp4", packed, scale, global_scale.float())
    return w, nvfp4_dense(w)


def nvfp4_dense(w: ExpertWeights) -> torch.Tensor:
    return torch.stack([nvfp4.decode(p, s, g) for p, s, g in zip(w.packed, w.scale, w.global_scale.tolist())])


def random_int4(experts: int, n: int, k: int, group: int, asymmetric: bool,
                gen: torch.Generator) -> tuple[ExpertWeights, torch.Tensor]:
    """compressed-tensors pack-quantized INT4, packed and unpacked by compressed-tensors itself."""
    q = torch.randint(-8, 8, (experts, n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(experts, n, k // group, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    packed = pack_to_int32(q, 4)
    zero_point = None
    z = torch.zeros(experts, n, k // group, dtype=torch.int8)
    if asymmetric:
        z = torch.randint(-8, 8, (experts, n, k // group), generator=gen, dtype=torch.int8)
        zero_point = pack_to_int32(z, 4, packed_dim=0)  # along N, as compressed-tensors stores zero points
        z = unpack_from_int32(zero_point, 4, torch.Size((experts, n, k // group)), packed_dim=0)
    q = unpack_from_int32(packed, 4, torch.Size((experts, n, k)))
    dense = (q.float() - z.float().repeat_interleave(group, -1)) * scale.float().repeat_interleave(group, -1)
    return ExpertWeights("w4a16", packed, scale, zero_point=zero_point), dense


def make_layer(fmt: str, experts: int, hidden: int, inter: int, gen: torch.Generator, group: int = 32):
    """(w1, w3, w2) ExpertWeights and their dense float decodings [E, N, K] for one format."""
    if fmt in ("mxfp4", "nvfp4"):
        p1, s1 = random_mxfp4(experts, inter, hidden, gen)
        p3, s3 = random_mxfp4(experts, inter, hidden, gen)
        p2, s2 = random_mxfp4(experts, hidden, inter, gen)
        if fmt == "mxfp4":
            return [mxfp4_weights(p, s) for p, s in ((p1, s1), (p3, s3), (p2, s2))]
        (w1, d1), (w3, d3) = nvfp4_cast(p1, s1, p3, s3)
        return [(w1, d1), (w3, d3), nvfp4_cast_single(p2, s2)]
    if fmt == "nvfp4-any":
        return [random_nvfp4(experts, n, k, gen) for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
    asym = fmt == "int4-asym"
    return [random_int4(experts, n, k, group, asym, gen) for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]


def clamp_exercising_input(tokens: int, hidden: int, gate: torch.Tensor, limit: float,
                           gen: torch.Generator) -> torch.Tensor:
    """BF16 activations [tokens, hidden], scaled so that about a tenth of the gate values x @ gate[e].T
    (gate: the dense w1 [E, I, H]) exceed the SwiGLU limit."""
    x = torch.randn(tokens, hidden, generator=gen)
    top = float(torch.einsum("th,eih->tei", x, gate).abs().flatten().quantile(0.9))
    return (x * (1.2 * limit / top)).bfloat16()
