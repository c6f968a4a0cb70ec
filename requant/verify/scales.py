"""The scale checks of a projection whose structure is sound. What one projection's values may not
hold is its codec's (Codec.value_problems); here, what spans projections and experts: fused
partners that must agree, and what the checkpoint-wide rules need later (Marlin spans, input
scales, group sizes)."""

from __future__ import annotations

from requant import formats
from requant.engines.check import MARLIN_FP4_FORMATS, MarlinSpan
from requant.formats import Codec
from requant.model import Expert, ModelSpec
from requant.verify.context import Context, Observed


def _fused_group(model: ModelSpec, proj: str) -> list[str]:
    for group in model.fused_projections:
        if proj in group:
            return list(group)
    return [proj]


def _reader(ctx: Context, parts: dict[str, str]):
    """read(suffix) -> the part's tensor, each read once; None where the projection has no such part."""
    cache = {}

    def read(suffix: str):
        if suffix not in parts:
            return None
        if suffix not in cache:
            cache[suffix] = ctx.ck.tensor(parts[suffix])
        return cache[suffix]
    return read


def check_scales(ctx: Context, expert: Expert, codec: Codec, projs: list[str], seen: Observed) -> None:
    model, out = ctx.model, ctx.out
    global_part, input_part = codec.part(formats.GLOBAL_SCALE), codec.part(formats.INPUT_SCALE)
    globals_, inputs = {}, {}
    for proj in projs:
        parts = expert.parts[proj]
        read = _reader(ctx, parts)
        for p in codec.value_problems(read, ctx.logical_shape(proj)):
            out.add(p.severity, p.code, p.message, parts[p.part], p.detail)
        if codec.name in MARLIN_FP4_FORMATS:
            scales = read(codec.part(formats.SCALE).suffix)   # the stored E4M3 bytes: no float copy
            group = "+".join(_fused_group(model, proj))
            seen.spans.setdefault((expert.block, group), MarlinSpan()).update(scales)
        if global_part and global_part.suffix in parts:
            globals_[proj] = formats.scalar(read(global_part.suffix))
        if input_part and input_part.suffix in parts:
            inputs[proj] = formats.scalar(read(input_part.suffix))
    for group in model.fused_projections:
        for values, severity, code, what in (
                (globals_, "error", "fused-global-scale-mismatch",
                 "weight_scale_2 differs between fused projections (vLLM keeps the first and mis-scales the other)"),
                (inputs, "warning", "fused-input-scale-mismatch",
                 "input_scale differs between fused projections (engines keep the max for the pair)")):
            present = {p: values[p] for p in group if p in values}
            if len(set(present.values())) > 1:
                out.add(severity, code, what, ctx.where(expert), ", ".join(f"{p}={v:g}" for p, v in present.items()))
    for proj, a in inputs.items():
        seen.input_scales.setdefault((expert.block, proj), set()).add(a)


def observe_shapes(ctx: Context, expert: Expert, codec: Codec, projs: list[str], seen: Observed) -> None:
    """What the config rules compare a format whose group size is chosen (W4A16) with, from the
    headers alone: the group size the scale shapes give, and whether zero points are stored."""
    if codec.fixed_group is not None:
        return
    for proj in projs:
        parts = expert.parts[proj]
        params = codec.params_from_shapes({p: ctx.ck.info(n).spec.shape for p, n in parts.items()})
        seen.group_sizes.add(params.group_size)
        seen.zero_points = seen.zero_points or params.zero_points
