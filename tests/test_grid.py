"""Property grid: every combination of expert dimensions x output format x W4A16 group size x scheme x
MTP policy either converts to a checkpoint that verify passes, or is refused with one line and a
non-zero exit. Never a traceback (internal error), never an output that looks finished after a refusal.

Dimensions are the small shapes where layouts degenerate: one W4A16 group per row (K equal to the group
size, once a crash), a single FP8 block, wide intermediate. Each case gets its own seeded checkpoint
with the cast's hard cases planted in seeded amounts.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME
from requant.verify import verify

DIMS = [(128, 128), (128, 256), (384, 128)]          # (hidden, moe_intermediate)
GROUPS = [None, "32", "64", "128"]                    # None: the target's default
SCHEMES = [None, "sym", "asym"]
MTP = [None, "keep", "convert"]
SEED = 11


def _cases():
    for (hidden, inter), out, group, scheme, mtp in itertools.product(DIMS, ["nvfp4", "w4a16"], GROUPS, SCHEMES, MTP):
        if out == "nvfp4" and (group, scheme) not in ((None, None), ("64", "asym")):
            continue   # nvfp4 ignores neither: one combination proves the refusal
        yield hidden, inter, out, group, scheme, mtp


CASES = list(_cases())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    rng = random.Random(SEED)
    out = {}
    for i, (hidden, inter) in enumerate(DIMS):
        path = str(root / f"h{hidden}-i{inter}")
        hard = synth.HardCases(out_of_window=rng.randint(0, 2), zero_blocks=rng.randint(0, 2),
                               neg_zero_blocks=rng.randint(0, 1))
        synth.write_checkpoint(path, synth.Dims(layers=1, experts=6, hidden=hidden, intermediate=inter,
                                                hash_layers=1), seed=SEED + i, hard=hard)
        out[hidden, inter] = path
    return out


def test_grid_converts_or_refuses_in_one_line(sources, tmp_path):
    assert len(CASES) > 80
    outcomes = {"converted": 0, "refused": 0}
    for n, (hidden, inter, out, group, scheme, mtp) in enumerate(CASES):
        dst = str(tmp_path / f"case{n}")
        args = ["convert", sources[hidden, inter], dst, "--out", out, "--quiet"]
        for flag, value in (("--group-size", group), ("--scheme", scheme), ("--mtp", mtp)):
            args += [flag, value] if value else []
        case = " ".join(args[3:])
        result = CliRunner().invoke(cli, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), f"{case}: {result.exception!r}"
        if result.exit_code == 0:
            outcomes["converted"] += 1
            found = verify(dst, progress=False)
            assert found["ok"], f"{case}: {found['findings']}"
            continue
        outcomes["refused"] += 1
        lines = result.stderr.strip().splitlines()
        assert result.exit_code in (1, 2) and len(lines) == 1 and lines[0].startswith("requant: error: "), \
            f"{case}: exit {result.exit_code}, {result.stderr!r}"
        assert "internal error" not in lines[0], f"{case}: {lines[0]}"
        finished = [name for name in (CONFIG_NAME, INDEX_NAME) if os.path.exists(os.path.join(dst, name))]
        assert not finished, f"{case}: refused, but left {finished} in {dst}"
    # Both outcomes occur: refusals (w4a16 with --mtp keep, nvfp4 with W4A16 options) and conversions.
    assert outcomes["converted"] >= 40 and outcomes["refused"] >= 10, outcomes
