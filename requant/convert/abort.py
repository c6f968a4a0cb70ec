"""Starting over: ending an unfinished conversion for good (`requant convert ... --abort`) instead
of resuming it, and what messages offer for it.

Out of place the source lives elsewhere, so what the conversion wrote into DST is removed and DST
is left empty. In place the directory is the user's only copy: the shards no run has replaced yet
are still the source's (checked against the journal's record of each), and the source's config.json
and index live in the journal; those come back, and the directory is the source again. A shard
already converted cannot come back: the NVFP4 cast clears -0 codes and re-rounds the blocks below
its window, W4A16 is lossy, so the source's bytes are no longer anywhere. An abort then changes
nothing and names those shards: resuming is the way to a checkpoint that loads.

A damaged or lost journal.json changes none of that: source.json alone says what each shard was
(the journal's shard states only repeat what the shards' own headers show). A damaged source.json
held the only copy of the source's config.json and index once they were set aside, and the only
record of the converted shards' source headers: nothing can go on from it, so the messages say
which files to put back (the same revision's) before an abort gives the directory back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections import Counter

from requant import card
from requant.errors import CheckpointError, RequantError, UsageError
from requant.io import fsutil, journal
from requant.experts import ExpertIndex
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json
from requant.io.safetensors import read_header
from requant.model import ModelSpec
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


def start_over_advice(target: str, hint: str) -> str:
    """How to start the unfinished conversion in `target` over, for a message: the abort command,
    or, in place once shards are converted, that resuming is the only way on. `hint`: this
    command's resume form, for a state too damaged to name its own."""
    try:
        record, snapshot = journal.load(target)
    except journal.Damaged as e:
        return damaged_state_advice(target, e, hint)
    if record.get("mode") != "in-place":
        return f"or start over with `{abort_command(record)}` (it removes what this conversion wrote into {target})"
    converted = converted_shards(target, snapshot)
    if converted:
        return (f"it cannot start over: {_named(converted, len(snapshot['shards']))} already converted, and the "
                "source's bytes cannot be recovered from them, so finishing it is the way to a checkpoint that loads")
    return f"or undo it with `{abort_command(record)}` (no shard is converted yet: the source comes back as it was)"


def lost_state_advice(hint: str) -> str:
    """For a directory without its config.json or index and no conversion state: what to do if an
    in-place conversion's state was lost there (`hint`: this command's resume form)."""
    return (f"if a conversion's state folder was emptied here, put back {CONFIG_NAME}, {INDEX_NAME} and every shard "
            f"whose file differs from the original's from the same revision of the original, then "
            f"`{abort_command({'resume': hint})}` ends it")


def damaged_state_advice(target: str, e: journal.Damaged, hint: str) -> str:
    """One line on a damaged state file `e`: what is still safe and the requant command that goes
    on (`hint`, this command's resume form, where neither file names it)."""
    try:
        snapshot = journal.load_snapshot(target)
    except journal.Damaged as lost:
        return _unrecoverable(target, f"{e}, and {lost}" if e.name == journal.JOURNAL else str(e), hint)
    conversion = snapshot.get("conversion") or {}
    command = conversion.get("resume") or hint
    resume = f"go on with `{command}` (it rebuilds the journal from {journal.SNAPSHOT} and each shard's own header)"
    if not conversion:   # written before source.json recorded the request: nothing to check a resume against
        resume = f"it cannot be resumed (no record of its options there): `{abort_command({'resume': command})}`"
    if conversion.get("mode", "in-place") != "in-place":
        return f"{e}; {resume}, or start over with `{abort_command({'resume': command})}`"
    converted = converted_shards(target, snapshot)
    if not converted:
        return (f"{e}; the source's config.json and index are safe in {journal.path_of(target, journal.SNAPSHOT)} and "
                f"no shard is converted: {resume}, or undo it with `{abort_command({'resume': command})}`")
    return (f"{e}; the source's config.json and index are safe in {journal.path_of(target, journal.SNAPSHOT)}; "
            f"{_named(converted, len(snapshot['shards']))} already converted ({_formats(target, snapshot, converted)})"
            f" and cannot give back the source's bytes: {resume}")


def _unrecoverable(target: str, e: str, hint: str) -> str:
    """source.json is damaged: with the directory wholly the source, or wholly the finished
    conversion (config.json and index in place and matching the shards), an abort ends it as it
    is; otherwise, what to put back first."""
    record = _readable_record(target)
    command = abort_command({"resume": record.get("resume") or hint})
    if record.get("mode") == "out-of-place":
        return f"{e}; the source is untouched elsewhere: start over with `{command}`"
    state, put_back = _directory_state(target, (record.get("options") or {}).get("out"))
    if state:
        return (f"{e}; {target}'s config.json and index are in place and match its shards, {state}: `{command}` "
                "ends the conversion as it is")
    return (f"{e}; it held the only copy of the source's config.json and index and of the converted shards' source "
            f"headers, so the conversion cannot go on; nothing was changed: put back {', '.join(put_back)} from the "
            f"same revision of the original, then `{command}` ends the conversion with {target} the source again")


def _readable_record(target: str) -> dict:
    try:
        return journal.load_record(target)
    except journal.Damaged:
        return {}


def _directory_state(target: str, out: str | None) -> tuple[str | None, list[str]]:
    """What `target` is by its files alone: ("every shard is the source's" or "every shard is
    converted", []) where config.json and the index match the shards and their routed experts are
    all in the source format or all in `out` (None: unknown, then all in one format); else (None,
    the files to put back from the original: config.json and the index where missing or not
    matching, the shards whose experts are in another format)."""
    try:
        with Checkpoint.open(target, unfinished=True) as ck:
            formats = shard_formats(ck)
        metadata = []
    except RequantError:   # missing, or the source's beside converted shards: read each shard alone
        metadata = [CONFIG_NAME, INDEX_NAME]
        formats = _loose_shard_formats(target)
    if formats is None:
        return None, [*metadata, "every shard whose file differs from the original's"]
    common = Counter(f for fs in formats.values() for f in fs).most_common(1)
    kept = {common[0][0]} if common and out is None else set()
    converted = [n for n, fs in formats.items() if (out in fs if out else fs - kept)]
    if not metadata and not converted:
        return "every shard is the source's", []
    if not metadata and len(converted) == len(formats):
        return "every shard is converted", []
    return None, metadata + converted


def _loose_shard_formats(target: str) -> dict[str, set[str]] | None:
    """shard_formats of every safetensors file in `target`, by its config.json (None: unreadable,
    or no routed experts recognised)."""
    try:
        config = read_json(os.path.join(target, CONFIG_NAME))
        names = sorted(n for n in os.listdir(target) if n.endswith(".safetensors"))
        return shard_formats(_loose(target, config, names))
    except RequantError:
        return None


def _loose(target: str, config: dict, names: list[str]) -> Checkpoint:
    """The shards `names` of `target` as a checkpoint with `config`, whatever the index says."""
    headers = {n: read_header(os.path.join(target, n)) for n in names}
    return Checkpoint(target, config, names, headers, {t: n for n, h in headers.items() for t in h.tensors})


def shard_formats(ck: Checkpoint) -> dict[str, set[str]]:
    """Each shard's formats of routed experts, by its header's dtypes (experts.ExpertIndex, as
    inspect and verify tell them)."""
    index = ExpertIndex(ModelSpec.for_checkpoint(ck), ck)
    found: dict[str, set[str]] = {n: set() for n in ck.shard_names}
    for unit in index.units:
        for proj, parts in unit.parts.items():
            codec = index.codec_of(unit, proj)
            found[ck.locations[next(iter(parts.values()))]].add(codec.name if codec else "unknown")
    return found


def _formats(target: str, snapshot: dict, names: list[str]) -> str:
    """What the converted shards' own headers say they hold, for a message."""
    try:
        formats = shard_formats(_loose(target, snapshot["config"], names))
    except RequantError:
        return "their headers differ from the source's"
    return "their experts " + ", ".join(sorted({"/".join(sorted(fs)) or "none" for fs in formats.values()}))


def abort(src: str, dst: str | None, hint: str = "") -> str:
    """End the unfinished conversion of `src` into `dst` (in place when None); what was done, one
    line. Refuses, changing nothing, where it would lose data. `hint`: this command's resume
    form, for messages on a state too damaged to name its own."""
    in_place = dst is None
    target = src if in_place else dst
    if not os.path.isdir(target):
        raise RequantError(f"nothing to abort: {target} is not a directory")
    lock = fsutil.DirLock(target, exclusive=True, what="a conversion writes there",
                          record=journal.path_of(target, journal.LOCK))
    try:
        if not journal.exists(target):
            if journal.state_left(target) or _temporaries_left(target):   # a start or an end killed, or the
                remove_temporaries(target, _whole(target, hint), METADATA_NAMES)   # state lost and put back since
                shutil.rmtree(journal.path_of(target))
                return (f"nothing to abort: {target} holds no unfinished conversion; removed what a killed conversion "
                        f"left ({journal.path_of(target)} and half-written files; nothing else was touched)")
            lost = "" if os.path.isfile(os.path.join(target, CONFIG_NAME)) or not os.listdir(target) else (
                f"; it has no {CONFIG_NAME} either: {lost_state_advice(hint)}")
            raise RequantError(f"nothing to abort: {target} holds no unfinished conversion{lost}")
        try:
            record, snapshot = journal.load(target)
            damage = ""
        except journal.Damaged as e:
            record, snapshot = _from_damaged(src, target, in_place, e, hint)
            damage = f"{e}; "
        if (record.get("mode") == "in-place") != in_place:
            raise UsageError(f"the conversion in {target} is {record.get('mode')}: abort it with "
                             f"`{abort_command(record)}`")
        return damage + (_restore_source(target, record, snapshot, damage) if in_place
                         else _remove_output(src, target, snapshot))
    finally:
        lock.release()


def _from_damaged(src: str, target: str, in_place: bool, e: journal.Damaged, hint: str) -> tuple[dict, dict]:
    """(record, snapshot) to abort by when a state file is damaged: source.json's request and
    snapshot; out of place, the source's own snapshot; in place with source.json damaged, an abort
    that only removes the state folder where the directory is wholly the source (else refused)."""
    try:
        snapshot = journal.load_snapshot(target)
        return {"mode": "in-place" if in_place else "out-of-place", "resume": hint,
                **(snapshot.get("conversion") or {})}, snapshot
    except journal.Damaged:
        pass
    if not in_place:
        with Checkpoint.open(src) as source:
            return {"mode": "out-of-place"}, source.snapshot()
    if not _directory_state(target, (_readable_record(target).get("options") or {}).get("out"))[0]:
        raise CheckpointError(damaged_state_advice(target, e, hint))
    with Checkpoint.open(target, unfinished=True) as ck:   # as it is, source or finished: nothing to give back
        return {"mode": "in-place"}, ck.snapshot()


def _temporaries_left(target: str) -> bool:
    """Whether `target` holds files a killed conversion was writing (remove_temporaries' names)."""
    prefixes = tuple(f"{n}.tmp-" for n in METADATA_NAMES)
    return any(e.endswith(PARTIAL_SUFFIX) or e.startswith(prefixes) for e in os.listdir(target))


def _whole(target: str, hint: str) -> dict:
    """The snapshot of `target` as it is (no shards where it holds only the state folder). A state
    folder with no journal goes only where the directory opens as a checkpoint: a source.json
    beside shards the index does not match may be the only record of their source."""
    if os.listdir(target) == [journal.JOURNAL_DIR]:
        return {"shards": []}
    try:
        with Checkpoint.open(target, unfinished=True) as ck:
            return ck.snapshot()
    except RequantError as e:
        lost = journal.Damaged(target, journal.JOURNAL, "is missing")
        raise CheckpointError(f"{target} does not open as a checkpoint ({e}); {damaged_state_advice(target, lost, hint)}"
                              ) from None


def _restore_source(target: str, record: dict, snapshot: dict, damage: str = "") -> str:
    """`damage`: what is wrong with the state files, for the refusal (it begins the line)."""
    total = len(snapshot["shards"])
    converted = converted_shards(target, snapshot)
    if converted:
        out = (record.get("options") or {}).get("out", "converted")
        raise RequantError(f"{damage}cannot abort the in-place conversion of {target}: {_named(converted, total)} "
                           f"already {out} ({_formats(target, snapshot, converted)}), and the source's "
                           "bytes cannot be recovered from them (the conversion is not reversible bit for bit); "
                           f"nothing was changed; finish the conversion with `{record['resume']}`")
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
    back = f"{' and '.join(restored)} written back from {journal.SNAPSHOT}; " if restored else ""
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
