"""The layer error of each serving path as scripts/measure_paths.py measured it on a synthetic
full-size DeepSeek-V4-Flash layer (requant.engines.serve_paths.compare_paths): `advise` quotes it, since it reads
no weights; `validate` and `report` measure the same paths on the checkpoint's own layers."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

MEASURED = Path(__file__).resolve().parent / "data" / "layer_errors.json"


@lru_cache(maxsize=None)
def measured_errors() -> dict[str, dict]:
    """compare_paths' path name ("mxfp4:mxfp4-w4a8", "w4a16-g32-sym:bf16", ...) -> {"rel_error",
    "sqnr_db", "basis"}."""
    data = json.loads(MEASURED.read_text())
    basis = f"routed experts of a synthetic {data['model']} layer, {data['tokens']} tokens; not this checkpoint"
    return {path: {**r, "basis": basis} for path, r in data["paths"].items()}
