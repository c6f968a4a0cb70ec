"""`requant advise`: should this checkpoint be converted at all, for this engine release and GPU?

For the checkpoint as it is and for each output requant could write from it, the engine release's
rules (requant/engines) say which MoE method and kernel the main layers and the MTP block get on
the GPU family, whether the engine starts (and with which flags), and the arithmetic it runs; the
numerics of each arithmetic come from `requant.paths` measurements. Only headers and config.json
are read, so a Hub checkpoint costs a few range requests. Everything said of a runtime outcome is
from the engines' code, not from running them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from requant import engines, formats
from requant.engines import FROM_CODE, GPU_FAMILIES, SPEED_CLASSES, EngineRules
from requant.errors import UnsupportedCheckpoint
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.experts import Block, ExpertIndex
from requant.targets import TARGETS

@dataclass(frozen=True)
class Candidate:
    """One way to serve the model: the checkpoint as it is, or an output requant can write."""

    label: str            # "as it is (<format>)", "<format>", or with the INT4 group: "<format> g128 sym"
    fmt: str              # expert format the engine sees
    convert: str = ""     # the requant command that writes it ("" for the checkpoint as it is)
    lossless: bool = True
    group_size: int | None = None


@dataclass
class PathVerdict:
    candidate: Candidate
    kernel: dict          # the main layers' Kernel, as data
    mtp: dict | None      # the MTP block's: None where the checkpoint has none
    starts: bool
    flags: str            # what the serve command must add for it to start ("" where nothing)
    speed: str
    problems: list[str] = field(default_factory=list)   # why it cannot be served at all


def candidates(model: ModelSpec, source_fmt: str, engine: EngineRules) -> list[Candidate]:
    """The checkpoint as it is, then each output requant could write from it for this engine."""
    found = [Candidate(f"as it is ({source_fmt})", source_fmt)]
    for name, target in sorted(TARGETS.items()):
        if source_fmt not in formats.encoder_sources(name):
            continue
        base = f"requant convert SRC DST --out {name} --engine {engine.spec}"
        if target.codec.elements == formats.get(source_fmt).elements:   # same code set: the cast is exact
            found.append(Candidate(name, name, base, lossless=True))
            continue
        for group in sorted(target.codec.group_sizes):
            if group in (32, 128):
                found.append(Candidate(f"{name} g{group} sym", name, f"{base} --group-size {group}",
                                       lossless=False, group_size=group))
    return found


def judge_path(candidate: Candidate, model: ModelSpec, engine: EngineRules, gpu: str, blocks: list[Block],
               mtp_fmt: str | None, tp: int, ep: int) -> PathVerdict:
    """What `engine` does with `candidate` on `gpu`, from its rules; `blocks`: the checkpoint's
    blocks of routed experts."""
    has_mtp = any(not b.main for b in blocks)
    problems = []
    refusal = engine.refusal(candidate.fmt)
    if refusal:
        problems.append(f"{engine.label} cannot serve {candidate.fmt} experts: {refusal}")
    if not engine.has_kernel_rules(candidate.fmt):
        problems.append(f"requant has no kernel rules for {candidate.fmt} experts on {engine.label}")
        return PathVerdict(candidate, {}, None, False, "", "none", problems)
    serving = engine.serving(candidate.fmt, gpu)
    chosen = serving.kernel
    mtp = None
    if has_mtp:
        mtp = chosen.mtp_path
        if mtp_fmt and mtp_fmt != candidate.fmt and not chosen.mtp:
            mtp["note"] = f"its experts stay {mtp_fmt.upper()}"
    problems += tp_problems(model, engine, candidate, gpu, tp, ep, blocks)
    starts = serving.starts and not problems
    return PathVerdict(candidate, asdict(serving.auto) | {"chosen": asdict(chosen)}, mtp, starts, serving.flags,
                       chosen.speed if starts else "none", problems)


def tp_problems(model: ModelSpec, engine: EngineRules, candidate: Candidate, gpu: str, tp: int, ep: int,
                blocks: list[Block]) -> list[str]:
    """Why the experts of `blocks` cannot be split over `ep` ranks (each kind of block its own expert
    count: V4.1's drafter has fewer) or over `tp` ranks (EP keeps experts whole): a scale block split
    between ranks (vLLM's create_weights refuses it; SGLang's loader silently drops the w2 scales,
    compressed_tensors_wNa16_moe.py), then the release's own TP rules (`tp` in its data)."""
    problems = []
    if ep > 1:
        counted: dict[str, Block] = {}   # config.json key of an expert count -> a block it counts, main first
        for block in sorted(blocks, key=lambda b: not b.main):
            counted.setdefault(model.config_key("num_experts", block.name), block)
        for key, block in counted.items():
            experts = model.value("num_experts", block.name)
            if experts % ep:
                whose = "" if block.main else f" of the {block.kind} blocks ({key})"
                problems.append(f"{experts} routed experts{whose} do not divide over --ep {ep}")
        return problems
    inter = model.value("intermediate_size")
    block = candidate.group_size or formats.get(candidate.fmt).fixed_group or 1
    if tp > 1 and (inter % tp or (inter // tp) % block):
        problems.append(f"moe_intermediate_size {inter} over TP={tp} leaves {inter / tp:g} per rank, not a multiple "
                        f"of the {block}-element scale block: use a smaller --tp, or EP")
    for rule in engine.data.get("tp", []):
        if rule["format"] == candidate.fmt and gpu in rule["gpus"] and TP_CONDITIONS[rule["when"]](inter, tp, block):
            problems.append(f"{engine.label} at TP={tp}: {rule['problem']}; {rule['works']}")
    return problems


# The conditions a release's `tp` rules name, on (moe_intermediate_size, TP, scale block).
TP_CONDITIONS = {
    "intermediate_per_rank_at_most_group": lambda inter, tp, block: tp > 1 and inter // tp <= block,
}


SPEED_RANK = {name: i for i, name in enumerate(SPEED_CLASSES)}


def recommend(paths: list[PathVerdict], errors: dict[str, dict]) -> dict:
    """The recommendation and its reasons: the fastest class that starts, then the smaller error;
    the checkpoint as it is wins ties, since converting costs time, disk and, for INT4, accuracy."""
    def error_of(p: PathVerdict):
        return (errors.get(_error_key(p)) or {}).get("rel_error")

    def key(p: PathVerdict):
        err = error_of(p)
        return (SPEED_RANK[p.speed], err if err is not None else float("inf"), p.candidate.convert != "")

    best = min(paths, key=key)
    as_is = paths[0]
    reasons = []
    if best is as_is:
        if as_is.speed == "fp4-tensor-cores":
            verdict = "do not convert: your checkpoint already runs on FP4 tensor cores here" + (
                f" (serve with {as_is.flags})" if as_is.flags else "")
        elif as_is.starts:
            verdict = ("do not convert: no output requant can write runs in a faster class here"
                       + (f" (serve with {as_is.flags})" if as_is.flags else "")
                       + "; the conversions run the same class of kernel with no smaller error (requant's rules "
                         "rank kernels by class, not by measured speed within one)")
        else:
            verdict = "nothing requant can write starts here"
        reasons.append(f"as it is: {_says(as_is)}")
    else:
        verdict = f"convert to {best.candidate.label}" + (f" and serve with {best.flags}" if best.flags else "")
        reasons.append(f"{best.candidate.label}: {_says(best)}")
        reasons.append(f"as it is: {_says(as_is)}")
    for p in paths:
        if p is not best and p is not as_is:
            reasons.append(f"{p.candidate.label}: {_says(p)}")
    return {"verdict": verdict, "choice": best.candidate.label, "command": best.candidate.convert,
            "flags": best.flags, "reasons": reasons}


def _says(p: PathVerdict) -> str:
    if p.problems:
        return "; ".join(p.problems)
    k = p.kernel["chosen"]
    text = f"{k['backend']} ({k['arithmetic'] or 'arithmetic not recorded'})" if p.starts else \
        f"does not start: {k['backend']}" + (f"; fix: {k['fix']}" if k.get("fix") else "")
    return text + (f", with {p.flags}" if p.flags and p.starts else "")


def _error_key(p: PathVerdict) -> str:
    """The path's name in requant.serve.compare_paths: stored format, then the serving mode (W4A4 under
    the input_scale requant writes)."""
    mode = p.kernel.get("chosen", {}).get("mode", "")
    stored = f"{p.candidate.fmt}-g{p.candidate.group_size}-sym" if p.candidate.group_size else p.candidate.fmt
    return f"{stored}:{mode}" + (":written" if mode == "nvfp4-w4a4" else "")


def advise(ck: Checkpoint, engine_specs: list[str], gpu: str, tp: int = 1, ep: int = 1,
           errors: dict[str, dict] | None = None) -> dict:
    """The answer for checkpoint `ck` (headers and config only) on each engine release and `gpu`."""
    engines.check_gpu(gpu)
    model = ModelSpec.for_checkpoint(ck)
    index = ExpertIndex(model, ck)
    source = index.main_codec
    if source is None:
        raise UnsupportedCheckpoint(f"{ck.path}: no routed experts in a format requant knows")
    mtp_blocks = index.drafter_blocks()
    mtp_fmt = index.blocks[mtp_blocks[0]].codec if mtp_blocks else None
    answers = []
    for spec in engine_specs or model.engine_names:
        rules = model.engine(spec)
        paths = []
        for cand in candidates(model, source.name, rules):
            mtp_as = (mtp_fmt.name if mtp_fmt else None) if not cand.convert else rules.mtp_format(cand.fmt)
            paths.append(judge_path(cand, model, rules, gpu, list(index.blocks.values()), mtp_as, tp, ep))
        answers.append({"engine": rules.name, "release": rules.version, "checked": rules.checked,
                        "caveat": rules.caveat, "gpu": gpu, "gpu_family": GPU_FAMILIES[gpu], "tp": tp, "ep": ep,
                        "paths": [_path_json(p, errors or {}) for p in paths],
                        "recommendation": recommend(paths, errors or {})})
    return {"checkpoint": ck.path, "model": model.model_name or model.name, "source_format": source.name,
            "mtp_format": mtp_fmt.name if mtp_fmt else None, "basis": FROM_CODE, "answers": answers}


def _path_json(p: PathVerdict, errors: dict) -> dict:
    return {"path": p.candidate.label, "format": p.candidate.fmt, "lossless": p.candidate.lossless,
            "convert": p.candidate.convert, "starts": p.starts, "flags": p.flags, "speed": p.speed,
            "main": p.kernel.get("chosen"), "auto": {k: v for k, v in p.kernel.items() if k != "chosen"},
            "mtp": p.mtp, "problems": p.problems, "layer_error": errors.get(_error_key(p))}


def format_advice(result: dict) -> str:
    lines = [f"checkpoint  {result['checkpoint']} ({result['model']}, experts {result['source_format']}"
             + (f", MTP experts {result['mtp_format']}" if result["mtp_format"] else "") + ")"]
    for a in result["answers"]:
        lines.append("")
        head = f"{a['engine']} {a['release']} on {a['gpu']} ({a['gpu_family']}), TP={a['tp']}" + \
               (f", EP={a['ep']}" if a["ep"] > 1 else "")
        lines.append(head + f" ({result['basis']})")
        if a["caveat"]:
            lines.append(f"  WARNING: {a['caveat']}")
        for p in a["paths"]:
            main = p["main"] or {}
            status = "starts" if p["starts"] else "does NOT start"
            lines.append(f"  {p['path']:<22}{status}{' with ' + p['flags'] if p['flags'] and p['starts'] else ''}")
            for problem in p["problems"]:
                lines.append(f"      {problem}")
            if main:
                lines.append(f"      main layers: {main['method']}: {main['backend']}")
                if main.get("arithmetic"):
                    lines.append(f"      arithmetic:  {main['arithmetic']}")
            if p["auto"] and not p["auto"].get("runs", True):
                lines.append(f"      without flags: {p['auto']['backend']}")
            if p["mtp"]:
                m = p["mtp"]
                lines.append(f"      MTP block:   {m['method']}: {m['backend']}" + ("" if m.get("runs", True)
                             else " (no kernel here: serve without speculative decoding)")
                             + (f"; {m['note']}" if m.get("note") else ""))
            if p["layer_error"]:
                e = p["layer_error"]
                db = "exact" if e["sqnr_db"] is None else f"{e['sqnr_db']:.1f} dB SQNR"
                lines.append(f"      layer error: {e['rel_error']:.2e} relative, {db} vs the source in BF16 ({e['basis']})")
        r = a["recommendation"]
        lines.append(f"  => {r['verdict']}")
        if r["command"]:
            lines.append(f"     {r['command']}")
    return "\n".join(lines)
