"""The kernel's GPU route (inline PTX dequantization, wgmma) against the torch reference, CUDA only.

Everywhere else the kernel runs through Triton's interpreter, which takes the FP32 route: this is
the one test of what a GPU runs. The test suite sets TRITON_INTERPRET=1 (conftest.py), so on a GPU
machine run this file alone with the interpreter off:

    TRITON_INTERPRET=0 python -m pytest tests/test_kernel_gpu.py

Tolerance: BF16 GEMM inputs against an FP32 reference give a relative L2 error of about
2-4e-3 (docs/kernel-notes.md, "Current numbers"); 1e-2 passes that and fails a wrong scale or nibble order,
which are off by O(1).
"""

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="requant's kernel needs triton (Linux wheels only): pip install 'requant[gpu]'")
from moe_fixtures import clamp_exercising_input, make_layer  # noqa: E402
from requant.kernels import fused_moe as fm  # noqa: E402
from requant.moe import Activation, routed_experts  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or fm.interpreting(),
                                reason="needs a CUDA GPU and TRITON_INTERPRET=0 (run this file alone)")

EXPERTS, HIDDEN, INTER, TOP_K, LIMIT = 16, 512, 256, 4, 10.0


@pytest.mark.parametrize("fmt,group,compute", [
    ("mxfp4", 32, torch.bfloat16), ("nvfp4", 16, torch.bfloat16),
    ("nvfp4-any", 16, torch.bfloat16), ("int4-sym", 128, torch.bfloat16), ("int4-asym", 32, torch.bfloat16),
])
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_gpu_kernel_matches_reference(fmt, group, compute, tokens):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{group}/{compute}/{tokens}".encode()))
    (w1, d1), (w3, d3), (w2, d2) = make_layer(fmt, EXPERTS, HIDDEN, INTER, gen, group=group)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen) * 1.5
    x = clamp_exercising_input(tokens, HIDDEN, d1, LIMIT, gen)
    act = Activation("swiglu_clamp", LIMIT)
    ref = routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), act)
    y = fm.fused_moe(x.cuda(), ids.cuda(), weights.cuda(), w1.to("cuda"), w3.to("cuda"), w2.to("cuda"),
                     activation=act, compute_dtype=compute).cpu()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    rel = float((y.float() - ref).norm() / ref.norm())
    assert rel < 1e-2, (fmt, compute, tokens, rel)
