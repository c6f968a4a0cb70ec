"""Per-codec checks of the scales of a projection whose structure is sound: values no decoder
should meet (NaN, negative, zero over live codes), fused partners that must agree, and what the
checkpoint-wide rules need later (Marlin spans, input scales, group sizes)."""

from __future__ import annotations

import math

import torch

from requant.engine_check import MarlinSpan
from requant.formats import int4, mxfp4, nvfp4, scalar
from requant.model import Expert, ModelSpec
from requant.verify.context import Context, Observed


def _bad_scalar(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "infinite"
    if value <= 0:
        return "zero" if value == 0 else "negative"
    return None


def _fused_group(model: ModelSpec, proj: str) -> list[str]:
    for group in model.fused_projections:
        if proj in group:
            return list(group)
    return [proj]


def check_nvfp4_scales(ctx: Context, expert: Expert, projs: list[str], seen: Observed) -> None:
    ck, model, out = ctx.ck, ctx.model, ctx.out
    globals_, inputs = {}, {}
    for proj in projs:
        parts = expert.parts[proj]
        prefix = ctx.where(expert, proj)
        scales = ck.tensor(parts["weight_scale"]).view(torch.float8_e4m3fn).float()
        nan = int(torch.isnan(scales).sum())
        if nan:
            out.add("error", "nan-block-scale", "NaN block scales (E4M3 0x7F/0xFF)", f"{prefix}.weight_scale", f"{nan} blocks")
        negative = int((scales < 0).sum())
        if negative:
            out.add("error", "negative-block-scale", "negative block scales", f"{prefix}.weight_scale", f"{negative} blocks")
        zero = scales == 0
        if zero.any():
            weight = ck.tensor(parts["weight"]).view(torch.uint8)
            codes = (weight.view(weight.shape[0], -1, nvfp4.BLOCK // 2) & 0x77).ne(0).any(dim=-1)
            lost = int((zero & codes).sum())
            if lost:
                out.add("warning", "zero-block-scale", "zero block scales over non-zero codes (those weights decode to 0)",
                        f"{prefix}.weight_scale", f"{lost} blocks")
        group = "+".join(_fused_group(model, proj))
        seen.spans.setdefault((expert.block, group), MarlinSpan()).update(scales)
        g = scalar(ck.tensor(parts["weight_scale_2"]))
        globals_[proj] = g
        if (why := _bad_scalar(g)) is not None:
            out.add("error", "bad-global-scale", "weight_scale_2 is not finite and positive", f"{prefix}.weight_scale_2", why)
        if "input_scale" in parts:
            a = scalar(ck.tensor(parts["input_scale"]))
            inputs[proj] = a
            if (why := _bad_scalar(a)) is not None:
                out.add("error", "bad-input-scale", "input_scale is not finite and positive (engines divide by it: "
                        "NaN or empty output)", f"{prefix}.input_scale", why)
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


def check_mxfp4_scales(ctx: Context, expert: Expert, projs: list[str], seen: Observed) -> None:
    for proj in projs:
        name = expert.parts[proj]["scale"]
        nan = int((ctx.ck.tensor(name).view(torch.uint8) == mxfp4.E8M0_NAN).sum())
        if nan:
            ctx.out.add("error", "nan-block-scale", "NaN block scales (E8M0 0xFF)", name, f"{nan} blocks")


def check_w4a16_scales(ctx: Context, expert: Expert, projs: list[str], seen: Observed) -> None:
    for proj in projs:
        parts = expert.parts[proj]
        prefix = ctx.where(expert, proj)
        scales = ctx.ck.tensor(parts["weight_scale"]).float()
        for code, mask, what, severity in (
                ("nonfinite-group-scale", ~torch.isfinite(scales), "non-finite group scales", "error"),
                ("negative-group-scale", scales < 0, "negative group scales", "error"),
                ("zero-group-scale", scales == 0, "zero group scales (those weights decode to 0)", "warning")):
            n = int(mask.sum())
            if n:
                ctx.out.add(severity, code, what, f"{prefix}.weight_scale", f"{n} groups")
        shape = [int(v) for v in ctx.ck.tensor(parts["weight_shape"]).reshape(-1).tolist()]
        if shape != list(ctx.logical_shape(proj)):
            ctx.out.add("error", "weight-shape-value", "weight_shape does not hold the logical [out, in] shape",
                        f"{prefix}.weight_shape", f"{shape}, expected {list(ctx.logical_shape(proj))}")


def observe_w4a16_shapes(ctx: Context, expert: Expert, projs: list[str], seen: Observed) -> None:
    """What the config rules compare the W4A16 experts with, from the headers alone: the group
    size the scale shapes give, and whether zero points are stored."""
    for proj in projs:
        parts = expert.parts[proj]
        params = int4.CODEC.params_from_shapes({p: ctx.ck.info(n).spec.shape for p, n in parts.items()})
        seen.group_sizes.add(params.group_size)
        seen.zero_points = seen.zero_points or params.zero_points


# header-only observations, made whether or not the scales are read
SHAPE_OBSERVATIONS = {int4.CODEC: observe_w4a16_shapes}
SCALE_CHECKS = {nvfp4.CODEC: check_nvfp4_scales, mxfp4.CODEC: check_mxfp4_scales, int4.CODEC: check_w4a16_scales}
