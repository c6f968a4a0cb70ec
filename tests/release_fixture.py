#!/usr/bin/env python3
"""The public DeepSeek-V4-Flash release's layout and configs, as facts the tests compare synth with:
tests/fixtures/deepseek_v4_flash_release.json, loaded by `load()` and expanded by `expand()`.

The fixture was derived from a full listing of the release's tensors (every tensor's name, dtype,
shape and shard, read from the public index and shard headers: 69,187 entries) and its three
config files, by running this module:

    python tests/release_fixture.py tensors.json.gz config.json inference-config.json \
        generation_config.json tests/fixtures/deepseek_v4_flash_release.json

It keeps the same facts in a few KB: each shard is one block template (tensor names with `{block}`
for `layers.N` / `mtp.N`, the 256 routed experts written once) applied to one block. Deriving
checks that the expansion equals the listing, order included, before writing anything.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys

PATH = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v4_flash_release.json")


def load() -> dict:
    with open(PATH) as f:
        return json.load(f)

BLOCK = re.compile(r"^((?:layers|mtp)\.\d+)\.")
EXPERT = re.compile(r"^\{block\}\.ffn\.experts\.(\d+)\.(.+)$")


def expand(fixture: dict) -> list[tuple[str, str, list[int], int]]:
    """(name, dtype, shape, shard number) in file order."""
    out = []
    for number, (template, block) in enumerate(fixture["shards"], start=1):
        for entry in fixture["templates"][template]:
            if "experts" in entry:
                out += [(f"{block}.ffn.experts.{e}.{rest}", dtype, shape, number)
                        for e in range(entry["experts"]) for rest, dtype, shape in entry["each"]]
            else:
                name, dtype, shape = entry
                out.append((name.replace("{block}", block), dtype, shape, number))
    return out


def _template(entries: list[tuple[str, str, list[int]]]) -> list:
    out, experts = [], []
    for name, dtype, shape in entries + [("", "", [])]:
        m = EXPERT.match(name)
        if m:
            experts.append((int(m[1]), m[2], dtype, shape))
            continue
        if experts:
            count = experts[-1][0] + 1
            each = [[rest, dtype, shape] for e, rest, dtype, shape in experts if e == 0]
            assert [(e, r, d, s) for e, r, d, s in experts] == \
                [(e, r, d, s) for e in range(count) for r, d, s in each], "experts not uniform and in order"
            out.append({"experts": count, "each": each})
            experts = []
        if name:
            out.append([name, dtype, shape])
    return out


def derive(listing: dict, configs: dict[str, dict]) -> dict:
    shards: dict[int, list] = {}
    for name, t in listing["tensors"].items():
        shards.setdefault(t["shard"], []).append((name, t["dtype"], t["shape"]))
    templates, applied = {}, []
    for number in sorted(shards):
        entries = shards[number]
        m = BLOCK.match(entries[0][0])
        block = m[1] if m else ""
        if block:
            entries = [(n.replace(block + ".", "{block}.", 1) if n.startswith(block + ".") else n, d, s)
                       for n, d, s in entries]
        body = _template(entries)
        key = next((k for k, v in templates.items() if v == body), f"t{len(templates)}")
        templates[key] = body
        applied.append([key, block])
    fixture = {"source": listing["source"] + "; condensed by scripts/derive_release_fixture.py",
               "num_shards": listing["num_shards"], "num_tensors": listing["num_tensors"],
               "total_size": listing["total_size"], **configs, "templates": templates, "shards": applied}
    expected = [(n, t["dtype"], t["shape"], t["shard"]) for n, t in listing["tensors"].items()]
    assert expand(fixture) == expected, "the condensed fixture does not expand to the listing"
    return fixture


def main() -> int:
    listing_path, config, inference, generation, out = sys.argv[1:6]
    with gzip.open(listing_path) as f:
        listing = json.load(f)
    configs = {}
    for key, path in (("config.json", config), ("inference/config.json", inference),
                      ("generation_config.json", generation)):
        with open(path) as f:
            configs[key] = json.load(f)
    with open(out, "w") as f:
        json.dump(derive(listing, configs), f, separators=(",", ":"))
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
