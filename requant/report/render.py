"""report.md and the one-screen terminal summary, from report.json's dict.

Words: a *layer* is a transformer block with routed experts (`layers.N`, or the MTP layer `mtp.N`;
report.json's schema calls these keys `block`); a *scale block* is the run of weights sharing one scale
in the source format (32 for MXFP4, 16 for NVFP4, the group for W4A16).
"""

from __future__ import annotations

from requant.formats import int4

METRIC_COLUMNS = (("exact_block_fraction", "exact scale blocks"), ("sqnr_db", "SQNR dB"), ("rel_rmse", "rel RMSE"),
                  ("max_abs_error", "max abs error"), ("cosine", "cosine"))


def fmt(key: str, value) -> str:
    if value is None:
        return "∞" if key == "sqnr_db" else "n/a"
    if key == "exact_block_fraction":
        return percent(value)
    if key == "sqnr_db":
        return f"{value:.2f}"
    if key == "cosine":   # near 1 the interesting part is the distance from 1
        return f"1 - {1 - value:.2g}" if 0.999 < value < 1 else f"{value:.6f}" if value < 1 else "1"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def percent(fraction: float) -> str:
    """A fraction as a percentage that reads 100% or 0% only when it is exactly that: 3 decimals, more
    where 3 would round a few differing blocks away."""
    if fraction in (0, 1):
        return f"{100 * fraction:.0f}%"
    for places in range(3, 12):
        text = f"{100 * fraction:.{places}f}"
        if text not in (f"{100:.{places}f}", f"{0:.{places}f}"):
            return f"{text}%"
    return f"{100 * fraction!r}%"


def is_exact(metrics: dict) -> bool:
    """Every compared weight decodes identically (no error at all)."""
    return bool(metrics["blocks"]) and metrics["exact_blocks"] == metrics["blocks"] and not metrics["nonfinite"]


# The SQNR W4A16 INT4 reaches at best against an MXFP4 source, by group size and scheme: the exhaustive
# scale search's optimum (the format's ceiling for round-to-nearest codes) on synthetic DeepSeek-V4-size
# projections (docs/w4a16.md, benchmarks/bench_w4a16.py); README "Format facts" quotes them.
W4A16_BEST_SQNR_DB = {(32, "sym"): 20.84, (32, "asym"): 23.24, (64, "sym"): 19.01, (64, "asym"): 20.55,
                      (128, "sym"): 17.52, (128, "asym"): 18.81}
# within this of the format's best: the conversion is as good as the format allows (synthetic
# weights of another checkpoint land a few tenths of a dB either side)
W4A16_TOLERANCE_DB = 1.0
LOSSY_FORMATS = (int4.CODEC.name,)   # lossy by design against an FP4 source: judged against the format's best


def lossy_standing(report: dict) -> str | None:
    """For a candidate lossy by design: 'as-expected' when its SQNR is within tolerance of what its
    format and group size reach at best (or above), 'below' when under it, None when it is not such
    a format or requant has no figure for its parameters."""
    cand, o = report["candidate"], report["overall"]
    if cand.get("format") not in LOSSY_FORMATS or o["sqnr_db"] is None or o["nonfinite"]:
        return None
    best = W4A16_BEST_SQNR_DB.get((cand.get("group_size"), cand.get("scheme")))
    if best is None:
        return None
    return "as-expected" if o["sqnr_db"] >= best - W4A16_TOLERANCE_DB else "below"


def verdict(report: dict) -> str:
    """One sentence up front: for a lossless target, exact or how far from it and where; for a
    format lossy by design (W4A16), its error against what that format and group size reach at best."""
    o, layers = report["overall"], report["by_layer"]
    scope = f"{report['selection']['experts_compared']:,} experts in {len(layers)} layers"
    if is_exact(o):
        return (f"Exact: every weight of the {scope} decodes identically to the source "
                f"({o['blocks']:,} scale blocks, error 0).")
    standing = lossy_standing(report)
    if standing is not None:
        cand = report["candidate"]
        best = W4A16_BEST_SQNR_DB[(cand["group_size"], cand["scheme"])]
        finite = [layer for layer in layers if layer["metrics"]["sqnr_db"] is not None]
        worst = min(finite, key=lambda layer: layer["metrics"]["sqnr_db"], default=None)
        head = ("As expected for the format" if standing == "as-expected"
                else "Below what the format reaches")
        return (f"{head}: W4A16 INT4 g{cand['group_size']} {cand['scheme']} is lossy by design; SQNR "
                f"{o['sqnr_db']:.2f} dB against the source over the {scope}"
                + (f" (lowest: {worst['block']} {worst['metrics']['sqnr_db']:.2f} dB)" if worst else "")
                + f", where this format and group size reach {best:.2f} dB at best on requant's synthetic weights "
                f"({round(o['sqnr_db'], 2) - best:+.2f} dB).")   # the difference of the two numbers shown
    differ = o["blocks"] - o["exact_blocks"]
    inexact = [layer for layer in layers if not is_exact(layer["metrics"])]
    finite = [layer for layer in inexact if layer["metrics"]["sqnr_db"] is not None]
    worst = min(finite, key=lambda layer: layer["metrics"]["sqnr_db"], default=None)
    text = (f"Not exact: {differ:,} of {o['blocks']:,} scale blocks differ from the source "
            f"({100 * differ / o['blocks']:.4g}%), in {len(inexact)} of {len(layers)} layers; "
            f"SQNR {fmt('sqnr_db', o['sqnr_db'])} dB overall"
            + (f" (lowest: {worst['block']} {worst['metrics']['sqnr_db']:.2f} dB)" if worst else "")
            + f", max abs error {fmt('max_abs_error', o['max_abs_error'])}.")
    if o["nonfinite"]:
        text += f" {o['nonfinite']:,} candidate values decode to NaN or inf."
    return text


def forward_verdict(forward: dict | None) -> str:
    if not forward or forward.get("status") != "run":
        return f"MoE forward: not run ({(forward or {}).get('reason', 'not requested')})."
    rows = forward["by_layer"]
    identical = all(r["rel_error"] == 0 for r in rows)
    worst = max(rows, key=lambda r: r["rel_error"])
    return (f"MoE forward on {forward['device']}: {'passed' if forward['passed'] else 'FAILED'}, "
            + ("identical outputs in every layer run." if identical else
               f"largest relative output error {worst['rel_error']:.3g} ({worst['block']})."))


def _cell(text: str) -> str:
    # A bare | would end the cell in every Markdown table dialect.
    return str(text).replace("|", "\\|")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows])


def metric_rows(rows: list[tuple[str, dict]]) -> list[list[str]]:
    return [[label] + [fmt(k, m[k]) for k, _ in METRIC_COLUMNS] for label, m in rows]


def forward_table(forward: dict) -> tuple[list[str], list[list[str]]]:
    header = ["layer", "rel. error", "max abs error", "cosine", "passed"]
    rows = [[r["block"], f"{r['rel_error']:.3g}", f"{r['max_abs_error']:.3g}", fmt("cosine", r["cosine"]),
             "yes" if r["passed"] else "NO"] for r in forward["by_layer"]]
    return header, rows


# What each serving mode computes, for the words above a table of the modes that ran.
SERVED_MODE_WORDS = {
    "nvfp4-w4a4": "nvfp4-w4a4, Blackwell's NVFP4 activations under each input_scale policy",
    "marlin-w4a16": "marlin-w4a16, vLLM's Marlin block-scale rule on Hopper and Ampere (its 'largest' rule), which "
                    "zeroes blocks far below the layer's largest",
    "mxfp4-w4a8": "mxfp4-w4a8, MXFP4 weights with MXFP8 activations as SGLang runs them on Blackwell",
    "bf16": "bf16, the weights decoded exactly with BF16 activations",
}


def served_words(served: list[tuple[str, dict]]) -> str:
    """The words above the served-numerics table: the modes that ran, on which side, nothing else."""
    modes = list(dict.fromkeys(s["mode"] for _, s in served))
    on_source = sorted({s["mode"] for _, s in served if s.get("side") == "source"})
    return ("Served numerics: each layer computed as an engine computes it, in the modes this run chose ("
            + "; ".join(SERVED_MODE_WORDS[m] for m in modes) + ")"
            + (f"; side source: the source itself in {', '.join(on_source)}" if on_source else "")
            + ". Errors against the source's reference path; other modes were not run (--serve all runs every "
            "one). Exact weights above need not mean exact served numbers.")


def forward_lines(forward: dict | None) -> list[str]:
    if not forward or forward.get("status") != "run":
        return [forward_verdict(forward)]
    lines = [forward_verdict(forward), "", f"What ran: {forward['what']}.", "", *_md_table(*forward_table(forward))]
    served = [(r["block"], s) for r in forward["by_layer"] for s in r.get("serving", [])]
    if served:
        lines += ["", served_words(served), "", *_md_table(*served_table(served))]
    return lines


def served_table(served: list[tuple[str, dict]]) -> tuple[list[str], list[list[str]]]:
    header = ["layer", "side", "mode", "input_scale", "w1/w3 input", "w2 input", "rel. error", "cosine",
              "flushed scale blocks"]
    rows = []
    for block, s in served:
        a13, a2 = (f"{v:.3g}" for v in s["input_scales"]) if s["input_scales"] else ("", "")
        rows.append([block, s.get("side", "candidate"), s["mode"], s["policy"] or "", a13, a2, f"{s['rel_err']:.3g}",
                     f"{s['cosine']:.6f}", str(s["flushed_blocks"])])
    return header, rows


def _db(v) -> str:
    return "∞" if v is None else f"{v:.2f}"


def paths_verdict(paths: dict | None) -> str:
    """One sentence: which path is closest to the BF16 reference, and by how much."""
    if not paths or paths.get("status") != "run":
        return f"Serving paths: not run ({(paths or {}).get('reason', 'not requested')})."
    layer = paths["layers"][0]
    text = f"Serving paths on {layer['block']}: "
    best, inexact = layer["closest"], layer["closest_inexact"]
    if layer["exact"]:
        text += f"exact (identical layer output to the reference): {', '.join(layer['exact'])}. "
    if inexact:
        text += (f"closest inexact: {inexact['path']} (SQNR {_db(inexact['sqnr_db'])} dB, rel. error "
                 f"{inexact['rel_err']:.3g})")
        if inexact["next"]:
            text += (f", {_db(inexact['margin_db'])} dB ahead of {inexact['next']}" if inexact["margin_db"] is not None
                     else f", then {inexact['next']}")
        text += "."
    elif best is None:
        text += "no path."
    return text.strip()


def paths_table(paths: dict) -> tuple[list[str], list[list[str]]]:
    layer = paths["layers"][0]
    engines = {p["path"]: p["engines"] for p in paths["paths"]}
    header = ["path", "what it is", "SQNR dB", "rel. error", "routed SQNR dB", "routed rel. error"]
    rows = [[name, engines.get(name, ""), _db(r["sqnr_db"]), f"{r['rel_err']:.3g}", _db(r["routed_sqnr_db"]),
             f"{r['routed_rel_err']:.3g}"] for name, r in layer["results"].items()]
    return header, rows


def paths_lines(paths: dict | None) -> list[str]:
    if not paths or paths.get("status") != "run":
        return [paths_verdict(paths)]
    return [paths_verdict(paths), "", f"What ran: {paths['what']}. Reference: {paths['reference']}. Errors of the "
            "layer output (routed + shared experts) and of the routed experts alone.", "",
            *_md_table(*paths_table(paths))]


NOTE = ("Weights are decoded to float32 and the candidate compared with the source. A scale block is the run of "
        "weights sharing one scale in the source format; it is exact when every value in it decodes identically. "
        "SQNR is infinite (∞) when there is no error.")


def markdown(report: dict, images: dict[str, str], missing_plots: str | None = None) -> str:
    src, dst, sel = report["source"], report["candidate"], report["selection"]
    layers = [(layer["block"], layer["metrics"]) for layer in report["by_layer"]]
    lines = [
        "# requant accuracy report", "",
        f"**{verdict(report)}**", "",
        forward_verdict(report["forward"]), "",
        f"- source: `{src['path']}` ({src['format']})",
        f"- candidate: `{dst['path']}` ({dst['format']})",
        f"- compared: {sel['experts_compared']:,} experts in {len(sel['blocks'])} layers"
        + (f" (--layers {sel['layers']})" if sel["layers"] else ""),
        f"- unmatched experts (in one checkpoint only): {len(sel['unmatched_experts'])}",
        "", NOTE, "",
        "## Overall", "",
        *_md_table(["scope"] + [t for _, t in METRIC_COLUMNS],
                   metric_rows([("all experts", report["overall"])] + list(report["by_projection"].items()))), "",
        "## Per layer", "",
        *_md_table(["layer"] + [t for _, t in METRIC_COLUMNS], metric_rows(layers)), "",
        "## MoE forward", "", *forward_lines(report["forward"]), "",
        "## Serving paths: the source as engines run it against each conversion", "",
        *paths_lines(report.get("paths")), "",
    ]
    if images:
        lines += ["## Plots", ""] + [f"![{title}]({name})" for name, title in images.items()] + [""]
    if missing_plots:
        lines += [f"No plots: {missing_plots}.", ""]
    t = report["timing"]
    lines += [f"Weights compared in {t['weights_seconds']:.1f} s ({t['expert_bytes_read'] / 2**20:,.0f} MiB of "
              "expert tensors read).", ""]
    return "\n".join(lines)


def terminal(report: dict, out_dir: str, missing_plots: str | None = None) -> str:
    lines = [verdict(report), forward_verdict(report["forward"]), paths_verdict(report.get("paths")), "",
             f"source    {report['source']['path']} ({report['source']['format']})",
             f"candidate {report['candidate']['path']} ({report['candidate']['format']})",
             f"compared  {report['selection']['experts_compared']:,} experts, {len(report['by_layer'])} layers",
             "",
             f"{'':<10}" + "".join(f"{t:>20}" for _, t in METRIC_COLUMNS)]
    for label, m in [("overall", report["overall"])] + list(report["by_projection"].items()):
        lines.append(f"{label:<10}" + "".join(f"{fmt(k, m[k]):>20}" for k, _ in METRIC_COLUMNS))
    finite = [layer for layer in report["by_layer"] if layer["metrics"]["sqnr_db"] is not None]
    worst = sorted(finite, key=lambda layer: layer["metrics"]["sqnr_db"])[:5]
    if worst:
        lines += ["", "lowest SQNR: " + ", ".join(f"{w['block']} {fmt('sqnr_db', w['metrics']['sqnr_db'])} dB"
                                                  for w in worst)]
    t = report["timing"]
    lines.append(f"time      {t['weights_seconds']:.1f} s for weights")
    lines.append(f"written   {out_dir}/report.json, report.md, report.html"
                 + (f" (no plots: {missing_plots})" if missing_plots else ", PNG plots"))
    return "\n".join(lines)
