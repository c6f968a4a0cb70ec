"""The codec registry: each codec's declared parts are what its encoders write and its decoder
reads, a stored projection is recognised and its group size inferred from headers alone, and
encoders exist only for the pairs they are registered for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from requant import formats
from requant.errors import UnsupportedError
from requant.formats import e2m1, int4, mxfp4, nvfp4
from requant.io.safetensors import DTYPES
from requant.targets import TARGETS

ROWS, K = 64, 256


def mxfp4_source(seed=0):
    rng = np.random.default_rng(seed)
    return mxfp4.encode(rng.standard_t(5, (ROWS, K)).astype(np.float32) * 0.01)


def dtype_name(t: torch.Tensor) -> str:
    return next(name for name, (_, dtype) in DTYPES.items() if dtype == t.dtype)


def check_declared(codec, params, tensors):
    """The tensors (suffix -> tensor) are exactly the parts the codec writes under params, in the
    dtype and shape it declares."""
    written = codec.written_parts(params)
    assert sorted(tensors) == sorted(p.suffix for p in written)
    for part in written:
        t = tensors[part.suffix]
        assert dtype_name(t) == part.dtypes[0], part.suffix
        assert tuple(t.shape) == part.shape(ROWS, K, params), part.suffix


def test_the_cast_writes_the_nvfp4_parts_and_the_codec_decodes_them_to_the_source():
    w, s = mxfp4_source()
    cast = formats.encoder("mxfp4", "nvfp4")(w.copy(), s, mxfp4.max_exponent(s))
    tensors = {"weight": torch.from_numpy(cast.weight), "weight_scale": torch.from_numpy(cast.weight_scale).view(
        torch.float8_e4m3fn), "weight_scale_2": torch.tensor(cast.weight_scale_2), "input_scale": torch.tensor(1.0)}
    params = nvfp4.CODEC.params_from_shapes({k: tuple(v.shape) for k, v in tensors.items()})
    check_declared(nvfp4.CODEC, params, tensors)
    source = mxfp4.CODEC.decode({"weight": torch.from_numpy(w), "scale": torch.from_numpy(s)})
    assert torch.equal(nvfp4.CODEC.decode(tensors), source)   # lossless: every block inside the window


@pytest.mark.parametrize("group,scheme", [(32, "asym"), (128, "sym")])
def test_the_int4_search_writes_the_w4a16_parts_and_their_group_size_is_inferred(group, scheme):
    w, s = mxfp4_source(1)
    enc = formats.encoder("mxfp4", "w4a16")({"w": (torch.from_numpy(w), torch.from_numpy(s))}, group, scheme)["w"]
    tensors = {"weight_packed": enc.packed, "weight_scale": enc.scale,
               "weight_shape": torch.tensor([ROWS, K], dtype=torch.int64)}
    if enc.zero_point is not None:
        tensors["weight_zero_point"] = enc.zero_point
    params = int4.CODEC.params_from_shapes({k: tuple(v.shape) for k, v in tensors.items()})
    assert params == formats.Params(group, zero_points=scheme == "asym")
    check_declared(int4.CODEC, params, tensors)
    assert int4.CODEC.block_size(params) == group
    decoded = int4.CODEC.decode(tensors)
    assert torch.equal(decoded, int4.decode(enc.packed, enc.scale, enc.zero_point))


def test_identify_by_dtypes_alone():
    assert formats.identify({"weight": "I8", "scale": "F8_E8M0"}) is mxfp4.CODEC
    assert formats.identify({"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32"}) is nvfp4.CODEC
    assert formats.identify({"weight_packed": "I32", "weight_scale": "BF16", "weight_shape": "I64"}) is int4.CODEC
    assert formats.identify({"weight": "F8_E4M3", "scale": "F8_E8M0"}).name == "fp8_block"
    assert formats.identify({"weight": "BF16"}) is None
    # the input scale and the zero points are not needed to recognise a projection
    assert formats.identify({"weight": "U8", "weight_scale": "F8_E4M3"}) is None


def test_encoders_only_for_registered_pairs_and_the_cli_offers_exactly_those():
    assert formats.encoder_sources("nvfp4") == formats.encoder_sources("w4a16") == ["mxfp4"]
    with pytest.raises(UnsupportedError, match="converts from mxfp4, not nvfp4"):
        formats.encoder("nvfp4", "nvfp4")
    from requant.cli import GROUP_SIZES, SOURCE_FORMATS

    assert SOURCE_FORMATS == ["mxfp4"] and GROUP_SIZES == ["32", "64", "128"]
    assert sorted(TARGETS) == ["nvfp4", "w4a16"] and all(TARGETS[n].codec is formats.get(n) for n in TARGETS)


def test_a_target_refuses_options_of_another():
    with pytest.raises(UnsupportedError, match="^--group-size and --scheme apply to --out w4a16 only$"):
        TARGETS["nvfp4"].options_from({"group_size": 32, "scheme": "asym"})
    with pytest.raises(UnsupportedError, match="^--scale-headroom applies to --out nvfp4 only$"):
        TARGETS["w4a16"].options_from({"scale_headroom": 2})
    assert TARGETS["w4a16"].options_from({"group_size": 64}).group_size == 64


def _cast_pair(seed=0):
    w, s = mxfp4_source(seed)
    w.reshape(-1)[::7] = 0x88   # -0 in both nibbles, which the cast writes as +0
    cast = formats.encoder("mxfp4", "nvfp4")(w.copy(), s, mxfp4.max_exponent(s))
    a = {"weight": torch.from_numpy(w), "scale": torch.from_numpy(s)}
    b = {"weight": torch.from_numpy(cast.weight), "weight_scale": torch.from_numpy(cast.weight_scale).view(
        torch.float8_e4m3fn), "weight_scale_2": torch.tensor(cast.weight_scale_2)}
    return a, b


def test_identical_energy_confirms_the_lossless_cast_from_the_bytes_and_nothing_else():
    a, b = _cast_pair()
    assert not torch.equal(a["weight"], b["weight"])   # the -0 bytes differ
    decoded = mxfp4.CODEC.decode(a).double()
    energy = formats.identical_energy(mxfp4.CODEC, a, nvfp4.CODEC, b)
    assert energy == pytest.approx(float((decoded * decoded).sum()), rel=1e-12)
    # one code changed, one block scale changed, a NaN source scale: not shown equal
    flipped = dict(b, weight=b["weight"].clone())
    flipped["weight"][3, 5] ^= 0x01
    rescaled = dict(b, weight_scale=b["weight_scale"].view(torch.uint8).clone())
    rescaled["weight_scale"][10, 3] += 8   # exponent + 1
    rescaled["weight_scale"] = rescaled["weight_scale"].view(torch.float8_e4m3fn)
    nan = dict(a, scale=a["scale"].clone())
    nan["scale"][0, 0] = 0xFF
    for sa, sb in ((a, flipped), (a, rescaled), (nan, b)):
        assert formats.identical_energy(mxfp4.CODEC, sa, nvfp4.CODEC, sb) is None
    # a codec without code tables (INT4's zero points) is never compared on the bytes
    assert formats.identical_energy(int4.CODEC, a, nvfp4.CODEC, b) is None


@pytest.mark.parametrize("dtype", [np.uint64, np.uint8])
def test_e2m1_same_values_is_float_equality_for_every_pair_of_bytes(dtype):
    """The word-level rule against the decoded values (where -0 == +0): every pair of bytes in
    every byte position of a word, the word's other bytes equal."""
    from requant.formats import e2m1

    x, y = (t.reshape(-1).astype(np.uint8) for t in np.meshgrid(np.arange(256), np.arange(256), indexing="ij"))
    values = e2m1.decode_packed(torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]).numpy()
    equal = (values[x] == values[y]).all(-1)
    width = np.dtype(dtype).itemsize
    filler = np.random.default_rng(width).integers(0, 256, width, dtype=np.uint8)
    for pos in range(width):
        a, b = np.tile(filler, (65536, 1)), np.tile(filler, (65536, 1))
        a[:, pos], b[:, pos] = x, y
        differ = e2m1.differing_words(a.view(dtype).reshape(-1), b.view(dtype).reshape(-1))
        assert np.array_equal(differ == 0, equal), pos
    zeros = np.array([0x08, 0x80, 0x88, 0x5D] * 2, np.uint8)   # -0 in either nibble, both
    assert e2m1.same_values(zeros, np.array([0, 0, 0, 0x5D] * 2, np.uint8))
    assert not e2m1.same_values(zeros[:7], np.array([0, 0, 0, 0x5D, 0, 0, 1], np.uint8))


def test_byte_pairs_on_the_cpu_equals_the_plain_lookup():
    table = torch.randn(256, 2)
    packed = torch.randint(0, 256, (9, 14), dtype=torch.uint8)[:, 2:12]   # a non-contiguous view
    plain = table[packed.long()].reshape(9, -1)
    assert torch.equal(formats.byte_pairs(table, packed), plain)


@pytest.mark.parametrize("global_scale", [1.0, 0.375, 2.0**-140, 2.0**120, 0.8127])   # normal, subnormal, overflowing
def test_nvfp4_decode_is_each_code_times_its_e4m3_scale_times_the_global_scale(global_scale):
    """NVFP4 decode (table lookups) gives, bit for bit, the plain float32 arithmetic: E2M1 value x
    (E4M3 block scale x global scale), for every weight byte under every scale byte; the NaN scale
    bytes (0x7F, 0xFF) give NaN, and so does a zero code times a scale that overflowed to inf."""
    g = torch.Generator().manual_seed(1)
    rows = 256
    weight = torch.randint(0, 256, (rows, 64), dtype=torch.uint8, generator=g)
    weight[:, :8] = torch.arange(256, dtype=torch.uint8).view(-1, 1)   # every byte in the first block...
    wide = torch.randint(0, 256, (rows, 10), dtype=torch.uint8, generator=g)
    wide[:, 1] = torch.arange(256, dtype=torch.uint8)                  # ...under every scale byte
    scale = wide[:, 1:9]                                               # a strided view, as a row slice gives
    global_scale = float(torch.tensor(global_scale, dtype=torch.float32))   # the F32 weight_scale_2
    values = e2m1.signed_values()
    codes = torch.stack([values[(weight & 0xF).long()], values[(weight >> 4).long()]], dim=-1).reshape(rows, -1, 16)
    factor = scale.view(torch.float8_e4m3fn).to(torch.float32) * global_scale
    expected = (codes * factor[..., None]).reshape(rows, -1)

    def same(got, want):
        nan = torch.isnan(want)
        return torch.equal(torch.isnan(got), nan) and torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])

    assert same(nvfp4.factors(scale, torch.tensor(global_scale)), factor)
    assert same(nvfp4.block_scale_values(scale), scale.view(torch.float8_e4m3fn).to(torch.float32))
    assert same(nvfp4.decode(weight, scale.view(torch.float8_e4m3fn), global_scale), expected)
    buffer = torch.full((rows, 128), 7.0)
    assert same(nvfp4.decode(weight, scale, global_scale, buffer), expected) and same(buffer, expected)


@pytest.mark.parametrize("global_scale, scale_bytes, nonfinite", [
    (1.0, (0x00, 0x7E), 0),              # every finite scale byte, nothing overflows: no decode
    (2.0**120, (0x00, 0x7E), None),      # large scale bytes times the global scale overflow
    (1.0, (0x7F, 0x80), None),           # the NaN byte 0x7F among them
])
def test_nvfp4_nonfinite_count_is_the_decoded_one(global_scale, scale_bytes, nonfinite):
    g = torch.Generator().manual_seed(2)
    weight = torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=g)
    scale = torch.randint(*scale_bytes, (64, 4), dtype=torch.uint8, generator=g)
    decoded = int((~torch.isfinite(nvfp4.decode(weight, scale, global_scale))).sum())
    assert nvfp4.count_nonfinite(weight, scale, global_scale) == decoded
    assert decoded == nonfinite if nonfinite is not None else decoded > 0


@pytest.mark.parametrize("chunk", [1 << 18, 4 * K])   # one piece; row chunks that divide the rows
def test_decoded_row_chunks_refuse_projections_of_different_shapes(chunk, monkeypatch):
    """report and verify --deep compare row chunks: a candidate with more rows or a shorter K than
    its source is an error, not a comparison of the rows they share."""
    from requant.errors import FormatError
    from requant.report import weights

    monkeypatch.setattr(weights, "_CHUNK_ELEMENTS", chunk)
    a, b = _cast_pair()
    more_rows = {k: (torch.cat([v, v[:8]]) if v.dim() == 2 else v) for k, v in b.items()}
    shorter_k = {"weight": b["weight"][:, :-8], "weight_scale": b["weight_scale"][:, :-1],
                 "weight_scale_2": b["weight_scale_2"]}
    for other in (more_rows, shorter_k):
        with pytest.raises(FormatError, match="decoded shapes differ"):
            list(weights.decoded_row_chunks(mxfp4.CODEC, a, nvfp4.CODEC, other, mxfp4.CODEC.decode,
                                            nvfp4.CODEC.decode))
    assert sum(len(x) for x, _ in weights.decoded_row_chunks(mxfp4.CODEC, a, nvfp4.CODEC, b, mxfp4.CODEC.decode,
                                                             nvfp4.CODEC.decode)) == ROWS


def _w4a16_parts(seed, group, scheme):
    w, s = mxfp4_source(seed)
    enc = formats.encoder("mxfp4", "w4a16")({"w": (torch.from_numpy(w), torch.from_numpy(s))}, group, scheme)["w"]
    parts = {"weight_packed": enc.packed, "weight_scale": enc.scale}
    if enc.zero_point is not None:
        parts["weight_zero_point"] = enc.zero_point
    return {"weight": torch.from_numpy(w), "scale": torch.from_numpy(s)}, parts


def test_every_codec_decodes_into_a_given_buffer_the_values_it_returns_without_one():
    """decode(parts, out) writes the buffer and returns its values; stale contents do not leak through."""
    a, b = _cast_pair()
    src, w4 = _w4a16_parts(2, 32, "asym")
    for codec, parts in ((mxfp4.CODEC, a), (nvfp4.CODEC, b), (int4.CODEC, w4)):
        plain = codec.decode(parts)
        buffer = torch.full((ROWS, K), float("nan"))
        assert codec.decode(parts, buffer).data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer, plain), codec.name
    with pytest.raises(ValueError, match="contiguous float32"):
        mxfp4.CODEC.decode(src, torch.empty(ROWS, K - 2))


@pytest.mark.parametrize("chunk", [3 * K, 16 * K, 1 << 18])   # row chunks: ragged, dividing, one piece
def test_reused_chunk_buffers_give_the_comparison_of_the_whole_projections(chunk, monkeypatch):
    """report compares row chunks decoded into two reused buffers: its sums equal those of the
    projections decoded whole and compared in one piece."""
    from requant.report import weights

    src, w4 = _w4a16_parts(3, 32, "sym")
    whole = weights.compare_chunks([(mxfp4.CODEC.decode(src), int4.CODEC.decode(w4))], 32)
    monkeypatch.setattr(weights, "_CHUNK_ELEMENTS", chunk)
    chunked = weights.compare_chunks(weights.decoded_row_chunks(
        mxfp4.CODEC, src, int4.CODEC, w4, mxfp4.CODEC.decode, int4.CODEC.decode), 32)
    assert chunked.metrics() == pytest.approx(whole.metrics(), rel=1e-6)
    assert (chunked.hist, chunked.zero_error, chunked.n) == (whole.hist, whole.zero_error, whole.n)
