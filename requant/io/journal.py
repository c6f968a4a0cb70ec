"""The conversion journal: what a resumed conversion must know, kept in the target directory.

`<target>/.requant-convert/source.json` is written once, before anything changes: the source's
config, index and every shard header (raw bytes) with its size and mtime, and under "conversion"
how it was asked for (mode, options, requant version, the resume command). It is the source's
fingerprint and, for in-place and streamed conversions whose source shards disappear, all the
plan needs to be rebuilt. `journal.json` beside it is small and rewritten atomically after each
step: the same request, the digest of source.json and each shard's state (done, and what encoding
it did). Should journal.json be lost or damaged, source.json and each shard's own header are
enough to go on (convert/abort.py, convert/resume.py); only the finished shards' stats are gone.
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
import contextlib
import hashlib
import json
import os
import shutil

from requant.io.fsutil import atomic_write, atomic_write_json, fsync_dir
from requant.io.names import CONFIG_NAME, INDEX_NAME

JOURNAL_DIR = ".requant-convert"
JOURNAL = "journal.json"
SNAPSHOT = "source.json"
LOCK = "lock.json"
FORMAT = 1


def path_of(target: str, name: str = "") -> str:
    return os.path.join(target, JOURNAL_DIR, name) if name else os.path.join(target, JOURNAL_DIR)


def exists(target: str) -> bool:
    """Whether `target` holds an unfinished conversion. A lone source.json is a start that never got
    as far as changing anything, or an end killed while the folder went (config.json is then in
    place), unless the target lacks config.json or the index and holds more than the folder: then journal.json
    (with source.json, or not) was lost part-way, and source.json may hold the only copy of the
    source's config and index."""
    if os.path.isfile(path_of(target, JOURNAL)):
        return True
    return (state_left(target) and bool(set(os.listdir(target)) - {JOURNAL_DIR})
            and not has_metadata(target))


def has_metadata(target: str) -> bool:
    """Whether config.json and the index are in `target` (an in-place conversion sets them aside in
    source.json until it ends)."""
    return all(os.path.isfile(os.path.join(target, n)) for n in (CONFIG_NAME, INDEX_NAME))


def state_left(target: str) -> bool:
    """Whether the state folder holds anything but a lock record (which any run makes)."""
    return os.path.isdir(path_of(target)) and bool(set(os.listdir(path_of(target))) - {LOCK})


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def digest(obj) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


def create(target: str, snapshot: dict, journal: dict) -> None:
    """Write source.json (with the request: `journal` but its shards), then journal.json: a
    journal exists only once its snapshot is durable."""
    os.makedirs(path_of(target), exist_ok=True)
    fsync_dir(target)
    snapshot["conversion"] = {k: v for k, v in journal.items() if k != "shards"}
    # Key order is kept: config.json and the index are rebuilt from it byte for byte.
    atomic_write(path_of(target, SNAPSHOT), json.dumps(snapshot, separators=(",", ":")).encode())
    journal["snapshot_sha256"] = digest(snapshot)
    save(target, journal)


def rebuild(target: str, snapshot: dict) -> dict:
    """A journal in place of a lost or damaged journal.json, from the request source.json records:
    no shard done yet (a resume finds the finished ones by their headers), none with stats. A
    damaged file is kept beside it as journal.json.damaged."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(path_of(target, JOURNAL), path_of(target, JOURNAL + ".damaged"))
    journal = {**snapshot["conversion"], "snapshot_sha256": digest(snapshot),
               "shards": [{"name": e["name"], "done": False, "stats": None} for e in snapshot["shards"]]}
    save(target, journal)
    return journal


def save(target: str, journal: dict) -> None:
    atomic_write_json(path_of(target, JOURNAL), journal)


class Damaged(ValueError):
    """A state file that is missing or cannot be read as what it should be; `name` says which
    (JOURNAL or SNAPSHOT)."""

    def __init__(self, target: str, name: str, why: str):
        super().__init__(f"{path_of(target, name)} {why}")
        self.name = name


def _read(target: str, name: str, shape) -> dict:
    """A state file, checked against `shape` (a function: the first thing wrong, or None)."""
    try:
        with open(path_of(target, name), "rb") as f:
            content = json.load(f)
    except FileNotFoundError:
        raise Damaged(target, name, "is missing") from None
    except (OSError, ValueError) as e:
        raise Damaged(target, name, f"cannot be read ({e})") from None
    wrong = shape(content)
    if wrong:
        raise Damaged(target, name, f"is not what requant writes there ({wrong})")
    return content


def _journal_shape(journal) -> str | None:
    if not isinstance(journal, dict) or journal.get("format") != FORMAT:
        return f"not a journal of format {FORMAT}"
    shards = journal.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str)
                                               and isinstance(s.get("done"), bool) for s in shards):
        return "no list of shards with their state"
    if not isinstance(journal.get("options"), dict) or not isinstance(journal.get("resume"), str):
        return "no options or resume command"
    return None


def _snapshot_shape(snapshot) -> str | None:
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("config"), dict):
        return "no source config"
    if not isinstance(snapshot.get("weight_map"), (dict, type(None))) \
            or not isinstance(snapshot.get("index_metadata"), (dict, type(None))):
        return "no source index"
    shards = snapshot.get("shards")
    fields = (("name", str), ("size", int), ("header", str), ("mtime_ns", (int, type(None))))
    if not isinstance(shards, list) or not all(isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in fields)
                                               for s in shards):
        return "no list of source shards"
    try:
        for s in shards:
            base64.b64decode(s["header"], validate=True)
    except ValueError:
        return "a shard header that is no base64"
    return None


def load_record(target: str) -> dict:
    """journal.json alone; Damaged when it is missing or unreadable."""
    return _read(target, JOURNAL, _journal_shape)


def load_snapshot(target: str) -> dict:
    """source.json; Damaged when it is missing or unreadable."""
    return _read(target, SNAPSHOT, _snapshot_shape)


def load(target: str) -> tuple[dict, dict]:
    """(journal, snapshot); Damaged naming the file when either is missing or unreadable,
    ValueError when they disagree."""
    journal = load_record(target)
    snapshot = load_snapshot(target)
    if journal.get("snapshot_sha256") != digest(snapshot) or \
            [s["name"] for s in journal["shards"]] != [s["name"] for s in snapshot["shards"]]:
        raise Damaged(target, SNAPSHOT, "does not match its journal")
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
        journal = load_record(target)
    except Damaged as e:
        try:
            command = f"`{load_snapshot(target)['conversion']['resume']}`"
        except (Damaged, KeyError, TypeError):
            command = "the command that started it, with --resume,"
        return f"conversion in progress, but {e}; {command} says what is safe and goes on where it can"
    done = sum(1 for s in journal["shards"] if s["done"])
    if journal.get("damaged"):
        return (f"conversion stopped on a damaged source: {done} of {len(journal['shards'])} shards done; "
                f"{damage_advice(journal)}")
    return f"conversion in progress: {done} of {len(journal['shards'])} shards, resume with `{journal['resume']}`"


def remove(target: str) -> None:
    """journal.json first: once it is gone the directory is no unfinished conversion, whatever
    of the folder a kill leaves behind."""
    with contextlib.suppress(FileNotFoundError):   # lost (a damaged state an abort ends)
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
