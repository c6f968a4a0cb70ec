"""What each serving engine release does with a checkpoint: requant's engine knowledge, in one place.

The rules are data, one file per engine release (`requant/engines/releases/<engine>-<version>.json`),
per model family (a recipe's `name`): how the engine names the expert modules it probes, the format
it loads the MTP/NextN block's experts in, which output formats it cannot serve, the MoE method and
kernel it selects per GPU family and for the MTP layer, the arithmetic that kernel runs, which flags
make it start and how to serve. Each fact names the engine file it was read from. The conformance
tier (tests/engines/) executes that release's own code and holds the data to it; a release file may
name a `base` release whose data it repeats except where it says otherwise.

A release requant has no data for is never guessed at: its rules are those of the nearest checked
release, and every verdict says it was not checked against the release asked for.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from requant.errors import UnsupportedError

# How requant says what an engine does at run time: read from the release's code, never run here.
FROM_CODE = "from the engine's code, not run"

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


# What happens when a release is started on a checkpoint, in the words verify, advise, the cards
# and the README table all use; NOT_CHECKED where requant has no rules for the model or release.
DOES_NOT_START = "does not start"
WRONG_RESULT = "starts, wrong result"
NO_KERNEL = "starts, no kernel at first use"
RUNS = "runs"
NOT_CHECKED = "not checked"
OUTCOMES = (RUNS, NO_KERNEL, WRONG_RESULT, DOES_NOT_START, NOT_CHECKED)


# What a kernel computes with, from fastest class to none: advise ranks paths by it.
SPEED_CLASSES = {
    "fp4-tensor-cores": "4-bit weights and 4/8-bit activations on FP4 tensor cores",
    "weight-only": "4-bit weights dequantized to BF16 on the tensor cores (W4A16)",
    "fallback": "a path with no fast kernel for these weights (BF16 dequant, or CUDA cores)",
    "none": "does not start",
}


@dataclass(frozen=True)
class Kernel:
    """The MoE path an engine release selects for one expert format on one GPU family."""

    method: str          # the engine's MoE method class
    backend: str         # what runs: "FP4 tensor-core grouped GEMM (...)", "Marlin W4A16", ...
    runs: bool           # False: the engine refuses to start, or the kernel is not built for this GPU (see `fix`)
    note: str = ""       # what the choice depends on (installed kernels, environment, flags)
    fix: str = ""        # the flag or step that makes it run, where it does not, in words
    fix_flags: str = ""  # the serve flags of `fix`, where flags do it
    fix_kernel: dict | None = None   # the Kernel (as data) those flags select
    selects: dict[str, str] | None = None   # install condition -> the engine's backend name (its enum)
    arithmetic: str = ""  # what the GEMMs compute with, e.g. "W4A8: MXFP4 weights x MXFP8 activations"
    speed: str = ""       # a SPEED_CLASSES key
    mode: str = ""        # the serving mode (requant.engines.serve) that emulates this arithmetic
    mtp: dict | None = None   # the MTP/NextN block's experts where they differ: method, backend, runs, ...
    evidence: tuple[str, ...] = ()   # "<file>:<lines>" of the release (and its kernel library) checked
    engine_answer: dict | None = None   # what the release's own code answered, as the tier records it
    # The MoE backends a user can ask for instead (flags/env, packages, what each runs): Kernel
    # fields plus "flags", "env", "packages" [{name, spec, in_requirements}] (docs/engines.md).
    opt_in: tuple[dict, ...] = ()

    @classmethod
    def from_data(cls, entry: dict) -> "Kernel":
        """A kernel entry of a release file (its evidence and opt_in lists as tuples)."""
        return cls(**{**entry, "evidence": tuple(entry.get("evidence", ())),
                      "opt_in": tuple(dict(o) for o in entry.get("opt_in", ()))})

    @property
    def outcome(self) -> str:
        """RUNS, or how it fails: the engine's recorded answer says whether it starts and only
        lacks a kernel for this GPU at the first forward; without one, a path that does not run
        is taken not to start."""
        if self.runs:
            return RUNS
        answer = self.engine_answer or {}
        return NO_KERNEL if answer.get("starts") and answer.get("kernel_built_for_gpu") is False else DOES_NOT_START

    @property
    def mtp_path(self) -> dict:
        """What the MTP block's experts get: its own entry where the release gives them another
        method, else the main layers' path."""
        return dict(self.mtp) if self.mtp else {"method": self.method, "backend": self.backend, "runs": self.runs,
                                                "arithmetic": self.arithmetic}

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
class Serving:
    """A serve command for one GPU family, and what it runs."""

    gpu: str
    command: str          # "" where the release cannot serve it there
    kernel: Kernel        # what the main layers run under that command
    auto: Kernel          # what they get without extra flags
    flags: str            # the flags the command adds for `kernel` to start
    speculative: bool     # whether the command drafts with the MTP block
    note: str = ""

    @property
    def starts(self) -> bool:
        return bool(self.command)

    @property
    def outcome(self) -> str:
        return RUNS if self.starts else self.kernel.outcome


@dataclass(frozen=True)
class EngineRules:
    """One engine release's rules for one model family.

    `version` is the release asked about; `checked_version` the release the rules were checked
    against. They differ only for a release requant has no data for (`checked` False): then every
    verdict built from these rules must say so instead of claiming the release loads anything."""

    name: str
    data: dict
    version: str
    checked_version: str
    label_name: str
    build_note: str = ""   # how a dev or local build named on the command line was taken as its release

    @property
    def checked(self) -> bool:
        return self.version == self.checked_version

    @property
    def release_label(self) -> str:
        """The release asked about: "vLLM 0.34.0"."""
        return f"{self.label_name} {self.version}"

    @property
    def label(self) -> str:
        """How findings name the rules' source: the release, and for one requant has not checked,
        whose rules stand in."""
        if self.checked:
            return self.release_label
        return f"{self.release_label} (by {self.checked_version}'s rules, not checked)"

    @property
    def spec(self) -> str:
        """How a user names this release on the command line."""
        return f"{self.name}=={self.version}"

    @property
    def caveat(self) -> str:
        """'' for a checked release; else the sentence every verdict on it carries."""
        if self.checked:
            return ""
        known = releases(self.name)
        if version_key(self.version) < version_key(known[0]):
            return (f"not checked against {self.release_label}: it is older than {self.label_name} {known[0]}, the "
                    f"first release requant has rules for (rules from {known[0]} stand in)")
        return (f"not checked against {self.release_label} (rules from {self.label_name} {self.checked_version}, "
                f"the nearest release requant has rules for; it has {known[0]} to {known[-1]})")

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

    def mtp_loads(self, fmt: str, written: str) -> bool:
        """Whether requant's output loads correctly here with MTP/drafter experts written as
        `written` (main experts `fmt`): the format the engine expects, or, where the rules say the
        output's quantization_config.ignore decides the drafter's method (`mtp_by_ignore`), either
        format, requant writing the ignore list that matches its choice."""
        by_ignore = self.data["formats"].get(fmt, {}).get("mtp_by_ignore")
        if by_ignore:
            return written in (by_ignore["listed"], by_ignore["unlisted"])
        expected = self.mtp_format(fmt)
        return expected is None or written == expected

    def mtp_format_for(self, fmt: str, block: str, ignore) -> str | None:
        """The format this engine loads drafter block `block`'s experts in, for a checkpoint whose
        main experts are `fmt` and whose quantization_config.ignore is `ignore`."""
        by_ignore = self.data["formats"].get(fmt, {}).get("mtp_by_ignore")
        if not by_ignore:
            return self.mtp_format(fmt)
        module = by_ignore["module"].format(block=block)
        listed = any(fnmatch.fnmatchcase(module, p) for p in ignore or () if isinstance(p, str))
        return by_ignore["listed" if listed else "unlisted"]

    @property
    def drafter(self) -> dict:
        """The draft block the family ships and how this release serves it: kind ("mtp" or
        "dspark"), the engine's draft model class, the speculative method, evidence; {} where the
        rules name none."""
        return dict(self.data.get("drafter", {}))

    @property
    def vision(self) -> dict:
        """What this release does with the family's vision tower: "tower" ("served", or "ignored":
        the model is served text-only), what it skips ("skipped": tensor patterns, an entry with
        hash_layers_only matching only the hash-routed layers), evidence; {} for a family without one."""
        return dict(self.data.get("vision", {}))

    @property
    def vision_summary(self) -> str:
        """What this release does with the model's vision tower, in a sentence ('' for a family without one)."""
        tower = self.vision.get("tower")
        if tower == "served":
            return (f"{self.label} serves the vision tower too: its VL wrapper takes vision.*, aligner.* and image_* "
                    "beside the text model (requant's tier ran its name mapping) and builds the tower's linears "
                    f"unquantized, for the BF16 they are; image inputs are accepted ({FROM_CODE}).")
        if tower == "ignored":
            skipped = [entry["what"] for entry in self.vision["skipped"]]
            listed = ", ".join(skipped[:-1]) + f" and {skipped[-1]}" if len(skipped) > 1 else skipped[0]
            return (f"{self.label} serves this model text-only: it builds no vision tower for it, and its loader "
                    f"skips {listed} (requant's tier ran that loader); they are passed through unchanged, unused "
                    f"there, and image inputs are not served ({FROM_CODE}).")
        return ""

    def vision_skipped(self, names, hash_layers: int) -> set[str]:
        """The tensors among `names` this release's loader skips (`vision["skipped"]`), where the
        first `hash_layers` main layers are hash-routed."""
        out = set()
        for entry in self.vision.get("skipped", ()):
            pattern = re.compile(entry["tensors"])
            for name in names:
                m = pattern.search(name)
                if m and (not entry.get("hash_layers_only") or int(name.split(".")[1]) < hash_layers):
                    out.add(name)
        return out

    def expert_probes(self, layer: int, projections: list[str]) -> dict[str, str]:
        """projection -> the module name the engine asks a compressed-tensors config about for
        layer `layer`'s routed experts (expert 0, as engines probe)."""
        probe = self.data["expert_probe"]
        return {p: probe["module"].format(layer=layer, name=probe["names"][p]) for p in projections}

    def has_kernel_rules(self, fmt: str) -> bool:
        return fmt in self.data.get("kernels", {})

    def kernel(self, fmt: str, gpu: str) -> Kernel:
        table = self.data.get("kernels", {}).get(fmt)
        if table is None:
            raise UnsupportedError(f"{self.label} has no MoE path for {fmt} experts in requant's rules")
        check_gpu(gpu)
        if gpu not in table:
            raise UnsupportedError(f"{self.label}: requant's rules say nothing of {fmt} experts on {gpu}")
        return Kernel.from_data(table[gpu])

    def serving(self, fmt: str, gpu: str, path: str = "DIR", tp: int = 4, has_mtp: bool = True) -> Serving:
        """How to start this release on a checkpoint of `fmt` experts on `gpu`: the command (with
        the flags its kernel needs to start, and the speculative flags where the MTP block's
        experts have a kernel there), or why it cannot start."""
        auto = kernel = self.kernel(fmt, gpu)
        flags = ""
        if not kernel.runs and kernel.fix_kernel:
            kernel, flags = Kernel.from_data(kernel.fix_kernel), kernel.fix_flags
        serve = self.data["serve"]
        if not kernel.runs:
            return Serving(gpu, "", kernel, auto, flags, False, f"{kernel.outcome}: {kernel.backend}" + (
                f"; {kernel.fix}" if kernel.fix else ""))
        mtp = kernel.mtp_path
        mtp_runs = has_mtp and mtp["runs"]
        parts = [serve["command"].format(path=path, tp=tp), flags, serve["speculative"] if mtp_runs else ""]
        note = "" if mtp_runs or not has_mtp else (f"no speculative decoding: the MTP block's experts get "
                                                   f"{mtp['method']} ({mtp['backend']}), which has no kernel here")
        return Serving(gpu, " ".join(p for p in parts if p), kernel, auto, flags, mtp_runs, note)

    def marlin_fp4_rule(self) -> str | None:
        """How this release turns NVFP4 block scales into Marlin's fp16 ones on GPUs without FP4
        tensor cores: "largest" (vLLM >= 0.31: one factor per layer from the largest scale,
        blocks far below it flushed), "unguarded" (scales times 2^7 go to Marlin's S0E5M3 format as they
        are, also those under 2 that the format cannot hold), or None (no Marlin NVFP4 path)."""
        return self.data.get("marlin_fp4_scales")


def check_gpu(gpu: str) -> None:
    if gpu not in GPU_FAMILIES:
        raise UnsupportedError(f"unknown GPU family {gpu!r} (known: {', '.join(GPU_FAMILIES)})")


# -- the release files --------------------------------------------------------------------------

_RELEASES = Path(__file__).resolve().parent / "releases"


def version_key(version: str) -> tuple:
    """Sort key of a release number: its numeric parts ("0.34.0+cu130" sorts as 0.34.0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else -1)
    return tuple(parts)


@lru_cache(maxsize=None)
def _release_files() -> dict[str, dict[str, Path]]:
    found: dict[str, dict[str, Path]] = {}
    for path in _RELEASES.glob("*.json"):
        engine, _, version = path.stem.partition("-")
        found.setdefault(engine, {})[version] = path
    return found


def engine_names() -> list[str]:
    return sorted(_release_files())


SCOPES = ("loader", "selection")   # what the tier ran for a release: its loader code, or its selection code only


def releases(engine: str, scope: str | None = None) -> list[str]:
    """The releases of `engine` requant has rules for, oldest first; with `scope`, only those whose
    file has that scope ("loader": the tier runs the release's loader code, the default of a file
    without "scope"; "selection": kernel selection and drafter rules read from its files)."""
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"unknown release scope {scope!r} (known: {', '.join(SCOPES)})")
    found = sorted(_release_files().get(engine, {}), key=version_key)
    return [v for v in found if scope is None or release_scope(engine, v) == scope]


def releases_with_marlin_rule(engine: str, rule: str) -> list[str]:
    """The releases of `engine`, oldest first, whose Marlin NVFP4 scale rule
    (EngineRules.marlin_fp4_rule) is `rule` for some model family."""
    return [v for v in releases(engine)
            if any(m.get("marlin_fp4_scales") == rule for m in release_data(engine, v)["models"].values())]


@lru_cache(maxsize=None)
def release_scope(engine: str, version: str) -> str:
    """A release file's own "scope" (never its base's): what the tier checked for that release."""
    return json.loads(_release_files()[engine][version].read_text()).get("scope", "loader")


def reread_release_files() -> None:
    """Forget what was read of the release files: for the scripts that write them and for tests
    that point `_RELEASES` elsewhere."""
    for cached in (_release_files, release_scope, release_data, release_file_merged):
        cached.cache_clear()


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested objects merged key by key; a null in `over` removes the key."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_OWN_KEYS = ("scope", "checked", "changes", "version")   # keys a release file never takes from its base


@lru_cache(maxsize=None)
def release_data(engine: str, version: str) -> dict:
    """The data of one checked release, its `base` release's merged under it. A model family may
    name a `base` family of the same release whose rules it repeats except where it says otherwise
    (DeepSeek-V4 with a DSpark drafter: the V4 main layers, its own drafter rules)."""
    data = dict(release_file_merged(engine, version))   # never the cached merge's own dicts
    data["models"] = resolve_families(data["models"])
    return data


@lru_cache(maxsize=None)
def release_file_merged(engine: str, version: str) -> dict:
    """One release's file merged over its base release's, model families not yet resolved: a family
    that names a base family takes that family's rules of this release, never of the base release
    (a family added in one release and inherited by the next follows the next one's base family)."""
    return merged_over_base(engine, json.loads(_release_files()[engine][version].read_text()))


def merged_over_base(engine: str, own: dict) -> dict:
    """A release file's content `own` merged over its `base` release's file (itself so merged),
    families unresolved; `own` is left as it is."""
    data = dict(own)
    base = data.pop("base", None)
    if base:   # what was checked, and how, is the release's own: never its base's
        data = _merge({k: v for k, v in release_file_merged(engine, base).items() if k not in _OWN_KEYS}, data)
    data.setdefault("scope", "loader")
    return data


def resolve_families(models: dict) -> dict:
    return {family: _family(models, family, ()) for family in models}


def _family(models: dict, family: str, seen: tuple) -> dict:
    rules = dict(models[family])
    base = rules.pop("base", None)
    if base is None:
        return rules
    if base in seen or base not in models:
        raise ValueError(f"engine rules: family {family} names base {base!r}, which is "
                         f"{'a cycle' if base in seen else 'not in the release'}")
    return _merge(_family(models, base, seen + (family,)), rules)


_VERSION = re.compile(r"(\d+(?:\.\d+)*)((?:[.-]?(?:dev|rc|a|b|post)\d*)*)(\+[0-9A-Za-z.]+)?")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`vllm` or `vllm==0.34.0` -> (name, version or None); a release named with fewer than three
    numbers is its .0 (`vllm==0.33` is 0.33.0), as the engines number their releases."""
    name, sep, version = spec.strip().partition("==")
    name = name.strip().lower()
    if name not in _release_files():
        raise UnsupportedError(f"unknown engine {name!r} in --engine {spec!r} (known: {', '.join(engine_names())})")
    version = version.strip()
    if sep and not _VERSION.fullmatch(version):
        raise UnsupportedError(f"--engine {spec!r}: give a release as NAME==VERSION, e.g. {name}=={releases(name)[-1]}")
    return name, normalize_version(version) if version else None


def normalize_version(version: str) -> str:
    """"0.33" -> "0.33.0"; a dev, pre-, post- or local part is kept ("0.5.24.dev3+gabc")."""
    m = _VERSION.fullmatch(version)
    if not m:
        return version
    numbers = m[1].split(".")
    return ".".join(numbers + ["0"] * (3 - len(numbers))) + (m[2] or "") + (m[3] or "")


def release_of(version: str) -> tuple[str, str]:
    """The release a build belongs to, and how it was mapped ("" for a release itself):
    "0.34.0+cu130" -> 0.34.0, a local build; "0.5.24.dev3+gabc" -> 0.5.24, a development build
    made before that release, so its code may lack some of 0.5.24's."""
    m = _VERSION.fullmatch(version)
    if not m or not (m[2] or m[3]):
        return version, ""
    release = normalize_version(m[1])
    part = (m[2] or "").lstrip(".-")
    if part.startswith("post"):
        kind = f"a post-release ({part}) of {release}"
    elif part:
        kind = f"a pre-release build ({part}) made before {release}, whose code may not hold all of {release}'s"
    else:
        return release, f"{version} is a local build ({m[3]}) of {release}; taken as {release}"
    return release, f"{version} is {kind}" + (f", local version {m[3]}" if m[3] else "") + f"; taken as {release}"


def first_serving(engine: str, family: str) -> str | None:
    """The engine's first release serving model `family`, where requant knows it (None: unknown).
    An engine's release files start at its first release serving the families its oldest file has
    rules for (the tier holds this: the release before has no model file for them); a family first
    named by a later file has no known first release, since older files may just not cover it."""
    known = releases(engine)
    if known and family in release_data(engine, known[0])["models"]:
        return known[0]
    return None


_DISTRIBUTIONS = {"vllm": "vllm", "sglang": "sglang"}


def installed_version(engine: str) -> str | None:
    """The release of `engine` installed in this Python environment, or None."""
    try:
        return metadata.version(_DISTRIBUTIONS.get(engine, engine))
    except metadata.PackageNotFoundError:
        return None


def resolve(spec: str) -> tuple[str, str, str]:
    """(engine, release, how it was chosen) for an --engine value: the release named, else the one
    installed here, else the newest requant has checked."""
    name, version = parse_spec(spec)
    if version:
        return name, version, "named"
    installed = installed_version(name)
    if installed:
        return name, installed, "installed"
    return name, releases(name)[-1], "newest checked"


def _checked_for(engine: str, version: str) -> str:
    """The release with rules that stands in for `version`: the release it is a build of, else the
    newest one before it, else the oldest."""
    known = releases(engine)
    release, _ = release_of(version)
    if release in known:
        return release
    earlier = [v for v in known if version_key(v) <= version_key(release)]
    return earlier[-1] if earlier else known[0]


def rules_for(recipe: dict, engine: str, version: str | None = None) -> EngineRules:
    """The rules of `engine` (a name or NAME==VERSION) for the model family of `recipe`, at
    `version` (None: what --engine named, else the installed release, else the newest checked)."""
    name, named = parse_spec(engine)
    version = version or named or resolve(name)[1]
    checked = _checked_for(name, version)
    data = release_data(name, checked)
    family = recipe.name
    if family not in data["models"]:
        anywhere = any(family in release_data(name, v)["models"] for v in releases(name))
        raise UnsupportedError(f"{data['label']} {checked}: requant has no rules for {family} models"
                               + ("" if anywhere else f" in any {data['label']} release")
                               + f" (it has: {', '.join(data['models'])})")
    release, build_note = release_of(version)
    if release == checked:
        version = checked
    return EngineRules(name, data["models"][family], version, checked, data["label"], build_note)


def available(recipe: dict) -> list[str]:
    """The engines requant has rules for this model family with, in any release."""
    return [e for e in engine_names() if any(recipe.name in release_data(e, v)["models"] for v in releases(e))]


def default_engine(recipe: dict) -> str:
    return recipe.default_engine
