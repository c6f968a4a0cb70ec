"""The model card (README.md) and provenance record (requant.json) every conversion writes.

The card tells a person what the directory holds and how to serve it; requant.json says the same
for tools (`requant verify` reads which engine the output was made for from it). Both are built
from the plan, the conversion's summed stats and the engine rules of the model's recipe.
"""

from __future__ import annotations

import json
import math
import os

from requant import __version__, sources
from requant.engines import GPU_FAMILIES, EngineRules

CARD_MARK = "<!-- written by requant: the model card of a converted checkpoint -->"
CARD_NAME = "README.md"
SOURCE_CARD_NAME = "README.source.md"   # the source's own card, kept but not passed off as this one's
PROVENANCE_NAME = "requant.json"
MTP_GROUP = "routed experts (MTP block)"


def provenance(plan, stats, source_label: str) -> dict:
    """What this output is: source, requant version and options, engine, format per tensor group,
    accuracy. JSON-able."""
    target, model = plan.target, plan.model
    rules = target.engine
    blocks = set(plan.blocks)
    mtp_blocks = sorted({e.block for e in sources.reader(model).experts(plan.source.names) if model.is_mtp(e.block)})
    groups = {"routed experts (main layers)": target.format_label}
    if mtp_blocks:
        groups[MTP_GROUP] = (target.format_label if set(mtp_blocks) <= blocks
                                                else f"{plan.source_format.upper()} (kept as in the source)")
    groups.update(target.other_tensor_groups())
    return {
        "producer": {"name": "requant", "version": __version__},
        "source": source_label,
        "model": model.model_name,
        "source_format": plan.source_format,
        "target_format": target.name,
        "options": target.describe_options(),
        "engine": {"name": rules.name, "version": rules.version, "forced": target.forced_problems},
        "tensor_groups": groups,
        "accuracy": target.accuracy(stats),
    }


def model_card(record: dict, rules: EngineRules) -> str:
    """README.md for the output directory: markdown a person reads on the Hub or in a terminal."""
    src = record["source"]
    opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in record["options"].items() if v is not None)
    front = ["---", "tags: [requant, " + record["target_format"] + ", moe]"]
    if "@" in src:   # a Hub source, repo@commit: the Hub links the card to it
        front += [f"base_model: {src.split('@')[0]}", "base_model_relation: quantized"]
    lines = [
        *front,
        "---",
        CARD_MARK,
        "",
        f"# {src.rstrip('/').split('/')[-1]}: {record['target_format'].upper()} experts for {rules.label}",
        "",
        f"Converted by requant {record['producer']['version']} from `{src}` "
        f"({record['source_format'].upper()} routed experts), offline and without calibration data.",
        "",
        f"Command: `requant convert SRC DST --in {record['source_format']} --out {record['target_format']} "
        f"--engine {rules.name}{' ' + opts if opts else ''}`",
        "",
        f"Made for **{rules.label}**: every tensor of this directory loads there into a parameter of the right "
        "kind (checked against that release's own loader code). Other engines or versions may load it "
        "differently; `requant verify DIR --engine NAME` says whether they do.",
    ]
    if record["engine"]["forced"]:
        lines += ["", "**Warning: converted with --force despite:** " + "; ".join(record["engine"]["forced"])]
    lines += ["", "## Tensor formats", "", "| tensors | stored as |", "|---|---|"]
    lines += [f"| {group} | {fmt} |" for group, fmt in record["tensor_groups"].items()]
    lines += ["", "## Accuracy", ""] + [f"- {line}" for line in _accuracy_lines(record["accuracy"])]
    lines += ["", "## Serve it", "", f"Commands for {rules.label}, per GPU family, from requant's rules for that release "
              "(read from its code, not run). Set the parallelism (`--tensor-parallel-size`, `--tp`) to your GPUs: "
              "the model does not fit on one. DIR is this directory, or its Hub repository id once uploaded.", ""]
    lines += serve_lines(rules, record["target_format"], has_mtp=MTP_GROUP in record["tensor_groups"])
    lines += [f"Check it first: `requant verify DIR --engine {rules.spec} --gpu sm_90` (or your GPU) names the MoE "
              f"kernel that release selects; `requant advise DIR --engine {rules.name}==VERSION --gpu ...` answers "
              "for another release.", ""]
    lines += ["## Source", "", f"The source checkpoint's own model card, if it had one, is kept as "
              f"`{SOURCE_CARD_NAME}`; its license and terms apply to these weights.", ""]
    return "\n".join(lines)


def serve_lines(rules: EngineRules, fmt: str, has_mtp: bool) -> list[str]:
    """The card's serve commands: one per GPU family the release has rules for."""
    if not rules.has_kernel_rules(fmt):
        return [f"requant has no serving rules for {fmt.upper()} experts on {rules.label}.", ""]
    lines = []
    for gpu, family in GPU_FAMILIES.items():
        how = rules.serving(fmt, gpu, has_mtp=has_mtp)
        k = how.kernel
        lines += [f"**{family}, {gpu}**: " + (f"{k.backend} ({k.arithmetic})" if how.starts else how.note), ""]
        if how.starts:
            if how.note:
                lines += [how.note + ".", ""]
            lines += ["```bash", how.command, "```", ""]
    return lines


def recorded_engine(path: str) -> dict | None:
    """{"name", "version"} of the engine requant laid the checkpoint at `path` out for, from its
    requant.json; None for checkpoints requant did not write (or whose record is unreadable)."""
    try:
        with open(os.path.join(path, PROVENANCE_NAME), encoding="utf-8") as f:
            engine = json.load(f).get("engine")
    except (OSError, ValueError, AttributeError):
        return None
    return engine if isinstance(engine, dict) and isinstance(engine.get("name"), str) else None


def is_requant_card(path: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        return CARD_MARK in f.read(4096)


def _accuracy_lines(acc: dict) -> list[str]:
    out = []
    if acc.get("blocks") is not None:
        exact, total = acc["exact_blocks"], acc["blocks"]
        out.append(f"{exact:,} of {total:,} scale blocks exact (bit-identical values to the source)"
                   + ("" if exact == total else f"; {acc['requantized_blocks']:,} re-quantized"))
    if acc.get("sqnr_db") is not None:
        db = acc["sqnr_db"]
        out.append(f"SQNR {'inf' if math.isinf(db) else f'{db:.2f}'} dB against the dequantized source "
                   f"(INT4 group {acc.get('group_size')}, {acc.get('scheme')})")
    return out or ["no routed-expert data was converted"]
