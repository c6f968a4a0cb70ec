"""verify's side of engine judging: which engines to judge by, and each verdict's problems as
findings of the right severity (the rules themselves are engines/check.py's)."""

from __future__ import annotations

from dataclasses import asdict

from requant import card, engines
from requant.engines.check import EngineVerdict, judge
from requant.errors import UnsupportedError
from requant.verify.context import Context, Layout, Observed

# Finding codes that stay informational or warnings whichever engine is judged.
_INFO_CODES = ("kernel", "vision")
_WARNING_CODES = ("marlin-flush", "marlin-unguarded")


def judge_engines(ctx: Context, layout: Layout, seen: Observed, engine: str | None, gpu: str | None) -> dict:
    """Each engine's verdict, by name. Problems are errors for the engine the output is served with
    (named, or recorded in requant.json at conversion); with none known, warnings per engine, and
    an error only when no engine loads the checkpoint correctly."""
    model, out = ctx.model, ctx.out
    made_for = _made_for(ctx) or {}
    if engine:
        asked = [(engine, None)]
    elif made_for.get("name") in model.engine_names:
        # the release it was made for, unless another release of that engine is installed here
        name = made_for["name"]
        asked = [(name, None if engines.installed_version(name) else made_for.get("version"))]
    else:   # every engine with rules for the model; with none, every engine, each then "not checked"
        asked = [(name, None) for name in model.engine_names or engines.engine_names()]
    strict = len(asked) == 1
    judged, verdicts = [], {}
    for spec, version in asked:
        try:
            judged.append(model.engine(spec, version))
        except UnsupportedError as e:   # no rules of that release for this model: said, not a usage error
            name, named = engines.parse_spec(spec)
            out.add("warning", "no-engine-rules", f"{engines.NOT_CHECKED}: {e}", name)
            verdict = EngineVerdict(name, named or version or "", name, checked=False, loads=None)
            verdicts[name] = asdict(verdict) | {"no_rules": str(e)}
    scale_names = fp8_linear_scale_names(ctx)
    for rules in judged:
        verdict, found = judge(rules, model, ctx.ck.config, layout.formats_by_block, layout.main.name,
                               seen.spans, gpu, scale_names)
        verdicts[rules.name] = asdict(verdict)
        if gpu is not None and not rules.has_kernel_rules(layout.main.name):
            note = (f"{rules.label}: requant has no MoE kernel rules for {model.name} {layout.main.name} experts "
                    f"on this release, so it names no kernel for {gpu}")
            verdicts[rules.name]["no_kernel_rules"] = note
            out.add("info", "no-kernel-rules", note)
        for code, message, where, detail in found:
            severity = ("info" if code in _INFO_CODES else "warning" if code in _WARNING_CODES
                        else "error" if strict else "warning")
            out.add(severity, code, message, where, detail)
    if not strict and judged and not any(verdicts[rules.name]["loads"] for rules in judged):
        out.add("error", "no-engine", "no engine release requant knows loads this checkpoint correctly (see the "
                "warnings above)")
    return verdicts


def _made_for(ctx: Context) -> dict | None:
    """The engine requant.json names (a conversion's about-to-be-written one first)."""
    if ctx.files is not None and card.PROVENANCE_NAME in ctx.files:
        return card.engine_of(ctx.files[card.PROVENANCE_NAME])
    return card.recorded_engine(ctx.ck.path)


def fp8_linear_scale_names(ctx: Context) -> set[str]:
    """The suffixes the FP8-block linears' scales carry: the source's `scale`, compressed-tensors'
    `weight_scale`, or `weight_scale_inv`."""
    ck, found = ctx.ck, set()
    for name in ck.names:
        if name.endswith(".weight") and ctx.model.expert_tensor(name) is None and ck.info(name).spec.dtype == "F8_E4M3":
            base = name[: -len("weight")]
            found.update(s for s in ("scale", "weight_scale", "weight_scale_inv") if base + s in ck.locations)
    return found
