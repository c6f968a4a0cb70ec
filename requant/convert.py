"""The conversion pipeline: plan from metadata, then stream tensors shard by shard.

Every conversion keeps a journal in its target directory (see io/journal.py), so a killed run
resumes where it stopped and ends byte-identical to an uninterrupted one. Each output shard is
written under a temporary name, fsynced, read back and renamed (in place: over its source
shard); config files and the index come last, and the journal goes only after them. While the
journal exists the directory has no config.json/index of either format, so nothing loads it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import shutil
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait
from dataclasses import dataclass

from tqdm import tqdm

from requant import __version__, card
from requant.compute import default_workers
from requant.errors import CheckpointError, FormatError, RequantError, describe_os_error
from requant.formats import mxfp4
from requant.io import hub as hub_lib
from requant.io import journal
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json, resolve_inside
from requant.io.fsutil import (DirLock, atomic_write, atomic_write_json, fault_point, free_bytes, fsync_dir,
                               remove_quietly)
from requant.io.safetensors import ShardWriter, encode_header, read_header
from requant.plan import Plan, ShardPlan, make_plan
from requant.targets import Options, Stats
from requant.verify import OutputRejected, check_written
from requant.workers import Encoders

PARTIAL_SUFFIX = ".partial"


@dataclass
class Result:
    plan: Plan
    stats: Stats
    bytes_in: int
    bytes_out: int
    seconds: float
    shards_kept: int = 0            # finished by an earlier run (--resume) and kept
    shards_converted: int = 0       # written by this run
    bytes_converted: int | None = None   # output bytes this run wrote (None: bytes_out)


class Stopped(RequantError):
    """A conversion that stopped after its journal was written: its work is kept for --resume."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class SourceDamaged(RequantError):
    """Source bytes that are no valid encoding (a FormatError while encoding a unit): resuming reads
    the same bytes again, so the advice is to replace the shard, never to resume as it is.
    `damage` says where (journal.describe_damage)."""

    def __init__(self, message: str, damage: dict | None = None):
        super().__init__(message)
        self.damage = damage


def refuse_in_place_on_cache(src: str, repo: str | None) -> None:
    """In place is for a directory of one's own, never for the Hugging Face cache."""
    if repo:
        raise RequantError(f"--in-place converts a directory of your own; {repo} would be converted inside the "
                           "Hugging Face cache, whose files every revision shares: convert it into a new "
                           f"directory (requant convert {src} DST ...), or download it with `hf download {repo} "
                           "--local-dir DIR` and convert DIR in place")
    if hub_lib.cache_snapshot(src):
        raise RequantError(f"cannot convert {src} in place: it is a Hugging Face cache snapshot, whose files are links "
                           "into blobs the cache shares between revisions; convert it into a new directory instead "
                           f"(requant convert {src} DST ...)")


def plan_conversion(src: str, out_format: str, options: Options, in_format: str | None = None, in_place: bool = False,
                    revision: str | None = None, token: str | None = None, cache_dir: str | None = None) -> Plan:
    """The plan, from headers alone; a Hub source's shard headers come by range requests (or from
    the cache offline), so nothing large is downloaded."""
    if in_place:
        refuse_in_place_on_cache(src, hub_lib.hub_repo(src))
    with hub_lib.open_headers(src, revision, token, cache_dir) as source:
        return make_plan(source, out_format, options, in_format)


def convert(src: str, dst: str | None, out_format: str, options: Options, in_format: str | None = None,
            workers: int | None = None, progress: bool = True, resume: bool = False, resume_hint: str | None = None,
            revision: str | None = None, stream: bool = False, token: str | None = None,
            cache_dir: str | None = None) -> Result:
    """Convert checkpoint `src` (a directory, or a Hub repository id) into directory `dst`, or in
    place when `dst` is None.

    `resume` continues the unfinished conversion journaled in the target; without it, a target
    holding a journal is refused. `resume_hint` is the command that resumes (for messages).
    `stream` fetches a Hub source one shard at a time, deleting each once converted. `token` and
    `cache_dir` are the Hub's (None: huggingface_hub's own defaults and environment).
    `workers` (default: one per core) encode in parallel (workers.py); `options.device` says where.
    """
    started = time.monotonic()
    given_src = src   # as the user named it, for the card's command line (a Hub source becomes a snapshot path)
    in_place = dst is None
    target = src if in_place else dst
    given_in = f" --in {in_format}" if in_format else ""
    hint = resume_hint or f"requant convert {src} {dst or '--in-place'}{given_in} --out {out_format} --resume"
    request = {"format": journal.FORMAT, "requant": __version__, "mode": "in-place" if in_place else "out-of-place",
               "options": _jsonable({"in": in_format, "out": out_format, "mtp": options.mtp,
                                     "input_scale": options.input_scale,
                                     "target": dataclasses.asdict(options.target) if options.target else None,
                                     "engine": options.engine, "force": options.force}),
               "resume": hint}
    hub = None
    repo = hub_lib.hub_repo(src)
    if in_place:
        refuse_in_place_on_cache(src, repo)
    if repo:
        hub = hub_lib.HubSource(repo, revision, progress, token=token, cache_dir=cache_dir,
                                explicit=src.startswith(hub_lib.HUB_PREFIX))
        if not stream:
            src = hub.snapshot()
        request["source"] = f"{repo}@{hub.commit}"
        hub = hub if stream else None
    elif stream or revision or cache_dir:
        raise RequantError(f"--stream-source, --revision and --cache-dir apply to Hub repositories; {src} is not one")
    if not in_place and hub is None:
        _check_overlap(src, dst)
    created = not in_place and not os.path.exists(dst)
    if created:
        os.makedirs(dst)
    locks, plan, journaled = [], None, False
    try:
        locks.append(DirLock(target, exclusive=True, what="a conversion writes there",
                             record=journal.path_of(target, journal.LOCK)))
        if not in_place and hub is None:   # an in-place conversion would pull the source from under us
            locks.append(DirLock(src, exclusive=False, what="an in-place conversion of it"))
        resume = resume and journal.exists(target)   # nothing journaled yet: --resume starts afresh
        source, snapshot = _open_source(src, target, in_place, resume, request, hub)
        journaled = resume
        plan = make_plan(source, out_format, options, in_format)
        plan.label = request.get("source") or src
        plan.run = {"source": given_src, "destination": dst, "in_place": in_place}
        entries = {e["name"]: e for e in snapshot["shards"]}
        _drop_leftovers(plan, target)
        done = [_shard_done(shard, target, in_place, entries[shard.name]) for shard in plan.shards]
        ancillary = [] if in_place else ancillary_files(source.path, set(plan.source.shard_names))
        final_metadata(plan)   # fails now, not after the shards, on a config the target cannot extend
        _check_space(plan, target, in_place, done, streamed=hub is not None)
        if not resume:
            request["shards"] = [{"name": s.name, "done": False, "stats": None} for s in plan.shards]
            journal.create(target, snapshot, request)
            journaled = True
        record = journal.load(target)[0]
        for is_done, state in zip(done, record["shards"]):
            state["done"] = state["done"] or is_done   # renamed, then stopped before the journal said so
        if in_place:
            _set_aside_source_metadata(target, source)
        return _run(plan, target, in_place, record, entries, ancillary, hub, workers or default_workers(), progress,
                    started, resumed=resume)
    except KeyboardInterrupt:
        if journaled:
            raise Stopped(_stopped("interrupted", target), 130) from None
        raise
    except SourceDamaged as e:
        if not journaled or e.damage is None:
            raise
        raise _stop_damaged(e, target, in_place, created) from None
    except OutputRejected as e:   # resuming would write the same bytes and be rejected again
        raise Stopped(f"{e}; delete {target} to start over", 1) from None
    except (RequantError, OSError) as e:
        if not journaled or isinstance(e, Stopped):
            raise
        message = str(e) if isinstance(e, RequantError) else describe_os_error(e)
        raise Stopped(_stopped(message, target), getattr(e, "exit_code", 1)) from None
    finally:
        if plan is not None:
            plan.source.close()
        if created and not journaled:
            shutil.rmtree(dst, ignore_errors=True)
        for lock in reversed(locks):
            lock.release()


def _stopped(why: str, target: str) -> str:
    return f"{why}; {journal.progress_message(target)} (finished shards are kept)"


def _stop_damaged(e: SourceDamaged, target: str, in_place: bool, created: bool) -> SourceDamaged:
    """A conversion stopped on damaged source bytes. Out of place with no shard finished, what
    this run wrote goes (nothing is left that looks resumable); otherwise the journal is marked
    damaged, so a resume refuses until that file is replaced and then goes on. In place nothing is
    removed: the converted shards are valid, the others still the source's."""
    what = journal.describe_damage(e.damage)
    try:
        record = journal.load(target)[0]
    except ValueError:
        return SourceDamaged(f"the source is damaged: {what}; resuming will not help until that shard is replaced "
                             f"(re-download it); {journal.progress_message(target)}", e.damage)
    done, total = sum(1 for s in record["shards"] if s["done"]), len(record["shards"])
    folder = os.path.dirname(e.damage["file"]) or "."
    encoded = sum(1 for s in record["shards"] if s["done"] and (s.get("stats") or {}).get("tensors_converted"))
    if not in_place and not encoded:   # only copies done, if anything: cheap to redo, not worth a journal
        shutil.rmtree(target if created else journal.path_of(target), ignore_errors=True)
        left = "removed" if created else "left empty"
        return SourceDamaged(f"the source is damaged: {what}; converting it again would stop here again, so "
                             f"nothing was kept ({target} {left}): re-download that shard, check the source with "
                             f"`requant verify {folder}`, then convert again", e.damage)
    record["damaged"] = e.damage
    journal.save(target, record)
    if not in_place:
        kept = f"the {done} of {total} shards converted so far are kept"
    elif done:
        kept = (f"the {done} shards converted so far are valid and kept, the other {total - done} are still the "
                "source's (nothing is lost: resuming goes on from there)")
    else:
        kept = (f"no shard was converted yet: the shards are still the source's, and its config.json and index are "
                f"kept in {journal.path_of(target)} until the conversion finishes")
    return SourceDamaged(f"the source is damaged: {what}; {kept}; "
                         f"{journal.damage_advice(record).split('; ', 1)[1]}", e.damage)


def _accept_replaced(target: str, record: dict, snapshot: dict) -> None:
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
        if not _matches(d["file"], entry["size"], base64.b64decode(entry["header"])):
            raise CheckpointError("cannot resume: this replacement of the damaged source shard differs in size or "
                                  "header from the shard the conversion began with (another revision?); download "
                                  "the same revision's shard", file=d["file"])
        record.setdefault("replaced", {})[entry["name"]] = entry["mtime_ns"] = st.st_mtime_ns
    del record["damaged"]
    journal.save(target, record)


def _jsonable(obj):
    return json.loads(json.dumps(obj))


def _check_overlap(src: str, dst: str) -> None:
    src_real, real = os.path.realpath(src), os.path.realpath(dst)
    if real == src_real or real.startswith(src_real + os.sep) or src_real.startswith(real + os.sep):
        raise RequantError(f"destination {dst} overlaps the source {src} (use --in-place to convert in place)")


def _open_source(src: str, target: str, in_place: bool, resume: bool, request: dict,
                 hub: hub_lib.HubSource | None) -> tuple[Checkpoint, dict]:
    """The source checkpoint and its snapshot: from the journal when resuming (in place or
    streamed, converted shards' sources are gone), after checking it is the same conversion."""
    staging = journal.path_of(target, "source")   # a streamed source's small files and current shard
    if not resume:
        if journal.exists(target):
            raise RequantError(f"{target} holds an unfinished conversion ({journal.progress_message(target)}); "
                               f"or delete {journal.path_of(target)} and its shards to start over")
        if not in_place and set(os.listdir(target)) - {journal.JOURNAL_DIR}:
            raise RequantError(f"destination {target} exists and is not an empty directory")
        source = hub.open_streamed(staging) if hub else Checkpoint.open(src)
        links = [n for n in source.shard_names if os.path.islink(source.shard_path(n))] if in_place else []
        if links:   # replacing a link would leave its target (e.g. a Hugging Face cache blob) behind
            raise RequantError(f"cannot convert in place: {source.shard_path(links[0])} is a symbolic link "
                               "(a Hugging Face cache snapshot?); convert it to a new directory instead")
        return source, source.snapshot()
    try:
        record, snapshot = journal.load(target)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    differences = [f"{what}{d}" for key, what in (("requant", "requant version "), ("mode", "mode "),
                                                    ("options", ""), ("source", "Hub source "))
                   for d in _differences(record.get(key), request.get(key))]
    if differences:
        raise RequantError(f"cannot resume: the conversion in {target} was started differently ({'; '.join(differences)}); "
                           f"rerun with the original settings ({record.get('resume') or 'see the journal'}), or delete "
                           f"{journal.path_of(target)} and its shards to start over")
    if record.get("damaged"):
        _accept_replaced(target, record, snapshot)
    if hub:
        source = Checkpoint.from_snapshot(staging, snapshot)
        source.reads.clear()
        return source, snapshot
    if not in_place:
        with Checkpoint.open(src) as current:
            changes = _source_changes(snapshot, current.snapshot())
        if changes:
            raise CheckpointError(f"cannot resume: the source changed since the conversion began ({'; '.join(changes)})",
                                  file=src)
    return Checkpoint.from_snapshot(src, snapshot), snapshot


def _option_flag(path: str) -> str:
    """The command-line flag of a journaled option: its field name, dashed (`target.group_size`:
    the target options dataclass's field, `--group-size`), as the CLI names every option."""
    return "--" + path.rsplit(".", 1)[-1].replace("_", "-")


_OPTIONS_AT_TOP = ("in", "out", "mtp", "input_scale", "engine", "force")   # request["options"]' own keys


def _differences(then, now, path: str = "") -> list[str]:
    """Readable differences between what a journal recorded and what this run asks for:
    `--flag X then, Y now`, one per differing leaf (nested option dicts by dotted name)."""
    if isinstance(then, dict) and isinstance(now, dict):
        return [d for key in sorted(set(then) | set(now), key=str)
                for d in _differences(then.get(key), now.get(key), f"{path}.{key}" if path else str(key))]
    if then == now:
        return []
    name = _option_flag(path) if path in _OPTIONS_AT_TOP or path.startswith("target.") else path
    def shown(v):
        return "default" if v is None else str(v)
    return [f"{name + ' ' if name else ''}{shown(then)} then, {shown(now)} now"]


def _source_changes(old: dict, new: dict) -> list[str]:
    changes = [f"{what} differs" for key, what in (("config", CONFIG_NAME), ("weight_map", INDEX_NAME),
                                                    ("index_metadata", INDEX_NAME + " metadata"))
               if old[key] != new[key]]
    before, after = ({s["name"]: s for s in snap["shards"]} for snap in (old, new))
    for name in sorted(set(before) | set(after)):
        if before.get(name) != after.get(name):
            changes.append(f"shard {name} " + ("appeared" if name not in before else "is gone" if name not in after
                                               else "has a different header, size or modification time"))
    return changes


def _matches(path: str, size: int, header: bytes, mtime_ns: int | None = None) -> bool:
    """Whether the file at `path` has this size, header bytes (and modification time)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(len(header))
    except FileNotFoundError:
        return False
    return st.st_size == size and head == header and mtime_ns in (None, st.st_mtime_ns)


def _drop_leftovers(plan: Plan, target: str) -> None:
    """Temporaries of a run that was killed: half-written shards and metadata files. The lock
    says no other process is writing them."""
    names = [s.name + PARTIAL_SUFFIX for s in plan.shards]
    prefixes = tuple(f"{n}.tmp-" for n in final_metadata(plan))
    for entry in os.listdir(target):
        if entry in names or entry.startswith(prefixes):
            remove_quietly(os.path.join(target, entry))


def _shard_done(shard: ShardPlan, target: str, in_place: bool, entry: dict) -> bool:
    """Whether the target already holds this shard's planned output. In place, a shard must be
    either converted or still exactly its recorded source."""
    final = os.path.join(target, shard.name)
    if _matches(final, shard.file_size, encode_header(shard.specs)[0]):
        return True
    if in_place and not _matches(final, entry["size"], base64.b64decode(entry["header"]), entry["mtime_ns"]):
        raise CheckpointError("matches neither the source shard recorded in the journal nor its planned conversion: "
                              "the directory changed since the conversion began", file=final)
    return False


def space_needed(plan: Plan, in_place: bool, done: list[bool] | None = None) -> tuple[int, int, int]:
    """(free bytes needed, largest output shard, growth) for the shards not yet done.

    In place, shard k's output is written while its source still exists, after the shards
    before it have grown or shrunk: the peak is the largest of (growth so far + output k)."""
    pending = [s for s, d in zip(plan.shards, done or [False] * len(plan.shards)) if not d]
    largest = max((s.file_size for s in pending), default=0)
    if not in_place:
        total = sum(s.file_size for s in pending)
        return total, largest, total
    need = growth = 0
    for s in pending:
        need = max(need, growth + s.file_size)
        growth += s.file_size - plan.source.headers[s.name].file_size
    return need, largest, growth


def _check_space(plan: Plan, target: str, in_place: bool, done: list[bool], streamed: bool) -> None:
    need, largest, growth = space_needed(plan, in_place, done)
    if streamed:   # plus one downloaded source shard at a time
        need += max((plan.source.headers[s.name].file_size for s, d in zip(plan.shards, done) if not d), default=0)
    have = free_bytes(target)
    if have < need:
        how = (f"the largest output shard is {largest:,} and the format grows the rest by {growth:,}" if in_place
               else f"{sum(1 for d in done if not d)} shards to write")
        raise RequantError(f"not enough free space in {target}: need {need:,} bytes ({how}), {have:,} available")


def _set_aside_source_metadata(target: str, source: Checkpoint) -> None:
    """In place, the source's index and config.json live on in the journal's snapshot; removing
    them leaves nothing a loader could open until the converted ones are written."""
    for name, original in ((INDEX_NAME, {"metadata": source.index_metadata, "weight_map": source.weight_map}),
                           (CONFIG_NAME, source.config)):
        path = os.path.join(target, name)
        if not os.path.exists(path):
            continue
        try:
            found = read_json(path)
        except CheckpointError:
            continue
        if name == INDEX_NAME:
            found = {"metadata": found.get("metadata") or {}, "weight_map": found.get("weight_map")}
        if found == original:
            os.remove(path)
            fsync_dir(target)
            fault_point()


def _run(plan: Plan, target: str, in_place: bool, record: dict, entries: dict, ancillary: list[str],
         hub: hub_lib.HubSource | None, workers: int, progress: bool, started: float, resumed: bool = False) -> Result:
    stats = Stats()
    kept = {shard.name for shard, state in zip(plan.shards, record["shards"]) if state["done"]}   # nothing to write
    with tqdm(total=plan.output_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              desc="converting", disable=not progress, dynamic_ncols=True) as bar, \
            Encoders.for_plan(plan, workers) as encoders:
        for shard, state in zip(plan.shards, record["shards"]):
            if state["done"]:
                if in_place:   # its pass-through tensors are read from the converted file now
                    plan.source.relocate(shard.name, read_header(os.path.join(target, shard.name)))
                if state["stats"]:
                    stats.add(_stats_from(state["stats"]))
                bar.update(shard.file_size)
                continue
            if hub:
                _fetch(plan, shard, hub, entries[shard.name])

            def remember(shard_stats: Stats, state=state) -> None:
                # Journaled before the rename: a run killed between rename and "done" resumes
                # with this shard's stats, so the config's summary still covers every shard.
                state["stats"] = dataclasses.asdict(shard_stats)
                journal.save(target, record)

            shard_stats = write_shard(plan, shard, target, encoders, bar, entries[shard.name], in_place, remember)
            if hub:   # the disk never holds more than one source shard
                os.remove(plan.source.reads[shard.name].path)
                plan.source.relocate(shard.name, None)
            state["done"] = True
            journal.save(target, record)
            stats.add(shard_stats)
    if not in_place:
        copy_ancillary(plan.source.path, target, ancillary)
    else:
        _set_aside_source_card(target)
    files = final_metadata(plan, stats)
    # verify's own checks on what was written, before config.json and the index make it loadable
    check_written(target, files, force=plan.target.options.force)
    finish_metadata(target, files)   # after the shards: a target may summarise them
    journal.remove(target)
    converted = [shard for shard in plan.shards if shard.name not in kept]
    return Result(plan, stats, plan.input_bytes, _dir_tensor_bytes(target, plan), time.monotonic() - started,
                  shards_kept=len(kept) if resumed else 0, shards_converted=len(converted),
                  bytes_converted=sum(shard.file_size for shard in converted))


def _fetch(plan: Plan, shard: ShardPlan, hub: hub_lib.HubSource, entry: dict) -> None:
    path = hub.fetch(shard.name, plan.source.path)
    if not _matches(path, entry["size"], base64.b64decode(entry["header"])):
        raise CheckpointError("downloaded shard does not match the header read when the conversion began "
                              "(the repository changed?)", file=path)
    plan.source.relocate(shard.name, read_header(path))


def _stats_from(d: dict) -> Stats:
    return Stats(**d)


def write_shard(plan: Plan, shard: ShardPlan, target: str, encoders: Encoders, bar, entry: dict,
                in_place: bool = False, before_rename=None) -> Stats:
    """Write one output shard. The encoders (workers.py) read, encode and write units at their
    offsets while this thread copies the other tensors inside the kernel (copy_file_range).
    `before_rename(stats)` runs once the shard is written and checked, before it takes its name."""
    final = os.path.join(target, shard.name)
    partial = final + PARTIAL_SUFFIX
    source = plan.source
    source_path = source.reads[shard.name].path if shard.name in source.reads else source.shard_path(shard.name)
    _check_unchanged(source_path, entry)
    writer = ShardWriter(partial, shard.specs)
    stats = Stats()
    half = len(shard.units) // 2
    shard_index = plan.shards.index(shard)
    pending: dict = {}   # future -> output bytes
    units: dict = {}     # future -> its unit

    def drain(mode):
        done, _ = wait(pending, return_when=mode)
        for future in done:
            try:
                stats.add(future.result())
            except FormatError as e:   # the source's bytes: the same bytes would fail a resume too
                raise SourceDamaged(str(e), _damage(source, units[future], e, source_path)) from None
            bar.update(pending.pop(future))
            units.pop(future)

    try:
        fault_point()
        for i, unit in enumerate(shard.units):
            if i == half:
                fault_point()
            if unit.encode is None:
                fd, info = source.locate(unit.inputs[0])
                writer.copy_from(unit.outputs[0].name, fd, info.start)
                bar.update(info.nbytes)
                continue
            reads = [(name, *source.where(name)) for name in unit.inputs]
            offsets = {spec.name: writer.offsets[spec.name] for spec in unit.outputs}
            future = encoders.submit(shard_index, i, unit, reads, partial, offsets)
            pending[future] = sum(s.nbytes for s in unit.outputs)
            units[future] = unit
            if len(pending) > encoders.window:  # bounded: memory stays a few experts deep
                drain(FIRST_COMPLETED)
        drain(ALL_COMPLETED)
        writer.close()
        fault_point()
        _verify_written(partial, shard)
        _check_unchanged(source_path, entry)   # nothing rewrote the source while it was read
        if before_rename is not None:
            before_rename(stats)
    except BaseException:
        for future in pending:   # no worker may still write to the file once it is removed
            future.cancel()
        wait(pending)
        writer.abort()
        remove_quietly(partial)
        raise
    os.replace(partial, final)
    fsync_dir(target)
    if in_place:   # the source is gone; its pass-through tensors now live in the new file
        source.relocate(shard.name, read_header(final))
    fault_point()
    bar.update(shard.file_size - sum(s.nbytes for s in shard.specs))  # header bytes
    return stats


def _damage(source: Checkpoint, unit, e: FormatError, shard_path: str) -> dict:
    """Where a unit's source bytes are damaged, for the message and the journal: the file, the
    tensor, the byte offset in the file of the first NaN E8M0 scale byte among the unit's scale
    inputs (None when the error is another), the file's size and mtime now."""
    path, tensor, offset = e.file, e.tensor, None
    for name in unit.inputs:
        try:
            where, info = source.where(name)
        except CheckpointError:
            continue
        if info.spec.dtype not in ("F8_E8M0", "U8") or "scale" not in name or info.nbytes > 1 << 28:
            continue
        try:
            with open(where, "rb") as f:
                f.seek(info.start)
                at = f.read(info.nbytes).find(bytes([mxfp4.E8M0_NAN]))
        except OSError:
            continue
        if at >= 0:
            path, tensor, offset = where, name, info.start + at
            break
    if path is None and tensor in unit.inputs:
        with contextlib.suppress(CheckpointError):
            path = source.where(tensor)[0]
    path = path or shard_path
    where = ", ".join(p for p in (f"file {e.file}" if e.file else "", f"tensor {e.tensor}" if e.tensor else "") if p)
    reason = str(e)[len(where) + 2:] if where and str(e).startswith(where + ": ") else str(e)
    st = os.stat(path)
    return {"file": path, "shard": os.path.basename(path), "tensor": tensor, "offset": offset, "reason": reason,
            "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _check_unchanged(path: str, entry: dict) -> None:
    st = os.stat(path)
    if st.st_size != entry["size"] or entry["mtime_ns"] not in (None, st.st_mtime_ns):
        raise CheckpointError("source shard was modified since the conversion began (its size or modification time "
                              "differs from the journal's record); restore it, or start over", file=path)


def _verify_written(path: str, shard: ShardPlan) -> None:
    header = read_header(path)
    expected = {s.name: s for s in shard.specs}
    if header.file_size != shard.file_size or {n: i.spec for n, i in header.tensors.items()} != expected:
        raise CheckpointError("written shard does not read back as planned", file=path)


def ancillary_files(src: str, shard_names: set[str]) -> list[str]:
    """Tokenizer files, generation config, reference code...: every file but the weights and the
    metadata the conversion rewrites, as paths relative to `src`. Hidden entries (caches, VCS,
    the journal) are skipped; a symlink leading out of the checkpoint is refused up front."""
    skip = shard_names | {INDEX_NAME, CONFIG_NAME, "hf_quant_config.json", card.PROVENANCE_NAME}
    found = []

    def walk(rel: str) -> None:
        for entry in sorted(os.listdir(resolve_inside(src, rel) if rel else src)):
            name = os.path.join(rel, entry)
            if entry.startswith(".") or (not rel and entry in skip):
                continue
            path = resolve_inside(src, name)
            if os.path.isdir(path):
                walk(name)
            elif os.path.isfile(path):
                found.append(name)
    walk("")
    return found


def copy_ancillary(src: str, dst: str, files: list[str]) -> None:
    """Copy the source's other files; its model card becomes README.source.md, since the output
    gets a card of its own."""
    for name in files:
        out = card.SOURCE_CARD_NAME if name == card.CARD_NAME else name
        os.makedirs(os.path.dirname(os.path.join(dst, out)), exist_ok=True)
        shutil.copyfile(resolve_inside(src, name), os.path.join(dst, out))


def _set_aside_source_card(target: str) -> None:
    """In place, the source's README.md moves to README.source.md before requant's card is written
    (a card left by a killed run of this conversion is requant's own and is simply replaced)."""
    path = os.path.join(target, card.CARD_NAME)
    if os.path.isfile(path) and not card.is_requant_card(path):
        os.replace(path, os.path.join(target, card.SOURCE_CARD_NAME))
        fsync_dir(target)
        fault_point()


def final_metadata(plan: Plan, stats: Stats | None = None) -> dict[str, dict | str]:
    """The files written last, in order: format side files, requant.json, the model card,
    config.json, then the index (whose arrival makes the output loadable). `stats` covers every
    shard, resumed runs included."""
    stats = stats or Stats()
    files: dict[str, dict | str] = dict(plan.target.extra_files(plan.blocks))
    record = card.provenance(plan, stats, plan.label)
    files[card.PROVENANCE_NAME] = record
    files[card.CARD_NAME] = card.model_card(record, plan.target.engine)
    files[CONFIG_NAME] = plan.target.config(plan.blocks, stats)
    files[INDEX_NAME] = plan.index
    return files


def finish_metadata(target: str, files: dict[str, dict | str]) -> None:
    for name, content in files.items():
        if isinstance(content, str):
            atomic_write(os.path.join(target, name), content.encode())
        else:
            atomic_write_json(os.path.join(target, name), content)


def _dir_tensor_bytes(dst: str, plan: Plan) -> int:
    return sum(os.path.getsize(os.path.join(dst, s.name)) for s in plan.shards)


def describe_plan(plan: Plan, dst: str | None, in_place: bool = False, source: str | None = None) -> dict:
    return {
        "source": source or plan.source.path,
        "source_format": plan.source_format,
        "target": plan.target.name,
        "engine": plan.target.engine.label,
        "mtp": plan.target.mtp,
        "shards": len(plan.shards),
        "converted_blocks": plan.blocks,
        "tensors": dict(plan.counts),
        "output_tensors": sum(len(s.specs) for s in plan.shards),
        "input_bytes": plan.input_bytes,              # shard file sizes (headers included)
        "output_bytes": plan.output_bytes,
        "input_tensor_bytes": plan.source.tensor_bytes,   # tensor data alone (inspect's figure)
        "output_tensor_bytes": plan.total_size,
        "free_bytes_needed": space_needed(plan, in_place)[0],
        "free_bytes_available": free_bytes(plan.source.path if in_place else dst),
    }


def format_plan(d: dict) -> str:
    counts = ", ".join(f"{v:,} {k}" for k, v in d["tensors"].items())
    ok = d["free_bytes_available"] >= d["free_bytes_needed"]
    return "\n".join([
        f"plan: {d['source_format']} -> {d['target']} for {d['engine']}, {d['shards']} shards, "
        f"{len(d['converted_blocks'])} MoE layers converted (MTP experts: {d['mtp']})",
        f"  tensors   {counts}; {d['output_tensors']:,} written",
        f"  files     in {d['input_bytes']:,} bytes, out {d['output_bytes']:,} (shard file sizes)",
        f"  data      in {d['input_tensor_bytes']:,} bytes, out {d['output_tensor_bytes']:,} (tensor data)",
        f"  disk      needs {d['free_bytes_needed']:,} free, {d['free_bytes_available']:,} available"
        + ("" if ok else "  (NOT ENOUGH)"),
    ])


def describe_result(r: Result) -> dict:
    s = r.stats
    return {
        "target": r.plan.target.name,
        "engine": r.plan.target.engine.label,
        "tensors_converted": s.tensors_converted,
        "blocks": s.blocks,
        "exact_blocks": s.exact_blocks,
        "requantized_blocks": s.requantized_blocks,
        "bytes_in": r.bytes_in,
        "bytes_out": r.bytes_out,
        "seconds": round(r.seconds, 3),
        "summary": r.plan.target.summary(s),
        "shards_kept": r.shards_kept,             # finished by an earlier run (--resume)
        "shards_converted": r.shards_converted,   # written now
        "bytes_converted": r.bytes_out if r.bytes_converted is None else r.bytes_converted,   # by this run
    }


def format_result(d: dict) -> str:
    """The summary line; after a resume the rate is over what this run converted, and the line says
    how many shards were kept from the earlier run."""
    kept, now = d.get("shards_kept", 0), d.get("shards_converted")
    rate = d.get("bytes_converted", d["bytes_out"]) / d["seconds"] / 2**20 if d["seconds"] else 0.0
    speed = (f"{rate:,.0f} MiB/s" if not kept else f"{rate:,.0f} MiB/s over the shards converted now" if now
             else "nothing left to convert")
    resumed = f"; {kept} shards kept from the earlier run, {now} converted now" if kept else ""
    return (f"converted {d['tensors_converted']:,} expert tensors to {d['target']} for {d['engine']} in {d['seconds']:.1f} s "
            f"({speed}): {d['summary']}{resumed}; shard file sizes in {d['bytes_in']:,} bytes, out {d['bytes_out']:,}")
