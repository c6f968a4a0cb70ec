"""Plots (PNG, via matplotlib's Agg backend) and a self-contained report.html.

matplotlib gives labelled axes, legends and colour bars in both the PNG files and the page
without a hand-written rasterizer; the page embeds the same PNGs as data: URIs and uses no
script, font or stylesheet from elsewhere, so it renders offline.
"""

from __future__ import annotations

import base64
import html
import io
import os

from requant.extras import MissingExtra, install_hint, require
from requant.report.render import (METRIC_COLUMNS, NOTE, forward_table, forward_verdict, is_exact, lossy_standing,
                                   metric_rows,
                                   paths_table, paths_verdict, served_table, served_words, verdict)

PLOTS = {
    "sqnr_per_layer.png": "Per-layer SQNR (dB)",
    "forward_error_per_layer.png": "Per-layer MoE forward error",
    "error_histogram.png": "Histogram of |weight error|",
    "exact_block_map.png": "Exact scale blocks per layer and expert",
}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def plots(report: dict) -> dict[str, bytes]:
    """File name -> PNG bytes, for the plots the report's data supports: error plots only where
    there is an error to draw (a lossless conversion gets the exact-block map alone)."""
    plt = _pyplot()
    out = {}
    layers = report["by_layer"]
    labels = [layer["block"] for layer in layers]
    x = range(len(layers))

    if any(layer["metrics"]["sqnr_db"] is not None for layer in layers):
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for proj in report["by_projection"]:
            ys = [layer["by_projection"][proj]["sqnr_db"] for layer in layers]
            ax.plot(x, [float("nan") if y is None else y for y in ys], marker="o", ms=3, label=proj)
        exact = [i for i, layer in enumerate(layers) if layer["metrics"]["sqnr_db"] is None]
        for i in exact:
            ax.axvline(i, color="#2a9d8f", alpha=0.25, lw=6)
        ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
        # from zero: an axis fitted to the data would make a few hundredths of a dB look like a cliff
        finite = [s for layer in layers for s in (v["sqnr_db"] for v in layer["by_projection"].values()) if s is not None]
        ax.set_ylim(bottom=min(0.0, *finite), top=max(finite) * 1.05 if max(finite) > 0 else None)
        ax.set_ylabel("SQNR (dB), higher is better")
        ax.set_title("Weight SQNR per layer" + (" (shaded: exact, SQNR ∞)" if exact else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out["sqnr_per_layer.png"] = _png(fig)

    forward = report.get("forward")
    if forward and forward.get("status") == "run" and any(r["rel_error"] > 0 for r in forward["by_layer"]):
        fig, ax = plt.subplots(figsize=(9, 3.2))
        rows = forward["by_layer"]
        ax.plot(range(len(rows)), [r["rel_error"] for r in rows], marker="o", ms=3)
        ax.set_ylim(bottom=0)   # a linear axis from zero: identical outputs sit on it
        ax.set_xticks(range(len(rows)), [r["block"] for r in rows], rotation=90, fontsize=7)
        ax.set_ylabel("relative output error")
        identical = [r["block"] for r in rows if r["rel_error"] == 0]
        ax.set_title(f"MoE forward error per layer ({forward['device']})"
                     + (f"; identical output: {', '.join(identical)}" if identical else ""))
        ax.grid(alpha=0.3)
        out["forward_error_per_layer.png"] = _png(fig)

    hist = report["error_histogram"]
    if any(any(counts) for counts in hist["by_projection"].values()):
        edges = hist["log10_abs_error_edges"]
        fig, ax = plt.subplots(figsize=(9, 3.2))
        width = edges[1] - edges[0]
        for proj, counts in hist["by_projection"].items():
            ax.step(edges[:-1], counts, where="post", label=f"{proj} ({hist['zero_error_elements'][proj]:,} exact)")
        ax.set_yscale("symlog")
        ax.set_ylim(bottom=0)
        ax.set_xlim(edges[0], edges[-1] + width)
        ax.set_xlabel("log10 |candidate - source| (non-zero errors)")
        ax.set_ylabel("elements")
        ax.set_title("Weight error histogram")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out["error_histogram.png"] = _png(fig)

    grid = report["exact_block_map"]
    values = [[float("nan") if v is None else 100 * v for v in row] for row in grid["fraction"]]
    fig, ax = plt.subplots(figsize=(9, max(2.2, 0.22 * len(values) + 1.2)))
    # The colours span 99-100% where every expert is that close, so a few differing blocks show; such
    # a colour scale is zoomed, and says so.
    low = min(99.0, _finite_min(values))
    image = ax.imshow(values, aspect="auto", cmap="viridis", vmin=low, vmax=100, interpolation="nearest")
    ax.set_yticks(range(len(grid["blocks"])), grid["blocks"], fontsize=7)
    ax.set_xlabel("expert")
    zoom = f"zoomed: colour scale from {low:g}%" if low > 0 else ""
    ax.set_title("Exact scale blocks (%) per layer and expert" + (f" ({zoom})" if zoom else ""))
    fig.colorbar(image, ax=ax, label="% exact scale blocks" + (f" ({zoom})" if zoom else ""))
    out["exact_block_map.png"] = _png(fig)
    return out


def _finite_min(values) -> float:
    found = [v for row in values for v in row if v == v]
    return min(found) if found else 0.0


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(t)}</th>" for t in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _metric_table(first: str, rows: list[tuple[str, dict]]) -> str:
    return _table([first] + [t for _, t in METRIC_COLUMNS], metric_rows(rows))


def _img(name: str, data: bytes) -> str:
    return (f'<figure><img alt="{html.escape(PLOTS[name])}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
            f'<figcaption>{html.escape(PLOTS[name])} ({name})</figcaption></figure>')


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1040px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}code{background:#f5f5f5;padding:1px 4px}
.note{color:#555}.notrun{background:#fff4e5;border:1px solid #f0b25a;padding:8px 12px}
.verdict{font-size:16px;padding:10px 14px;border-radius:4px}.exact{background:#e6f4ea;border:1px solid #34a853}
.inexact{background:#fff4e5;border:1px solid #f0b25a}
figure{margin:12px 0}figcaption{color:#555;font-size:12px}img{max-width:100%}
"""


def page(report: dict, pngs: dict[str, bytes], missing_plots: str | None = None) -> str:
    src, dst, sel = report["source"], report["candidate"], report["selection"]
    exact = is_exact(report["overall"])
    figures = "".join(_img(name, data) for name, data in pngs.items() if name != "forward_error_per_layer.png")
    if missing_plots:
        figures = f'<p class="notrun">No plots: {html.escape(missing_plots)}.</p>'
    elif exact:
        figures = ("<p>Nothing to plot as an error: every weight is exact. The map shows it per layer and expert."
                   "</p>" + figures)
    forward = report["forward"]
    if forward and forward.get("status") == "run":
        fwd = (f"<p>{html.escape(forward_verdict(forward))} What ran: {html.escape(forward['what'])}.</p>"
               + _table(*forward_table(forward)))
        served = [(r["block"], s) for r in forward["by_layer"] for s in r.get("serving", [])]
        if served:
            fwd += f"<p>{html.escape(served_words(served))}</p>" + _table(*served_table(served))
        if "forward_error_per_layer.png" in pngs:
            fwd += _img("forward_error_per_layer.png", pngs["forward_error_per_layer.png"])
    else:
        fwd = f'<p class="notrun">{html.escape(forward_verdict(forward))}</p>'
    paths = report.get("paths")
    if paths and paths.get("status") == "run":
        served_paths = (f"<p>{html.escape(paths_verdict(paths))} What ran: {html.escape(paths['what'])}. Reference: "
                        f"{html.escape(paths['reference'])}.</p>" + _table(*paths_table(paths)))
    else:
        served_paths = f'<p class="notrun">{html.escape(paths_verdict(paths))}</p>'
    per_layer = _metric_table("layer", [(layer["block"], layer["metrics"]) for layer in report["by_layer"]])
    overall = _metric_table("scope", [("all experts", report["overall"])] + list(report["by_projection"].items()))
    t = report["timing"]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>requant accuracy report</title>
<style>{STYLE}</style></head><body>
<h1>requant accuracy report</h1>
<p class="verdict {'exact' if exact or lossy_standing(report) == 'as-expected' else 'inexact'}"><b>{html.escape(verdict(report))}</b><br>
{html.escape(forward_verdict(forward))}</p>
<p>source <code>{html.escape(src['path'])}</code> ({html.escape(str(src['format']))})<br>
candidate <code>{html.escape(dst['path'])}</code> ({html.escape(str(dst['format']))})<br>
{sel['experts_compared']:,} experts compared in {len(sel['blocks'])} layers{
    html.escape(f" (--layers {sel['layers']})") if sel['layers'] else ""}; {len(sel['unmatched_experts'])} unmatched</p>
<p class="note">{html.escape(NOTE)}</p>
<h2>Overall</h2>{overall}
<h2>Plots</h2>{figures}
<h2>MoE forward</h2>{fwd}
<h2>Serving paths: the source as engines run it against each conversion</h2>{served_paths}
<h2>Per layer</h2>{per_layer}
<p class="note">Weights compared in {t['weights_seconds']:.1f} s; {t['expert_bytes_read'] / 2**20:,.0f} MiB of expert
tensors read. Generated by requant {html.escape(report['generated_by']['version'])}.</p>
</body></html>
"""


def plots_missing() -> str | None:
    """Why no plots can be drawn (matplotlib not installed), or None."""
    try:
        require("matplotlib")
    except MissingExtra:
        return install_hint("matplotlib")
    return None


def write(report: dict, out_dir: str) -> dict[str, str]:
    """Write the PNGs and report.html into out_dir, removing plots an earlier run left that this
    report does not have. Returns PNG name -> title."""
    missing = plots_missing()
    pngs = {} if missing else plots(report)
    for name in PLOTS:
        path = os.path.join(out_dir, name)
        if name in pngs:
            with open(path, "wb") as f:
                f.write(pngs[name])
        elif os.path.exists(path):
            os.remove(path)
    with open(os.path.join(out_dir, "report.html"), "w", encoding="utf-8") as f:
        f.write(page(report, pngs, missing))
    return {name: PLOTS[name] for name in pngs}
