"""`requant advise`: should this checkpoint be converted at all, for this engine release and GPU?

For the checkpoint as it is, each output requant could write from it, and each MoE backend the
release lets a user ask for instead of its default (`opt_in` in the release data), the release's
rules (requant/engines) say which method and kernel the main layers and the drafter (MTP/DSpark)
get on the GPU family, the outcome (engines.OUTCOMES) and the arithmetic it runs; the numerics of
each arithmetic come from `requant.paths` measurements. The recommendation weighs, in this order:
it runs, the drafter is kept, the accuracy tier (weights kept exactly with activations of 8 bits or
more, or not), the speed class, the measured error (PREFER); and a release older than the
first one where the source runs faster with its drafter leads with the upgrade. Only headers and
config.json are read, so a Hub checkpoint costs a few range requests. Everything said of a runtime
outcome is from the engines' code, not from running them.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from requant import engines, formats
from requant.engines import (DOES_NOT_START, FROM_CODE, GPU_FAMILIES, NOT_CHECKED, RUNS, SPEED_CLASSES, WRONG_RESULT,
                             EngineRules, Kernel)
from requant.engines.check import drafter_loads
from requant.errors import UnsupportedCheckpoint, UnsupportedError
from requant.experts import Block, ExpertIndex
from requant.io.checkpoint import Checkpoint
from requant.model import ModelSpec
from requant.targets import TARGETS

# What the recommendation weighs, most important first (--prefer). "tier": the source's weights kept
# exactly and activations of 8 bits or more, else re-quantized weights or 4-bit activations (measured:
# 26.7 dB and better against 16.3 dB and worse); "error": the measured error itself.
PREFER = {"balanced": ("runs", "drafter", "tier", "speed", "error"),
          "accuracy": ("runs", "drafter", "error", "speed"),
          "speed": ("runs", "drafter", "speed", "error")}

PUBLISHED = Path(engines.__file__).resolve().parent / "published.json"


@dataclass(frozen=True)
class Dims:
    """The dimensions a verdict depends on: moe_intermediate_size, and each block's expert count
    by the config.json key that holds it."""

    intermediate: int
    experts: dict[str, int]


@dataclass(frozen=True)
class Candidate:
    """One way to serve the model: the checkpoint as it is or an output requant can write, under
    the release's default MoE backend or one the user asks for (`opt_in`)."""

    label: str            # "as it is (<format>)", "<format>", "<format> g128 sym", each ", with <flags>" when opted in
    fmt: str              # expert format the engine sees
    convert: str = ""     # the requant command that writes it ("" for the checkpoint as it is)
    lossless: bool = True
    group_size: int | None = None
    opt_in: dict | None = None   # the release's opt_in entry it asks for (flags, env, packages, ...)


@dataclass
class PathVerdict:
    candidate: Candidate
    kernel: dict          # the main layers' Kernel, as data
    mtp: dict | None      # the drafter's: None where the checkpoint has none
    outcome: str          # engines.OUTCOMES
    flags: str            # what the serve command must add ("" where nothing)
    speed: str
    problems: list[str] = field(default_factory=list)   # why it does not run as it should

    @property
    def runs(self) -> bool:
        return self.outcome == RUNS

    @property
    def drafter_kept(self) -> bool | None:
        """Whether the drafter still drafts (a kernel, and its experts loaded in the format they are
        stored in); None where the checkpoint has none."""
        return None if self.mtp is None else bool(self.mtp.get("runs")) and self.mtp.get("outcome") != WRONG_RESULT

    @property
    def env(self) -> str:
        return (self.candidate.opt_in or {}).get("env", "")

    @property
    def packages_missing(self) -> list[dict]:
        """The packages it needs that the engine's own requirements do not bring."""
        return [p for p in (self.candidate.opt_in or {}).get("packages", ()) if not p.get("in_requirements")]


def default_destination(checkpoint: str, label: str) -> str:
    """Where a conversion goes by default: beside the checkpoint, named after the output
    (`<checkpoint>-nvfp4`, `<checkpoint>-w4a16-g128`); a Hub id's name in the working directory."""
    base = checkpoint.rstrip("/") if os.path.exists(checkpoint) else checkpoint.rstrip("/").rsplit("/", 1)[-1]
    return f"{base}-{label.replace(' sym', '').replace(' ', '-')}"


def candidates(checkpoint: str, source_fmt: str, engine: EngineRules) -> list[Candidate]:
    """The checkpoint as it is, then each output requant could write from it for this engine."""
    found = [Candidate(f"as it is ({source_fmt})", source_fmt)]
    for name, target in sorted(TARGETS.items()):
        if source_fmt not in formats.encoder_sources(name):
            continue
        if target.codec.elements == formats.get(source_fmt).elements:   # same code set: the cast is exact
            found.append(Candidate(name, name, _convert_command(checkpoint, name, name, engine, None)))
            continue
        for group in sorted(target.codec.group_sizes):
            if group in (32, 128):
                label = f"{name} g{group} sym"
                found.append(Candidate(label, name, _convert_command(checkpoint, label, name, engine, group),
                                       lossless=False, group_size=group))
    return found


def _convert_command(checkpoint: str, label: str, fmt: str, engine: EngineRules, group: int | None) -> str:
    dst = default_destination(checkpoint, label)
    return (f"requant convert {shlex.quote(checkpoint)} {shlex.quote(dst)} --out {fmt} --engine {engine.spec}"
            + (f" --group-size {group}" if group else ""))


def opted_in(candidate: Candidate, engine: EngineRules, gpu: str) -> list[Candidate]:
    """The candidate under each MoE backend the release lets a user ask for on `gpu`."""
    if not engine.has_kernel_rules(candidate.fmt) or gpu not in engine.data["kernels"][candidate.fmt]:
        return []
    found = []
    cell = engine.kernel(candidate.fmt, gpu)
    default = engine.serving(candidate.fmt, gpu)
    answered = (cell.engine_answer or {}).get("explicit", {})   # the engine's answer per backend it was asked for
    for entry in cell.opt_in:
        if entry.get("flags") == default.flags and not entry.get("env") or _same_path({"method": cell.method, **entry},
                                                                                      default.kernel):
            continue   # what the default (or the flags it needs anyway) already runs
        entry = {"method": cell.method, **entry}   # the same MoE method unless the entry names its own
        selects = entry.get("selects")   # the engine's name of the backend (a Kernel.selects map, or the name)
        backend = selects.get("default") if isinstance(selects, dict) else selects
        if "engine_answer" not in entry and backend in answered:
            entry = {**entry, "engine_answer": answered[backend]}
        asked = " ".join(x for x in (entry.get("env", ""), entry.get("flags", "")) if x)
        found.append(Candidate(f"{candidate.label}, with {asked}", candidate.fmt, candidate.convert,
                               candidate.lossless, candidate.group_size, entry))
    return found


def _same_path(entry: dict, kernel: Kernel) -> bool:
    return all(entry.get(k) == getattr(kernel, k) for k in ("method", "arithmetic", "speed", "runs")) and \
        bool((entry.get("mtp") or {}).get("runs", entry.get("runs"))) == bool(kernel.mtp_path["runs"])


_KERNEL_FIELDS = {f.name for f in fields(Kernel)}


def judge_path(candidate: Candidate, model: ModelSpec, engine: EngineRules, gpu: str, blocks: list[Block],
               mtp_fmt: str | None, tp: int, ep: int, dims: Dims, drafter: tuple[str, str] | None = None) -> PathVerdict:
    """What `engine` does with `candidate` on `gpu`, from its rules; `blocks`: the checkpoint's
    blocks of routed experts; `dims`: the dimensions to judge at; `drafter`: for the checkpoint as
    it is, (stored, loaded): the format a drafter block's experts are stored in and the one this
    release loads them in (engines.check.drafter_loads, verify's rule), None for an output requant
    would write (its drafter is what the release expects)."""
    has_mtp = any(not b.main for b in blocks)
    if not engine.has_kernel_rules(candidate.fmt):
        return PathVerdict(candidate, {}, None, NOT_CHECKED, "", "none",
                           [f"{NOT_CHECKED}: requant has no kernel rules for {model.name} {candidate.fmt} experts on "
                            f"{engine.label}"])
    serving = engine.serving(candidate.fmt, gpu)
    if candidate.opt_in:
        chosen = auto = Kernel.from_data({k: v for k, v in candidate.opt_in.items() if k in _KERNEL_FIELDS})
        flags, outcome = candidate.opt_in.get("flags", ""), chosen.outcome
    else:
        chosen, auto, flags, outcome = serving.kernel, serving.auto, serving.flags, serving.outcome
    problems = []
    refusal = engine.refusal(candidate.fmt)
    if refusal:
        problems.append(f"{engine.label} cannot serve {candidate.fmt} experts: {refusal}")
        outcome = DOES_NOT_START
    mtp = None
    if has_mtp:
        mtp = _drafter_path(engine, candidate.fmt, gpu, chosen, drafter)
        if mtp_fmt and mtp_fmt != candidate.fmt and not chosen.mtp and "note" not in mtp:
            mtp["note"] = f"its experts stay {mtp_fmt.upper()}"
    for worse, text in tp_problems(model, engine, candidate, gpu, tp, ep, blocks, dims, chosen.method):
        problems.append(text)
        outcome = max(outcome, worse, key=_OUTCOME_RANK.get)
    return PathVerdict(candidate, asdict(auto) | {"chosen": asdict(chosen)}, mtp, outcome, flags,
                       chosen.speed if outcome == RUNS else "none", problems)


_OUTCOME_RANK = {name: i for i, name in enumerate(engines.OUTCOMES)}


def _drafter_path(engine: EngineRules, fmt: str, gpu: str, chosen: Kernel, drafter: tuple[str, str] | None) -> dict:
    """What the drafter's experts get: the chosen kernel's MTP path, unless the release loads them
    in another format than the one its rules' MTP path is for (an ignore list that names or omits
    them), then that format's path on `gpu`; outcome "starts, wrong result" where that format is not
    the one they are stored in (garbage drafts)."""
    mtp = chosen.mtp_path
    if drafter is None:
        return mtp | {"outcome": RUNS} if mtp["runs"] else mtp
    stored, loaded = drafter
    if loaded != engine.mtp_format(fmt) and engine.has_kernel_rules(loaded) and gpu in engine.data["kernels"][loaded]:
        # the main layers' path of that format: its kernel entry's own `mtp` is for the default layout
        mtp = replace(engine.kernel(loaded, gpu), mtp=None).mtp_path | {"note": f"its experts load as {loaded.upper()} here"}
    if stored != loaded:
        return mtp | {"outcome": WRONG_RESULT, "note": f"its experts are {stored.upper()} but {engine.release_label} "
                      f"loads them as {loaded.upper()}: garbage drafts ({engine.mtp_evidence(fmt)})"}
    return mtp | {"outcome": RUNS} if mtp["runs"] else mtp


def tp_problems(model: ModelSpec, engine: EngineRules, candidate: Candidate, gpu: str, tp: int, ep: int,
                blocks: list[Block], dims: Dims, method: str) -> list[tuple[str, str]]:
    """(outcome, why) for each way the experts of `blocks` do not split over `ep` ranks (each
    kind of block its own expert count: V4.1's drafter has fewer) or over `tp` ranks (EP keeps
    experts whole): a scale block split between ranks (vLLM's create_weights refuses it), then
    the release's own TP rules (`tp` in its data, each naming a TP_CONDITIONS entry, and where it
    lists `methods`, only for paths whose MoE method, `method`, is one of them)."""
    problems = []
    if ep > 1:
        counted: dict[str, Block] = {}   # config.json key of an expert count -> a block it counts, main first
        for block in sorted(blocks, key=lambda b: not b.main):
            counted.setdefault(model.config_key("num_experts", block.name), block)
        for key, block in counted.items():
            experts = dims.experts[key]
            if experts % ep:
                whose = "" if block.main else f" of the {block.kind} blocks ({key})"
                problems.append((DOES_NOT_START, f"{experts} routed experts{whose} do not divide over --ep {ep}"))
        return problems
    inter = dims.intermediate
    block = candidate.group_size or formats.get(candidate.fmt).fixed_group or 1
    if tp > 1 and (inter % tp or (inter // tp) % block):
        problems.append((DOES_NOT_START, f"moe_intermediate_size {inter} over TP={tp} leaves {inter / tp:g} per rank, "
                         f"not a multiple of the {block}-element scale block: use a smaller --tp, or EP"))
    for rule in engine.data.get("tp", []):
        if rule["format"] != candidate.fmt or gpu not in rule["gpus"] or method not in rule.get("methods", [method]):
            continue
        outcome, applies = TP_CONDITIONS[rule["when"]]
        if applies(inter, tp, block):
            problems.append((rule.get("outcome", outcome), f"{engine.label} at TP={tp}: {rule['problem']}; {rule['works']}"))
    return problems


# The conditions a release's `tp` rules name, on (moe_intermediate_size, TP, scale block), with
# what the engine then does (a rule's own "outcome" overrides it).
TP_CONDITIONS = {
    # Marlin orders w13's group scales as per-channel ones (vLLM int_wna16.py, marlin_utils.py)
    "intermediate_per_rank_at_most_group": (WRONG_RESULT, lambda inter, tp, block: tp > 1 and inter // tp <= block),
    # SGLang's Mxfp4FlashinferCutlassMoEMethod.create_weights raises (mxfp4_flashinfer_cutlass_moe.py:66-73)
    "intermediate_per_rank_not_multiple_of_128": (DOES_NOT_START,
                                                  lambda inter, tp, block: bool(inter % tp or (inter // tp) % 128)),
}


SPEED_RANK = {name: i for i, name in enumerate(SPEED_CLASSES)}


def _error(p: PathVerdict, errors: dict) -> float:
    found = (errors.get(_error_key(p)) or {}).get("rel_error")
    return found if found is not None else float("inf")


def _rank(p: PathVerdict, errors: dict, weigh: tuple[str, ...]) -> tuple:
    """Smaller is better: `weigh`'s criteria in order, then fewer packages to install, the
    checkpoint as it is, and the release's default backend."""
    score = {"runs": _OUTCOME_RANK[p.outcome], "drafter": p.drafter_kept is False, "tier": _lossy(p),
             "error": _error(p, errors), "speed": SPEED_RANK[p.speed]}
    return (*(score[k] for k in weigh), len(p.packages_missing), p.candidate.convert != "", p.candidate.opt_in is not None)


def _lossy(p: PathVerdict) -> bool:
    """Whether the path re-quantizes the weights or runs 4-bit activations (PREFER's "tier")."""
    return not p.candidate.lossless or p.kernel.get("chosen", {}).get("arithmetic", "").startswith("W4A4")


def costs(p: PathVerdict, errors: dict, engine: EngineRules, fastest: str = "fp4-tensor-cores") -> list[str]:
    """What a path gives up, in the order the recommendation weighs it; `fastest`: the fastest
    speed class any path reaches here (a slower one is a cost only against that)."""
    if not p.runs:
        return [p.outcome]
    found = []
    if p.drafter_kept is False:
        found.append(DRAFTS_GARBAGE if p.mtp.get("outcome") == WRONG_RESULT else f"loses {_drafter_name(engine)} drafting")
    arithmetic = p.kernel["chosen"].get("arithmetic", "")
    if arithmetic.startswith("W4A4"):
        found.append("W4A4: activations in FP4")
    elif arithmetic.startswith("W4A8"):
        found.append("W4A8: activations in FP8")
    if not p.candidate.lossless:
        found.append(f"weights re-quantized to INT4 g{p.candidate.group_size}")
    error = errors.get(_error_key(p))
    if error and error.get("sqnr_db") is not None:
        found.append(f"{error['sqnr_db']:.1f} dB SQNR (requant's measurement, synthetic layer)")
    if SPEED_RANK[p.speed] > SPEED_RANK[fastest]:
        found.append(f"{p.speed}: {SPEED_CLASSES[p.speed]}")
    for package in p.packages_missing:
        found.append(f"needs package {package['name']}{package.get('spec', '')}, not in {engine.label_name}'s requirements")
    return found


DRAFTS_GARBAGE = "drafter drafts garbage: serve without speculative decoding, or convert with --drafter keep"


def _drafter_name(engine: EngineRules) -> str:
    return "DSpark" if engine.drafter.get("kind") == "dspark" else "MTP"


def recommend(paths: list[PathVerdict], errors: dict[str, dict], engine: EngineRules, checkpoint: str,
              weigh: tuple[str, ...] = PREFER["balanced"]) -> dict:
    """The recommendation and its reasons: `weigh`'s criteria in order; the checkpoint as it is
    wins ties, since converting costs time, disk and, for INT4, accuracy."""
    best = min(paths, key=lambda p: _rank(p, errors, weigh))
    fastest = fastest_speed(paths)
    gives_up = costs(best, errors, engine, fastest)
    serve = " ".join(x for x in (best.env, f"serve with {best.flags}" if best.flags else "") if x)
    if not best.runs:
        checked = [p for p in paths if p.outcome != NOT_CHECKED]
        verdict = (f"{NOT_CHECKED}: requant has no rules for these experts on {engine.label}" if not checked
                   else f"nothing requant can write runs here ({best.outcome})")
    elif not best.candidate.convert:
        verdict = f"do not convert: {checkpoint} runs as it is" + (f", {serve}" if serve else "")
    else:
        verdict = f"convert to {best.candidate.label.split(', with')[0]}" + (f" and {serve}" if serve else "")
    if best.runs:
        verdict += f" ({best.kernel['chosen'].get('arithmetic') or best.kernel['chosen']['backend']})"
        verdict += "; gives up: " + ", ".join(gives_up) if gives_up else "; gives up nothing requant measures here"
        faster = [p for p in paths if p.runs and SPEED_RANK[p.speed] < SPEED_RANK[best.speed]]
        if faster:
            quick = min(faster, key=lambda p: _rank(p, errors, PREFER["speed"]))
            verdict += f"; faster: {quick.candidate.label} (gives up: {', '.join(costs(quick, errors, engine, fastest))})"
    reasons = [f"{p.candidate.label}: {_says(p, errors, engine, fastest)}"
               for p in sorted(paths, key=lambda p: p is not best)]
    return {"verdict": verdict, "choice": best.candidate.label, "command": best.candidate.convert,
            "flags": best.flags, "env": best.env, "outcome": best.outcome, "gives_up": gives_up,
            "weighed": list(weigh), "reasons": reasons}


def fastest_speed(paths: list[PathVerdict]) -> str:
    return min((p.speed for p in paths if p.runs), key=SPEED_RANK.get, default="none")


def _says(p: PathVerdict, errors: dict, engine: EngineRules, fastest: str) -> str:
    if p.problems:
        return f"{p.outcome}: " + "; ".join(p.problems)
    k = p.kernel["chosen"]
    if not p.runs:
        return f"{p.outcome}: {k['backend']}" + (f"; fix: {k['fix']}" if k.get("fix") else "")
    return f"{k['backend']} ({k['arithmetic'] or 'arithmetic not recorded'})" + (
        f", with {p.flags}" if p.flags else "") + "; gives up: " + (", ".join(costs(p, errors, engine, fastest)) or "nothing")


def _error_key(p: PathVerdict) -> str:
    """The path's name in requant.engines.serve_paths.compare_paths: stored format, then the serving mode (W4A4 under
    the input_scale requant writes)."""
    mode = p.kernel.get("chosen", {}).get("mode", "")
    stored = f"{p.candidate.fmt}-g{p.candidate.group_size}-sym" if p.candidate.group_size else p.candidate.fmt
    return f"{stored}:{mode}" + (":written" if mode == "nvfp4-w4a4" else "")


# -- a release against the others -------------------------------------------------------------------

def upgrade(model: ModelSpec, engine: EngineRules, source_fmt: str, gpu: str, here: PathVerdict | None,
            has_drafter: bool, judge) -> dict | None:
    """The first release after `engine`'s whose default path for the checkpoint as it is reaches
    the best (drafter kept, speed class) any later release with rules reaches, where that is better
    than `here` (the path chosen on this release; None where it does not serve the model), and the
    first release where a backend the user asks for reaches it, if earlier: computed over the release
    files, never typed. `judge(rules, candidate)`: that release's PathVerdict (its TP rules included)."""
    def score(path: PathVerdict | None) -> tuple:
        if path is None or not path.runs:
            return (True, SPEED_RANK["none"])
        return (has_drafter and path.drafter_kept is False, SPEED_RANK[path.speed])

    by_default, opted = [], []
    for version in engines.releases(engine.name):
        if engines.version_key(version) <= engines.version_key(engine.version):
            continue
        try:
            rules = model.engine(engine.name, version)
        except UnsupportedError:
            continue
        if not rules.has_kernel_rules(source_fmt):
            continue
        as_is = Candidate("as it is", source_fmt)
        path = judge(rules, as_is)
        (opted if path.flags else by_default).append((score(path), version, path))   # flags: the user asks for it
        opted += [(score(p), version, p) for p in (judge(rules, c) for c in opted_in(as_is, rules, gpu))]
    if not by_default or min(s for s, *_ in by_default) >= score(here):
        return None
    best = min(s for s, *_ in by_default)
    _, version, path = next(f for f in by_default if f[0] == best)
    kernel = path.kernel["chosen"]
    drafting = f" with {_drafter_name(engine)}" if has_drafter else ""
    speed = "on FP4 tensor cores" if kernel["speed"] == "fp4-tensor-cores" else f"({kernel['speed']})"
    text = (f"upgrade {engine.label_name} to {version}: the source then runs {kernel['arithmetic'].split(':')[0]} "
            f"{speed}{drafting}, no conversion")
    sooner = next((f for f in opted if f[0] == best and engines.version_key(f[1]) < engines.version_key(version)), None)
    if sooner:
        text += f" (from {sooner[1]} on, with {sooner[2].flags})"
    return {"release": version, "text": text, "method": kernel["method"], "backend": kernel["backend"],
            "arithmetic": kernel["arithmetic"], "speed": kernel["speed"], "drafter_kept": has_drafter or None,
            "evidence": list(kernel["evidence"][:3]), "scope": engines.release_scope(engine.name, version),
            "opt_in_from": {"release": sooner[1], "flags": sooner[2].flags,
                            "evidence": list(sooner[2].kernel["chosen"]["evidence"][:2])} if sooner else None}


def published(engine: str, family: str, gpu: str) -> list[dict]:
    """Figures others published for this engine and GPU family on a model of `family`
    (requant/engines/published.json), each with its model, source and setup; never requant's own."""
    entries = json.loads(PUBLISHED.read_text())["figures"]
    return [e for e in entries if e["engine"] == engine and e["gpu"] == gpu and family in e["families"]]


# -- the answer ---------------------------------------------------------------------------------------

def checkpoint_dims(model: ModelSpec, blocks: list[Block]) -> Dims:
    keys = {model.config_key("num_experts", b.name): b.name for b in blocks}
    return Dims(model.value("intermediate_size"), {key: model.value("num_experts", name) for key, name in keys.items()})


def full_scale_dims(model: ModelSpec, dims: Dims) -> dict[str, Dims]:
    """Named model -> its released dimensions, for a checkpoint whose own are none of them (a reduced
    synthetic one): the verdict can depend on them (TP and EP splits)."""
    if model.model_name is not None:
        return {}
    main_key = model.config_key("num_experts")
    found = {}
    for name, entry in model.recipe.models.items():
        full = Dims(int(entry.dims["intermediate"]), {**dims.experts, main_key: int(entry.dims["experts"])})
        if full != dims:
            found[name] = full
    return found


def advise(ck: Checkpoint, engine_specs: list[str], gpu: str, tp: int = 1, ep: int = 1,
           errors: dict[str, dict] | None = None, prefer: str = "balanced", model: str | None = None) -> dict:
    """The answer for checkpoint `ck` (headers and config only) on each engine release and `gpu`;
    `model`: the named model to read it as (--model)."""
    engines.check_gpu(gpu)
    errors = errors or {}
    model = ModelSpec.for_checkpoint(ck, model=model, identify=True)
    index = ExpertIndex(model, ck)
    source = index.main_codec
    if source is None:
        raise UnsupportedCheckpoint(f"{ck.path}: no routed experts in a format requant knows")
    mtp_blocks = index.drafter_blocks()
    mtp_fmt = index.blocks[mtp_blocks[0]].codec if mtp_blocks else None
    blocks = list(index.blocks.values())
    dims = checkpoint_dims(model, blocks)
    answers = [_answer(ck.path, ck.config, model, spec, source.name, mtp_fmt.name if mtp_fmt else None, blocks, gpu, tp, ep,
                       dims, errors, PREFER[prefer])
               for spec in engine_specs or model.engine_names or engines.engine_names()]   # none: each "not checked"
    return {"checkpoint": ck.path, "model": model.model_name or model.name, "source_format": source.name,
            "mtp_format": mtp_fmt.name if mtp_fmt else None, "basis": FROM_CODE,
            "dims": asdict(dims), "answers": answers}


def _without_paths(status: str, caveat: str, verdict: str, outcome: str, lead: dict | None) -> dict:
    """An answer with no path to judge (no rules for the model, or a release before the first that
    serves it): its status and caveat, and a recommendation that chooses nothing."""
    return {"status": status, "checked": False, "caveat": caveat, "paths": [], "upgrade": lead,
            "recommendation": {"verdict": verdict, "outcome": outcome, "choice": None, "command": "", "flags": "",
                               "env": "", "gives_up": [], "reasons": []}}


def _answer(checkpoint: str, config: dict, model: ModelSpec, spec: str, source_fmt: str, mtp_fmt: str | None,
            blocks: list[Block], gpu: str, tp: int, ep: int, dims: Dims, errors: dict, weigh: tuple[str, ...]) -> dict:
    name, named = engines.parse_spec(spec)
    version, how = (named, "named") if named else engines.resolve(name)[1:]
    head = {"engine": name, "release": version, "chosen_as": how, "gpu": gpu, "gpu_family": GPU_FAMILIES[gpu],
            "tp": tp, "ep": ep, "published": published(name, model.name, gpu)}
    has_drafter = mtp_fmt is not None

    def judge(rules: EngineRules, cand: Candidate, at: Dims = dims) -> PathVerdict:   # a release's verdict on a path
        if cand.convert:   # what requant would write: the drafter format the release expects
            return judge_path(cand, model, rules, gpu, blocks, rules.mtp_format(cand.fmt), tp, ep, at)
        loads = drafter_loads(rules, model, config, {b.name: b.codec.name for b in blocks if b.codec}, source_fmt)
        worst = next((each for each in loads.values() if each[0] != each[1]), next(iter(loads.values()), None))
        return judge_path(cand, model, rules, gpu, blocks, mtp_fmt, tp, ep, at, worst)

    try:
        rules = model.engine(name, version)
    except UnsupportedError as e:   # no rules of this engine for the model: not checked, never "does not start"
        return head | _without_paths(NOT_CHECKED, str(e), f"{NOT_CHECKED}: {e}", NOT_CHECKED, None)
    first = engines.first_serving(name, model.name)
    if first and engines.version_key(engines.release_of(version)[0]) < engines.version_key(first):
        lead = upgrade(model, rules, source_fmt, gpu, None, has_drafter, judge)
        verdict = f"{rules.release_label} does not serve {model.model_name or model.name} models (first release that does: {first})"
        return head | _without_paths("does not serve", verdict, verdict + (f"; {lead['text']}" if lead else ""),
                                     DOES_NOT_START, lead)
    paths = []
    for cand in candidates(checkpoint, source_fmt, rules):
        paths += [judge(rules, each) for each in (cand, *opted_in(cand, rules, gpu))]
    recommendation = recommend(paths, errors, rules, checkpoint, weigh)
    chosen = next(p for p in paths if p.candidate.label == recommendation["choice"])
    lead = upgrade(model, rules, source_fmt, gpu, chosen, has_drafter, judge)
    scope = engines.release_scope(name, rules.checked_version)
    status = "checked" if rules.checked else NOT_CHECKED
    if lead:
        recommendation["verdict"] = f"{lead['text']}; on {rules.version} itself: {recommendation['verdict']}"
    if not rules.checked:
        recommendation["verdict"] = (f"{rules.caveat}; by those rules, hedged: {recommendation['verdict']}")
    at_full = {}
    for named_model, full in full_scale_dims(model, dims).items():
        judged = [judge(rules, p.candidate, full) for p in paths]
        other = recommend(judged, errors, rules, checkpoint, weigh)
        if other["choice"] != recommendation["choice"] or other["outcome"] != recommendation["outcome"]:
            at_full[named_model] = {"dims": asdict(full), "verdict": other["verdict"]}
    return head | {"status": status, "checked": rules.checked, "rules_release": rules.checked_version,
                   "scope": scope, "what_was_checked": rules_checked_text(name, rules.checked_version, scope),
                   "build_note": rules.build_note, "caveat": rules.caveat, "upgrade": lead,
                   "vision": rules.vision_summary,
                   "paths": [_path_json(p, errors, rules, fastest_speed(paths)) for p in paths],
                   "recommendation": recommendation,
                   "at_full_scale": at_full}


def rules_checked_text(engine: str, version: str, scope: str) -> str:
    """What requant checked of the release whose rules answer."""
    label = engines.release_data(engine, version)["label"]
    if scope == "selection":
        return f"kernel selection from {label} {version}'s files, loader not run"
    return f"{label} {version}'s loader and kernel selection code, run by requant's tier"


def _path_json(p: PathVerdict, errors: dict, engine: EngineRules, fastest: str) -> dict:
    opt = p.candidate.opt_in or {}
    return {"path": p.candidate.label, "format": p.candidate.fmt, "lossless": p.candidate.lossless,
            "convert": p.candidate.convert, "outcome": p.outcome, "starts": p.outcome in (RUNS, WRONG_RESULT,
                                                                                           engines.NO_KERNEL),
            "runs": p.runs, "flags": p.flags, "env": p.env, "opt_in": bool(opt),
            "packages": list(opt.get("packages", ())), "speed": p.speed, "main": p.kernel.get("chosen"),
            "auto": {k: v for k, v in p.kernel.items() if k != "chosen"}, "mtp": p.mtp,
            "drafter_kept": p.drafter_kept, "problems": p.problems, "gives_up": costs(p, errors, engine, fastest),
            "layer_error": errors.get(_error_key(p))}


def format_advice(result: dict) -> str:
    d = result["dims"]
    lines = [f"checkpoint  {result['checkpoint']} ({result['model']}, experts {result['source_format']}"
             + (f", drafter experts {result['mtp_format']}" if result["mtp_format"] else "")
             + f"; moe_intermediate_size {d['intermediate']}, {', '.join(f'{v} experts ({k})' for k, v in d['experts'].items())})"]
    for a in result["answers"]:
        lines.append("")
        head = f"{a['engine']} {a['release']} on {a['gpu']} ({a['gpu_family']}), TP={a['tp']}" + \
               (f", EP={a['ep']}" if a["ep"] > 1 else "")
        lines.append(head + f" ({result['basis']})")
        if a.get("build_note"):
            lines.append(f"  note: {a['build_note']}")
        if a["caveat"]:
            lines.append(f"  WARNING: {a['caveat']}")
        elif a.get("what_was_checked"):
            lines.append(f"  checked: {a['what_was_checked']}")
        if a.get("vision"):
            lines.append(f"  vision: {a['vision']}")
        for p in a["paths"]:
            _format_path(lines, p)
        r = a["recommendation"]
        lines.append(f"  => {r['verdict']}")
        if r["command"]:
            lines.append(f"     {r['command']}")
        if a.get("upgrade") and a["upgrade"]["evidence"]:
            lines.append(f"     upgrade evidence ({a['upgrade']['release']}, {FROM_CODE}): "
                         + "; ".join(a["upgrade"]["evidence"]))
            sooner = a["upgrade"]["opt_in_from"]
            if sooner:
                lines.append(f"     {sooner['release']} with {sooner['flags']} ({FROM_CODE}): " + "; ".join(sooner["evidence"]))
        for named, other in (a.get("at_full_scale") or {}).items():
            lines.append(f"  NOTE: this checkpoint's dimensions are not {named}'s (moe_intermediate_size "
                         f"{other['dims']['intermediate']}); at those the answer is: {other['verdict']}")
        for fig in a.get("published", []):
            lines.append(f"  published for {fig['model']} (not requant's measurement): {fig['figure']}; setup: "
                         f"{fig['setup']}; source: {fig['source']}")
    return "\n".join(lines)


def _format_path(lines: list[str], p: dict) -> None:
    main = p["main"] or {}
    if p["opt_in"] and not p["runs"]:   # an opt-in backend that does not help here: one line
        lines.append(f"  {p['path']}: {p['outcome']}: {main['backend']}")
        return
    lines.append(f"  {p['path'] + ':':<23} {p['outcome']}"
                 + (f" with {p['flags']}" if p["flags"] and p["runs"] and not p["opt_in"] else ""))
    for problem in p["problems"]:
        lines.append(f"      {problem}")
    if main:
        lines.append(f"      main layers: {main['method']}: {main['backend']}")
        if main.get("arithmetic"):
            lines.append(f"      arithmetic:  {main['arithmetic']}")
        if main.get("evidence"):
            lines.append(f"      evidence:    {'; '.join(main['evidence'][:2])}")
    if p["packages"]:
        lines.append("      packages:    " + ", ".join(
            f"{k['name']}{k.get('spec', '')} ({'in' if k.get('in_requirements') else 'NOT in'} the engine's requirements)"
            for k in p["packages"]))
    if p["auto"] and not p["opt_in"] and not p["auto"].get("runs", True):
        lines.append(f"      without flags: {p['auto']['backend']}")
    if p["mtp"]:
        m = p["mtp"]
        lines.append(f"      drafter:     {m['method']}: {m['backend']}"
                     + (f" ({WRONG_RESULT})" if m.get("outcome") == WRONG_RESULT else "" if m.get("runs", True)
                     else " (no kernel here: serve without speculative decoding)") + (f"; {m['note']}" if m.get("note") else ""))
    if p["layer_error"]:
        e = p["layer_error"]
        db = "exact" if e["sqnr_db"] is None else f"{e['sqnr_db']:.1f} dB SQNR"
        lines.append(f"      layer error: {e['rel_error']:.2e} relative, {db} vs the source in BF16 ({e['basis']})")
    if p["gives_up"] and p["runs"]:
        lines.append(f"      gives up:    {', '.join(p['gives_up'])}")
