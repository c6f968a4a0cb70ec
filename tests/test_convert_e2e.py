"""synth -> convert -> every tensor checked with an independent reader (the safetensors package)."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
from safetensors import safe_open

from requant.formats import mxfp4, nvfp4
from tests.helpers.cli import run_cli
from tests.helpers.files import tree

EXPERT = re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.ffn\.experts\.(?P<e>\d+)\.(?P<proj>w[123])\.(?P<part>\w+)$")


def load_all(path: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                tensors[name] = f.get_tensor(name)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


@pytest.fixture(scope="module")
def converted(small_source, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("out") / "nvfp4")
    # SGLang's layout is NVIDIA's: MTP experts stay MXFP4 (vLLM's default layout converts them: see below).
    result = run_cli("convert", small_source, dst, "--in", "mxfp4", "--out", "nvfp4", "--engine", "sglang", "--workers", "2", "--json")
    assert result.returncode == 0, result.stderr
    return dst, json.loads(result.stdout)


def test_every_tensor_is_converted_or_identical(small_source, converted):
    dst, summary = converted
    src, out = load_all(small_source), load_all(dst)
    converted_blocks = set()
    for name, t in src.items():
        m = EXPERT.match(name)
        if not m or m["block"].startswith("mtp."):
            assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)) and out[name].dtype == t.dtype, name
            continue
        converted_blocks.add(m["block"])
        prefix = name.rsplit(".", 1)[0]
        assert f"{prefix}.scale" not in out, "the MXFP4 scale must be removed"
        if m["part"] != "weight":
            continue
        w, ws = out[f"{prefix}.weight"], out[f"{prefix}.weight_scale"]
        ws2, inp = out[f"{prefix}.weight_scale_2"], out[f"{prefix}.input_scale"]
        assert (w.dtype, ws.dtype, ws2.dtype, inp.dtype) == (torch.uint8, torch.float8_e4m3fn, torch.float32, torch.float32)
        assert ws2.shape == () and inp.shape == () and ws.shape == (w.shape[0], w.shape[1] * 2 // 16)
        assert torch.isfinite(inp) and inp > 0
        a = mxfp4.decode(t, src[f"{prefix}.scale"])
        b = nvfp4.decode(w, ws, ws2)
        exact = (a == b).view(a.shape[0], -1, 32).all(-1)
        # Only blocks more than 17 binades below the fused pair's largest may change.
        scale = src[f"{prefix}.scale"].view(torch.uint8).int()
        partner = {"w1": "w3", "w3": "w1"}.get(m["proj"])
        k_max = scale.max()
        if partner:
            k_max = max(k_max, src[f"{m['block']}.ffn.experts.{m['e']}.{partner}.scale"].view(torch.uint8).int().max())
        assert exact[scale >= k_max - 17].all(), name
    assert converted_blocks == {f"layers.{i}" for i in range(5)}
    expected = {n for n in out if not (EXPERT.match(n) and not n.startswith("mtp."))}
    assert expected <= set(src)
    planted = 2 * 3 * 8 * 5  # synth's out_of_window=2 per projection, 3 projections, 8 experts, 5 layers
    assert 0 < summary["requantized_blocks"] <= planted
    assert summary["exact_blocks"] + summary["requantized_blocks"] == summary["blocks"]


def test_fused_pairs_share_global_and_input_scales(converted):
    dst, _ = converted
    out = load_all(dst)
    for e in range(8):
        p = f"layers.3.ffn.experts.{e}"
        assert torch.equal(out[f"{p}.w1.weight_scale_2"], out[f"{p}.w3.weight_scale_2"])
        assert torch.equal(out[f"{p}.w1.input_scale"], out[f"{p}.w3.input_scale"])
    norm = out["layers.3.ffn_norm.weight"].float().abs().max().item()
    bound = (256 ** 0.5) * norm / (6 * 448)
    assert out["layers.3.ffn.experts.0.w1.input_scale"].item() == pytest.approx(bound, rel=1e-6)


def test_config_and_hf_quant_config(small_source, converted):
    dst, _ = converted
    with open(os.path.join(small_source, "config.json")) as f:
        before = json.load(f)
    with open(os.path.join(dst, "config.json")) as f:
        after = json.load(f)
    with open(os.path.join(dst, "hf_quant_config.json")) as f:
        hf = json.load(f)
    qc = after["quantization_config"]
    strip = lambda c: {k: v for k, v in c.items() if k != "quantization_config"}  # noqa: E731
    assert strip(after) == strip(before)
    for key, value in before["quantization_config"].items():
        assert qc[key] == value  # quant_method stays fp8: engines dispatch DeepSeek-V4 on it
    assert after["expert_dtype"] == "fp4"
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["moe_quant_algo"] == "NVFP4" and qc["group_size"] == 16
    assert qc["kv_cache_quant_algo"] is None and qc["producer"]["name"] == "requant"
    layers = {f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(5)}
    assert qc["quantized_layers"] == layers
    assert qc["ignore"] == ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    for side in ("weights", "input_activations"):
        assert group[side] == {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    assert hf["producer"] == qc["producer"]
    assert hf["quantization"] == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16,
                                  "quantized_layers": layers, "exclude_modules": qc["ignore"]}


def test_ancillary_files_are_carried_over(small_source, converted):
    dst, _ = converted
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "inference/config.json"):
        with open(os.path.join(small_source, name), "rb") as a, open(os.path.join(dst, name), "rb") as b:
            assert a.read() == b.read(), name
    assert not [n for n in os.listdir(dst) if n.endswith((".partial", ".tmp"))]


def test_mtp_convert_and_constant_input_scale(small_source, tmp_path):
    dst = str(tmp_path / "o")
    result = run_cli("convert", small_source, dst, "--out", "nvfp4", "--mtp", "convert", "--input-scale", "1.0", "--quiet")
    assert result.returncode == 0, result.stderr
    out = load_all(dst)
    assert "mtp.0.ffn.experts.3.w2.weight_scale_2" in out and "mtp.0.ffn.experts.3.w2.scale" not in out
    scales = {v.item() for k, v in out.items() if k.endswith(".input_scale")}
    assert scales == {1.0}
    with open(os.path.join(dst, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    with open(os.path.join(dst, "hf_quant_config.json")) as f:
        hf = json.load(f)["quantization"]
    assert "mtp.0.ffn.experts" in qc["quantized_layers"] and "mtp.0.ffn.experts" in hf["quantized_layers"]
    assert "mtp.*" not in qc["ignore"] and "mtp.*.e_proj" in qc["ignore"] and hf["exclude_modules"] == qc["ignore"]


def test_scale_headroom_lowers_block_scales_and_stays_lossless(small_source, tmp_path):
    dst = str(tmp_path / "o")
    assert run_cli("convert", small_source, dst, "--out", "nvfp4", "--scale-headroom", "2", "--quiet").returncode == 0
    out = load_all(dst)
    largest = max(v.float().max().item() for k, v in out.items() if k.endswith(".weight_scale"))
    assert largest == 64.0


def test_dry_run_writes_nothing(small_source, tmp_path):
    before = tree(small_source)
    result = run_cli("convert", small_source, str(tmp_path / "o"), "--out", "nvfp4", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "converted tensors" in result.stdout and "free" in result.stdout
    assert not os.path.exists(tmp_path / "o") and tree(small_source) == before


def test_dry_run_short_of_space_exits_3(small_source, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from requant.cli import cli
    from requant.io import fsutil

    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 1000)
    result = CliRunner().invoke(cli, ["convert", small_source, str(tmp_path / "o"), "--out", "nvfp4", "--dry-run"])
    assert result.exit_code == 3 and "(NOT ENOUGH)" in result.stdout
    assert result.stderr.startswith("requant: error: not enough free space") and result.stderr.count("\n") == 1
    assert not os.path.exists(tmp_path / "o")


def test_inspect_source_and_output(small_source, converted):
    dst, _ = converted
    info = json.loads(run_cli("inspect", dst, "--json").stdout)
    assert info["model_type"] == "deepseek_v4" and info["expert_format"] == "nvfp4"
    assert info["expert_blocks_by_format"] == {"mxfp4": 1, "nvfp4": 5}
    assert info["drafter_blocks_by_format"] == {"mxfp4": 1}   # the MTP block, kept for SGLang
    assert info["quantization_config"]["moe_quant_algo"] == "NVFP4"
    assert info["tensor_bytes"] == info["index_total_size"]
    assert "1 drafter block mxfp4; 5 layers nvfp4" in run_cli("inspect", dst).stdout
    text = run_cli("inspect", small_source).stdout
    assert "format mxfp4" in text and "deepseek_v4" in text and "F8_E8M0" in text


# --- bad input: one line, non-zero exit, source untouched, nothing that looks complete -----------

def _set_bytes(path: str, tensor: str, offset_in_tensor: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start = 8 + n + header[tensor]["data_offsets"][0]
        f.seek(start + offset_in_tensor)
        f.write(data)


def _rewrite_header(path: str, edit) -> None:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)


def _layer_shard(src: str, layer: int) -> str:
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        return os.path.join(src, json.load(f)["weight_map"][f"layers.{layer}.ffn.experts.0.w1.weight"])


def _nan_scale(src):
    _set_bytes(_layer_shard(src, 2), "layers.2.ffn.experts.5.w3.scale", 7, b"\xff")
    return "layers.2.ffn.experts.5.w3.scale"


def _scale_shape(src):
    def edit(h):
        entry = h["layers.1.ffn.experts.2.w2.scale"]
        entry["shape"] = [entry["shape"][0] // 2, entry["shape"][1] * 2]
    _rewrite_header(_layer_shard(src, 1), edit)
    return "layers.1.ffn.experts.2.w2.scale"


def _missing_scale(src):
    _rewrite_header(_layer_shard(src, 3), lambda h: h.pop("layers.3.ffn.experts.4.w1.scale"))
    index_path = os.path.join(src, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    del index["weight_map"]["layers.3.ffn.experts.4.w1.scale"]
    with open(index_path, "w") as f:
        json.dump(index, f)
    return "layers.3.ffn.experts.4.w1.scale"


def _truncated(src):
    path = _layer_shard(src, 4)
    os.truncate(path, os.path.getsize(path) - 100)
    return os.path.basename(path)


def _unknown_model(src):
    path = os.path.join(src, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["model_type"] = "llama"
    with open(path, "w") as f:
        json.dump(config, f)
    return "llama"


def _lying_config(src):
    path = os.path.join(src, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["hidden_size"] = 512
    with open(path, "w") as f:
        json.dump(config, f)
    return "hidden_size=512"


@pytest.mark.parametrize("damage", [_nan_scale, _scale_shape, _missing_scale, _truncated, _unknown_model, _lying_config])
def test_bad_input_is_one_clear_line(source_copy, tmp_path, damage):
    expected = damage(source_copy)
    before = tree(source_copy)
    dst = str(tmp_path / "out")
    result = run_cli("convert", source_copy, dst, "--out", "nvfp4", "--quiet")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("requant: error:"), result.stderr
    assert expected in lines[0]
    assert tree(source_copy) == before
    assert not os.path.exists(os.path.join(dst, "model.safetensors.index.json"))


def test_wrong_source_format_and_existing_destination(small_source, converted, tmp_path):
    dst, _ = converted
    result = run_cli("convert", dst, str(tmp_path / "again"), "--in", "mxfp4", "--out", "nvfp4")
    assert result.returncode != 0 and "stored as nvfp4" in result.stderr and "Traceback" not in result.stderr
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    result = run_cli("convert", small_source, str(occupied), "--out", "nvfp4")
    assert result.returncode != 0 and "not an empty directory" in result.stderr
    assert (occupied / "keep.txt").read_text() == "mine" and len(os.listdir(occupied)) == 1


def test_expert_bytes_equal_modelopt_reference(small_source, converted):
    """The whole pipeline, not just the cast: one layer's experts against ModelOpt's own export math."""
    shard_cast_utils = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    dst, _ = converted
    src, out = load_all(small_source), load_all(dst)
    block = "layers.3.ffn.experts"
    bases = [f"{block}.{e}.{p}" for e in range(8) for p in ("w1", "w3", "w2")]
    k_max = shard_cast_utils.build_w13_kmax_overrides([b for b in bases if not b.endswith("w2")],
                                                      lambda b: src[f"{b}.scale"], "cpu")
    for base in bases:
        k = k_max.get(base, shard_cast_utils.mxfp4_kmax(src[f"{base}.scale"]))
        q, ws, ws2, _, _ = shard_cast_utils.quantize_mxfp4_to_nvfp4_lossless(
            src[f"{base}.weight"], src[f"{base}.scale"], k, "cpu")
        assert torch.equal(out[f"{base}.weight"], q.view(torch.uint8)), base
        assert torch.equal(out[f"{base}.weight_scale"].view(torch.uint8), ws.view(torch.uint8)), base
        assert torch.equal(out[f"{base}.weight_scale_2"], ws2.float()), base


def _shard_without_experts(path: str) -> str:
    from requant.io.checkpoint import Checkpoint

    with Checkpoint.open(path) as ck:
        return next(n for n in ck.shard_names if not any(".experts." in t for t in ck.headers[n].tensors))


def test_in_place_leaves_a_shard_with_nothing_to_convert_where_it_is(source_copy, tmp_path):
    """A shard of pass-through tensors only (embeddings, an Engram table) is not rewritten in
    place, even when its header is not the one requant would write (here: other metadata)."""
    from requant.io.safetensors import read_header, save_file

    name = _shard_without_experts(source_copy)
    path = os.path.join(source_copy, name)
    header = read_header(path)
    with safe_open(path, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in header.tensors}
    save_file(path, tensors, {"format": "pt", "written_by": "another tool"})
    before = os.stat(path)
    plain = str(tmp_path / "plain")   # the same source converted out of place, for the bytes
    assert run_cli("convert", source_copy, plain, "--out", "nvfp4").returncode == 0
    result = run_cli("convert", source_copy, "--in-place", "--out", "nvfp4")
    assert result.returncode == 0, result.stderr
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert read_header(path).metadata["written_by"] == "another tool"
    src_tensors, out_tensors = load_all(source_copy), load_all(plain)
    assert set(src_tensors) == set(out_tensors)
    for n in header.tensors:
        assert torch.equal(src_tensors[n].view(torch.uint8), out_tensors[n].view(torch.uint8)), n
    assert run_cli("verify", source_copy).returncode == 0


def test_pass_through_copies_go_in_bounded_pieces(tmp_path, monkeypatch):
    """A tensor is copied COPY_CHUNK bytes at a time, inside the kernel or, where copy_file_range
    fails (another file system), by hand: the same bytes either way, never the whole tensor at once."""
    from requant.io import safetensors

    data = bytes(range(256)) * 4099   # not a multiple of the piece
    src = tmp_path / "src.bin"
    src.write_bytes(b"xyz" + data)
    spec = safetensors.TensorSpec("t", "U8", (len(data),))
    monkeypatch.setattr(safetensors, "COPY_CHUNK", 4096)
    real_pread = os.pread
    for kernel in (True, False):
        if not kernel:
            def refuse(*_):
                raise OSError(18, "Invalid cross-device link")
            monkeypatch.setattr(os, "copy_file_range", refuse)
        reads = []
        monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
        out = tmp_path / f"out-{kernel}.safetensors"
        pieces = []
        writer = safetensors.ShardWriter(str(out), [spec])
        fd = os.open(src, os.O_RDONLY)
        writer.copy_from("t", fd, 3, progress=pieces.append)
        os.close(fd)
        writer.close()
        assert sum(pieces) == len(data) and max(pieces) <= 4096 and len(pieces) >= len(data) // 4096
        assert not kernel or not reads
        assert kernel or (reads and max(reads) <= 4096)
        with safe_open(str(out), "pt") as f:
            assert f.get_tensor("t").numpy().tobytes() == data
