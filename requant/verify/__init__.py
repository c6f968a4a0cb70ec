"""requant verify: lint an FP4 MoE checkpoint (NVFP4, W4A16 or MXFP4 routed experts), requant's or
anyone's, for the failures that stop serving engines loading it or make them compute garbage.

Checks, in order: the index and shard headers (every indexed tensor present at a valid offset,
total_size: opener), the routed experts' tensors (every projection complete with the right dtypes
and shapes: structure), their scales (finite, positive, fused partners agreeing: scales), how
config.json and hf_quant_config.json dispatch the experts in vLLM and SGLang (config_rules,
engine_verdicts), and the Hopper (Marlin) fp16 scale-overflow hazard. Tensors are read one expert at a
time; only scales are read unless --deep (deep).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict

from tqdm import tqdm

from requant import formats
from requant.compute import torch_threads
from requant.engines import NOT_CHECKED
from requant.errors import RequantError
from requant.io.diagnosis import path_problem, path_problem_line
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from requant.model import ModelSpec
from requant.verify.config_rules import check_config
from requant.verify.context import Context, Layout, Observed
from requant.verify.deep import DeepCompare
from requant.verify.findings import SEVERITIES, Findings
from requant.verify.engine_verdicts import judge_engines
from requant.verify.opener import open_leniently
from requant.verify.scales import check_scales, observe_shapes
from requant.verify.structure import check_structure

log = logging.getLogger(__name__)


def verify(path: str, deep: bool = False, source: str | None = None, progress: bool = True,
           engine: str | None = None, gpu: str | None = None, device: str | None = None,
           model: str | None = None) -> dict:
    """Check checkpoint `path`; return a JSON-able result whose 'ok' is False when errors were found.

    `engine` (vllm, sglang): judge loading by that engine's rules only, its problems as errors;
    None: the engine requant.json names, else every engine the recipe knows. `gpu` (sm_80 ...):
    also name the MoE kernel each judged engine selects on that GPU family. `device` decodes for
    --deep (default: CUDA when present). `model`: the named model to read it as (--model).

    A path that is no checkpoint at all (missing, a file, an unfinished conversion) gets one
    finding and a `diagnosis`, in the words `inspect` and `convert` use (requant.io.diagnosis)."""
    problem = path_problem(path)
    if problem is not None:
        out = Findings()
        code = "conversion-in-progress" if os.path.isdir(path) else "no-checkpoint"
        out.add("error", code, problem)
        result = {"path": os.path.abspath(path), "format": None, "experts_checked": 0, "deep": None, "engines": {},
                  "diagnosis": path_problem_line(path)}
        return _finish(result, out)
    return _check(path, deep=deep, source=source, progress=progress, engine=engine, gpu=gpu, device=device,
                  model=model)


def _check(path: str, deep: bool = False, source: str | None = None, progress: bool = True,
           engine: str | None = None, gpu: str | None = None, device: str | None = None,
           files: dict | None = None, data: bool = True, engines: bool = True, model: str | None = None) -> dict:
    """verify's checks on `path` (a journal there is not looked at). `files` overlays metadata a
    conversion is about to write; `data` False reads headers only (no scale is read);
    `engines` False judges no engine."""
    started = time.monotonic()
    out = Findings()
    result = {"path": os.path.abspath(path), "format": None, "experts_checked": 0, "deep": None, "engines": {}}
    ck = open_leniently(path, out, files)
    if ck is not None:
        try:
            try:
                model = ModelSpec.for_checkpoint(ck, model=model, identify=files is None)   # not convert's own check
            except RequantError as e:
                out.add("error", "model", "no recipe for this model; expert checks skipped", detail=str(e))
            else:
                _verify_experts(Context(ck, model, out, files), result, deep, source, progress, engine, gpu, device,
                                data=data, engines=engines)
        finally:
            ck.close()
    result = _finish(result, out)
    log.info("checked %s: %d experts (%s), engines judged: %s; %d errors, %d warnings, in %.2f s", path,
             result["experts_checked"], result["format"], ", ".join(result["engines"]) or "none",
             result["summary"]["error"], result["summary"]["warning"], time.monotonic() - started)
    return result


def _finish(result: dict, out: Findings) -> dict:
    findings = out.sorted()
    result["summary"] = {s: sum(f.count for f in findings if f.severity == s) for s in SEVERITIES}
    result["ok"] = result["summary"]["error"] == 0
    result["findings"] = [asdict(f) for f in findings]
    return result


def _errors_line(result: dict, limit: int = 2) -> str:
    """A result's errors in one line: the first few kinds, an example each, and how many more."""
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    parts = []
    for f in errors[:limit]:
        count = f" (x{f['count']:,})" if f["count"] > 1 else ""
        example = f" [{f['examples'][0]}]" if f["examples"] else ""
        parts.append(f"{f['code']}: {f['message']}{count}{example}")
    more = sum(f["count"] for f in errors[limit:])
    return "; ".join(parts) + (f"; and {more:,} more errors" if more else "")


def failure_line(result: dict) -> str:
    """A failed result as the one error line the CLI prints: why the path is no checkpoint, else
    how many errors and the first few."""
    errors = result["summary"]["error"]
    return result.get("diagnosis") or (f"{result['path']}: verify found {errors:,} error{'s' if errors != 1 else ''}: "
                                       f"{_errors_line(result)}")


class OutputRejected(RequantError):
    """What a conversion would write, or has written, fails verify's own checks (exit 1)."""


def planned_checkpoint(plan) -> tuple[Checkpoint, dict]:
    """What `plan` will write, from its specs alone: a Checkpoint of its shard headers (offsets
    nominal, nothing to read) and the metadata files beside them."""
    from requant.io.safetensors import Header, TensorInfo
    from requant.targets import Stats

    headers = {}
    for shard in plan.shards:
        tensors = {s.name: TensorInfo(s, 0, s.nbytes) for s in shard.specs}
        headers[shard.name] = Header(os.path.join(plan.source.path, shard.name), tensors, {}, 0, shard.file_size)
    stats = Stats()
    files = dict(plan.target.extra_files(plan.blocks))
    files[CONFIG_NAME] = plan.target.config(plan.blocks, stats)
    files[INDEX_NAME] = plan.index
    ck = Checkpoint(plan.source.path, files[CONFIG_NAME], [s.name for s in plan.shards], headers, dict(plan.weight_map),
                    files[INDEX_NAME]["metadata"], plan.weight_map)
    return ck, files


def check_conversion_plan(plan) -> dict:
    """Pre-flight: verify's header-level checks (the config rules of the output format, the
    routed-expert set against config.json, each projection's parts, dtypes and shapes) on what
    `plan` is about to write, before anything is written. Raises OutputRejected, one line, when
    they find errors; returns the verify-like result otherwise. Engine verdicts are left to the
    target's own check (check_engine, which --force overrides)."""
    ck, files = planned_checkpoint(plan)
    out = Findings()
    result = {"path": plan.source.path, "format": None, "experts_checked": 0, "deep": None, "engines": {}}
    _verify_experts(Context(ck, plan.model, out, files), result, False, None, False, None, None, None,
                    data=False, engines=False)
    result = _finish(result, out)
    if not result["ok"]:
        raise OutputRejected(f"{plan.source.path}: refused before writing anything: the {plan.target.name} output "
                             f"would fail `requant verify`: {_errors_line(result)}")
    return result


def check_written(path: str, files: dict | None = None, force: bool = False) -> dict:
    """After writing: verify's checks on the output at `path`, headers only (the shards as written,
    `files` — config.json, the index, requant.json... not yet on disk — as they are about to be
    written), with the engine it was made for unless `force` (the card records what --force
    overrode). Raises OutputRejected, one line, when verify would reject it; a conversion that
    calls this before writing config.json and the index leaves nothing loadable behind."""
    result = _check(path, progress=False, files=files, data=False, engines=not force)
    if not result["ok"]:
        raise OutputRejected(f"{path}: the converted checkpoint fails `requant verify`, so it was not finished "
                             f"(no config.json or index written): {_errors_line(result)}")
    return result


def expert_layout(ctx: Context) -> Layout | None:
    """Each block's experts' format (the most common among its projections) and the main layers'."""
    main = ctx.experts.main_codec
    return None if main is None else Layout(ctx.experts.codec_by_block(), main)


def _verify_experts(ctx: Context, result: dict, deep: bool, source: str | None, progress: bool,
                    engine: str | None, gpu: str | None, device: str | None, data: bool = True,
                    engines: bool = True) -> None:
    model, out = ctx.model, ctx.out
    experts = ctx.experts.units
    layout = expert_layout(ctx)
    if layout is None:
        out.add("error", "no-experts", "no routed experts in a known format "
                f"({', '.join(c.name for c in formats.codecs())})")
        return
    result["format"] = layout.main.name
    _check_expert_set(ctx)

    seen = Observed()
    deep_compare = DeepCompare(ctx, source, device) if deep and data else None
    # with --deep the pool's threads are the parallelism: torch's own on top oversubscribe the cores
    with torch_threads(1) if deep else contextlib.nullcontext():
        try:
            for expert in tqdm(experts, unit="expert", desc="verify", disable=not progress, dynamic_ncols=True):
                codec = layout.codecs_by_block[expert.block]
                readable = check_structure(ctx, expert, codec)
                observe_shapes(ctx, expert, codec, list(readable), seen)
                if data:
                    check_scales(ctx, expert, codec, list(readable), seen)
                if deep_compare:   # decoded by the pool while this loop reads the next experts' scales
                    deep_compare.submit(expert, readable)
                result["experts_checked"] += 1
            if deep_compare:
                deep_compare.finish()
        finally:
            if deep_compare:
                deep_compare.close()

    for (block, proj), values in seen.input_scales.items():
        if len(values) > 1:
            out.add("info", "input-scale-spread", "input_scale of one projection varies across a layer's experts "
                    "(W4A4 kernels use the layer maximum)", f"{model.experts_module(block)} {proj}",
                    f"{min(values):g} .. {max(values):g}")
    check_config(ctx, layout, seen)
    if engines:
        # An engine verdict on a checkpoint with errors of its own would be said of bytes no engine
        # gets: such a verdict is marked unjudged, and says nothing of loading (loads: None).
        sound = out.count("error") == 0
        result["engines"] = judge_engines(ctx, layout, seen, engine, gpu)
        for verdict in result["engines"].values():
            verdict["judged"] = sound
            if not sound:
                verdict["loads"] = None
    if deep_compare:
        result["deep"] = deep_compare.summary()
        blocks_total = sum(s["blocks"] for s in result["deep"].values())
        exact_total = sum(s["exact_blocks"] for s in result["deep"].values())
        if source and blocks_total:
            out.add("info", "deep-compare", f"decoded every block against the source: {exact_total:,} of "
                    f"{blocks_total:,} exact, {blocks_total - exact_total:,} re-quantized")


def _check_expert_set(ctx: Context) -> None:
    """Every layer has routed experts, every block all of them."""
    model, out = ctx.model, ctx.out
    blocks = ctx.experts.blocks.values()
    layer_blocks = [b for b in blocks if b.main]
    if len(layer_blocks) != model.value("num_layers"):
        out.add("error", "missing-layers", "layers with routed experts do not match num_hidden_layers", CONFIG_NAME,
                f"{len(layer_blocks)} found, {model.value('num_layers')} expected")
    for block in blocks:
        module = model.experts_module(block.name)
        n_experts = model.value("num_experts", block.name)
        for i in block.missing(n_experts):
            out.add("error", "missing-expert", f"routed expert has no tensors (config.json's "
                    f"{model.config_key('num_experts', block.name)} is {n_experts})",
                    f"{module}.{i}")
        extra = block.extra(n_experts)
        if extra:
            # An engine sizes the router and the expert tensors from the config, so experts past
            # that count are either dropped or fail the load: the checkpoint contradicts itself.
            out.add("error", "extra-expert", f"routed experts beyond config.json's "
                    f"{model.config_key('num_experts', block.name)} ({n_experts})", module, str(extra))


def engine_verdict_text(v: dict) -> str:
    """One engine verdict in words: a release requant has not checked, or a checkpoint with errors
    of its own, gets no 'loads it correctly'."""
    if v.get("no_rules"):
        return f"{NOT_CHECKED}: {v['no_rules']}"
    if not v.get("judged", True):
        return "not judged: the checkpoint itself has errors (below)"
    if not v["checked"]:
        return (f"not checked against {v['label']} (rules from {v['rules_version']}"
                + (f", by which it would not load: {len(v['problems'])} problems" if not v["loads"] else "") + ")")
    return "loads it correctly" if v["loads"] else "does NOT load it correctly"


def format_findings(result: dict) -> str:
    """verify's result as the terminal shows it; a path that is no checkpoint, in one line."""
    if result.get("diagnosis"):
        return f"FAILED: {result['diagnosis']}"
    lines = [f"checkpoint  {result['path']}",
             f"experts     {result['experts_checked']:,} checked, format {result['format'] or 'unknown'}"]
    for name, v in result["engines"].items():
        lines.append(f"{'engine':<12}{(name + ' ' + v['version']).strip()}: {engine_verdict_text(v)}"
                     + (f"; MoE kernel {v['kernel']['outcome']}: {v['kernel']['backend']}" + (f" (with {v['kernel']['flags']})" if v['kernel']['flags']
                                                                     else "") if v.get("kernel") else ""))
    for f in result["findings"]:
        count = f" (x{f['count']:,})" if f["count"] > 1 else ""
        lines.append(f"{f['severity'].upper():<8}{f['code']}: {f['message']}{count}")
        lines += [f"          {ex}" for ex in f["examples"]]
    s = result["summary"]
    lines.append(f"{'OK' if result['ok'] else 'FAILED'}: {s['error']} errors, {s['warning']} warnings, {s['info']} notes")
    return "\n".join(lines)
