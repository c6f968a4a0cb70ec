"""Write the SGLang release files' generated cells from executing each release's own code.

    python scripts/generate_sglang_cells.py            # every sglang release file
    python scripts/generate_sglang_cells.py 0.5.20     # one
    python scripts/generate_sglang_cells.py --check    # exit 1 where a file differs from the engine

The loader-scope release (the tier's, 0.5.23): the loader harness's kernel table
(tests/engines/sglang_kernels.table over a synthetic source and requant's outputs) becomes each
cell's `engine_answer`, its explicit backends the cell's `opt_in`, and SGLang's own MXFP4 CUTLASS
TP condition the `tp` rule; the hand-written prose of its cells is kept (the tier compares its
advise-visible fields with the answer).

A selection-scope release (0.5.12 .. 0.5.22): its DeepSeek-V4 MoE selection is executed
(tests/engines/sglang_selection.py) and the whole `kernels` of `deepseek_v4`, the `tp` rule, and
the prose `checked` and `changes` are written; its `base` is the next newer release. A release
with no file yet gets one when named. Needs the sglang wheels and the FlashInfer wheels they pin
(downloaded into ~/.cache/requant/engine-wheels on first use).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from requant import engines  # noqa: E402
from tests.engines import sglang_cells as C  # noqa: E402
from tests.engines.sglang_harness import reset  # noqa: E402

RELEASES = ROOT / "requant" / "engines" / "releases"


def _summary(cell: dict) -> str:
    fix = f"; {cell['fix_flags']} makes it run" if cell.get("fix_flags") else ""
    return f"{cell['method']} ({cell['selects']['default']}), {'runs' if cell['runs'] else 'does not run'}" \
           f"{': ' + cell['arithmetic'] if cell['arithmetic'] else ''}{fix}"


def changes(version: str, base: str, kernels: dict, tp: list) -> list[str]:
    """What differs from the base release, advise-visibly, with this release's lines."""
    base_data = engines.release_data("sglang", base)["models"]["deepseek_v4"]
    out = []
    for fmt in kernels:
        for gpu, cell in (kernels[fmt] or {}).items():
            before = base_data.get("kernels", {}).get(fmt, {}).get(gpu)
            if before is None:
                out.append(f"{fmt} on {gpu}: {_summary(cell)} ({cell['evidence'][0]})")
            elif C.visible(cell) != C.visible(before):
                out.append(f"{fmt} on {gpu}: {_summary(cell)}, where {base} selects {_summary(before)} "
                           f"({'; '.join(cell['evidence'][:2])})")
    rule = lambda rules: [(r["format"], r["when"], r["gpus"]) for r in rules or []]  # noqa: E731  (lines move)
    if rule(tp) != rule(base_data.get("tp")):
        out.append("the per-rank multiple-of-128 TP rule of Mxfp4FlashinferCutlassMoEMethod holds on "
                   + (", ".join(tp[0]["gpus"]) if tp else "no GPU (no backend selects that method)"))
    return out or [f"every generated cell as {base}, at this release's lines"]


def checked(version: str, facts: dict) -> list[str]:
    fi = f"FlashInfer {facts['pin']} (the wheel's pin) read for the CUTLASS modules it builds per GPU"
    if facts["manifest"] != facts["pin"]:
        fi += (f"; its wheel fetches the TRT-LLM-gen cubins at build time, so FlashInfer {facts['manifest']}'s manifest "
               "(the first wheel that has one) stands for which GPUs they cover")
    return [
        f"MXFP4 source: the DeepSeek-V4 --moe-runner-backend auto default ({facts['override']}) and "
        "Fp8Config.get_quant_method's routed-experts branch (layers/quantization/fp8.py) executed from this release's "
        "wheel for sm_80/90/100/120 and each explicit backend (tests/engines/sglang_selection.py), with "
        "Mxfp4MarlinMoEMethod's load-time platform check (layers/quantization/mxfp4_marlin_moe.py)",
        ("NVFP4 output: HybridFp8NvFp4Config.get_quant_method (main layers and the excluded NextN block) and "
         "ModelOptNvFp4FusedMoEMethod.__init__'s platform refusal executed" if facts["nvfp4"] else
         "NVFP4 output: not served (no HybridFp8NvFp4Config: requant's MIXED_PRECISION/NVFP4 config is not detected)"),
        "W4A16 output: the compressed-tensors WNA16 MoE dispatch read at the cited lines (not executed); the resolved "
        "backend executed as for MXFP4",
        fi,
        "not run for this release: the loader harness (name mapping, weight loading, the NextN loader, start-up hooks): "
        "the expert probe, formats and serve rules are the base release's; runtime outcomes are from the engine's code, not run",
        "DeepSeek-V4 with a DSpark drafter (V4-Flash-0731, V4-Pro-0813) and V4.1: no rules for this release (not checked); "
        f"its wheel {'has' if facts['dspark'] else 'has no'} models/deepseek_v4_dspark.py and "
        f"{'has' if facts['v41'] else 'has no'} configs/deepseek_v41.py",
    ]


def selection_file(version: str, base: str) -> dict:
    kernels, tp, facts = C.selection_release(version)
    base_model = engines.release_data("sglang", base)["models"]["deepseek_v4"]
    # the release's whole deepseek_v4 rules: the base's, with every kernel cell and the tp rules generated
    model = {k: v for k, v in base_model.items() if k != "tp"} | {"kernels": kernels} | ({"tp": tp} if tp else {})
    if not facts["nvfp4"]:
        model["unsupported"] = dict(base_model.get("unsupported", {}), nvfp4=(
            f"SGLang {version} has no hybrid FP8+NVFP4 config (HybridFp8NvFp4Config, first in 0.5.14): requant's "
            "NVFP4 experts would be read as MXFP4; upgrade SGLang"))
    models = {"deepseek_v4": C.delta(base_model, model)}
    # every other family's rules (the drafter families', Vision-Exp's) come from the loader harness, not
    # run here: "not checked" for this release
    models.update({family: None for family in engines.release_data("sglang", base)["models"] if family != "deepseek_v4"})
    return {"engine": "sglang", "label": "SGLang", "version": version, "base": base, "scope": "selection",
            "checked": checked(version, facts), "changes": changes(version, base, kernels, tp), "models": models}


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def update_loader(version: str) -> dict:
    path = RELEASES / f"sglang-{version}.json"
    data = json.loads(path.read_text())
    cells, tp = C.loader_release(version)
    model = data["models"]["deepseek_v4"]
    for fmt, gpus in cells.items():
        for gpu, cell in gpus.items():
            model["kernels"][fmt][gpu].update(engine_answer=cell["engine_answer"], opt_in=cell["opt_in"])
    if tp:
        model["tp"] = tp
    else:
        model.pop("tp", None)
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file differs")
    args = parser.parse_args(argv)
    known = engines.releases("sglang")
    versions = args.versions or known
    stale = []
    try:
        for version in sorted(versions, key=engines.version_key, reverse=True):   # newest first: each names the next newer as base
            path = RELEASES / f"sglang-{version}.json"
            if path.exists() and engines.release_scope("sglang", version) == "loader":
                data = update_loader(version)
            else:
                newer = [v for v in engines.releases("sglang") if engines.version_key(v) > engines.version_key(version)]
                data = selection_file(version, newer[0])
            if not path.exists() or json.loads(path.read_text()) != data:
                stale.append(version)
                if not args.check:
                    _write(path, data)
                    engines.reread_release_files()   # the next older release reads this one as its base
    finally:
        reset()
    print(("differs from the engine: " if args.check else "written: ") + (", ".join(stale) or "none"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
