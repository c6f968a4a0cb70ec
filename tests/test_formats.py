"""Bit-level NVFP4 cast against ModelOpt's reference and against independent decodes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from requant.errors import FormatError
from requant.formats import e2m1, mxfp4, nvfp4

shard_cast_utils = pytest.importorskip("modelopt.torch.export.shard_cast_utils")


def realistic_mxfp4(rng, rows, k, out_of_window=0, zero_blocks=0, neg_zero_blocks=0):
    x = rng.standard_t(5, (rows, k)).astype(np.float32) * 0.01
    x *= np.exp(rng.normal(0, 0.4, (rows, 1))).astype(np.float32)
    w, s = mxfp4.encode(x)
    blocks = w.reshape(rows, -1, 16)
    for i, pick in enumerate(rng.choice(s.size, out_of_window + zero_blocks + neg_zero_blocks, replace=False)):
        r, b = divmod(int(pick), s.shape[1])
        if i < out_of_window:
            s[r, b] = int(s.max()) - int(rng.integers(18, 30))
        elif i < out_of_window + zero_blocks:
            s[r, b], blocks[r, b] = 0, 0
        else:
            blocks[r, b] = 0x88
    return w, s


def modelopt_cast(w, s, k_max):
    q, ws, ws2, n_blocks, _ = shard_cast_utils.quantize_mxfp4_to_nvfp4_lossless(
        torch.from_numpy(w).view(torch.int8), torch.from_numpy(s).view(torch.float8_e8m0fnu), k_max, "cpu")
    return q.view(torch.uint8).numpy(), ws.view(torch.uint8).numpy(), float(ws2), n_blocks


@pytest.mark.parametrize("seed", range(4))
def test_cast_matches_modelopt_bytes_for_fused_pair(seed):
    rng = np.random.default_rng(seed)
    w1, s1 = realistic_mxfp4(rng, 64, 512, out_of_window=5, zero_blocks=3, neg_zero_blocks=2)
    w3, s3 = realistic_mxfp4(rng, 64, 512, out_of_window=1, zero_blocks=1)
    s3 = np.where(s3 > 0, s3.astype(np.int16) - 3, 0).astype(np.uint8)  # w3 smaller: shared k_max matters
    overrides = shard_cast_utils.build_w13_kmax_overrides(
        ["e.w1", "e.w3"], lambda b: torch.from_numpy({"e.w1": s1, "e.w3": s3}[b]).view(torch.float8_e8m0fnu), "cpu")
    k_max = max(mxfp4.max_exponent(s1), mxfp4.max_exponent(s3))
    assert overrides["e.w1"] == overrides["e.w3"] == k_max
    for w, s in ((w1, s1), (w3, s3)):
        ours = nvfp4.cast_from_mxfp4(w, s, k_max)
        ref_w, ref_s, ref_ws2, n_blocks = modelopt_cast(w, s, k_max)
        np.testing.assert_array_equal(ours.weight, ref_w)
        np.testing.assert_array_equal(ours.weight_scale, ref_s)
        assert ours.weight_scale_2 == ref_ws2
        assert ours.blocks == n_blocks
        assert ours.requantized_blocks > 0


def test_cast_is_lossless_in_window_by_independent_decode():
    rng = np.random.default_rng(7)
    w, s = realistic_mxfp4(rng, 128, 1024, zero_blocks=4, neg_zero_blocks=4)
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s))
    assert cast.exact_blocks == cast.blocks and cast.requantized_blocks == 0
    source = mxfp4.decode(torch.from_numpy(w), torch.from_numpy(s))
    out = nvfp4.decode(torch.from_numpy(cast.weight), torch.from_numpy(cast.weight_scale), cast.weight_scale_2)
    assert torch.equal(source, out)
    nibbles = np.stack([cast.weight & 0xF, cast.weight >> 4])
    assert not (nibbles == 0x8).any(), "-0 must be written as +0, as NVIDIA's exporter does"


def test_out_of_window_blocks_are_counted_and_rounded_to_nearest():
    rng = np.random.default_rng(3)
    w, s = realistic_mxfp4(rng, 32, 256, out_of_window=6)
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s))
    assert cast.requantized_blocks + cast.exact_blocks == cast.blocks
    assert 0 < cast.requantized_blocks <= 6
    source = mxfp4.decode(torch.from_numpy(w), torch.from_numpy(s))
    out = nvfp4.decode(torch.from_numpy(cast.weight), torch.from_numpy(cast.weight_scale), cast.weight_scale_2)
    step = 0.5 * 2.0**-9 * cast.weight_scale_2  # smallest E2M1 step at the clamped block scale
    assert float((source - out).abs().max()) <= step / 2 + 1e-30


@pytest.mark.parametrize("headroom", [0, 3])
def test_headroom_lowers_the_largest_block_scale(headroom):
    rng = np.random.default_rng(11)
    w, s = realistic_mxfp4(rng, 64, 512)
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s), top=8 - headroom)
    largest = torch.from_numpy(cast.weight_scale).view(torch.float8_e4m3fn).float().max().item()
    assert largest == 2.0 ** (8 - headroom)
    # ModelOpt has no such placement, so the oracle is the independent decode: still lossless.
    source = mxfp4.decode(torch.from_numpy(w), torch.from_numpy(s))
    out = nvfp4.decode(torch.from_numpy(cast.weight), torch.from_numpy(cast.weight_scale), cast.weight_scale_2)
    assert cast.exact_blocks == cast.blocks and torch.equal(source, out)


def test_all_zero_tensor():
    w = np.zeros((16, 64), np.uint8)
    s = np.zeros((16, 4), np.uint8)
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s))
    ref_w, ref_s, ref_ws2, _ = modelopt_cast(w, s, 0)
    np.testing.assert_array_equal(cast.weight, ref_w)
    np.testing.assert_array_equal(cast.weight_scale, ref_s)
    assert cast.weight_scale_2 == ref_ws2 and cast.exact_blocks == cast.blocks


def test_e4m3_powers_of_two_match_torch():
    for e in range(-9, 9):
        byte = nvfp4.e4m3_power_of_two(e)
        assert torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item() == 2.0**e
    with pytest.raises(ValueError):
        nvfp4.e4m3_power_of_two(9)


def test_clear_negative_zero_against_nibble_loop():
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (8, 32), dtype=np.uint8)
    packed[0, :4] = [0x88, 0x08, 0x80, 0x8F]
    expected = packed.copy()
    for idx in np.ndindex(packed.shape):
        lo, hi = packed[idx] & 0xF, packed[idx] >> 4
        expected[idx] = (0 if lo == 8 else lo) | ((0 if hi == 8 else hi) << 4)
    np.testing.assert_array_equal(nvfp4.clear_negative_zero(packed), expected)


def test_rounding_is_nearest_even_with_saturation():
    grid = np.array(e2m1.MAGNITUDES)
    values = np.concatenate([np.linspace(-8, 8, 4001), (grid[1:] + grid[:-1]) / 2, [0.0, -0.0, -1e-9, 7.0]])
    codes = e2m1.round_to_nibbles(values.astype(np.float32))
    for v, c in zip(values, codes):
        a = min(abs(v), 6.0)
        distance = np.abs(grid - a)
        best = np.flatnonzero(distance == distance.min())
        want = best[0] if len(best) == 1 else next(i for i in best if i % 2 == 0)
        assert c & 7 == want, v
        assert (c >> 3) == (1 if v < 0 else 0), v


def test_encode_decode_roundtrip_error_is_bounded():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    w, s = mxfp4.encode(x)
    y = mxfp4.decode(torch.from_numpy(w), torch.from_numpy(s)).numpy()
    scale = np.exp2(s.astype(np.float64) - 127).repeat(32, axis=1)
    inside = np.abs(x) <= 6 * scale  # on the grid's range: at most half the largest step (2)
    assert np.all(np.abs(x - y)[inside] <= scale[inside] * 1.0)
    # The OCP exponent puts a block's amax in [4, 8) * scale, so clipping at 6 costs < 2 * scale.
    assert np.all(np.abs(x - y) < scale * 2.0)
    assert (~inside).any()


def test_bad_inputs_are_format_errors():
    w, s = np.zeros((4, 32), np.uint8), np.full((4, 2), 120, np.uint8)
    s[2, 1] = 0xFF
    with pytest.raises(FormatError, match="NaN"):
        nvfp4.cast_from_mxfp4(w, s, 0)
    with pytest.raises(FormatError, match="does not match"):
        nvfp4.cast_from_mxfp4(w, np.zeros((4, 3), np.uint8), 0)
    with pytest.raises(FormatError, match="exceeds"):
        nvfp4.cast_from_mxfp4(w, np.full((4, 2), 140, np.uint8), 0)


def test_every_nibble_pair_survives_the_cast():
    """All 256 byte values in one in-window block decode to the same numbers (bar -0)."""
    w = np.array(list(itertools.islice(itertools.cycle(range(256)), 16 * 32)), np.uint8).reshape(16, 32)
    s = np.full((16, 2), 120, np.uint8)
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s))
    a = mxfp4.decode(torch.from_numpy(w), torch.from_numpy(s))
    b = nvfp4.decode(torch.from_numpy(cast.weight), torch.from_numpy(cast.weight_scale), cast.weight_scale_2)
    assert torch.equal(a, b)


# each codec's own value checks (verify reports them) ---------------------------------------------

def _reader(tensors):
    return lambda suffix: tensors.get(suffix)


def test_nvfp4_value_problems_name_the_part_and_count_the_blocks():
    rng = np.random.default_rng(3)
    w, s = mxfp4.encode(rng.standard_normal((8, 64)).astype(np.float32))
    cast = nvfp4.cast_from_mxfp4(w, s, mxfp4.max_exponent(s))
    tensors = {"weight": torch.from_numpy(cast.weight), "weight_scale": torch.from_numpy(cast.weight_scale.copy()),
               "weight_scale_2": torch.tensor(cast.weight_scale_2), "input_scale": torch.tensor(0.5)}
    assert nvfp4.CODEC.value_problems(_reader(tensors), (8, 64)) == []
    scale = tensors["weight_scale"]
    scale[0, 0], scale[1, 1], scale[2, 2] = 0x7F, 0xB8, 0x00    # NaN, -1.0, zero (over live codes)
    scale[4, 0], scale[5, 1], scale[3, 3] = 0xFF, 0xFE, 0x80    # -NaN, -448, -0.0 (a zero, not negative)
    tensors["weight"][2:4].fill_(0x11)
    tensors["input_scale"] = torch.tensor(float("nan"))
    found = {(p.code, p.part, p.detail) for p in nvfp4.CODEC.value_problems(_reader(tensors), (8, 64))}
    assert found == {("nan-block-scale", "weight_scale", "2 blocks"),
                     ("negative-block-scale", "weight_scale", "2 blocks"),
                     ("zero-block-scale", "weight_scale", "2 blocks"), ("bad-input-scale", "input_scale", "NaN")}


def test_mxfp4_and_int4_value_problems():
    from requant.formats import int4
    w, s = mxfp4.encode(np.ones((4, 64), dtype=np.float32))
    s[1, 0] = mxfp4.E8M0_NAN
    assert [(p.code, p.detail) for p in mxfp4.CODEC.value_problems(_reader({"scale": torch.from_numpy(s)}), (4, 64))] \
        == [("nan-block-scale", "1 blocks")]
    scale = torch.ones(4, 2, dtype=torch.bfloat16)
    scale[0, 0], scale[1, 1] = -1, 0
    tensors = {"weight_scale": scale, "weight_shape": torch.tensor([4, 32])}
    found = {(p.code, p.part) for p in int4.CODEC.value_problems(_reader(tensors), (4, 64))}
    assert found == {("negative-group-scale", "weight_scale"), ("zero-group-scale", "weight_scale"),
                     ("weight-shape-value", "weight_shape")}


def test_code_cites_headings_that_docs_formats_has():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    headings = {line.lstrip("#").strip() for line in (root / "docs" / "formats.md").read_text().splitlines()
                if line.startswith("#")}
    cited = {}
    for path in [*(root / "requant").rglob("*.py"), *(root / "requant").rglob("*.c"), *(root / "tests").rglob("*.py")]:
        for heading in re.findall(r"docs/formats\.md, ([^),:;\n]+)", path.read_text()):
            cited.setdefault(heading.strip(), path.name)
    assert cited, "no citations found: the pattern no longer matches how code cites docs/formats.md"
    assert not {h: f for h, f in cited.items() if h not in headings}, headings
