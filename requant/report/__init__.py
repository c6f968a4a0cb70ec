"""requant report: the accuracy difference between two checkpoints of the same model.

`make_report` compares every routed expert (weights.py, build.py), adds requant validate's
MoE-forward comparison and engines.serve_paths.compare_paths' serving-path comparison of the source, and writes report.json, report.md,
report.html and the PNG plots into one directory. Schema: docs/report-schema.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict

from requant.errors import RequantError
from requant.report import build, html, render

log = logging.getLogger(__name__)


def forward_section(src: str, dst: str, blocks: list[str], tokens: int = 64,
                    serve_modes: list[str] | None = None) -> dict:
    """requant validate's MoE-layer comparison: every selected layer on a GPU; on a CPU (the torch
    reference, no kernel) only the first selected layer, with fewer tokens. Says what ran where."""
    import torch

    try:
        from requant.validate import validate
    except ImportError:
        return {"status": "not run", "reason": "validate unavailable: requant.validate is not in this install"}
    from requant.compute import kernel_device

    gpu = kernel_device(None) == "cuda"
    chosen = blocks if gpu else blocks[:1]
    tokens = tokens if gpu else min(tokens, 16)
    try:
        result = validate(src, dst, layers=",".join(chosen), tokens=tokens, device="cuda" if gpu else "cpu",
                          progress=False, serve_modes=serve_modes)
    except (RequantError, ImportError, RuntimeError) as e:
        return {"status": "not run", "reason": f"validate failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}
    device = f"cuda ({torch.cuda.get_device_name()})" if gpu else "cpu (torch reference, kernel not run)"
    return {
        "status": "run", "device": device,
        "what": f"requant validate: {tokens} tokens through each MoE layer (router, routed experts "
                + ("in requant's fused-MoE kernel" if gpu else "in the torch reference") + ", shared expert), "
                f"{len(chosen)} of {len(blocks)} selected layers" + ("" if gpu else "; CPU subsample, no GPU used"),
        "passed": all(r.passed for r in result.layers),
        "by_layer": [{"block": r.layer, "rel_error": r.rel_err, "max_abs_error": r.max_abs_err, "cosine": r.cosine,
                      "routing_agreement": r.routing_agreement, "passed": r.passed,
                      "serving": [asdict(s) for s in r.serving]} for r in result.layers],
    }


# compare_paths in a report: the first selected layer, at most this many tokens and experts (a
# full-size DeepSeek-V4-Flash expert took ~1.5 s on 2 cores, decoded and re-encoded 5 ways: 32 in 49 s).
PATHS_TOKENS = 16
PATHS_EXPERTS = 32


def paths_section(src: str, blocks: list[str], tokens: int = PATHS_TOKENS, experts: int | None = PATHS_EXPERTS) -> dict:
    """engines.serve_paths.compare_paths on the source's first selected layer: the source as each engine runs it
    against each conversion requant could write (made in memory), on the same inputs."""
    from requant.errors import UnsupportedError
    from requant.engines.serve_paths import compare_paths

    chosen = blocks[:1]
    try:
        result = compare_paths(src, chosen, tokens=tokens, experts=experts)
    except UnsupportedError as e:
        return {"status": "not run", "reason": str(e).splitlines()[0]}
    except (RequantError, ImportError, RuntimeError) as e:
        return {"status": "not run", "reason": f"compare_paths failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}
    layer = result["layers"][0]
    what = (f"{layer['tokens']} tokens through {layer['block']} of the source (CPU torch, FP32), the conversions made "
            f"in memory; {layer['experts_computed']} experts computed"
            + (f" (the {experts} most chosen; {layer['pairs_dropped']} of {layer['pairs'] + layer['pairs_dropped']} "
               f"token-expert pairs dropped in every path)" if layer["pairs_dropped"] else ""))
    return {"status": "run", "what": what, **result}


def _one_source_row(report: dict) -> None:
    """The source as an engine runs it is the serving paths' number where they ran on that layer
    (`mxfp4:mxfp4-w4a8`); the forward section's own source rows for the layer, the same quantity
    measured once more (on a GPU with other tokens), are left out so each number has one source."""
    paths, forward = report["paths"], report["forward"]
    if paths.get("status") != "run" or forward.get("status") != "run":
        return
    covered = {layer["block"] for layer in paths["layers"]}
    for row in forward["by_layer"]:
        if row["block"] in covered:
            row["serving"] = [s for s in row["serving"] if s.get("side", "candidate") != "source"]


def make_report(src: str, dst: str, out_dir: str, layers: str | None = None, workers: int | None = None,
                progress: bool = True, forward: bool = True, serve_modes: list[str] | None = None,
                device: str | None = None, paths: bool = True) -> dict:
    """`paths`: also run paths_section (with the forward comparison only)."""
    started = time.monotonic()
    report = build.build(src, dst, layers, workers, progress, device)
    log.info("compared the weights of %d experts in %d blocks in %.2f s (%s)", report["selection"]["experts_compared"],
             len(report["selection"]["blocks"]), time.monotonic() - started, report["timing"].get("comparison"))
    step = time.monotonic()
    report["forward"] = (forward_section(src, dst, report["selection"]["blocks"], serve_modes=serve_modes) if forward
                         else {"status": "not run", "reason": "not requested (--no-forward)"})
    log.info("MoE forward comparison: %s in %.2f s", report["forward"].get("device") or report["forward"].get("reason"),
             time.monotonic() - step)
    step = time.monotonic()
    report["paths"] = (paths_section(src, report["selection"]["blocks"]) if forward and paths
                       else {"status": "not run", "reason": "not requested" + (" (--no-forward)" if not forward else "")})
    log.info("serving paths: %s in %.2f s", report["paths"]["status"], time.monotonic() - step)
    _one_source_row(report)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    images = html.write(report, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(render.markdown(report, images, html.plots_missing()))
    log.info("wrote report.json, report.md, report.html and %d plots into %s", len(images), out_dir)
    return report
