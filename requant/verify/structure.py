"""Whether each routed-expert projection has the parts its codec declares, in the declared dtypes
and in the shapes config.json's sizes give."""

from __future__ import annotations

from requant import formats
from requant.formats import mxfp4
from requant.model import Expert
from requant.verify.context import Context

SCALAR_SHAPES = ((), (1,))
# An MXFP4 source's .scale left beside converted parts: engines build no parameter for it and the
# load fails. Other strangers are only suspicious.
LEFTOVER_SOURCE_SCALE = mxfp4.CODEC.part(formats.SCALE).suffix


def accepted_shapes(part: formats.Part, rows: int, k: int, params: formats.Params) -> tuple[tuple, ...]:
    if part.scalar:
        return SCALAR_SHAPES
    if part.grouped and params.group_size is None:
        return ()   # the scales' shape gives no group size: no shape of theirs fits
    return (part.shape(rows, k, params),)


def check_structure(ctx: Context, expert: Expert, codec: formats.Codec) -> dict[str, formats.Codec]:
    """Check each projection's parts; return proj -> codec for the projections complete enough to read."""
    readable = {}
    for proj in ctx.model.projections:
        parts = expert.parts.get(proj, {})
        prefix = ctx.where(expert, proj)
        if not parts:
            ctx.out.add("error", "missing-projection", "routed expert projection has no tensors", prefix)
            continue
        rows, k = ctx.logical_shape(proj)
        params = codec.params_from_shapes({p: ctx.matrix_shape(n, codec) for p, n in parts.items()}, k)
        ok = True
        for part in codec.parts:
            name = f"{prefix}.{part.suffix}"
            if part.suffix not in parts:
                if part.required:
                    input_scale = part.role == formats.INPUT_SCALE
                    code = "missing-input-scale" if input_scale else "missing-part"
                    why = " (engines divide by it: vLLM emits NaN or empty output)" if input_scale else ""
                    ctx.out.add("error", code, f"{codec.name} projection lacks .{part.suffix}{why}", name)
                    ok = ok and input_scale
                continue
            spec = ctx.ck.info(parts[part.suffix]).spec
            shape = ctx.matrix_shape(parts[part.suffix], codec)
            shapes = accepted_shapes(part, rows, k, params)
            if spec.dtype not in part.dtypes:
                ctx.out.add("error", "wrong-dtype", f"{codec.name} .{part.suffix} has the wrong dtype", name,
                            f"{spec.dtype}, expected {'/'.join(part.dtypes)}")
                ok = False
            elif part.shape_checked and shape not in shapes:
                ctx.out.add("error", "wrong-shape", f"{codec.name} .{part.suffix} has the wrong shape for "
                            "config.json's sizes", name,
                            f"{list(shape)}, expected {' or '.join(str(list(s)) for s in shapes)}")
                ok = False
        declared = {p.suffix for p in codec.parts} | set(ctx.model.carried_parts)
        for suffix in parts:
            if suffix not in declared:
                severity = "error" if suffix == LEFTOVER_SOURCE_SCALE else "warning"
                ctx.out.add(severity, "unexpected-part", f"{codec.name} projection carries a tensor engines do not "
                            "expect (a leftover source tensor fails the load)", f"{prefix}.{suffix}")
        if ok:
            readable[proj] = codec
    return readable
