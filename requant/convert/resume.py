"""Resuming: what a conversion journals about how it was asked for, the checks that a resume is the
same conversion of the same source, and which shards the target already holds finished."""

from __future__ import annotations

import base64
import dataclasses
import json
import os

from requant import card
from requant.errors import CheckpointError, RequantError
from requant.io import hub as hub_lib
from requant.io import journal
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json
from requant.plan import ShardPlan
from requant.targets import TARGETS, Options

from requant.convert.abort import damaged_state_advice, lost_state_advice, start_over_advice
from requant.convert.outputs import SourceDamaged, untouched

# Options fields not journaled among the options: the target's own (journaled under "target"), the
# device (it never changes the output), the graft's donor (journaled with a fingerprint of its
# drafter, under "donor": pipeline.convert).
_UNJOURNALED = ("target", "device", "donor")


def journaled_options(options: Options, in_format: str | None, out_format: str) -> dict:
    """The options a journal records: --in, --out, Options' fields (those that shape the output),
    and the target's own options under "target"."""
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(Options) if f.name not in _UNJOURNALED}
    target = dataclasses.asdict(options.target) if options.target else None
    return json.loads(json.dumps({"in": in_format, "out": out_format, **fields, "target": target}))


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")   # click's spelling of a parameter name


# A journaled option's dotted path -> the `requant convert` flag that sets it, from the same
# dataclasses the CLI fills (tests check each flag exists on the command).
OPTION_FLAGS: dict[str, str] = {
    "in": "--in", "out": "--out",
    **{f.name: _flag(f.name) for f in dataclasses.fields(Options) if f.name not in _UNJOURNALED},
    **{f"target.{f.name}": _flag(f.name) for t in TARGETS.values() for f in dataclasses.fields(t.options_type)},
}


def open_source(src: str, target: str, in_place: bool, resume: bool, request: dict,
                hub: hub_lib.HubSource | None, opened: Checkpoint | None = None) -> tuple[Checkpoint, dict]:
    """The source checkpoint and its snapshot: from the journal when resuming (in place or
    streamed, converted shards' sources are gone), after checking it is the same conversion.
    `opened`: the source as the caller opened it (a graft's, which reads two directories), used
    instead of opening `src`, and compared with the journal's snapshot on a resume."""
    staging = journal.path_of(target, "source")   # a streamed source's small files and current shard
    hint = request["resume"]
    if not resume:
        if journal.exists(target):   # refused: only --resume or --abort decides what becomes of it
            try:
                journal.load(target)
            except journal.Damaged as e:
                raise RequantError(f"{target} holds an unfinished conversion: {damaged_state_advice(target, e, hint)}"
                                   ) from None
            raise RequantError(f"{target} holds an unfinished conversion ({journal.progress_message(target)}); "
                               f"{start_over_advice(target, hint)}")
        if not in_place and set(os.listdir(target)) - {journal.JOURNAL_DIR}:
            raise RequantError(f"destination {target} exists and is not an empty directory")
        try:
            source = hub.open_streamed(staging) if hub else opened or Checkpoint.open(src)
        except RequantError as e:   # in place, a directory without its metadata may be a conversion whose state went
            if in_place and not journal.has_metadata(target) \
                    and any(n.endswith(".safetensors") for n in os.listdir(target)):
                raise CheckpointError(f"{e}; {lost_state_advice(hint)}") from None
            raise
        links = [n for n in source.shard_names if os.path.islink(source.shard_path(n))] if in_place else []
        if links:   # replacing a link would leave its target (e.g. a Hugging Face cache blob) behind
            raise RequantError(f"cannot convert in place: {source.shard_path(links[0])} is a symbolic link "
                               "(a Hugging Face cache snapshot?); convert it to a new directory instead")
        return source, source.snapshot()
    try:
        record, snapshot = journal.load(target)
    except journal.Damaged as e:
        record, snapshot = _rebuilt(target, e, request)
    _check_same(target, record, request)
    if record.get("damaged"):
        accept_replaced(target, record, snapshot)
    if hub:
        source = Checkpoint.from_snapshot(staging, snapshot)
        source.reads.clear()
        return source, snapshot
    if not in_place:
        current = opened or Checkpoint.open(src)
        changes = source_changes(snapshot, current.snapshot())
        if current is not opened:
            current.close()
        if changes:
            raise CheckpointError(f"cannot resume: the source changed since the conversion began ({'; '.join(changes)})",
                                  file=src)
    # a graft's snapshot names files of two directories, which from_snapshot (one directory) cannot rebuild
    return opened or Checkpoint.from_snapshot(src, snapshot), snapshot


def _check_same(target: str, record: dict, request: dict) -> None:
    """Refuses a resume asked for differently from the conversion `record` describes."""
    differences = [f"{what}{d}" for key, what in (("requant", "requant version "), ("mode", "mode "),
                                                    ("options", ""), ("source", "Hub source "),
                                                    ("donor", "drafter donor "))
                   for d in differences_between(record.get(key), request.get(key), named=key == "options")]
    if differences:
        raise RequantError(f"cannot resume: the conversion in {target} was started differently ({'; '.join(differences)}); "
                           f"rerun with the original settings: `{record.get('resume')}`; "
                           f"{start_over_advice(target, request['resume'])}")


def _rebuilt(target: str, e: "journal.Damaged", request: dict) -> tuple[dict, dict]:
    """A lost or damaged journal.json, rebuilt from source.json once this resume is checked to be
    the conversion it records: each shard is then found converted or still the source by its own
    header (shard_done; a shard is replaced by one rename, so it is wholly one or the other). The
    finished shards' stats were only in the journal: requant.json's accuracy leaves them out and
    says which. Refused, naming what is safe, where source.json is damaged or records no request."""
    try:
        snapshot = journal.load_snapshot(target) if e.name == journal.JOURNAL else None
    except journal.Damaged:
        snapshot = None
    if snapshot is None or not snapshot.get("conversion"):
        raise CheckpointError(f"cannot resume: {damaged_state_advice(target, e, request['resume'])}") from None
    _check_same(target, snapshot["conversion"], request)
    return journal.rebuild(target, snapshot), snapshot


def finished_conversion(target: str, source: str, out_format: str) -> str | None:
    """What --resume says where `target` holds no journal but a finished conversion of `source`
    (a path, or repo@commit) to `out_format`: config.json, the index, and requant.json naming
    both; None otherwise."""
    try:
        record = read_json(os.path.join(target, card.PROVENANCE_NAME))
    except CheckpointError:
        return None
    recorded = record.get("source") if isinstance(record, dict) else None
    same_source = isinstance(recorded, str) and (
        recorded == source or os.path.exists(source) and os.path.exists(recorded) and os.path.samefile(recorded, source))
    if (not same_source or record.get("target_format") != out_format
            or not journal.has_metadata(target)):
        return None
    return (f"{target} is a finished conversion of {source} to {out_format} (its requant.json says how it was "
            f"made); nothing to resume. `requant verify {target}` checks it")


def differences_between(then, now, path: str = "", named: bool = False) -> list[str]:
    """Readable differences between what a journal recorded and what this run asks for, one per
    differing leaf (nested dicts by dotted path): `--flag X then, Y now` where `named` and the
    path is an option with a flag (OPTION_FLAGS), else `path X then, Y now`."""
    if isinstance(then, dict) and isinstance(now, dict):
        return [d for key in sorted(set(then) | set(now), key=str)
                for d in differences_between(then.get(key), now.get(key), f"{path}.{key}" if path else str(key),
                                             named)]
    if then == now:
        return []
    name = OPTION_FLAGS.get(path, path) if named else path
    def shown(v):
        return "default" if v is None else str(v)
    return [f"{name + ' ' if name else ''}{shown(then)} then, {shown(now)} now"]


def source_changes(old: dict, new: dict) -> list[str]:
    changes = [f"{what} differs" for key, what in (("config", CONFIG_NAME), ("weight_map", INDEX_NAME),
                                                    ("index_metadata", INDEX_NAME + " metadata"))
               if old[key] != new[key]]
    before, after = ({s["name"]: s for s in snap["shards"]} for snap in (old, new))
    for name in sorted(set(before) | set(after)):
        if before.get(name) != after.get(name):
            changes.append(f"shard {name} " + ("appeared" if name not in before else "is gone" if name not in after
                                               else "has a different header, size or modification time"))
    return changes


def shard_done(shard: ShardPlan, target: str, in_place: bool, entry: dict) -> bool:
    """Whether the target already holds this shard's planned output: its size and header bytes,
    which for a shard whose output is the source's file (outputs.verbatim) are that file's, in
    whatever layout: a hard link to it, or a whole copy (renamed to its name only once checked).
    In place, a shard must be either converted or still exactly its recorded source; one that only
    passes tensors through is its own output there (outputs.untouched)."""
    final = os.path.join(target, shard.name)
    if journal.matches(final, shard.file_size, shard.header):
        return True
    if not in_place:
        return False
    if not journal.still_source(target, entry):
        raise CheckpointError("matches neither the source shard recorded in the journal nor its planned conversion: "
                              "the directory changed since the conversion began", file=final)
    return untouched(shard)


def accept_replaced(target: str, record: dict, snapshot: dict) -> None:
    """Resuming a conversion that stopped on a damaged source shard: refused while that file is
    the one found damaged; a replacement with the recorded size and header (re-downloaded) is
    recorded as the source from now on."""
    d = record["damaged"]
    entry = next((s for s in snapshot["shards"] if s["name"] == d.get("shard")), None)
    try:
        st = os.stat(d["file"])
    except FileNotFoundError:
        if entry is not None and entry["mtime_ns"] is None:   # a streamed download: fetched again
            st = None
        else:
            raise SourceDamaged(f"cannot resume: {d['file']}, the damaged source shard, is missing; put the "
                                f"re-downloaded shard there, then resume with `{record['resume']}`", d) from None
    if st is not None and (st.st_size, st.st_mtime_ns) == (d.get("size"), d.get("mtime_ns")):
        raise SourceDamaged(f"cannot resume: the source is damaged and has not changed since: "
                            f"{journal.damage_advice(record)}", d)
    if st is not None and entry is not None and entry["mtime_ns"] is not None:
        if not journal.matches(d["file"], entry["size"], base64.b64decode(entry["header"])):
            raise CheckpointError("cannot resume: this replacement of the damaged source shard differs in size or "
                                  "header from the shard the conversion began with (another revision?); download "
                                  "the same revision's shard", file=d["file"])
        record.setdefault("replaced", {})[entry["name"]] = entry["mtime_ns"] = st.st_mtime_ns
    del record["damaged"]
    journal.save(target, record)
