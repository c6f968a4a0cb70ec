"""requant report: the accuracy difference between two checkpoints of the same model.

`make_report` compares every routed expert (weights.py, build.py), adds the MoE-forward
comparison when requant.validate is available, and writes report.json, report.md,
report.html and the PNG plots into one directory. Schema: docs/report-schema.md.
"""

from __future__ import annotations

import json
import os

from requant.report import build, html, render


def forward_section() -> dict:
    """The MoE-forward comparison, or why it was not run."""
    try:
        from requant import validate  # noqa: F401  (written in parallel; integrated once it lands)
    except ImportError:
        return {"status": "not run", "reason": "validate unavailable: requant.validate is not in this install"}
    return {"status": "not run", "reason": "validate unavailable: requant.validate has no report entry point yet"}


def make_report(src: str, dst: str, out_dir: str, layers: str | None = None, workers: int | None = None,
                progress: bool = True) -> dict:
    report = build.build(src, dst, layers, workers, progress)
    report["forward"] = forward_section()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    images = html.write(report, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(render.markdown(report, images))
    return report
