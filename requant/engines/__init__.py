"""What each serving engine, at the release its rules were checked against, does with a checkpoint.

The rules are data in the model's recipe (`engines` in recipes/<model>.json): per engine, its
version, how it names the expert modules it probes, which format it loads the MTP experts in for
each expert format, which output formats it cannot serve (and why), the MoE kernel it selects per
GPU family, and how to start it. The conformance tests (tests/engines/) execute the engines' own
code from their release wheels and hold these rules to it: a new engine release is a new set of
rules, checked the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from requant.errors import UnsupportedError

GPU_FAMILIES = {"sm_80": "Ampere (A100)", "sm_90": "Hopper (H100/H200)",
                "sm_100": "Blackwell (B200/GB200)", "sm_120": "Blackwell (RTX PRO 6000)"}


# How an installation can differ from the engine's default one in ways that change the MoE
# kernel it selects (`Kernel.selects`). "default" is the release installed with its declared
# dependencies on a machine where they all work: for vLLM 0.33.0, FlashInfer usable (it needs
# flashinfer-cubin, or nvcc + ninja to JIT), humming-kernels importable, deep_gemm (not a
# dependency) absent. A condition is "default" or deviations joined by "+", e.g.
# "no_flashinfer+deep_gemm".
INSTALL_CONDITIONS = {
    "no_flashinfer": "FlashInfer not usable (no flashinfer-cubin and no nvcc + ninja)",
    "no_humming": "humming-kernels not importable",
    "deep_gemm": "deep_gemm installed",
}


@dataclass(frozen=True)
class Kernel:
    """The MoE path an engine selects for one expert format on one GPU family."""

    method: str          # the engine's MoE method class
    backend: str         # what runs: "FP4 tensor-core grouped GEMM (...)", "Marlin W4A16", ...
    runs: bool           # False: the engine refuses to start (see `fix`)
    note: str = ""       # what the choice depends on (installed kernels, environment, flags)
    fix: str = ""        # the flag or step that makes it run, where it does not
    selects: dict[str, str] | None = None   # install condition -> the engine's backend name (its enum)

    def selected(self, deviations: set[str]) -> str | None:
        """The engine's backend name on an installation with these INSTALL_CONDITIONS deviations
        from the default: the entry of the listed condition with the most deviations, all of
        them present ("default" has none). None where the rules do not say."""
        if not self.selects:
            return None
        unknown = set(deviations) - set(INSTALL_CONDITIONS)
        if unknown:
            raise ValueError(f"unknown install conditions {sorted(unknown)} (known: {', '.join(INSTALL_CONDITIONS)})")
        fitting = {cond: set() if cond == "default" else set(cond.split("+")) for cond in self.selects}
        fitting = {cond: flags for cond, flags in fitting.items() if flags <= set(deviations)}
        if not fitting:
            return None
        most = max(len(flags) for flags in fitting.values())
        picks = {self.selects[cond] for cond, flags in fitting.items() if len(flags) == most}
        if len(picks) > 1:
            raise ValueError(f"conditions {sorted(fitting)} disagree for {sorted(deviations)}: list the combination")
        return picks.pop()


@dataclass(frozen=True)
class EngineRules:
    name: str
    data: dict

    @property
    def version(self) -> str:
        return self.data["version"]

    @property
    def label(self) -> str:
        return f"{self.data['label']} {self.version}"

    def refusal(self, fmt: str) -> str | None:
        """Why this engine release cannot serve experts stored as `fmt`, or None when it can."""
        return self.data.get("unsupported", {}).get(fmt)

    def layout(self, fmt: str, key: str):
        """A layout rule for `fmt` output (e.g. W4A16's "fp8_linears": how the FP8-block linears must
        be described for this engine), or None."""
        return self.data["formats"].get(fmt, {}).get(key)

    def mtp_format(self, fmt: str) -> str | None:
        """The format this engine loads the MTP block's experts in when the main experts are `fmt`."""
        return self.data["formats"].get(fmt, {}).get("mtp_experts")

    def mtp_evidence(self, fmt: str) -> str:
        return self.data["formats"].get(fmt, {}).get("mtp_evidence", "")

    def expert_probes(self, layer: int, projections: list[str]) -> dict[str, str]:
        """projection -> the module name the engine asks a compressed-tensors config about for
        layer `layer`'s routed experts (expert 0, as engines probe)."""
        probe = self.data["expert_probe"]
        return {p: probe["module"].format(layer=layer, name=probe["names"][p]) for p in projections}

    def kernel(self, fmt: str, gpu: str) -> Kernel:
        table = self.data["kernels"].get(fmt)
        if table is None:
            raise UnsupportedError(f"{self.label} has no MoE path for {fmt} experts in requant's rules")
        if gpu not in GPU_FAMILIES:
            raise UnsupportedError(f"unknown GPU family {gpu!r} (known: {', '.join(GPU_FAMILIES)})")
        return Kernel(**table[gpu])

    def serve(self, fmt: str) -> dict[str, dict]:
        """GPU family -> {"command", "note"} for serving a checkpoint of `fmt` experts."""
        return self.data["serve"].get(fmt, {})

    def marlin_fp4_rule(self) -> str | None:
        """How this release turns NVFP4 block scales into Marlin's fp16 ones on GPUs without FP4
        tensor cores: "largest" (vLLM >= 0.33: one factor per layer from the largest scale,
        blocks far below it flushed), "smallest" (older vLLM: factor from the smallest scale, the
        largest may overflow), "unguarded" (scales times 2^7 go to Marlin's S0E5M3 format as they
        are, also those under 2 that the format cannot hold), or None (no Marlin NVFP4 path)."""
        return self.data.get("marlin_fp4_scales")


def available(recipe: dict) -> list[str]:
    return list(recipe.get("engines", {}))


def rules_for(recipe: dict, engine: str) -> EngineRules:
    engines = recipe.get("engines", {})
    if engine not in engines:
        raise UnsupportedError(f"no rules for engine {engine!r} for {recipe['name']} "
                               f"(known: {', '.join(engines) or 'none'})")
    return EngineRules(engine, engines[engine])


def default_engine(recipe: dict) -> str:
    return next(name for name, data in recipe["engines"].items() if data.get("default"))
