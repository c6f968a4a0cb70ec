"""The shared-checkpoint factory (tests/factory.py): one build per key, read-only results, and a
check that catches a test which changed one anyway."""

from __future__ import annotations

import os
import stat

from requant import synth
from requant.io.checkpoint import Checkpoint
from requant.targets import Options
from tests.factory import Checkpoints

DIMS = synth.Dims(layers=1, experts=6)


def test_one_build_per_key(tmp_path):
    made = Checkpoints(tmp_path)
    src = made.source(DIMS, seed=1)
    assert made.source(synth.Dims(layers=1, experts=6), seed=1) == src        # equal dimensions, same key
    assert made.source(DIMS, seed=2) != src
    assert made.source(DIMS, seed=1, hard=synth.HardCases(zero_blocks=1)) != src
    out = made.converted(src, "nvfp4")
    assert made.pair("nvfp4", dims=DIMS, seed=1) == (src, out)
    assert made.converted(src, "nvfp4", Options(engine="sglang")) != out
    assert made.converted(src, "w4a16") != out
    assert len(os.listdir(tmp_path)) == 6   # three sources, three conversions: each built once
    with Checkpoint.open(out) as ck:
        assert any(n.endswith(".weight_scale_2") for n in ck.names)


def test_shared_paths_are_read_only_and_a_change_is_caught(tmp_path):
    made = Checkpoints(tmp_path / "made")
    src = made.source(DIMS)
    for root, dirs, files in os.walk(src):
        for p in [root] + [os.path.join(root, n) for n in files]:
            assert not os.stat(p).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), p
    assert made.changed() == []
    config = os.path.join(src, "config.json")
    os.chmod(config, 0o644)   # what a careless test (or root, which mode bits do not stop) could do
    with open(config, "a") as f:
        f.write(" ")
    assert made.changed() == [config]


def test_copy_is_writable_and_keeps_holes(tmp_path):
    made = Checkpoints(tmp_path / "made")
    release = made.release()
    copy = made.copy(release, tmp_path / "copy")
    shards = sorted(n for n in os.listdir(release) if n.endswith(".safetensors"))
    assert shards == sorted(n for n in os.listdir(copy) if n.endswith(".safetensors")) and len(shards) == 46
    for name in shards:
        a, b = os.stat(os.path.join(release, name)), os.stat(os.path.join(copy, name))
        assert a.st_size == b.st_size and b.st_blocks * 512 < (1 << 20) + a.st_blocks * 512, name
    with open(os.path.join(copy, shards[0]), "rb") as f, open(os.path.join(release, shards[0]), "rb") as g:
        assert f.read(1 << 16) == g.read(1 << 16)   # the header, byte for byte
    with open(os.path.join(copy, "config.json"), "a") as f:
        f.write(" ")
    assert os.access(copy, os.W_OK) and made.changed() == []
