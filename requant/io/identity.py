"""What a checkpoint says of its own name, beside config.json's model fields: the Hub repository it
is a snapshot of (the Hugging Face cache's folder names it), config.json's `_name_or_path`, and its
model card's title and front matter. Recipes match these against revisions they know only by name."""

from __future__ import annotations

import json
import os
import re

# huggingface_hub's cache layout: <cache>/models--<owner>--<name>/snapshots/<commit>
_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+$")
_CARD = "README.md"
_RECORD = "requant.json"   # a conversion's provenance record (requant.card.PROVENANCE_NAME; io sits below card)
_CARD_HEAD_BYTES = 1 << 16   # the title and front matter sit at the top


def names_seen(path: str, config: dict) -> list[tuple[str, str]]:
    """(text, where it was seen) for each place checkpoint `path` names itself."""
    seen = []
    snapshot = _SNAPSHOT.search(os.path.abspath(path))
    if snapshot:
        seen.append((f"{snapshot['owner']}/{snapshot['name']}", "Hub repository id"))
    name = config.get("_name_or_path")
    if isinstance(name, str) and name:
        seen.append((name, "config.json _name_or_path"))
    return seen + _card_names(os.path.join(path, _CARD))


def _card_names(path: str) -> list[tuple[str, str]]:
    """The front matter's lines and the first `# ` title of a model card; none where it is unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(_CARD_HEAD_BYTES).splitlines()
    except OSError:
        return []
    seen, body = [], lines
    if lines and lines[0].strip() == "---" and "---" in (line.strip() for line in lines[1:]):
        end = next(i for i, line in enumerate(lines[1:], 1) if line.strip() == "---")
        seen = [(line.strip(), f"{_CARD} front matter") for line in lines[1:end] if line.strip()]
        body = lines[end + 1:]
    title = next((line[2:].strip() for line in body if line.startswith("# ")), None)
    return seen + ([(title, f"{_CARD} title")] if title else [])


def recorded_model(path: str) -> str | None:
    """The named model a requant conversion recorded it read checkpoint `path`'s source as (its
    requant.json `model`); None for a checkpoint requant did not write."""
    try:
        with open(os.path.join(path, _RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    model = record.get("model") if isinstance(record, dict) else None
    return model if isinstance(model, str) else None
