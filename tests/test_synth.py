"""Synthetic checkpoints: every tensor family at small scale, the real release's layout at full scale."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from requant import synth
from requant.errors import UnsupportedError
from requant.formats import mxfp4
from requant.io.checkpoint import Checkpoint
from tests import release_fixture
from tests.helpers.cli import run_cli


def test_full_scale_layout_is_the_release_tensor_for_tensor():
    release = release_fixture.load()
    theirs = release_fixture.expand(release)
    shards = synth.layout(synth.Dims(full_scale=True))
    ours = [(s.name, s.dtype, list(s.shape), i + 1) for i, specs in enumerate(shards) for s in specs]
    assert len(shards) == release["num_shards"] == 46
    assert len(ours) == len(theirs) == release["num_tensors"] == 69187
    assert ours == theirs, "names, dtypes, shapes, shard placement and order within shards"
    assert sum(s.nbytes for specs in shards for s in specs) == release["total_size"] == 159_609_485_896


def test_config_matches_the_release_but_for_dimensions():
    release = release_fixture.load()["config.json"]
    assert synth.make_config(synth.Dims(full_scale=True)) == release
    small = synth.make_config(synth.Dims())
    assert small.keys() == release.keys()
    changed = {k for k in release if small[k] != release[k]}
    assert changed <= {"hidden_size", "moe_intermediate_size", "n_routed_experts", "num_hidden_layers",
                       "vocab_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                       "index_n_heads", "index_head_dim", "compress_ratios"}


def test_inference_and_generation_config_match_the_release():
    release = release_fixture.load()
    files = synth.metadata_files(synth.Dims(full_scale=True))
    assert files["inference/config.json"] == release["inference/config.json"]
    assert files["generation_config.json"] == release["generation_config.json"]


def test_small_checkpoint_has_every_tensor_family(small_source):
    with Checkpoint.open(small_source) as ck:
        names = set(ck.names)
        total = sum(os.path.getsize(ck.shard_path(s)) for s in ck.shard_names)
        assert total < 16 * 2**20, "default synth should be a few MB"
        for name in ("layers.0.ffn.gate.tid2eid", "layers.2.ffn.gate.tid2eid", "layers.3.ffn.gate.bias",
                     "layers.2.attn.compressor.ape", "layers.2.attn.indexer.wq_b.scale",
                     "layers.3.attn.compressor.wgate.weight", "layers.0.attn.wq_a.scale",
                     "layers.1.ffn.shared_experts.w2.weight", "mtp.0.ffn.experts.0.w1.scale", "mtp.0.e_proj.weight",
                     "mtp.0.ffn.gate.bias", "head.weight", "embed.weight", "hc_head_fn"):
            assert name in names, name
        assert "layers.3.attn.indexer.wq_b.weight" not in names  # ratio 128 has no indexer
        assert "layers.0.attn.compressor.ape" not in names       # ratio 0 has no compressor
        tid2eid = ck.tensor("layers.0.ffn.gate.tid2eid")
        assert all(len(set(row.tolist())) == row.numel() for row in tid2eid[:50])
        assert int(tid2eid.max()) < ck.config["n_routed_experts"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "inference/config.json"):
        assert os.path.exists(os.path.join(small_source, name)), name


def test_expert_exponents_spread_like_a_trained_layer(tmp_path):
    path = str(tmp_path / "c")
    synth.write_checkpoint(path, synth.Dims(layers=1, experts=6, hidden=512, intermediate=256), seed=3)
    with Checkpoint.open(path) as ck:
        for proj in ("w1", "w2", "w3"):
            s = ck.tensor(f"layers.0.ffn.experts.0.{proj}.scale").view(torch.uint8).numpy().astype(int)
            span = s.max() - s.min()
            assert 3 <= span <= 17, f"{proj}: exponent span {span} is not a trained model's"
            w = ck.tensor(f"layers.0.ffn.experts.0.{proj}.weight").view(torch.uint8).numpy()
            hist = np.bincount(np.concatenate([w & 7, w >> 4 & 7]).ravel(), minlength=8)
            assert (hist > 0).all(), "every E2M1 magnitude should occur"
            assert not np.array_equal(w, ck.tensor(f"layers.0.ffn.experts.1.{proj}.weight").view(torch.uint8).numpy())


def test_hard_case_flags_plant_blocks(tmp_path):
    path = str(tmp_path / "c")
    synth.write_checkpoint(path, synth.Dims(layers=1), seed=4,
                           hard=synth.HardCases(out_of_window=3, zero_blocks=2, neg_zero_blocks=2))
    with Checkpoint.open(path) as ck:
        w = ck.tensor("layers.0.ffn.experts.2.w3.weight").view(torch.uint8).numpy()
        s = ck.tensor("layers.0.ffn.experts.2.w3.scale").view(torch.uint8).numpy()
    k_max = mxfp4.max_exponent(s)
    nonzero = s[s > 0].astype(int) - 127
    assert (nonzero < k_max - 17).sum() == 3
    assert (s == 0).sum() == 2
    assert (w.reshape(s.shape[0], -1, 16) == 0x88).all(axis=-1).sum() == 2


def test_same_seed_same_bytes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for p in (a, b):
        synth.write_checkpoint(p, synth.Dims(layers=1, experts=6), seed=9)
    for name in sorted(os.listdir(a)):
        if name.endswith(".safetensors"):
            with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
                assert fa.read() == fb.read(), name


def test_full_scale_sparse_dry_run_takes_seconds(tmp_path):
    src = str(tmp_path / "full")
    result = run_cli("synth", src, "--full-scale", "--sparse")
    assert result.returncode == 0, result.stderr
    du = sum(os.stat(os.path.join(src, n)).st_blocks * 512 for n in os.listdir(src) if n.endswith(".safetensors"))
    assert du < 200 * 2**20, f"sparse full-scale checkpoint uses {du} bytes of disk"
    start = time.monotonic()
    result = run_cli("convert", src, str(tmp_path / "out"), "--out", "nvfp4", "--dry-run", "--json")
    elapsed = time.monotonic() - start
    plan = json.loads(result.stdout)
    short = plan["free_bytes_available"] < plan["free_bytes_needed"]   # ~168 GB: depends on this machine
    assert result.returncode == (3 if short else 0), result.stderr
    assert plan["tensors"]["converted tensors"] == (43 + 1) * 256 * 6   # vLLM's layout: the MTP block too
    src_total = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if n.endswith(".safetensors"))
    assert plan["input_bytes"] == src_total
    assert not os.path.exists(tmp_path / "out")
    from requant.convert import plan_conversion
    from requant.targets import Options
    plan = plan_conversion(src, "nvfp4", Options())
    # docs/formats.md, Sizes: +201,332,736 bytes per converted layer, scalars included (43 layers + MTP).
    assert plan.total_size - plan.source.tensor_bytes == (43 + 1) * 201_332_736
    print(f"dry run of the full-scale plan: {elapsed:.1f} s")
    assert elapsed < 120  # generous: this is "seconds", not a benchmark; see scripts/ for speed


def test_synth_refuses_bad_dimensions(tmp_path):
    result = run_cli("synth", str(tmp_path / "x"), "--hidden", "200")
    assert result.returncode != 0
    assert "multiple of 128" in result.stderr and "Traceback" not in result.stderr


def test_recipe_expressions_are_arithmetic_only():
    from requant.expressions import evaluate
    dims = {"layers": 3, "ratio": "0 if index < 1 else 4", "ratios": "[ratio for index in range(layers)]"}
    assert evaluate("ratios", dims) == [0, 4, 4] and evaluate("ratio", dims, {"index": 0}) == 0
    for bad in ("__import__('os')", "layers.real", "open('x')"):
        with pytest.raises(ValueError, match="not allowed"):
            evaluate(bad, dims)
    with pytest.raises(ValueError, match="through itself"):
        evaluate("a", {"a": "b + 1", "b": "a"})


def test_unknown_model_or_dimension_is_refused(tmp_path):
    result = run_cli("synth", str(tmp_path / "x"), "--model", "no-such-model")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    with pytest.raises(UnsupportedError, match="no dimension"):
        synth.Dims(heads_per_group=2)
