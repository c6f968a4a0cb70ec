"""Write the kernel-cell fields the conformance tier derives from a vLLM release's own code into
that release's file, requant/engines/releases/vllm-<version>.json.

    python scripts/generate_engine_cells.py [RELEASE ...] [--check]

For each release (default: every vLLM release with a file) it fetches the wheel (the tier's cache),
runs tests/engines/vllm_kernels.py's derive() (the release's backend selectors, under every install
condition, --moe-backend value and VLLM_* switch) and sets the generated fields (vllm_kernels.GENERATED;
for a selection-scope release also `backend` and `evidence`) wherever the file, merged over its
`base`, says otherwise. A file only ever holds what differs from its base. --check writes nothing
and exits 1 listing the cells that differ (tests/engines/test_vllm_kernels.py does the same per
release).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from engines import vllm_harness, vllm_kernels, wheels  # noqa: E402
from requant import engines  # noqa: E402

ENGINE = "vllm"


def effective(own: dict, version: str) -> dict:
    """What engines.release_data would give for the file content `own` (its base's data merged
    under it, model families resolved), without writing it."""
    data = engines.merged_over_base(ENGINE, copy.deepcopy(own))
    data["models"] = engines.resolve_families(data["models"])
    return data


def _strip(own: dict, keys: tuple[str, ...]) -> None:
    for rules in (own.get("models") or {}).values():
        for cells in ((rules or {}).get("kernels") or {}).values():
            for cell in (cells or {}).values():
                for key in (*keys, "mtp"):
                    (cell or {}).pop(key, None)


def _delta(have, want):
    """The value to write so that merging it over `have` gives `want` (null removes a key)."""
    if not want and want != 0 and want is not False:
        return None if have else want
    if isinstance(have, dict) and isinstance(want, dict):
        return {**{k: None for k in have if k not in want}, **{k: _delta(have.get(k), v) if isinstance(v, dict)
                                                              else v for k, v in want.items()}}
    return want


def generate(version: str) -> tuple[dict, list[str]]:
    """The release file's new content, and the cells that differed."""
    wheels.use([f"{ENGINE}=={version}"])
    vllm_harness.reset()
    path = engines._release_files()[ENGINE][version]
    own = json.loads(path.read_text())
    data = engines.release_data(ENGINE, version)
    want = vllm_kernels.expected(vllm_kernels.derive(), data)
    differed = vllm_kernels.mismatches(data, want)
    fields = vllm_kernels.SELECTION_GENERATED if data["scope"] == "selection" else vllm_kernels.GENERATED
    _strip(own, fields)
    # families without a family base first: the others inherit what those get
    order = sorted(want, key=lambda f: bool(((own.get("models") or {}).get(f) or {}).get("base")))
    for family in order:
        eff = effective(own, version)
        for fmt, gpus in want[family].items():
            for gpu, cell in gpus.items():
                have = eff["models"][family]["kernels"][fmt][gpu]
                for key, value in cell.items():
                    if have.get(key) == value or not have.get(key) and not value and not isinstance(value, bool):
                        continue
                    target = own.setdefault("models", {}).setdefault(family, {}).setdefault("kernels", {})
                    target = target.setdefault(fmt, {}).setdefault(gpu, {})
                    target[key] = _delta(have.get(key), value)
    _prune(own)
    left = vllm_kernels.mismatches(effective(own, version), want)
    if left:
        raise AssertionError(f"{ENGINE} {version}: generated cells do not merge to the derived ones: {left[:3]}")
    return own, differed


def _prune(node):
    """Drop the empty objects _strip leaves behind."""
    if isinstance(node, dict):
        for key in list(node):
            if isinstance(node[key], dict):
                _prune(node[key])
                if not node[key]:
                    del node[key]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("releases", nargs="*", help="vLLM releases (default: every one with a release file)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = ap.parse_args(argv)
    status = 0
    # newest first: a file's deltas are against its base, which is the next newer release
    for version in sorted(args.releases or engines.releases(ENGINE), key=engines.version_key, reverse=True):
        if wheels.wheel(ENGINE, version) is None:
            print(f"vllm {version}: no wheel could be fetched", file=sys.stderr)
            return 2
        own, differed = generate(version)
        for line in differed:
            print(f"vllm {version}: {line}")
        if differed and not args.check:
            path = engines._release_files()[ENGINE][version]
            path.write_text(json.dumps(own, indent=2, ensure_ascii=False) + "\n")
            engines.reread_release_files()
            print(f"vllm {version}: wrote {path.name}")
        status |= bool(differed and args.check)
    return status


if __name__ == "__main__":
    sys.exit(main())
