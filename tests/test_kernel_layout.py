"""The fused-MoE kernel's host-side facts on the CPU without Triton: the weights' bit and block
layout, the activations' column order, the alignment of (token, k) pairs and the launch-config
lookup (requant/kernels/_details: layout, align, configs, device), each against a plain
computation written out here. The Triton tests (test_kernel_moe.py, test_kernel_ptx.py) run the
kernel itself on these layouts."""

import json
import os
import subprocess
import sys

import pytest
import torch

from requant.kernels._details import align, configs, device, layout
from requant.kernels.weights import ExpertWeights

CODES = {"e2m1": 0, "integer": 2}  # nvfp4's and w4a16's kernel codes (mxfp4 shares e2m1's layout)

NO_TRITON = """
import importlib.abc, sys, torch
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError("triton blocked")
sys.meta_path.insert(0, Block())
from requant.kernels._details import align, configs, device, layout, ptx
from requant.kernels.weights import ExpertWeights
w = ExpertWeights("nvfp4", torch.zeros(2, 64, 64, dtype=torch.uint8), torch.zeros(2, 64, 8, dtype=torch.uint8),
                  torch.ones(2))
kw = layout.kernel_weights(w)
align.align_torch(torch.tensor([[0, 1]]), 2, 16)
configs.default_config(6, 256)
print(sorted(m for m in sys.modules if m.split(".")[0] == "triton"), tuple(kw.words.shape))
"""


def test_layout_align_and_configs_import_and_run_without_triton():
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": checkout}
    child = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["[]", "(2,", "2,", "1,", "64,", "16)"]


def rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF if r else x


@pytest.mark.parametrize("name", ["e2m1", "integer"])
def test_kernel_words_hold_each_nibble_where_its_pair_reads_it(name):
    """Pair m of a kernel word, the OR of its terms (rotation, mask), holds nibble 2m's bits at
    NIBBLE_BITS in its low half and nibble 2m + 1's 16 bits up: what the PTX and the FP32 route read."""
    gen = torch.Generator().manual_seed(1)
    stored = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int32)
    stored[:3] = torch.tensor([0, -1, 0x12345678], dtype=torch.int32)
    kernel = layout.kernel_words(stored, CODES[name]).long()
    nibbles = (stored.long()[:, None] >> torch.arange(0, 32, 4)) & 15
    for m, terms in enumerate(layout.PAIR_TERMS[name]):
        reg = sum(rotl32(kernel, r) & mask for r, mask in terms)
        for h in range(2):
            got = sum(((reg >> (bit + 16 * h)) & 1) << b for b, bit in enumerate(layout.NIBBLE_BITS[name]))
            assert torch.equal(got, nibbles[:, 2 * m + h]), (m, h)


def test_kernel_words_are_a_bit_permutation():
    for code in CODES.values():
        one_bits = torch.tensor([layout.signed(1 << b) for b in range(32)], dtype=torch.int32)
        moved = layout.kernel_words(one_bits, code).long() & 0xFFFFFFFF
        assert sorted(int(v).bit_length() - 1 for v in moved) == list(range(32))


def test_tile_blocks_of_64_rows_by_one_k_tile():
    """Column c of row n (`group` elements of K each) lands in K tile t = c * group // 128 at block
    n // 64, row n % 64: words (group 8) and scales of groups of 16-128 at their place in the tile,
    a group wider than a tile once in each of its tiles; every block contiguous, N padded to whole
    128 rows and K to whole K tiles with zeros."""
    gen = torch.Generator().manual_seed(15)
    for group, c, shape in ((8, 40, (3, 4, 3, 64, 16)), (16, 20, (3, 4, 3, 64, 8)), (128, 3, (3, 4, 3, 64, 1)),
                            (256, 2, (3, 4, 4, 64, 1))):
        x = torch.randint(1, 2**31 - 1, (3, 200, c), generator=gen, dtype=torch.int32)
        tiled = layout.tile_blocks(x, group)
        assert tiled.shape == shape and tiled.is_contiguous()
        per_tile = shape[-1]
        k = torch.arange(shape[2] * 128)  # every element of K, padding included
        col, tile = k // group, k // 128
        kept = col < c
        n = torch.arange(200)[:, None]
        got = tiled[:, n // 64, tile[kept], n % 64, col[kept] % per_tile]
        assert torch.equal(got, x[:, n, col[kept]]), group
        assert int((tiled != 0).sum()) == x.numel() * max(1, group // 128), group  # the rest is zero padding


def test_permute_k_orders_columns_as_the_mma_tile():
    """Column 32q + 8m + 2l + n0 of each 128-column tile holds x's column 32l + 8q + 2m + n0; K = 200
    is padded with zeros to two tiles."""
    x = torch.randn(3, 200)
    got = layout.permute_k(x, 128)
    assert got.shape == (3, 256) and layout.padded_k(200) == 256
    want = torch.zeros(3, 256)
    padded = torch.nn.functional.pad(x, (0, 56))
    for t in range(2):
        for q in range(4):
            for m in range(4):
                for lane in range(4):
                    for n0 in range(2):
                        want[:, 128 * t + 32 * q + 8 * m + 2 * lane + n0] = padded[:, 128 * t + 32 * lane + 8 * q + 2 * m + n0]
    assert torch.equal(got, want)


def plain_align(ids: torch.Tensor, experts: int, block: int) -> tuple[list[int], list[int]]:
    flat = ids.flatten().tolist()
    sorted_ids, block_expert = [], []
    for e in range(experts):
        run = [p for p, x in enumerate(flat) if x == e]
        if run:
            run += [len(flat)] * (-len(run) % block)
            sorted_ids += run
            block_expert += [e] * (len(run) // block)
    blocks = align.max_blocks(len(flat), experts, block)
    return (sorted_ids + [len(flat)] * (blocks * block - len(sorted_ids)),
            block_expert + [-1] * (blocks - len(block_expert)))


@pytest.mark.parametrize("tokens,top_k,experts,block", [(1, 6, 8, 16), (13, 3, 8, 4), (40, 2, 8, 16), (60, 4, 256, 16),
                                                        (7, 1, 3, 1)])
def test_align_torch_matches_a_plain_sort(tokens, top_k, experts, block):
    """Pairs by expert, each expert's pairs in pair order, each run padded with the pair count to whole
    blocks; the unused blocks after them (up to `max_blocks`) marked -1."""
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    ids[: tokens // 2] = ids[0]  # skew the load onto a few experts
    sorted_ids, block_expert = align.align_torch(ids, experts, block)
    want_ids, want_experts = plain_align(ids, experts, block)
    assert sorted_ids.tolist() == want_ids and block_expert.tolist() == want_experts
    assert sorted_ids.dtype == block_expert.dtype == torch.int32


@pytest.mark.parametrize("fmt,group,in_blocks", [("nvfp4", 16, True), ("mxfp4", 32, False), ("w4a16", 32, True),
                                                 ("w4a16", 128, False)])
def test_kernel_weights(fmt, group, in_blocks):
    """Words in the kernel's bit and block layout; block scales in blocks where a row's scales per K
    tile are 8 bytes or more, as stored otherwise."""
    gen = torch.Generator().manual_seed(3)
    e, n, k = 2, 96, 256
    if fmt == "w4a16":
        packed = torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), generator=gen, dtype=torch.int32)
        scale = torch.rand(e, n, k // group, generator=gen).bfloat16()
        w = ExpertWeights(fmt, packed, scale)
    else:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
        scale = torch.randint(100, 130, (e, n, k // group), generator=gen, dtype=torch.uint8)
        w = ExpertWeights(fmt, packed, scale, torch.ones(e) if fmt == "nvfp4" else None)
    kw = layout.kernel_weights(w)
    words = layout.kernel_words(layout.as_int32_words(packed), w.codec.kernel_code)
    assert (kw.n, kw.k, kw.group, kw.experts) == (n, k, group, e)
    assert torch.equal(kw.words, layout.tile_blocks(words, 8)) and kw.words.shape == (e, 2, 2, 64, 16)
    assert layout.scales_in_blocks(group, scale.element_size()) == in_blocks
    assert torch.equal(kw.scale, layout.tile_blocks(scale, group) if in_blocks else scale)
    assert layout.kernel_weights(kw) is kw


def test_scale_layout():
    """Blocks for 8 bytes a tile or more, int32 words for 4 (K whole tiles, scales pipelined), rows else."""
    on, off = configs.KernelConfig(16, 64, 128), configs.KernelConfig(16, 64, 128, pipelined_scales=False)
    assert layout.scale_layout(on, 16, 1, 4096) == layout.SCALES_BLOCKS      # NVFP4
    assert layout.scale_layout(on, 32, 2, 4096) == layout.SCALES_BLOCKS      # INT4 g32
    assert layout.scale_layout(on, 32, 1, 4096) == layout.SCALES_WORDS       # MXFP4
    assert layout.scale_layout(on, 64, 2, 4096) == layout.SCALES_WORDS       # INT4 g64
    assert layout.scale_layout(off, 32, 1, 4096) == layout.SCALES_ROWS
    assert layout.scale_layout(on, 32, 1, 2880) == layout.SCALES_ROWS        # K off whole tiles
    assert layout.scale_layout(on, 128, 2, 4096) == layout.SCALES_ROWS      # INT4 g128
    after = configs.KernelConfig(16, 64, 128, scale_after_dot=True)
    assert layout.row_scaled(after, 2, 128, layout.SCALES_ROWS) and layout.row_scaled(after, 2, 256, layout.SCALES_ROWS)
    assert not layout.row_scaled(after, 2, 64, layout.SCALES_ROWS) and not layout.row_scaled(on, 2, 128, 0)
    assert not layout.row_scaled(after, 0, 128, layout.SCALES_ROWS)          # NVFP4 ignores the switch


def test_device_config_names():
    assert device.config_name("NVIDIA H200") == "h200"
    assert device.config_name("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert device.device_config_name(torch.device("cpu")) is None


PROBLEM = configs.Problem("nvfp4", 16, 256, 4096, 2048, 6)


def test_launch_config_lookup(tmp_path, monkeypatch):
    """The device's file, the tuned token count nearest on a log scale; the built-in rule for a shape
    or device without an entry, and under the interpreter whatever the file says."""
    monkeypatch.setattr(configs, "CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    one = configs.KernelConfig(16, 64, 128, split_k=4, down=configs.KernelConfig(16, 128, 128, num_stages=5))
    many = configs.KernelConfig(64, 128, 128, num_warps=8, num_stages=4)
    configs.save_tuned(configs.config_path("gpu-x"), "GPU X", PROBLEM, {1: one, 64: one}, "test")
    configs.save_tuned(configs.config_path("gpu-x"), "GPU X", PROBLEM, {64: many}, "test")  # merged, 64 replaced
    data = json.loads((tmp_path / "gpu-x.json").read_text())
    assert data["device"] == "GPU X" and list(data["configs"][PROBLEM.key]) == ["1", "64"]
    assert configs.launch_config(PROBLEM, 1, "gpu-x") == one
    assert configs.launch_config(PROBLEM, 7, "gpu-x") == one       # log 7 nearer log 1 than log 64
    assert configs.launch_config(PROBLEM, 9, "gpu-x") == many
    assert configs.launch_config(PROBLEM, 16384, "gpu-x") == many
    other = configs.Problem("nvfp4", 16, 128, 2880, 2880, 4)
    assert configs.launch_config(other, 1, "gpu-x") == configs.default_config(4, 128, 0)
    assert configs.launch_config(PROBLEM, 1, "gpu-y") == configs.default_config(6, 256, 0)
    assert configs.launch_config(PROBLEM, 1, None) == configs.default_config(6, 256, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert configs.launch_config(PROBLEM, 1, "gpu-x") == configs.KernelConfig(16, 64, 128, num_warps=4, num_stages=1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    (tmp_path / "gpu-z.json").write_text('{"configs": {"k": {"1": {"block_m": 16, "bogus": 1}}}}')
    with pytest.raises(ValueError, match="gpu-z.json: not a launch-config file"):
        configs.launch_config(PROBLEM, 1, "gpu-z")


def test_shipped_config_files_parse_and_name_known_formats():
    names = [f[:-5] for f in os.listdir(configs.CONFIG_DIR) if f.endswith(".json")]
    assert "h200" in names
    for name in names:
        with open(configs.config_path(name)) as f:
            assert device.config_name(json.load(f)["device"]) == name
        table = configs.device_table(name)
        assert table
        for key, by_tokens in table.items():
            fmt, group, *dims = key.split()
            assert fmt in {"nvfp4", "mxfp4", "w4a16"} and group.startswith("g") and by_tokens, key
            assert all(c.block_k == layout.K_TILE for c in by_tokens.values())


def test_config_dicts_round_trip():
    cfg = configs.default_config(6, 256)  # interpreter's
    for c in (cfg, configs.KernelConfig(16, 64, 128, split_k=2, scale_after_dot=True,
                                        down=configs.KernelConfig(16, 128, 128, num_stages=4))):
        assert configs.KernelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
