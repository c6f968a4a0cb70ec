"""Which of requant's engine rules hold for an engine release: the conformance tier run against it.

    python scripts/check_engine_release.py vllm==0.35.0 [--keep-going]

Fetches the release's wheel (`pip download --no-deps`, into the tier's wheel cache), runs
tests/engines against it with requant's rules for the nearest release it has checked (the one the
release would get from `requant verify --engine vllm==0.35.0`), and lists the tests that held and
those that failed or skipped (either makes it exit 1: a skipped check holds nothing): each failure
is a rule to re-read in the new release's code. Adding the release
is then a data file, requant/engines/releases/<engine>-<version>.json (docs/engines.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from engines import wheels  # noqa: E402
from requant import engines  # noqa: E402

RESULT = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED)(?: \[\d+\])? (\S+)")   # pytest -rA's summary lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("release", help="ENGINE==VERSION, e.g. vllm==0.35.0")
    args = ap.parse_args(argv)
    name, version = engines.parse_spec(args.release)
    if version is None:
        ap.error("give the release as ENGINE==VERSION")
    os.environ[wheels.ENV] = f"{name}=={version}"
    if wheels.fetch(name) is None:
        print(f"{name}=={version}: no wheel could be fetched", file=sys.stderr)
        return 2
    checked = engines.rules_for(SimpleNamespace(name="deepseek_v4"), name, version)
    print(f"{name} {version}: " + ("requant has rules for this release" if checked.checked
                                   else f"checking the rules of {checked.checked_version} against it"))
    tier = [os.path.join("tests", "engines", f) for f in sorted(os.listdir(os.path.join(ROOT, "tests", "engines")))
            if f.startswith(f"test_{name}")]
    done = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", *tier],
                          cwd=ROOT, capture_output=True, text=True, env=os.environ)
    results: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        m = RESULT.match(line)
        if m:
            results.setdefault(m.group(1), []).append(m.group(2))
    for status in ("FAILED", "ERROR", "SKIPPED"):
        for test in results.get(status, []):
            print(f"  {status:<8}{test}")
    held, broken = len(results.get("PASSED", [])), len(results.get("FAILED", [])) + len(results.get("ERROR", []))
    skipped = len(results.get("SKIPPED", []))
    print(f"{held} held, {broken} failed or errored, {skipped} skipped")
    if not results:
        print(done.stdout[-3000:] + done.stderr[-2000:], file=sys.stderr)
        return 2
    if skipped and not broken:   # a skipped check held nothing: the release is not held until it runs
        print(f"{name} {version} is not held: {skipped} check(s) skipped (listed above)", file=sys.stderr)
    return 1 if broken or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
