"""The conversion pipeline: plan from metadata, then stream tensors shard by shard.

Output shards are written under a temporary name, fsynced, read back and renamed; config files and
the index come last, so a directory without its index is never a loadable checkpoint.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

from tqdm import tqdm

from requant.errors import CheckpointError, RequantError
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, resolve_inside
from requant.io.fsutil import atomic_write_json, free_bytes, fsync_dir
from requant.io.safetensors import ShardWriter, read_header
from requant.plan import Plan, ShardPlan, make_plan
from requant.targets import Options, Stats

PARTIAL_SUFFIX = ".partial"


@dataclass
class Result:
    plan: Plan
    stats: Stats
    bytes_in: int
    bytes_out: int
    seconds: float


def plan_conversion(src: str, out_format: str, options: Options, in_format: str = "mxfp4") -> Plan:
    return make_plan(Checkpoint.open(src), out_format, options, in_format)


def convert(src: str, dst: str, out_format: str, options: Options, in_format: str = "mxfp4",
            workers: int = 1, progress: bool = True) -> Result:
    """Convert checkpoint `src` into a new directory `dst`."""
    started = time.monotonic()
    plan = plan_conversion(src, out_format, options, in_format)
    _check_destination(plan, dst)
    created = not os.path.exists(dst)
    os.makedirs(dst, exist_ok=True)
    stats = Stats()
    try:
        with tqdm(total=plan.output_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                  desc="converting", disable=not progress, dynamic_ncols=True) as bar:
            for shard in plan.shards:
                stats.add(write_shard(plan, shard, dst, workers, bar))
        copy_ancillary(plan.source.path, dst, set(plan.source.shard_names))
        finish_metadata(plan, dst)
    except BaseException:
        _discard_output(dst, created, plan)
        raise
    finally:
        plan.source.close()
    return Result(plan, stats, plan.input_bytes, _dir_tensor_bytes(dst, plan), time.monotonic() - started)


def _check_destination(plan: Plan, dst: str) -> None:
    src = os.path.realpath(plan.source.path)
    real = os.path.realpath(dst)
    if real == src or real.startswith(src + os.sep) or src.startswith(real + os.sep):
        raise RequantError(f"destination {dst} overlaps the source {plan.source.path}")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise RequantError(f"destination {dst} exists and is not an empty directory")
    need = plan.output_bytes
    have = free_bytes(dst)
    if have < need:
        raise RequantError(f"not enough free space for {dst}: need {need:,} bytes, {have:,} available")


def write_shard(plan: Plan, shard: ShardPlan, dst: str, workers: int, bar) -> Stats:
    """Write one output shard. Worker threads read and encode experts; this thread writes, so
    disk writes overlap with encoding. Copies go through the kernel (copy_file_range)."""
    final = os.path.join(dst, shard.name)
    partial = final + PARTIAL_SUFFIX
    writer = ShardWriter(partial, shard.specs)
    stats = Stats()
    source = plan.source

    def encode(unit):
        outputs, unit_stats = unit.encode({name: source.tensor(name) for name in unit.inputs})
        return unit, outputs, unit_stats

    def drain(pending, mode):
        done, rest = wait(pending, return_when=mode)
        for future in done:
            unit, outputs, unit_stats = future.result()
            for spec in unit.outputs:
                writer.write(spec.name, outputs[spec.name])
            stats.add(unit_stats)
            bar.update(sum(s.nbytes for s in unit.outputs))
        return rest

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            pending = set()
            for unit in shard.units:
                if unit.encode is None:
                    info = source.info(unit.inputs[0])
                    writer.copy_from(unit.outputs[0].name, source.fd(source.locations[unit.inputs[0]]), info.start)
                    bar.update(info.nbytes)
                    continue
                pending.add(pool.submit(encode, unit))
                if len(pending) > 2 * max(1, workers):  # bounded: memory stays a few experts deep
                    pending = drain(pending, FIRST_COMPLETED)
            drain(pending, ALL_COMPLETED)
        writer.close()
    except BaseException:
        writer.abort()
        _remove(partial)
        raise
    _verify_written(partial, shard)
    os.replace(partial, final)
    fsync_dir(dst)
    bar.update(shard.file_size - sum(s.nbytes for s in shard.specs))  # header bytes
    return stats


def _verify_written(path: str, shard: ShardPlan) -> None:
    header = read_header(path)
    expected = {s.name: s for s in shard.specs}
    if header.file_size != shard.file_size or {n: i.spec for n, i in header.tensors.items()} != expected:
        raise CheckpointError("written shard does not read back as planned", file=path)


def copy_ancillary(src: str, dst: str, shard_names: set[str]) -> None:
    """Copy tokenizer files, generation config, reference code...: everything but the weights and
    the metadata the conversion rewrites. Hidden entries (caches, VCS) are skipped."""
    skip = shard_names | {INDEX_NAME, CONFIG_NAME, "hf_quant_config.json"}
    for entry in sorted(os.listdir(src)):
        if entry in skip or entry.startswith("."):
            continue
        path = resolve_inside(src, entry)
        target = os.path.join(dst, entry)
        if os.path.isdir(path):
            shutil.copytree(path, target, symlinks=False, dirs_exist_ok=True)
        else:
            shutil.copyfile(path, target)


def finish_metadata(plan: Plan, dst: str) -> None:
    """config.json and sibling files, then the index: the last write makes the output loadable."""
    for name, content in plan.target.extra_files(plan.blocks).items():
        atomic_write_json(os.path.join(dst, name), content)
    atomic_write_json(os.path.join(dst, CONFIG_NAME), plan.target.config(plan.blocks))
    metadata = dict(plan.source.index_metadata)
    metadata["total_size"] = plan.total_size
    atomic_write_json(os.path.join(dst, INDEX_NAME), {"metadata": metadata, "weight_map": plan.weight_map})


def _dir_tensor_bytes(dst: str, plan: Plan) -> int:
    return sum(os.path.getsize(os.path.join(dst, s.name)) for s in plan.shards)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _discard_output(dst: str, created: bool, plan: Plan) -> None:
    """After a failure, leave nothing that could pass for a finished conversion."""
    if created:
        shutil.rmtree(dst, ignore_errors=True)
        return
    for shard in plan.shards:
        _remove(os.path.join(dst, shard.name))
        _remove(os.path.join(dst, shard.name + PARTIAL_SUFFIX))
    for name in (INDEX_NAME, CONFIG_NAME, *plan.target.extra_files(plan.blocks)):
        _remove(os.path.join(dst, name))


def describe_plan(plan: Plan, dst: str) -> dict:
    return {
        "source": plan.source.path,
        "source_format": plan.source_format,
        "target": plan.target.name,
        "shards": len(plan.shards),
        "converted_blocks": plan.blocks,
        "tensors": dict(plan.counts),
        "output_tensors": sum(len(s.specs) for s in plan.shards),
        "input_bytes": plan.input_bytes,
        "output_bytes": plan.output_bytes,
        "free_bytes_needed": plan.output_bytes,
        "free_bytes_available": free_bytes(dst),
    }


def format_plan(d: dict) -> str:
    counts = ", ".join(f"{v:,} {k}" for k, v in d["tensors"].items())
    ok = d["free_bytes_available"] >= d["free_bytes_needed"]
    return "\n".join([
        f"plan: {d['source_format']} -> {d['target']}, {d['shards']} shards, "
        f"{len(d['converted_blocks'])} MoE blocks converted",
        f"  tensors   {counts}; {d['output_tensors']:,} written",
        f"  bytes     in {d['input_bytes']:,}, out {d['output_bytes']:,}",
        f"  disk      needs {d['free_bytes_needed']:,} free, {d['free_bytes_available']:,} available"
        + ("" if ok else "  (NOT ENOUGH)"),
    ])


def describe_result(r: Result) -> dict:
    s = r.stats
    return {
        "target": r.plan.target.name,
        "tensors_converted": s.tensors_converted,
        "blocks": s.blocks,
        "exact_blocks": s.exact_blocks,
        "requantized_blocks": s.requantized_blocks,
        "bytes_in": r.bytes_in,
        "bytes_out": r.bytes_out,
        "seconds": round(r.seconds, 3),
        "summary": r.plan.target.summary(s),
    }


def format_result(d: dict) -> str:
    rate = d["bytes_out"] / d["seconds"] / 2**20 if d["seconds"] else 0.0
    return (f"converted {d['tensors_converted']:,} expert tensors to {d['target']} in {d['seconds']:.1f} s "
            f"({rate:,.0f} MiB/s): {d['summary']}; bytes in {d['bytes_in']:,}, out {d['bytes_out']:,}")
