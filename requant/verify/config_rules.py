"""How config.json (and hf_quant_config.json) dispatch the routed experts: each output format's
target checks the configuration it writes (Target.check_config, beside its writer). Which engine
probes reach which config group is each engine's own rule (engines/check.py)."""

from __future__ import annotations

from requant.targets import TARGETS
from requant.verify.context import Context, Layout, Observed


def check_config(ctx: Context, layout: Layout, seen: Observed) -> None:
    """The config rules of the main experts' format; none for a format requant does not write
    (an MXFP4 source)."""
    target = TARGETS.get(layout.main.name)
    if target is not None:
        target.check_config(ctx, layout, seen)
