"""Starting over: ending an unfinished conversion for good (`requant convert ... --abort`) instead
of resuming it, and what messages offer for it.

Out of place the source lives elsewhere, so what the conversion wrote into DST is removed and DST
is left empty. In place the directory is the user's only copy: the shards no run has replaced yet
are still the source's (checked against the journal's record of each), and the source's config.json
and index live in the journal; those come back, and the directory is the source again. A shard
already converted cannot come back: the NVFP4 cast clears -0 codes and re-rounds the blocks below
its window, W4A16 is lossy, so the source's bytes are no longer anywhere. An abort then changes
nothing and names those shards: resuming is the way to a checkpoint that loads.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from requant import card
from requant.errors import CheckpointError, RequantError, UsageError
from requant.io import fsutil, journal
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME
from requant.targets.nvfp4 import HF_QUANT_CONFIG

from requant.convert.outputs import PARTIAL_SUFFIX, ancillary_files

# The metadata a conversion writes last (outputs.final_metadata), each through a temporary sibling.
METADATA_NAMES = (HF_QUANT_CONFIG, card.PROVENANCE_NAME, card.CARD_NAME, CONFIG_NAME, INDEX_NAME)


def abort_command(record: dict) -> str:
    """The command that aborts the conversion a journal records: its resume command, --abort for
    --resume."""
    resume = record.get("resume") or ""
    return resume.removesuffix(" --resume") + " --abort"


def converted_shards(target: str, snapshot: dict) -> list[str]:
    """In place: the recorded source shards that are no longer the source's bytes."""
    return [e["name"] for e in snapshot["shards"] if not journal.still_source(target, e)]


def start_over_advice(target: str) -> str:
    """How to start the unfinished conversion in `target` over, for a message: the abort command,
    or, in place once shards are converted, that resuming is the only way on."""
    try:
        record, snapshot = journal.load(target)
    except ValueError as e:
        return f"its journal cannot be read ({e})"
    if record.get("mode") != "in-place":
        return f"or start over with `{abort_command(record)}` (it removes what this conversion wrote into {target})"
    converted = converted_shards(target, snapshot)
    if converted:
        return (f"it cannot start over: {_named(converted, len(snapshot['shards']))} already converted, and the "
                "source's bytes cannot be recovered from them, so finishing it is the way to a checkpoint that loads")
    return f"or undo it with `{abort_command(record)}` (no shard is converted yet: the source comes back as it was)"


def abort(src: str, dst: str | None) -> str:
    """End the unfinished conversion of `src` into `dst` (in place when None); what was done, one
    line. Refuses, changing nothing, where it would lose data."""
    in_place = dst is None
    target = src if in_place else dst
    if not os.path.isdir(target):
        raise RequantError(f"nothing to abort: {target} is not a directory")
    lock = fsutil.DirLock(target, exclusive=True, what="a conversion writes there",
                          record=journal.path_of(target, journal.LOCK))
    try:
        if not journal.exists(target):
            if os.path.isfile(journal.path_of(target, journal.SNAPSHOT)):   # left before the first change or at the end
                shutil.rmtree(journal.path_of(target))
                return (f"nothing to abort: {target} holds no unfinished conversion; removed the snapshot a conversion "
                        f"left in {journal.path_of(target)} (nothing else was touched)")
            raise RequantError(f"nothing to abort: {target} holds no unfinished conversion")
        try:
            record, snapshot = journal.load(target)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if (record.get("mode") == "in-place") != in_place:
            raise UsageError(f"the conversion in {target} is {record.get('mode')}: abort it with "
                             f"`{abort_command(record)}`")
        return _restore_source(target, record, snapshot) if in_place else _remove_output(src, target, snapshot)
    finally:
        lock.release()


def _restore_source(target: str, record: dict, snapshot: dict) -> str:
    total = len(snapshot["shards"])
    converted = converted_shards(target, snapshot)
    if converted:
        raise RequantError(f"cannot abort the in-place conversion of {target}: {_named(converted, total)} already "
                           f"{record['options']['out']}, and the source's bytes cannot be recovered from them (the "
                           "conversion is not reversible bit for bit); nothing was changed; finish the conversion "
                           f"with `{record['resume']}`")
    remove_temporaries(target, snapshot, METADATA_NAMES)
    restored = []
    if snapshot["weight_map"] is not None and not os.path.exists(os.path.join(target, INDEX_NAME)):
        fsutil.atomic_write_json(os.path.join(target, INDEX_NAME),
                                 {"metadata": snapshot["index_metadata"] or {}, "weight_map": snapshot["weight_map"]})
        restored.append(INDEX_NAME)
    if not os.path.exists(os.path.join(target, CONFIG_NAME)):
        fsutil.atomic_write_json(os.path.join(target, CONFIG_NAME), snapshot["config"])
        restored.append(CONFIG_NAME)
    journal.remove(target)   # last: an abort stopped before this is simply run again
    back = f"{' and '.join(restored)} written back from the journal; " if restored else ""
    return (f"aborted the in-place conversion of {target}: none of its {total} shards had been converted; {back}"
            f"{target} is the source again")


def _remove_output(src: str, target: str, snapshot: dict) -> str:
    """Out of place: remove what the conversion wrote into `target` (its shards, metadata and the
    copies of the source's other files); anything else stays."""
    names = {e["name"] for e in snapshot["shards"]}
    copies = []
    if os.path.isdir(src):   # the source's other files were copied beside the shards
        copies = [card.SOURCE_CARD_NAME if n == card.CARD_NAME else n for n in ancillary_files(src, names)]
    removed = 0
    for name in sorted(names) + copies + list(METADATA_NAMES):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(target, name))
            removed += 1
    remove_temporaries(target, snapshot, METADATA_NAMES)
    for folder in sorted({os.path.dirname(c) for c in copies if os.path.dirname(c)}, key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.removedirs(os.path.join(target, folder))   # only folders left empty, up to the target
    journal.remove(target)
    left = sorted(set(os.listdir(target)) - {journal.JOURNAL_DIR})
    rest = f"; {len(left)} other entries stay ({', '.join(left)})" if left else f"; {target} is empty"
    return f"aborted the conversion into {target}: removed what it had written ({removed} files){rest}"


def remove_temporaries(target: str, snapshot: dict, metadata_names) -> None:
    """Half-written shards and metadata files of a run that was killed (the lock says no process
    is writing them)."""
    partials = {e["name"] + PARTIAL_SUFFIX for e in snapshot["shards"]}
    prefixes = tuple(f"{n}.tmp-" for n in metadata_names)
    for entry in os.listdir(target):
        if entry in partials or entry.startswith(prefixes):
            fsutil.remove_quietly(os.path.join(target, entry))
    fsutil.fsync_dir(target)


def _named(shards: list[str], total: int) -> str:
    return f"{len(shards)} of {total} shards ({', '.join(shards)}) are"   # every one: exactly what is gone
