"""Knowledge of storage formats lives in requant/formats/ (one codec per format); every other
module asks the registry. A format name quoted on its own in code outside formats/ is a dispatch
on a string that the registry should answer."""

from __future__ import annotations

import pathlib
import re

import requant
from requant import formats

PACKAGE = pathlib.Path(requant.__file__).parent
NAMES = sorted({c.name for c in formats.codecs()} | {"int4"})   # int4: the W4A16 codec's former kernel name
LITERAL = re.compile(r"""(["'])(%s)\1""" % "|".join(NAMES))


def test_no_format_name_literals_outside_formats():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("formats/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LITERAL.search(line):
                found.append(f"requant/{relative}:{number}: {line.strip()}")
    assert not found, "format names outside requant/formats/:\n" + "\n".join(found)


def test_the_check_sees_a_literal():
    assert LITERAL.search('if fmt == "nvfp4":') and LITERAL.search("get('w4a16')")
    assert not LITERAL.search('"--out w4a16"') and not LITERAL.search('"nvfp4-w4a4"')
