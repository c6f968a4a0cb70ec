"""Open a checkpoint that may be damaged: every unreadable shard or index mismatch becomes a
finding instead of an exception, and whatever can be read is returned for the other checks."""

from __future__ import annotations

import os

from requant.errors import CheckpointError
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json, resolve_inside
from requant.io.safetensors import read_header
from requant.verify.findings import Findings


def open_leniently(path: str, out: Findings, files: dict | None = None) -> Checkpoint | None:
    """Open what can be opened, reporting every unreadable shard or index mismatch as a finding.
    `files`: config.json and the index as a conversion is about to write them, read instead of
    the disk's (whose shards are read as they are)."""
    files = files or {}
    try:
        config = files[CONFIG_NAME] if CONFIG_NAME in files else read_json(os.path.join(path, CONFIG_NAME))
        index_path = os.path.join(path, INDEX_NAME)
        if INDEX_NAME in files:
            index = files[INDEX_NAME]
        elif not os.path.exists(index_path):
            return Checkpoint.open(path)   # single-file checkpoint: nothing to cross-check
        else:
            index = read_json(index_path)
    except CheckpointError as e:
        out.add("error", "unreadable", "checkpoint cannot be opened", detail=str(e))
        return None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        out.add("error", "index", "weight_map is missing or not a map of tensor name to shard file", INDEX_NAME)
        return None
    headers = {}
    for shard in dict.fromkeys(weight_map.values()):
        try:
            shard_path = resolve_inside(path, shard, "shard")
            if not os.path.isfile(shard_path):
                raise CheckpointError("shard named by the index is missing", file=shard_path)
            headers[shard] = read_header(shard_path)
        except CheckpointError as e:
            out.add("error", "shard-unreadable", "shard cannot be read (missing, truncated or corrupt header)",
                    shard, str(e))
    locations: dict[str, str] = {}
    for shard, header in headers.items():
        for name in header.tensors:
            if name in locations:
                out.add("error", "duplicate-tensor", "tensor stored in two shards", name, f"{locations[name]}, {shard}")
            locations[name] = shard
    for name, shard in weight_map.items():
        if shard in headers and locations.get(name) != shard:
            out.add("error", "index-tensor-missing", "tensor named by the index is not in the shard it names",
                    name, shard)
    for name, shard in locations.items():
        if name not in weight_map:
            out.add("warning", "unindexed-tensor", "tensor stored in a shard but absent from the index", name, shard)
    metadata = index.get("metadata") or {}
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is None:
        out.add("info", "no-total-size", "the index has no metadata.total_size")
    elif len(headers) == len(set(weight_map.values())):
        actual = sum(i.nbytes for h in headers.values() for i in h.tensors.values())
        if total != actual:
            out.add("error", "total-size", "index metadata.total_size disagrees with the tensor bytes in the shards",
                    INDEX_NAME, f"total_size {total:,}, shards hold {actual:,}")
    return Checkpoint(path, config, list(headers), headers, locations, metadata if isinstance(metadata, dict) else {})
