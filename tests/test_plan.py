"""The planner (`plan_conversion`, `requant convert --dry-run`) on header-only checkpoints.

The full-scale checkpoint is the public DeepSeek-V4-Flash release as its headers declare it
(tests/fixtures: every tensor's name, dtype, shape and shard; the data sections are holes), so what
the plan must contain is worked out here from that listing and the formats' documented layouts
(NVFP4: ModelOpt's; W4A16: compressed-tensors' pack-quantized), not from requant's own tables.
Refusals run on a reduced sparse synthetic checkpoint whose config.json is edited.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.convert import plan_conversion
from requant.errors import RequantError
from requant.targets import Options
from requant.targets.w4a16 import W4A16Options
from tests import release_fixture

ROUTED = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")
NVFP4_GROWTH_PER_LAYER = 201_332_736   # bytes one converted Flash layer grows by (scale bytes doubled, scalars)


def release_listing() -> dict[str, list[tuple[str, str, tuple]]]:
    """Shard name -> its tensors (name, dtype, shape), in file order."""
    fixture = release_fixture.load()
    shards: dict[str, list] = {}
    for name, dtype, shape, number in release_fixture.expand(fixture):
        shards.setdefault(synth.shard_name(number - 1, fixture["num_shards"]), []).append((name, dtype, tuple(shape)))
    return shards


def nvfp4_outputs(name: str, shape: tuple) -> list[tuple]:
    out, half_in = shape
    return [(f"{name}.weight", "U8", (out, half_in)), (f"{name}.weight_scale", "F8_E4M3", (out, half_in * 2 // 16)),
            (f"{name}.weight_scale_2", "F32", ()), (f"{name}.input_scale", "F32", ())]


def w4a16_outputs(name: str, shape: tuple, group: int, zero_points: bool = False) -> list[tuple]:
    out, k = shape[0], shape[1] * 2
    specs = [(f"{name}.weight_packed", "I32", (out, k // 8)), (f"{name}.weight_scale", "BF16", (out, k // group)),
             (f"{name}.weight_shape", "I64", (2,))]
    return specs + ([(f"{name}.weight_zero_point", "I32", (out // 8, k // group))] if zero_points else [])


def fp8_scale_as_f32(name: str, dtype: str, shape: tuple) -> tuple | None:
    """compressed-tensors' name and dtype for an FP8-block linear's E8M0 scale: exact F32 powers of two."""
    if name.endswith(".scale") and dtype == "F8_E8M0":
        return name[: -len(".scale")] + ".weight_scale", "F32", shape
    return None


def expected_shards(listing: dict, converted_blocks: set[str], expert_outputs, rewrite=None) -> dict[str, dict]:
    """Per shard: the routed-expert outputs (a set), the other tensors (in order), and the counts."""
    out = {}
    for shard, tensors in listing.items():
        experts, others, counts = set(), [], {"converted tensors": 0, "passed through": 0, "rewritten": 0}
        for name, dtype, shape in tensors:
            m = ROUTED.match(name)
            if m and m[1] in converted_blocks:
                counts["converted tensors"] += 1
                if m[2] == "weight":
                    experts.update(expert_outputs(name[: -len(".weight")], shape))
                continue
            new = rewrite(name, dtype, shape) if rewrite else None
            counts["rewritten" if new else "passed through"] += 1
            others.append(new or (name, dtype, shape))
        out[shard] = {"experts": experts, "others": others, "counts": counts}
    return out


def check_plan(plan, expected: dict[str, dict]) -> None:
    assert [s.name for s in plan.shards] == list(expected)
    totals: dict[str, int] = {}
    for shard in plan.shards:
        want = expected[shard.name]
        written = [(s.name, s.dtype, tuple(s.shape)) for s in shard.specs]
        assert len(written) == len(set(written)), f"{shard.name}: a tensor planned twice"
        experts = {t for t in written if ".ffn.experts." in t[0] and t not in want["others"]}
        others = [t for t in written if t not in experts]
        assert experts == want["experts"], f"{shard.name}: routed-expert outputs differ"
        assert others == want["others"], f"{shard.name}: the other tensors differ (order kept)"
        for k, v in want["counts"].items():
            totals[k] = totals.get(k, 0) + v
    assert dict(plan.counts) == {k: v for k, v in totals.items() if v}


@pytest.fixture(scope="module")
def listing():
    return release_listing()


@pytest.fixture(scope="module")
def release(checkpoints):
    return checkpoints.release()


@pytest.fixture(scope="module")
def flash_blocks(listing):
    return sorted({m[1] for ts in listing.values() for n, _, _ in ts if (m := ROUTED.match(n))},
                  key=lambda b: (b.startswith("mtp"), int(b.rsplit(".", 1)[1])))


def test_release_is_header_only_at_full_size(release, listing):
    fixture = release_fixture.load()
    shards = [os.path.join(release, s) for s in listing]
    assert sum(os.path.getsize(p) for p in shards) > fixture["total_size"]   # headers plus every tensor's bytes
    assert sum(os.stat(p).st_blocks * 512 for p in shards) < 64 << 20        # ... of which almost none on disk
    assert sum(len(ts) for ts in listing.values()) == fixture["num_tensors"] == 69_187


def test_nvfp4_plan_of_the_release(release, listing, flash_blocks):
    plan = plan_conversion(release, "nvfp4", Options())
    # vLLM (the default engine) loads the MTP block's experts with the NVFP4 method too
    assert plan.blocks == flash_blocks and len(flash_blocks) == 43 + 1
    assert plan.source_format == "mxfp4" and plan.target.name == "nvfp4"
    check_plan(plan, expected_shards(listing, set(flash_blocks), nvfp4_outputs))
    assert plan.counts == {"converted tensors": 44 * 256 * 6, "passed through": 69_187 - 44 * 256 * 6}
    # a converted layer's shard grows by the same bytes; the embedding and head shards do not change
    for shard in plan.shards:
        source_bytes = sum(i.nbytes for i in plan.source.headers[shard.name].tensors.values())
        growth = sum(s.nbytes for s in shard.specs) - source_bytes
        converts = any(".ffn.experts." in s.name for s in shard.specs)
        assert growth == (NVFP4_GROWTH_PER_LAYER if converts else 0), shard.name
    assert plan.total_size == release_fixture.load()["total_size"] + 44 * NVFP4_GROWTH_PER_LAYER


def test_w4a16_plan_of_the_release(release, listing, flash_blocks):
    plan = plan_conversion(release, "w4a16", Options())   # group 128, symmetric: no zero points
    assert plan.blocks == flash_blocks
    expected = expected_shards(listing, set(flash_blocks), lambda n, s: w4a16_outputs(n, s, 128), fp8_scale_as_f32)
    check_plan(plan, expected)
    rewritten = sum(e["counts"]["rewritten"] for e in expected.values())
    # attention (5 linears), shared experts (3) per block, the indexer's wq_b on the 21 layers that
    # have one, and the MTP block's e_proj / h_proj
    assert rewritten == 44 * (5 + 3) + 21 + 2
    assert plan.counts["converted tensors"] == 44 * 256 * 6


@pytest.fixture(scope="module")
def reduced(checkpoints):
    """The default model at reduced dimensions, headers only."""
    return checkpoints.source(synth.Dims(), sparse=True)


def reduced_listing(path: str) -> dict[str, list[tuple]]:
    from requant.io.checkpoint import Checkpoint

    with Checkpoint.open(path) as ck:
        return {shard: [(i.spec.name, i.spec.dtype, tuple(i.spec.shape)) for i in ck.headers[shard].tensors.values()]
                for shard in ck.shard_names}


def test_sglang_keeps_the_mtp_experts(reduced):
    """SGLang loads its NextN block's experts as MXFP4, so they pass through byte for byte."""
    plan = plan_conversion(reduced, "nvfp4", Options(engine="sglang"))
    layers = [f"layers.{i}" for i in range(synth.Dims().layers)]
    assert plan.blocks == layers
    check_plan(plan, expected_shards(reduced_listing(reduced), set(layers), nvfp4_outputs))


def test_w4a16_asym_plans_zero_points(reduced):
    plan = plan_conversion(reduced, "w4a16", Options(target=W4A16Options(group_size=32, scheme="asym")))
    blocks = {*(f"layers.{i}" for i in range(synth.Dims().layers)), "mtp.0"}
    check_plan(plan, expected_shards(reduced_listing(reduced), blocks,
                                     lambda n, s: w4a16_outputs(n, s, 32, zero_points=True), fp8_scale_as_f32))


def test_dry_run_prints_the_plan_and_writes_nothing(reduced, tmp_path):
    dst = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", reduced, str(dst), "--out", "nvfp4", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    plan = plan_conversion(reduced, "nvfp4", Options())
    assert (shown["shards"], shown["converted_blocks"], shown["tensors"]) == (len(plan.shards), plan.blocks, dict(plan.counts))
    assert (shown["output_tensors"], shown["output_tensor_bytes"], shown["output_bytes"]) == \
        (len(plan.weight_map), plan.total_size, plan.output_bytes)
    assert shown["input_bytes"] == sum(os.path.getsize(os.path.join(reduced, s.name)) for s in plan.shards)
    assert not dst.exists()


def edited(checkpoints, source: str, dest, **config) -> str:
    path = checkpoints.copy(source, dest)
    with open(os.path.join(path, "config.json")) as f:
        content = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**content, **config}, f)
    return path


DIMS = synth.Dims()


@pytest.mark.parametrize("config, named", [
    ({"n_routed_experts": DIMS.experts + 1}, ["n_routed_experts", f"layers.0.ffn.experts.{DIMS.experts}"]),
    ({"hidden_size": DIMS.hidden // 2}, ["layers.0.ffn.experts.0.w1.weight", "hidden_size"]),
    ({"moe_intermediate_size": DIMS.intermediate * 2}, ["layers.0.ffn.experts.0.w1.weight", "moe_intermediate_size"]),
], ids=["more-experts-in-config", "hidden", "intermediate"])
def test_refusals_are_one_line_before_anything_is_written(checkpoints, reduced, tmp_path, config, named):
    src = edited(checkpoints, reduced, tmp_path / "src", **config)
    dst = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", src, str(dst), "--out", "nvfp4", "--dry-run"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("requant: error:"), result.output
    assert all(n in lines[0] for n in named), lines[0]
    assert not dst.exists()


def test_fewer_experts_in_config_than_in_the_checkpoint_is_refused(checkpoints, reduced, tmp_path):
    src = edited(checkpoints, reduced, tmp_path / "src", n_routed_experts=DIMS.experts - 1)
    with pytest.raises(RequantError, match="n_routed_experts"):
        plan_conversion(src, "nvfp4", Options())


def test_full_scale_refusal_names_the_missing_expert(checkpoints):
    with pytest.raises(RequantError, match=r"n_routed_experts.*layers\.0\.ffn\.experts\.256"):
        plan_conversion(checkpoints.release(n_routed_experts=257), "nvfp4", Options())
