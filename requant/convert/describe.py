"""A plan and a result as data (for --json) and as the lines `requant convert` prints."""

from __future__ import annotations

import textwrap

from requant.io import fsutil
from requant.plan import Plan

from requant.convert.outputs import space_needed, untouched, verbatim
from requant.convert.pipeline import Result


def describe_plan(plan: Plan, dst: str | None, in_place: bool = False, source: str | None = None) -> dict:
    # the shards that keep the source's bytes: left where they are in place, else linked or copied whole
    unchanged = [s for s in plan.shards if (untouched(s) if in_place else verbatim(s))]
    return {
        "source": source or plan.source.path,
        "source_format": plan.source_format,
        "target": plan.target.name,
        "engine": plan.target.engine.label,
        "mtp": plan.target.describe_options()["mtp"],   # a graft names its donor
        "shards": len(plan.shards),
        "converted_blocks": plan.blocks,
        "tensors": dict(plan.counts),
        "output_tensors": sum(len(s.specs) for s in plan.shards),
        "input_bytes": plan.input_bytes,              # shard file sizes (headers included)
        "output_bytes": plan.output_bytes,
        "input_tensor_bytes": plan.source.tensor_bytes,   # tensor data alone (inspect's figure)
        "output_tensor_bytes": plan.total_size,
        "unchanged_shards": {"as": "keep" if in_place else plan.verbatim_as, "shards": [s.name for s in unchanged],
                             "bytes": sum(plan.source.headers[s.name].file_size for s in unchanged)},
        "free_bytes_needed": space_needed(plan, in_place)[0],
        "free_bytes_available": fsutil.free_bytes(plan.source.path if in_place else dst),
    }


def format_plan(d: dict) -> str:
    counts = ", ".join(f"{v:,} {k}" for k, v in d["tensors"].items())
    ok = d["free_bytes_available"] >= d["free_bytes_needed"]
    return "\n".join([
        f"plan: {d['source_format']} -> {d['target']} for {d['engine']}, {d['shards']} shards, "
        f"{len(d['converted_blocks'])} MoE layers converted (MTP experts: {d['mtp']})",
        f"  tensors   {counts}; {d['output_tensors']:,} written",
        f"  files     in {d['input_bytes']:,} bytes, out {d['output_bytes']:,} (shard file sizes)",
        f"  data      in {d['input_tensor_bytes']:,} bytes, out {d['output_tensor_bytes']:,} (tensor data)",
        *_unchanged_line(d["unchanged_shards"]),
        f"  disk      needs {d['free_bytes_needed']:,} free, {d['free_bytes_available']:,} available"
        + ("" if ok else "  (NOT ENOUGH)"),
    ])


_UNCHANGED_AS = {"link": "hard-linked to the source's files (no new disk)",
                 "copy": "copied whole (--copy-all, or no hard link can be made there)",
                 "keep": "left where they are"}


def _unchanged_line(u: dict) -> list[str]:
    """The shards that keep the source's bytes, every one named (wrapped under the line)."""
    if not u["shards"]:
        return []
    return [f"  unchanged {len(u['shards'])} shards, {u['bytes']:,} bytes, {_UNCHANGED_AS[u['as']]}:",
            *textwrap.wrap(", ".join(u["shards"]), 100, initial_indent=" " * 12, subsequent_indent=" " * 12)]


def describe_result(r: Result) -> dict:
    s = r.stats
    return {
        "target": r.plan.target.name,
        "engine": r.plan.target.engine.label,
        "tensors_converted": s.tensors_converted,
        "blocks": s.blocks,
        "exact_blocks": s.exact_blocks,
        "requantized_blocks": s.requantized_blocks,
        "bytes_in": r.bytes_in,
        "bytes_out": r.bytes_out,
        "seconds": round(r.seconds, 3),
        "summary": r.plan.target.summary(s),
        "shards_kept": r.shards_kept,             # finished by an earlier run (--resume)
        "shards_converted": r.shards_converted,   # written now
        "bytes_converted": r.bytes_out if r.bytes_converted is None else r.bytes_converted,   # by this run
    }


def format_result(d: dict) -> str:
    """The summary line; after a resume the rate is over what this run converted, and the line says
    how many shards were kept from the earlier run."""
    kept, now = d.get("shards_kept", 0), d.get("shards_converted")
    rate = d.get("bytes_converted", d["bytes_out"]) / d["seconds"] / 2**20 if d["seconds"] else 0.0
    speed = (f"{rate:,.0f} MiB/s" if not kept else f"{rate:,.0f} MiB/s over the shards converted now" if now
             else "nothing left to convert")
    resumed = f"; {kept} shards kept from the earlier run, {now} converted now" if kept else ""
    return (f"converted {d['tensors_converted']:,} expert tensors to {d['target']} for {d['engine']} in {d['seconds']:.1f} s "
            f"({speed}): {d['summary']}{resumed}; shard file sizes in {d['bytes_in']:,} bytes, out {d['bytes_out']:,}")
