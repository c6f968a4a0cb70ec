"""The Triton fused-MoE kernel against the torch reference, on the CPU through Triton's interpreter.

Tolerance: the kernel runs in FP32 here (the interpreter's compute dtype), so it differs from the
FP32 reference only by summation order (~1e-6 relative) and by rounding its output to BF16, at most
half a BF16 ulp (2^-9 relative). Elementwise rtol 2^-8 covers both; atol covers outputs that cancel
to near zero, where FP32 summation noise dominates.
"""

import os
import zlib
from dataclasses import replace
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="requant's kernel needs triton (Linux wheels only): pip install 'requant[gpu]'")
from moe_fixtures import clamp_exercising_input, make_layer, nvfp4_dense, random_mxfp4  # noqa: E402
from requant.errors import FormatError, UnsupportedError  # noqa: E402
from requant.formats import mxfp4  # noqa: E402
from requant.engines.numerics import fake_quantize_activations  # noqa: E402
from requant.kernels import fused_moe as fused_moe_module  # noqa: E402
from requant.kernels._details import _kernels, launch, layout  # noqa: E402
from requant.kernels._details.align import align_torch  # noqa: E402
from requant.kernels.fused_moe import (ExpertWeights, KernelConfig, default_config, fused_moe, moe_align,  # noqa: E402
                                       permute_k, prepare)
from requant.moe import Activation, MoEConfig, MoELayer, Router, route, routed_experts  # noqa: E402

EXPERTS, HIDDEN, INTER, LIMIT = 8, 256, 128, 10.0
SWIGLU = Activation("swiglu_clamp", LIMIT)


def assert_matches(y: torch.Tensor, ref: torch.Tensor):
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-4 * float(ref.abs().max()))


def run_case(fmt, ids, weights, gen, group=32, hidden=HIDDEN, inter=INTER, wrap=lambda w, gen: w, config=None):
    """The kernel and the reference on one random layer; `wrap` may restage each ExpertWeights."""
    (w1, d1), (w3, d3), (w2, d2) = make_layer(fmt, EXPERTS, hidden, inter, gen, group=group)
    w1, w3, w2 = (wrap(w, gen) for w in (w1, w3, w2))
    x = clamp_exercising_input(ids.shape[0], hidden, d1, LIMIT, gen)
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, config=config)
    ref = routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU)
    clamped = (torch.einsum("th,eih->tei", x.float(), d3).abs() > LIMIT).float().mean()
    return y, ref, clamped


def random_routing(tokens, top_k, gen):
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=gen) * 1.5


@pytest.mark.parametrize("fmt,group", [
    ("mxfp4", 32), ("nvfp4", 16), ("nvfp4-any", 16),
    ("int4-sym", 32), ("int4-sym", 128), ("int4-asym", 64), ("int4-asym", 32),
])
def test_formats_match_reference(fmt, group):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{group}".encode()))
    ids, weights = random_routing(7, 3, gen)
    y, ref, clamped = run_case(fmt, ids, weights, gen, group=group)
    assert clamped > 0.02, "the SwiGLU clamp must be exercised"
    assert_matches(y, ref)


@pytest.mark.parametrize("fmt,group,hidden,scales", [
    ("nvfp4", 16, HIDDEN, "SCALES_BLOCKS"), ("int4-asym", 32, HIDDEN, "SCALES_BLOCKS"),
    ("nvfp4-any", 16, 176, "SCALES_BLOCKS"), ("int4-asym", 32, 160, "SCALES_BLOCKS"),
    ("int4-asym", 64, HIDDEN, "SCALES_WORDS"), ("mxfp4", 32, HIDDEN, "SCALES_WORDS"),
    ("mxfp4", 32, 160, "SCALES_ROWS"), ("int4-sym", 128, HIDDEN, "SCALES_ROWS"),
])
def test_scales_by_hand_or_pipelined_agree(fmt, group, hidden, scales):
    """A tile's scales (and zero points) loaded with its words (`pipelined_scales`, the default)
    or by hand one tile ahead: the same bytes out, K whole tiles or not (176, 160: the last tile
    partial). Pipelined, w1/w3's scales are read in the layout named (`scale_layout`): in blocks
    (8 bytes a tile or more), as one int32 word a row and tile (4 bytes: INT4 g64, MXFP4), or by
    hand after all (MXFP4 with K off whole tiles, INT4 g128's 2 bytes)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"pipelined/{fmt}/{group}/{hidden}".encode()))
    (w1, _), (w3, _), (w2, _) = make_layer(fmt, EXPERTS, hidden, INTER, gen, group=group)
    ids, weights = random_routing(7, 3, gen)
    x = (torch.randn(7, hidden, generator=gen) * 0.05).bfloat16()
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1)
    kw1, kw3 = (fused_moe_module.kernel_weights(w) for w in (w1, w3))
    assert launch.launch_scales(cfg, kw1, kw3)[0] == getattr(layout, scales)
    outs = [fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, config=replace(cfg, pipelined_scales=p)) for p in (True, False)]
    assert torch.equal(outs[0], outs[1])


# Scale bytes that decode to NaN, by format.
NAN_SCALE = {"mxfp4": lambda n: torch.full(n, 0xFF, dtype=torch.uint8),
             "nvfp4": lambda n: torch.full(n, 0x7F, dtype=torch.uint8),
             "w4a16": lambda n: torch.full(n, float("nan"), dtype=torch.bfloat16)}


def garbage_past_k(w: ExpertWeights, gen: torch.Generator, extra: int = 64) -> ExpertWeights:
    """The same weights as views of rows `extra` elements longer whose extra words are random and
    whose extra scales are NaN: a kernel reading past K there produces NaN."""
    def widen(t, more, filler):
        wide = torch.cat([t, filler((*t.shape[:-1], more))], dim=-1)
        return wide[..., :t.shape[-1]]

    def random_bits(shape, dtype):
        return torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen,
                             dtype=torch.uint8).view(dtype)

    per_word = w.codec.elements_per_word
    packed = widen(w.packed, extra // per_word, lambda n: random_bits(n, w.packed.dtype))
    scale = widen(w.scale, extra // w.group, NAN_SCALE[w.format])
    zero = None if w.zero_point is None else widen(w.zero_point, extra // w.group,
                                                   lambda n: random_bits(n, torch.int32))
    return ExpertWeights(w.format, packed, scale, w.global_scale, zero)


def poison_float_buffers(monkeypatch):
    """Every floating-point torch.empty starts as NaN: a buffer the kernel leaves partly unwritten
    (the intermediate's padding up to whole K tiles) and then reads shows up."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("fmt,group,hidden,inter,split,extra,apart", [
    ("mxfp4", 32, 160, 96, 1, 64, False), ("mxfp4", 32, 160, 96, 2, 64, False),
    ("nvfp4-any", 16, 176, 80, 1, 80, False), ("int4-sym", 32, 96, 160, 1, 64, False),
    ("int4-asym", 32, 160, 96, 1, 64, False), ("int4-asym", 32, 160, 96, 2, 64, True),
])
def test_k_off_whole_tiles(fmt, group, hidden, inter, split, extra, apart, monkeypatch):
    """K not a multiple of the 128-wide K tile (gpt-oss: 2880 = 22.5 tiles): the last tile is read
    up to K only, whatever lies beyond it in the weights' rows, and the intermediate's padding
    columns are zeros, not whatever memory held (split 2: w1/w3's 2 tiles in two slices, the last
    one partial). The weights are views of rows `extra` longer than K, garbage there, and N is
    not whole 64-row blocks (80, 96, 160, 176): the kernel's block layout (`tile_blocks`) must take
    K and N only, padded with zeros. apart: w1 and w3 by separate programs, with zero points."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{hidden}/{inter}/{split}".encode()))
    poison_float_buffers(monkeypatch)
    ids, weights = random_routing(7, 3, gen)
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1, split_k=split, gate_up_apart=apart)
    y, ref, _ = run_case(fmt, ids, weights, gen, group=group, hidden=hidden, inter=inter, config=cfg,
                         wrap=lambda w, gen: garbage_past_k(w, gen, extra))
    assert_matches(y, ref)


@pytest.mark.parametrize("apart", [False, True])
def test_w1_and_w3_global_scales_are_separate(apart):
    """Engines that apply w1's global scale to w3 are silently wrong; this test must see that, with
    w1 and w3 in one program and in separate ones."""
    gen = torch.Generator().manual_seed(11)
    (w1, d1), (w3, _), (w2, d2) = make_layer("nvfp4-any", EXPERTS, HIDDEN, INTER, gen)
    w3.global_scale = w1.global_scale * torch.linspace(0.5, 2.0, EXPERTS)
    d3 = nvfp4_dense(w3)
    ids, weights = random_routing(9, 2, gen)
    x = (torch.randn(9, HIDDEN, generator=gen) * 0.05).bfloat16()
    cfg = replace(default_config(18, EXPERTS), gate_up_apart=apart)
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, config=cfg)
    assert_matches(y, routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU))
    shared_scale = d3 * (w1.global_scale / w3.global_scale)[:, None, None]
    wrong = routed_experts(x, ids, weights, lambda e: (d1[e], shared_scale[e], d2[e]), SWIGLU)
    assert (y.float() - wrong).norm() > 0.05 * wrong.norm()


@pytest.mark.parametrize("tokens", [1, 37])
def test_token_counts(tokens):
    # 37 tokens x top-4 over 8 experts puts ~18 pairs on an expert: more than one 16-row block.
    gen = torch.Generator().manual_seed(tokens)
    ids, weights = random_routing(tokens, 4, gen)
    y, ref, _ = run_case("nvfp4", ids, weights, gen)
    assert_matches(y, ref)


def test_all_tokens_on_one_expert():
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((21, 1), 5)
    y, ref, _ = run_case("mxfp4", ids, torch.rand(21, 1, generator=gen), gen)
    assert_matches(y, ref)


def test_most_experts_empty():
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([[1, 6], [6, 1], [1, 6], [6, 1], [1, 6]])
    y, ref, _ = run_case("int4-asym", ids, torch.rand(5, 2, generator=gen), gen)
    assert_matches(y, ref)


def test_hash_layer_routing():
    """Hash layers take their experts from tid2eid; the kernel must follow whatever routing it gets."""
    gen = torch.Generator().manual_seed(5)
    cfg = MoEConfig(HIDDEN, INTER, EXPERTS, Router("sqrtsoftplus", 3, 1.5), SWIGLU)
    tid2eid = torch.stack([torch.randperm(EXPERTS, generator=gen)[:3] for _ in range(50)])
    layer = MoELayer(torch.randn(EXPERTS, HIDDEN, generator=gen), None, tid2eid, experts=None)
    token_ids = torch.randint(0, 50, (11,), generator=gen)
    x = torch.randn(11, HIDDEN, generator=gen)
    ids, weights = route(x, layer, cfg, token_ids)
    assert torch.equal(ids, tid2eid[token_ids])
    y, ref, _ = run_case("nvfp4", ids, weights, gen)
    assert_matches(y, ref)


@pytest.mark.parametrize("align", [moe_align, align_torch])
def test_moe_align_invariants(align):
    """Both ways of aligning (one Triton program at decode sizes, torch's sort beyond)."""
    gen = torch.Generator().manual_seed(6)
    # (60, 4, 4): 68 blocks, more than one pass of the Triton program's 32-block loop.
    for tokens, top_k, block in [(1, 6, 16), (13, 3, 4), (40, 2, 16), (60, 4, 4)]:
        ids, _ = random_routing(tokens, top_k, gen)
        ids[: tokens // 2] = ids[0]  # skew the load onto a few experts
        sorted_ids, block_expert = align(ids, EXPERTS, block)
        pairs = tokens * top_k
        real = sorted_ids[sorted_ids < pairs]
        assert torch.equal(real.sort().values, torch.arange(pairs, dtype=torch.int32))  # each pair once
        rows = sorted_ids.view(-1, block)
        for b, e in enumerate(block_expert.tolist()):
            members = rows[b][rows[b] < pairs].long()
            if e < 0:
                assert members.numel() == 0
            else:
                assert members.numel() > 0 and (ids.flatten()[members] == e).all()
        # Blocks are contiguous per expert and padding only ends an expert's run.
        used = block_expert[block_expert >= 0]
        assert torch.equal(used, used.sort().values)
        assert (block_expert[len(used):] == -1).all()
        assert (sorted_ids.view(-1, block)[len(used):] == pairs).all()
        # Within an expert, pairs in their own order (either way, so the two agree exactly).
        assert all(torch.equal(run, run.sort().values) for run in
                   (real[(ids.flatten()[real.long()] == e)] for e in range(EXPERTS)))


@pytest.mark.parametrize("align", [moe_align, align_torch])
@pytest.mark.parametrize("counts,block,full", [([1] * 6, 16, True), ([1] * 7 + [9], 4, True),
                                               ([2] * 8, 4, False), ([5], 4, False)])
def test_moe_align_allots_the_blocks_a_routing_can_fill(align, counts, block, full):
    """The blocks allotted for P pairs are the most P pairs can fill (n + (P - n) // block, n =
    min(experts, P)), all of them filled when every expert but one has one pair: one token of top-6
    fills its 6 (no block for nobody), 16 pairs over 8 experts, 7 with one, fill 7 + 3 = 10. Other
    routings leave the spare blocks marked unused."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).view(-1, 1)
    sorted_ids, block_expert = align(ids, EXPERTS, block)
    n = min(EXPERTS, ids.numel())
    filled = sum(-(-c // block) for c in counts)
    assert block_expert.numel() == n + (ids.numel() - n) // block
    assert (block_expert >= 0).sum() == filled and sorted_ids.numel() == block_expert.numel() * block
    assert (filled == block_expert.numel()) == full


@pytest.mark.parametrize("align_pairs", [2048, 4])
def test_prepared_activations_are_permuted_and_padded(align_pairs, monkeypatch):
    """The one-launch prologue's A equals `permute_k` of x in the compute dtype, zeros padding
    K = 160 to two whole tiles (whatever the buffer held before); its alignment equals torch's.
    align_pairs 4: more pairs than one program aligns, so torch aligns and the launch only
    permutes."""
    monkeypatch.setattr(fused_moe_module, "ALIGN_PAIRS", align_pairs)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(5, 200, generator=gen).bfloat16()[:, :160]  # rows further apart than K
    ids, _ = random_routing(5, 3, gen)
    poison_float_buffers(monkeypatch)
    a, sorted_ids, block_expert = prepare(x, ids, EXPERTS, 16, torch.float32)
    assert a.dtype == torch.float32 and torch.equal(a, permute_k(x.float(), 128))
    assert all(torch.equal(p, q) for p, q in zip((sorted_ids, block_expert), align_torch(ids, EXPERTS, 16)))


def test_rejects_mismatched_scales():
    with pytest.raises(FormatError):
        ExpertWeights("nvfp4", torch.zeros(2, 64, 32, dtype=torch.uint8), torch.zeros(2, 64, 2, dtype=torch.uint8),
                      torch.ones(2))
    with pytest.raises(FormatError):
        ExpertWeights("w4a16", torch.zeros(2, 64, 8, dtype=torch.int32), torch.zeros(2, 64, 2, dtype=torch.bfloat16),
                      torch.ones(2))


def test_w4a4_emulation_quantizes_both_gemm_inputs():
    """With activation scales the kernel multiplies NVFP4-quantized x and intermediate (as W4A4
    engines do): equal to the torch reference fed the same quantized inputs, and measurably not
    the BF16-activation result."""
    gen = torch.Generator().manual_seed(12)
    (w1, d1), (w3, d3), (w2, d2) = make_layer("nvfp4", EXPERTS, HIDDEN, INTER, gen)
    ids, weights = random_routing(6, 2, gen)
    x = torch.randn(6, HIDDEN, generator=gen).bfloat16()
    scales = (0.004, 0.002)
    # Split K for w1/w3 too: the intermediate then leaves the split-K SwiGLU in natural column order.
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1, split_k=2)
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, activation_scales=scales, config=cfg)
    quantize = lambda t, s: fake_quantize_activations(t.bfloat16(), s).float()  # noqa: E731
    ref = routed_experts(quantize(x, scales[0]), ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU,
                         intermediate=lambda h: quantize(h, scales[1]))
    plain = routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU)
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    # A rounding flip of one element between the kernel's and the reference's FP32 sums moves that
    # element by one E2M1 step; the norm still agrees to ~1e-3.
    assert rel(y, ref) < 3e-3
    assert rel(y, plain) > 2e-2


def test_split_k_matches_reference():
    """Split-K (decode batches): FP32 partials per K slice, SwiGLU after their sum."""
    gen = torch.Generator().manual_seed(8)
    hidden, inter, experts = 512, 256, 3  # w1/w3: 4 K tiles, split 4; w2: 2 K tiles, split 2
    (w1, d1), (w3, d3), (w2, d2) = make_layer("nvfp4-any", experts, hidden, inter, gen)
    ids, weights = torch.tensor([[0, 2], [2, 1]]), torch.rand(2, 2, generator=gen)
    x = (torch.randn(2, hidden, generator=gen) * 0.05).bfloat16()
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1, split_k=4)
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, config=cfg)
    assert_matches(y, routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU))


def test_down_config_of_its_own(monkeypatch):
    """A config's `down` (one token's default: 128 rows a program, split 2) applies to the down GEMM
    alone: the same result as the reference with w1/w3 split 4 and w2 in 128-row programs, and a
    down config that would need another alignment of the pairs is refused."""
    gen = torch.Generator().manual_seed(9)
    hidden, inter, experts = 512, 256, 3
    (w1, d1), (w3, d3), (w2, d2) = make_layer("int4-sym", experts, hidden, inter, gen, group=32)
    ids, weights = torch.tensor([[0, 2], [2, 1]]), torch.rand(2, 2, generator=gen)
    x = (torch.randn(2, hidden, generator=gen) * 0.05).bfloat16()
    down = KernelConfig(16, 128, 128, num_warps=4, num_stages=1, split_k=2)
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1, split_k=4, down=down)
    seen = []
    launch_one = fused_moe_module.launch

    def spy(*args, **kwargs):
        seen.append((args[3] is None, args[10]))  # (the down GEMM: no w3, its config)
        return launch_one(*args, **kwargs)
    monkeypatch.setattr(fused_moe_module, "launch", spy)
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, config=cfg)
    assert seen == [(False, cfg), (True, down)]
    assert_matches(y, routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU))
    with pytest.raises(ValueError, match="block_m=16"):
        KernelConfig(16, 64, 128, down=KernelConfig(32, 64, 128))


@pytest.mark.parametrize("fmt,group,split,apart", [
    ("int4-sym", 128, 1, False), ("int4-asym", 128, 2, False), ("int4-sym", 256, 2, True),
])
def test_scale_after_dot_matches_reference(fmt, group, split, apart, monkeypatch):
    """`scale_after_dot` with one group a K tile or more (INT4 g128, g256): each tile's product with
    the unscaled codes, minus their zero points, times its rows' scales. w1/w3 have 4 K tiles (so
    the next tile's scales are loaded ahead, and g256 takes one scale for two tiles), w2 two; the
    launches take the path (ROW_SCALES), and a format whose groups are smaller than the tile
    (NVFP4) ignores the switch."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"after-dot/{fmt}/{group}/{split}".encode()))
    hidden, inter = 512, 256
    (w1, d1), (w3, d3), (w2, d2) = make_layer(fmt, EXPERTS, hidden, inter, gen, group=group)
    ids, weights = random_routing(5, 3, gen)
    x = clamp_exercising_input(5, hidden, d1, LIMIT, gen)
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1, split_k=split, gate_up_apart=apart,
                       scale_after_dot=True)
    row_scales = []
    kernel = _kernels.moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                row_scales.append(kwargs["ROW_SCALES"])
                return kernel[grid](*args, **kwargs)
            return run
    monkeypatch.setattr(_kernels, "moe_gemm_kernel", Spy())
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, config=cfg)
    assert row_scales == [True, True]
    assert_matches(y, routed_experts(x, ids, weights, lambda e: (d1[e], d3[e], d2[e]), SWIGLU))
    (n1, _), (n3, _), (n2, _) = make_layer("nvfp4-any", EXPERTS, hidden, inter, gen)
    fused_moe(x, ids, weights, n1, n3, n2, activation=SWIGLU, config=cfg)
    assert row_scales[2:] == [False, False]


def gated_experts(x, ids, weights, d13, b13, d2, b2, limit, *, kind="swiglu_oai", alpha=1.702, gate_rows=0,
                  interleaved=True, plus_one=True, b13_after_clamp=False, b2_after_weight=False):
    """sum_k w_k * expert(x) written out in FP32 for fused gate/up weights d13 [E, 2I, H] and biases
    b13 [E, 2I], as gpt-oss's model code has it (rows 2i gate, 2i+1 up; biases before the clamp;
    b2 before the routing weight). The keyword switches give the plausible mistakes."""
    inter = d13.shape[1] // 2
    gu = torch.einsum("th,tkoh->tko", x.float(), d13[ids])
    if not b13_after_clamp:
        gu = gu + b13[ids].float()
    if interleaved:
        g, u = gu[..., gate_rows::2], gu[..., 1 - gate_rows::2]
    else:
        g, u = gu[..., :inter], gu[..., inter:]
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    if b13_after_clamp:
        g, u = g + b13[ids, 0::2].float(), u + b13[ids, 1::2].float()
    if kind == "swiglu_oai":
        h = (u + 1 if plus_one else u) * g * torch.sigmoid(alpha * g)
    else:
        h = torch.nn.functional.silu(g) * u
    out = torch.einsum("tki,tkhi->tkh", h, d2[ids])
    if b2_after_weight:
        return (out * weights[..., None] + b2[ids].float()).sum(1)
    return ((out + b2[ids].float()) * weights[..., None]).sum(1)


@pytest.mark.parametrize("kind,split,hidden,inter,apart", [
    ("swiglu_oai", 1, 256, 256, False), ("swiglu_oai", 2, 256, 256, False), ("swiglu_clamp", 2, 256, 256, False),
    ("swiglu_oai", 2, 160, 96, False), ("swiglu_oai", 1, 256, 256, True), ("swiglu_clamp", 2, 160, 96, True),
])
def test_fused_interleaved_gate_up_with_biases(kind, split, hidden, inter, apart, monkeypatch):
    """gpt-oss: MXFP4 gate/up fused in one [E, 2I, H] matrix with interleaved rows, passed as row
    views, BF16 biases on all three projections. Split-K must add each bias once.
    256: 2 K tiles each; 160 / 96 (gpt-oss's 2880 is not whole tiles either): the rows continue
    past K with garbage and NaN scales, and float buffers start as NaN (`test_k_off_whole_tiles`).
    apart: gate and up by separate programs, each with its own bias."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{split}/{hidden}/{inter}".encode()))
    experts, limit = 4, 7.0
    p13, s13 = random_mxfp4(experts, 2 * inter, hidden, gen)
    p2, s2 = random_mxfp4(experts, hidden, inter, gen)
    if hidden % 128 or inter % 128:
        poison_float_buffers(monkeypatch)
        (p13, s13), (p2, s2) = ((w.packed, w.scale) for w in (garbage_past_k(ExpertWeights("mxfp4", p, s), gen)
                                                                for p, s in ((p13, s13), (p2, s2))))
    d13 = torch.stack([mxfp4.decode(p, s) for p, s in zip(p13, s13)])
    d2 = torch.stack([mxfp4.decode(p, s) for p, s in zip(p2, s2)])
    ids, weights = random_routing(6, 2, gen)
    ids = ids % experts
    x = torch.randn(6, hidden, generator=gen)
    # About a tenth of the gate and up values beyond the limit; the rest where alpha and +1 matter.
    x = (x * (limit / float(torch.einsum("th,oh->to", x, d13.flatten(0, 1)).abs().quantile(0.9)))).bfloat16()
    gu = torch.einsum("th,eoh->teo", x.float(), d13)
    b13 = (torch.randn(experts, 2 * inter, generator=gen) * 0.5 * float(gu.std())).bfloat16()
    unbiased_out = gated_experts(x, ids, weights, d13, b13, d2, torch.zeros(experts, hidden), limit, kind=kind)
    b2 = (torch.randn(experts, hidden, generator=gen) * float(unbiased_out.std())).bfloat16()
    w1 = ExpertWeights("mxfp4", p13[:, 0::2], s13[:, 0::2])
    w3 = ExpertWeights("mxfp4", p13[:, 1::2], s13[:, 1::2])
    w2 = ExpertWeights("mxfp4", p2, s2)
    cfg = KernelConfig(16, 64, 128, num_warps=4, num_stages=1, split_k=split, gate_up_apart=apart)
    act = Activation(kind, limit, 1.702 if kind == "swiglu_oai" else None)
    y = fused_moe(x, ids, weights, w1, w3, w2, activation=act,
                  b1=b13[:, 0::2], b3=b13[:, 1::2], b2=b2, config=cfg)
    expect = lambda **wrong: gated_experts(x, ids, weights, d13, b13, d2, b2, limit, kind=kind, **wrong)  # noqa: E731
    ref = expect()
    assert_matches(y, ref)
    g = (gu + b13.float())[..., 0::2]
    assert (g > limit).float().mean() > 0.05, "the gate clamp must be exercised"
    mistakes = [dict(gate_rows=1), dict(interleaved=False), dict(b13_after_clamp=True), dict(b2_after_weight=True)]
    if kind == "swiglu_oai":
        mistakes += [dict(alpha=1.0), dict(plus_one=False)]
    for wrong in mistakes:
        other = expect(**wrong)
        assert (y.float() - other).norm() > 0.02 * other.norm(), f"kernel indistinguishable from {wrong}"


def test_activation_arguments_are_checked():
    gen = torch.Generator().manual_seed(13)
    (w1, _), (w3, _), (w2, _) = make_layer("mxfp4", EXPERTS, HIDDEN, INTER, gen)
    x, ids, weights = torch.randn(2, HIDDEN).bfloat16(), torch.tensor([[0], [1]]), torch.ones(2, 1)
    with pytest.raises(TypeError, match="activation"):   # no model's activation by default
        fused_moe(x, ids, weights, w1, w3, w2)
    with pytest.raises(ValueError, match="alpha"):
        Activation("swiglu_clamp", LIMIT, 1.702)
    with pytest.raises(ValueError, match="alpha"):
        Activation("swiglu_oai", LIMIT)
    with pytest.raises(UnsupportedError, match="no torch reference"):
        Activation("gelu", LIMIT)
    # a kind the reference might learn before the kernel does
    with pytest.raises(UnsupportedError, match="the kernel fuses no activation 'gelu'"):
        fused_moe(x, ids, weights, w1, w3, w2, activation=SimpleNamespace(kind="gelu", limit=LIMIT, alpha=None))
    with pytest.raises(FormatError, match="b1 and b3"):
        fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, b1=torch.zeros(EXPERTS, INTER))
    with pytest.raises(FormatError, match="b2 must be"):
        fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, b2=torch.zeros(EXPERTS, INTER))
    with pytest.raises(ValueError, match="compute dtype torch.float16 is not one of"):
        fused_moe(x, ids, weights, w1, w3, w2, activation=SWIGLU, compute_dtype=torch.float16)
