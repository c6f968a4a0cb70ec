"""The conversion journal: what a resumed conversion must know, kept in the target directory.

`<target>/.requant-convert/source.json` is written once, before anything changes: the source's
config, index and every shard header (raw bytes) with its size and mtime. It is the source's
fingerprint and, for in-place and streamed conversions whose source shards disappear, all the
plan needs to be rebuilt. `journal.json` beside it is small and rewritten atomically after each
step: mode, options, requant version, the digest of source.json and each shard's state.
While this folder exists the directory is an unfinished conversion, never a checkpoint.

A conversion that stopped on damaged source bytes marks its journal `damaged` (which file,
tensor, byte, and the file's size and mtime then): resuming is refused while that file is
unchanged. A shard replaced since (same size and header, a new mtime: re-downloaded) is accepted
through `replaced`, the new mtime that overrides the snapshot's (source.json itself is written
once; one journal write records the change, so a crash leaves either state).
`lock.json` is the conversion lock's holder (fsutil.DirLock), present while a run holds it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil

from requant.io.fsutil import atomic_write, atomic_write_json, fsync_dir

JOURNAL_DIR = ".requant-convert"
JOURNAL = "journal.json"
SNAPSHOT = "source.json"
LOCK = "lock.json"
FORMAT = 1


def path_of(target: str, name: str = "") -> str:
    return os.path.join(target, JOURNAL_DIR, name) if name else os.path.join(target, JOURNAL_DIR)


def exists(target: str) -> bool:
    """Whether `target` holds an unfinished conversion (a lone source.json is a start that never
    got as far as changing anything)."""
    return os.path.isfile(path_of(target, JOURNAL))


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def digest(obj) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


def create(target: str, snapshot: dict, journal: dict) -> None:
    """Write source.json, then journal.json: a journal exists only once its snapshot is durable."""
    os.makedirs(path_of(target), exist_ok=True)
    fsync_dir(target)
    # Key order is kept: config.json and the index are rebuilt from it byte for byte.
    atomic_write(path_of(target, SNAPSHOT), json.dumps(snapshot, separators=(",", ":")).encode())
    journal["snapshot_sha256"] = digest(snapshot)
    save(target, journal)


def save(target: str, journal: dict) -> None:
    atomic_write_json(path_of(target, JOURNAL), journal)


def load(target: str) -> tuple[dict, dict]:
    """(journal, snapshot); ValueError with a reason when either is unreadable or they disagree."""
    try:
        with open(path_of(target, JOURNAL), "rb") as f:
            journal = json.load(f)
        with open(path_of(target, SNAPSHOT), "rb") as f:
            snapshot = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"the journal in {path_of(target)} cannot be read ({e})") from None
    if not isinstance(journal, dict) or journal.get("format") != FORMAT:
        raise ValueError(f"{path_of(target, JOURNAL)} is not a requant journal of format {FORMAT}")
    if journal.get("snapshot_sha256") != digest(snapshot):
        raise ValueError(f"{path_of(target, SNAPSHOT)} does not match its journal")
    for entry in snapshot.get("shards", []):   # source shards replaced after a damaged-source stop
        if entry.get("name") in (journal.get("replaced") or {}):
            entry["mtime_ns"] = journal["replaced"][entry["name"]]
    return journal, snapshot


def matches(path: str, size: int, header: bytes, mtime_ns: int | None = None) -> bool:
    """Whether the file at `path` has this size, header bytes (and modification time)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(len(header))
    except FileNotFoundError:
        return False
    return st.st_size == size and head == header and mtime_ns in (None, st.st_mtime_ns)


def still_source(target: str, entry: dict) -> bool:
    """Whether the shard a snapshot entry records is still, in `target`, that source shard."""
    return matches(os.path.join(target, entry["name"]), entry["size"], base64.b64decode(entry["header"]),
                   entry["mtime_ns"])


def progress_message(target: str) -> str:
    """What `inspect` and loaders-through-requant say about an unfinished directory."""
    try:
        with open(path_of(target, JOURNAL), "rb") as f:
            journal = json.load(f)
        done = sum(1 for s in journal["shards"] if s["done"])
        if journal.get("damaged"):
            return (f"conversion stopped on a damaged source: {done} of {len(journal['shards'])} shards done; "
                    f"{damage_advice(journal)}")
        return (f"conversion in progress: {done} of {len(journal['shards'])} shards, "
                f"resume with `{journal['resume']}`")
    except (OSError, ValueError, KeyError, TypeError):
        return f"conversion in progress (its journal {path_of(target)} is unreadable)"


def remove(target: str) -> None:
    """journal.json first: once it is gone the directory is no unfinished conversion, whatever
    of the folder a kill leaves behind."""
    os.remove(path_of(target, JOURNAL))
    fsync_dir(path_of(target))
    shutil.rmtree(path_of(target))
    fsync_dir(target)


def damage_advice(journal: dict) -> str:
    """What to do about the damaged source shard a journal is marked with."""
    d = journal["damaged"]
    folder = os.path.dirname(d["file"]) or "."
    if journal.get("mode") == "in-place":   # half converted: verify cannot open it until it is finished
        check = (f"resume with `{journal['resume']}` (it reads the new file and stops here again if it is still "
                 f"damaged), then check the result with `requant verify {folder}`")
    else:
        check = f"check it with `requant verify {folder}`, then resume with `{journal['resume']}`"
    return (f"{describe_damage(d)}; resuming will not help until {d['file']} is replaced: re-download that "
            f"shard (the same file name), {check}")


def describe_damage(d: dict) -> str:
    where = ", ".join(p for p in (f"file {d['file']}", f"tensor {d['tensor']}" if d.get("tensor") else "",
                                  f"byte offset {d['offset']:,}" if d.get("offset") is not None else "") if p)
    return f"{where}: {d['reason']}"
