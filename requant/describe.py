"""What a checkpoint is: model, expert format, tensor counts and bytes, quantization config."""

from __future__ import annotations

import os
from collections import defaultdict

from requant.io.diagnosis import path_problem
from requant.errors import CheckpointError, RequantError
from requant.card import recorded_engine
from requant.io.checkpoint import Checkpoint
from requant.experts import ExpertIndex
from requant.model import ModelSpec
from requant.targets.nvfp4 import expert_dtype


def inspect_checkpoint(path: str, model: str | None = None) -> dict:
    """What checkpoint `path` holds; `model`: the named model to read it as (--model)."""
    problem = path_problem(path)   # a missing path, a file, an unfinished conversion: verify's words
    if problem is not None:
        raise CheckpointError(problem, file=path)
    with Checkpoint.open(path) as ck:
        by_dtype: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for header in ck.headers.values():
            for info in header.tensors.values():
                by_dtype[info.spec.dtype][0] += 1
                by_dtype[info.spec.dtype][1] += info.nbytes
        try:
            model, no_recipe = ModelSpec.for_checkpoint(ck, model=model, identify=True), None
        except RequantError as e:
            model, no_recipe = None, str(e)
        index = ExpertIndex(model, ck) if model else None
        blocks, drafter_blocks = defaultdict(set), defaultdict(set)
        for block in index.blocks.values() if index else ():
            fmt = block.codec.name if block.codec else "unknown"
            blocks[fmt].add(block.name)
            if not block.main:
                drafter_blocks[fmt].add(block.name)
        main = index.main_codec if index else None
        qc = ck.config.get("quantization_config") or {}
        return {
            "path": os.path.abspath(path),
            "model_type": ck.config.get("model_type"),
            "recipe": model.name if model else None,
            "no_recipe": no_recipe,   # why none is read
            "model": model.model_name if model else None,
            "expert_format": main.name if main else None,
            "expert_blocks_by_format": {fmt: len(b) for fmt, b in sorted(blocks.items())},
            "drafter_blocks_by_format": {fmt: len(b) for fmt, b in sorted(drafter_blocks.items())},   # MTP / DSpark
            "routed_experts": sum(b.count for b in index.blocks.values()) if index else 0,
            "shards": len(ck.shard_names),
            "tensors": len(ck.locations),
            "tensor_bytes": ck.tensor_bytes,                                          # tensor data
            "file_bytes": sum(h.file_size for h in ck.headers.values()),              # shard file sizes
            "index_total_size": ck.index_metadata.get("total_size"),
            "dtypes": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(by_dtype.items())},
            "quantization_config": {
                k: qc.get(k) for k in ("quant_method", "quant_algo", "moe_quant_algo", "group_size", "format")
                if k in qc
            } | ({"quantized_layers": len(qc["quantized_layers"])} if "quantized_layers" in qc else {})
              | ({"ignore": qc["ignore"]} if "ignore" in qc else {})
              | ({"sqnr_db_vs_source": qc["requant_accuracy"].get("sqnr_db")} if "requant_accuracy" in qc else {}),
            "expert_dtype": expert_dtype(model, ck.config)[1] if model else ck.config.get("expert_dtype"),
            "made_for": _made_for(path),
        }


def _made_for(path: str) -> str | None:
    engine = recorded_engine(path)
    return f"{engine['name']} {engine.get('version')}" if engine else None


def _blocks_text(blocks: int, drafter: int) -> str:
    """"43 layers", "3 drafter blocks", "40 layers + 1 drafter block"."""
    parts = [f"{blocks - drafter} layers"] if blocks > drafter else []
    parts += [f"{drafter} drafter block{'s' if drafter > 1 else ''}"] if drafter else []
    return " + ".join(parts)


def format_report(info: dict) -> str:
    lines = [
        f"checkpoint     {info['path']}",
        f"model          {info['model'] or info['model_type']} (recipe: {info['recipe'] or 'none'})",
        f"experts        {info['routed_experts']:,} routed experts, format {info['expert_format'] or 'unknown'}"
        + "".join(f"; {_blocks_text(n, info['drafter_blocks_by_format'].get(fmt, 0))} {fmt}"
                  for fmt, n in info["expert_blocks_by_format"].items()),
        f"shards         {info['shards']}  tensors {info['tensors']:,}",
        f"bytes          tensor data {info['tensor_bytes']:,}; shard file sizes {info['file_bytes']:,}",
    ]
    if info["no_recipe"]:
        lines.insert(2, f"no recipe      {info['no_recipe']}")
    if info["index_total_size"] is not None and info["index_total_size"] != info["tensor_bytes"]:
        lines.append(f"WARNING        index total_size {info['index_total_size']:,} differs from the shards' tensor data")
    lines.append("dtypes")
    for dtype, v in info["dtypes"].items():
        lines.append(f"  {dtype:<9} {v['tensors']:>8,} tensors {v['bytes']:>18,} bytes of tensor data")
    qc = info["quantization_config"]
    lines.append("quantization   " + (", ".join(f"{k}={v}" for k, v in qc.items()) if qc else "none"))
    if info["made_for"]:
        lines.append(f"made for       {info['made_for']} (requant.json; README.md says how to serve it)")
    return "\n".join(lines)
