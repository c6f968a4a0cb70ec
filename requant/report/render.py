"""report.md and the one-screen terminal summary, from report.json's dict."""

from __future__ import annotations

METRIC_COLUMNS = (("exact_block_fraction", "exact blocks"), ("sqnr_db", "SQNR dB"), ("rel_rmse", "rel RMSE"),
                  ("max_abs_error", "max |err|"), ("cosine", "cosine"))


def fmt(key: str, value) -> str:
    if value is None:
        return "∞" if key == "sqnr_db" else "n/a"
    if key == "exact_block_fraction":
        return f"{100 * value:.3f}%"
    if key == "sqnr_db":
        return f"{value:.2f}"
    if key == "cosine":   # near 1 the interesting part is the distance from 1
        return f"1 - {1 - value:.2g}" if 0.999 < value < 1 else f"{value:.6f}" if value < 1 else "1"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _row(label: str, metrics: dict) -> str:
    return "| " + " | ".join([label] + [fmt(k, metrics[k]) for k, _ in METRIC_COLUMNS]) + " |"


def _header(first: str) -> list[str]:
    return ["| " + " | ".join([first] + [t for _, t in METRIC_COLUMNS]) + " |",
            "|" + "---|" * (len(METRIC_COLUMNS) + 1)]


def forward_lines(forward: dict | None) -> list[str]:
    if not forward or forward.get("status") != "run":
        reason = (forward or {}).get("reason", "not requested")
        return [f"Forward comparison: **not run** ({reason})."]
    lines = [f"Forward comparison run on **{forward['device']}** ({forward['what']}).", ""]
    lines += ["| block | rel. error | max |err| | cosine |", "|---|---|---|---|"]
    lines += [f"| {r['block']} | {r['rel_error']:.3g} | {r['max_abs_error']:.3g} | {r['cosine']:.8f} |"
              for r in forward["by_layer"]]
    served = [(r["block"], s) for r in forward["by_layer"] for s in r.get("serving", [])]
    if served:
        lines += ["", "Served numerics: the candidate layer computed as each engine computes it (nvfp4-w4a4: "
                  "activations quantized to NVFP4 under each input_scale policy; marlin-w4a16: vLLM 0.33.0's "
                  "Marlin block-scale rule, which zeroes blocks far below the layer's largest), against the "
                  "source's reference path. Exact weights above need not mean exact served numbers.", "",
                  "| block | mode | input_scale | w1/w3 input | w2 input | rel. error | cosine | flushed blocks |",
                  "|---|---|---|---|---|---|---|---|"]
        for block, s in served:
            a13, a2 = (f"{v:.3g}" for v in s["input_scales"]) if s["input_scales"] else ("", "")
            lines.append(f"| {block} | {s['mode']} | {s['policy'] or ''} | {a13} | {a2} | {s['rel_err']:.3g} | "
                         f"{s['cosine']:.6f} | {s['flushed_blocks']} |")
    return lines


def markdown(report: dict, images: dict[str, str]) -> str:
    src, dst, sel = report["source"], report["candidate"], report["selection"]
    lines = [
        "# requant accuracy report", "",
        f"- source: `{src['path']}` ({src['format']})",
        f"- candidate: `{dst['path']}` ({dst['format']})",
        f"- compared: {sel['experts_compared']:,} experts in {len(sel['blocks'])} blocks"
        + (f" (--layers {sel['layers']})" if sel["layers"] else ""),
        f"- unmatched experts (in one checkpoint only): {len(sel['unmatched_experts'])}",
        "", "Weights are decoded to float32 and the candidate compared with the source. A block is one scale "
        "block of the source format along K; it is exact when every value in it decodes identically. "
        "SQNR is infinite (∞) when there is no error.", "",
        "## Overall", "", *_header("scope"), _row("all experts", report["overall"]),
        *[_row(p, m) for p, m in report["by_projection"].items()], "",
        "## Per layer", "", *_header("block"),
        *[_row(layer["block"], layer["metrics"]) for layer in report["by_layer"]], "",
        "## MoE forward", "", *forward_lines(report["forward"]), "",
    ]
    if images:
        lines += ["## Plots", ""] + [f"![{title}]({name})" for name, title in images.items()] + [""]
    t = report["timing"]
    lines += [f"Weights compared in {t['weights_seconds']:.1f} s ({t['expert_bytes_read'] / 2**20:,.0f} MiB of "
              "expert tensors read).", ""]
    return "\n".join(lines)


def terminal(report: dict, out_dir: str) -> str:
    o = report["overall"]
    lines = [f"source    {report['source']['path']} ({report['source']['format']})",
             f"candidate {report['candidate']['path']} ({report['candidate']['format']})",
             f"compared  {report['selection']['experts_compared']:,} experts, {len(report['by_layer'])} blocks",
             "",
             f"{'':<10}" + "".join(f"{t:>14}" for _, t in METRIC_COLUMNS)]
    for label, m in [("overall", o)] + list(report["by_projection"].items()):
        lines.append(f"{label:<10}" + "".join(f"{fmt(k, m[k]):>14}" for k, _ in METRIC_COLUMNS))
    finite = [layer for layer in report["by_layer"] if layer["metrics"]["sqnr_db"] is not None]
    worst = sorted(finite, key=lambda layer: layer["metrics"]["sqnr_db"])[:5]
    if worst:
        lines += ["", "lowest SQNR: " + ", ".join(f"{w['block']} {w['metrics']['sqnr_db']:.1f} dB" for w in worst)]
    elif report["by_layer"]:
        lines += ["", "every compared weight decodes identically (SQNR ∞)"]
    forward = report["forward"]
    lines.append("forward   " + (f"run on {forward['device']}" if forward and forward.get("status") == "run"
                                 else f"not run ({(forward or {}).get('reason', 'not requested')})"))
    t = report["timing"]
    lines.append(f"time      {t['weights_seconds']:.1f} s for weights")
    lines.append(f"written   {out_dir}/report.json, report.md, report.html")
    return "\n".join(lines)

