"""The model card (README.md) and provenance record (requant.json) every conversion writes.

The card tells a person what the directory holds and how to serve it; requant.json says the same
for tools (`requant verify` reads which engine the output was made for from it). Both are built
from the plan, the conversion's summed stats and the engine rules of the model's recipe.
"""

from __future__ import annotations

import json
import math
import os

from requant import __version__
from requant.engines import GPU_FAMILIES, EngineRules
from requant.experts import ExpertIndex

CARD_MARK = "<!-- written by requant: the model card of a converted checkpoint -->"
CARD_NAME = "README.md"
SOURCE_CARD_NAME = "README.source.md"   # the source's own card, kept but not passed off as this one's
PROVENANCE_NAME = "requant.json"
MTP_GROUP = "routed experts (MTP block)"


def provenance(plan, stats, source_label: str, linked: list[str] = ()) -> dict:
    """What this output is: source, requant version and options, engine, format per tensor group,
    accuracy, the shards that are hard links to the source's files (`linked`). JSON-able."""
    target, model = plan.target, plan.model
    rules = target.engine
    blocks = set(plan.blocks)
    mtp_blocks = (getattr(plan, "experts", None) or ExpertIndex(model, plan.source)).drafter_blocks()
    groups = {"routed experts (main layers)": target.format_label}
    donor = target.options.donor if target.mtp == "graft" else None
    if mtp_blocks:
        kept = f"grafted from {donor}, kept as it stores them" if donor else "kept as in the source"
        groups[MTP_GROUP] = (target.format_label if set(mtp_blocks) <= blocks
                                                else f"{plan.source_format.upper()} ({kept})")
    groups.update(target.other_tensor_groups())
    run = getattr(plan, "run", None) or {}
    return {
        "producer": {"name": "requant", "version": __version__},
        "source": source_label,
        "model": model.model_name,
        "source_format": plan.source_format,
        # --drafter graft: whose drafter this is, as given and as found (a directory's real path, a
        # Hub repository at its commit)
        **({"drafter_donor": donor, "drafter_donor_resolved": run.get("donor", donor)} if donor else {}),
        "target_format": target.name,
        "options": target.describe_options(),
        "engine": {"name": rules.name, "version": rules.version, "forced": target.forced_problems},
        "tensor_groups": groups,
        "accuracy": target.accuracy(stats),
        "tensor_bytes": plan.total_size,
        "linked_shards": list(linked),
        "command": command_line(run.get("source") or source_label, run.get("destination"),
                                run.get("in_place", False), getattr(plan, "in_format", None) or plan.source_format,
                                target.name, target.options.engine or rules.name,
                                {k: v for k, v in target.describe_options().items() if mtp_blocks or k != "mtp"},
                                target.options.force),
        "source_card": source_card_metadata(plan.source.path, plan.source.config,
                                            source_label.split("@")[0] if "@" in source_label else None),
    }


def command_line(source: str, destination: str | None, in_place: bool, in_format: str | None, out_format: str,
                 engine: str, options: dict, force: bool) -> str:
    """`requant convert ...` as it was run: the source as given, the destination (or --in-place),
    the formats, the engine, the options that shaped the output, --force."""
    words = ["requant", "convert", _quoted(source)]
    words += ["--in-place"] if in_place else [_quoted(destination or "DST")]
    if in_format:
        words += ["--in", in_format]
    words += ["--out", out_format, "--engine", engine]
    words += [f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v is not None]
    if force:
        words.append("--force")
    return " ".join(words)


def _quoted(word: str) -> str:
    import shlex
    return shlex.quote(word)


def source_card_metadata(path: str, config: dict, hub_repo: str | None) -> dict:
    """What the output's card carries over from the source: its license (from the front matter of
    the source's README.md) and the model it derives from (a Hub source's repository; else the
    source card's own base_model, else config.json's `_name_or_path` when it names a repository)."""
    front = {}
    for name in (CARD_NAME, SOURCE_CARD_NAME):   # in place, the source's card is set aside first
        card_path = os.path.join(path, name)
        if os.path.isfile(card_path) and not is_requant_card(card_path):
            front = _front_matter(card_path)
            break
    meta = {}
    for key in ("license", "license_name", "license_link"):
        if isinstance(front.get(key), (str, list)):
            meta[key] = front[key]
    base = hub_repo or front.get("base_model")
    if base is None:
        name = config.get("_name_or_path")
        if isinstance(name, str) and name.count("/") == 1 and not os.path.isabs(name) and not name.startswith("."):
            base = name
    if isinstance(base, (str, list)) and base:
        meta["base_model"] = base
    return meta


def _front_matter(path: str) -> dict:
    """A model card's YAML front matter (between the leading `---` lines); {} when none or unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return {}
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        import yaml
        data = yaml.safe_load(text[3:end])
    except Exception:   # a malformed front matter carries nothing over
        return {}
    return data if isinstance(data, dict) else {}


def model_card(record: dict, rules: EngineRules) -> str:
    """README.md for the output directory: markdown a person reads on the Hub or in a terminal."""
    src = record["source"]
    forced = record["engine"]["forced"]
    front = ["---", "tags: [requant, " + record["target_format"] + ", moe]"]
    carried = record.get("source_card") or {}
    if "@" in src and "base_model" not in carried:   # a Hub source, repo@commit: the Hub links the card to it
        carried = {**carried, "base_model": src.split("@")[0]}
    for key in ("license", "license_name", "license_link", "base_model"):
        if key in carried:
            front.append(f"{key}: {json.dumps(carried[key])}")
    if "base_model" in carried:
        front.append("base_model_relation: quantized")
    command = record.get("command") or (f"requant convert {src} DST --in {record['source_format']} --out "
                                        f"{record['target_format']} --engine {rules.name}")
    if forced:
        made_for = (f"Laid out for **{rules.label}**, converted with --force: that release does **not** load it "
                    "correctly (" + "; ".join(forced) + "). Other engines or versions may load it differently; "
                    "`requant verify DIR --engine NAME` says whether they do.")
    else:
        tower = rules.vision.get("tower")
        made_for = (f"Made for **{rules.label}**: every tensor of this directory"
                    + (" but the vision tensors the next sentence names" if tower == "ignored" else "")
                    + " loads there into a parameter of the right kind (checked against that release's own loader "
                    "code). Other engines or versions may load it differently; `requant verify DIR --engine NAME` "
                    "says whether they do." + (f" {rules.vision_summary}" if rules.vision_summary else ""))
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
        *([f"The drafter is grafted from `{record['drafter_donor']}` (`{record.get('drafter_donor_resolved')}`): its "
           "tensors are that checkpoint's, byte for byte, and its config.json fields come from there.", ""]
          if record.get("drafter_donor") else []),
        f"Command: `{command}`",
        "",
        made_for,
    ]
    lines += ["", "## Tensor formats", "", "| tensors | stored as |", "|---|---|"]
    lines += [f"| {group} | {fmt} |" for group, fmt in record["tensor_groups"].items()]
    lines += ["", "## Accuracy", ""] + [f"- {line}" for line in _accuracy_lines(record["accuracy"])]
    lines += ["", "## Serve it", ""]
    if forced:
        lines += [f"{rules.label} cannot serve this checkpoint (see above); requant gives no serve command for it.", ""]
    else:
        lines += [f"Commands for {rules.label}, per GPU family, from requant's rules for that release (read from its "
                  f"code, not run). {_fit_sentence(record.get('tensor_bytes'))} DIR is this directory, or its Hub "
                  "repository id once uploaded.", ""]
        lines += serve_lines(rules, record["target_format"], has_mtp=MTP_GROUP in record["tensor_groups"],
                             tp=1 if _fits_one_gpu(record.get("tensor_bytes")) else 4)
    lines += [f"Check it first: `requant verify DIR --engine {rules.spec} --gpu sm_90` (or your GPU) names the MoE "
              f"kernel that release selects; `requant advise DIR --engine {rules.name}==VERSION --gpu ...` answers "
              "for another release.", ""]
    lines += ["## Source", "", f"The source checkpoint's own model card, if it had one, is kept as "
              f"`{SOURCE_CARD_NAME}`; its license and terms apply to these weights.", ""]
    lines += _linked_lines(record.get("linked_shards") or [])
    return "\n".join(lines)


def _linked_lines(linked: list[str]) -> list[str]:
    """The card's word on shards that are the source's files: what a person may and may not do."""
    if not linked:
        return []
    return ["## Shards shared with the source", "",
            f"In the directory requant wrote, {len(linked)} shards hold nothing it converts and are hard links to the source's files (the "
            "same bytes, stored once): " + ", ".join(f"`{n}`" for n in linked) + ". Deleting the source leaves "
            "them whole; a tool that edits one of these files in place edits the source's too (requant never "
            "does: it writes new files and renames them). `requant convert --copy-all` makes copies instead.", ""]


ONE_GPU_BYTES = 80e9   # an 80 GB GPU (H100/A100 80GB), the smallest that serving these models commonly assumes


def _fit_sentence(nbytes: int | None) -> str:
    """Whether the weights fit on one GPU, from their size: the parallelism advice follows from it."""
    if nbytes is None:
        return "Set the parallelism (`--tensor-parallel-size`, `--tp`) to your GPUs."
    size = f"{nbytes / 1e9:.1f} GB of weights"
    if _fits_one_gpu(nbytes):
        return (f"The {size} fit on one 80 GB GPU: the commands below use one; raise the parallelism "
                "(`--tensor-parallel-size`, `--tp`) for throughput.")
    return (f"The {size} do not fit on one 80 GB GPU: set the parallelism (`--tensor-parallel-size`, `--tp`) to "
            "your GPUs.")


def _fits_one_gpu(nbytes: int | None) -> bool:
    return nbytes is not None and nbytes * 1.1 < ONE_GPU_BYTES   # headroom for activations and the KV cache


def serve_lines(rules: EngineRules, fmt: str, has_mtp: bool, tp: int = 4) -> list[str]:
    """The card's serve commands: one per GPU family the release has rules for."""
    if not rules.has_kernel_rules(fmt):
        return [f"requant has no serving rules for {fmt.upper()} experts on {rules.label}.", ""]
    lines = []
    for gpu, family in GPU_FAMILIES.items():
        how = rules.serving(fmt, gpu, tp=tp, has_mtp=has_mtp)
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
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return engine_of(record)


def engine_of(record) -> dict | None:
    """The {"name", "version"} a provenance record names, or None where it names none readable."""
    engine = record.get("engine") if isinstance(record, dict) else None
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
