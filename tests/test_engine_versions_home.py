"""Engine release versions are engine knowledge: outside requant/engines/ no file of requant/ names
one (issue 42, item 4); what needs one asks requant.engines (cli's help texts do).

The versions are the release files' own (requant/engines/releases/<engine>-<version>.json), so a
new release is covered when its file lands.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "requant"
RELEASES = ROOT / "engines" / "releases"


def versions() -> set[str]:
    return {path.stem.partition("-")[2] for path in RELEASES.glob("*.json")}


def naming(root: Path, found: set[str]) -> dict[str, list[str]]:
    """relative path -> the versions of `found` each text file under `root` outside engines/ names."""
    pattern = re.compile(r"(?<![\d.])(" + "|".join(map(re.escape, sorted(found))) + r")(?!\d)")
    named = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if not path.is_file() or relative.startswith("engines/") or "__pycache__" in relative:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if hits := sorted(set(pattern.findall(text))):
            named[relative] = hits
    return named


def test_no_engine_release_named_outside_engines():
    assert len(versions()) > 10 and {"0.34.0", "0.5.23"} <= versions()
    stray = naming(ROOT, versions())
    assert not stray, f"engine releases named outside requant/engines/ (ask requant.engines): {stray}"


def test_the_scan_finds_a_release(tmp_path):
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "x.py").write_text("vLLM 0.34.0")
    (tmp_path / "a.py").write_text('HELP = "e.g. vllm==0.34.0"  # 10.34.0 and 0.34.01 are no release')
    (tmp_path / "b.py").write_text("no release here: 0.34, 1.0.34.0")
    assert naming(tmp_path, {"0.34.0"}) == {"a.py": ["0.34.0"]}
