"""The conversion's course: plan, journal, each shard in turn, the metadata last, and how a stop
is reported (what is kept for --resume)."""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass

from tqdm import tqdm

from requant import __version__
from requant.compute import default_workers
from requant.errors import CheckpointError, RequantError, describe_os_error
from requant.io import fsutil
from requant.io import hub as hub_lib
from requant.io import journal
from requant.io.checkpoint import Checkpoint
from requant.io.safetensors import read_header
from requant.plan import Plan, ShardPlan, make_plan
from requant.targets import Options, Stats
from requant.verify import OutputRejected, check_written
from requant.workers import Encoders

from requant.convert import abort as aborting, graft as grafting, outputs, resume as resuming
from requant.convert.outputs import SourceDamaged

log = logging.getLogger(__name__)


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


class AlreadyFinished(RequantError):
    """--resume where the conversion has finished: nothing to do, and that is success."""

    exit_code = 0


class Stopped(RequantError):
    """A conversion that stopped after its journal was written: its work is kept for --resume."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


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
                    revision: str | None = None, token: str | None = None, cache_dir: str | None = None,
                    dst: str | None = None, copy_all: bool = False) -> Plan:
    """The plan, from headers alone; a Hub source's shard headers come by range requests (or from
    the cache offline), so nothing large is downloaded. With `dst` (or `in_place`) it says how the
    shards that stay as they are get there (outputs.choose_verbatim_as)."""
    if in_place:
        refuse_in_place_on_cache(src, hub_lib.hub_repo(src))
    if options.mtp == grafting.GRAFT:
        grafting.refuse_unsupported(in_place, streamed=False)
    with hub_lib.open_headers(src, revision, token, cache_dir) as source:
        if options.mtp == grafting.GRAFT:
            source = grafting.graft(source, options.donor, options.model, fetch=False,
                                    hub={"progress": False, "token": token, "cache_dir": cache_dir}).checkpoint
        plan = _logged(make_plan(source, out_format, options, in_format))
        if in_place or dst:
            outputs.choose_verbatim_as(plan, None if in_place else dst, copy_all)
        return plan


def _logged(plan: Plan) -> Plan:
    """The plan, logged: what is converted, what passes through, and the bytes either side."""
    log.info("plan: %s experts of %d blocks -> %s; %s; %d shards, %d bytes in, %d bytes out",
             plan.source_format, len(plan.blocks), plan.target.name,
             ", ".join(f"{n} {what}" for what, n in sorted(plan.counts.items())), len(plan.shards),
             plan.input_bytes, plan.output_bytes)
    return plan


def convert(src: str, dst: str | None, out_format: str, options: Options, in_format: str | None = None,
            workers: int | None = None, progress: bool = True, resume: bool = False, resume_hint: str | None = None,
            revision: str | None = None, stream: bool = False, token: str | None = None,
            cache_dir: str | None = None, copy_all: bool = False) -> Result:
    """Convert checkpoint `src` (a directory, or a Hub repository id) into directory `dst`, or in
    place when `dst` is None.

    `resume` continues the unfinished conversion journaled in the target; without it, a target
    holding a journal is refused. `resume_hint` is the command that resumes (for messages).
    `stream` fetches a Hub source one shard at a time, deleting each once converted. `token` and
    `cache_dir` are the Hub's (None: huggingface_hub's own defaults and environment).
    `workers` (default: one per core) encode in parallel (workers.py); `options.device` says where.
    Out of place, a shard the conversion would leave byte for byte as it is becomes a hard link to
    the source's file where the filesystem allows, a copy otherwise or with `copy_all`.
    """
    started = time.monotonic()
    given_src = src   # as the user named it, for the card's command line (a Hub source becomes a snapshot path)
    in_place = dst is None
    target = src if in_place else dst
    given_in = f" --in {in_format}" if in_format else ""
    hint = resume_hint or f"requant convert {src} {dst or '--in-place'}{given_in} --out {out_format} --resume"
    request = {"format": journal.FORMAT, "requant": __version__, "mode": "in-place" if in_place else "out-of-place",
               "options": resuming.journaled_options(options, in_format, out_format), "resume": hint}
    hub = None
    repo = hub_lib.hub_repo(src)
    if in_place:
        refuse_in_place_on_cache(src, repo)
    if options.mtp == grafting.GRAFT:
        grafting.refuse_unsupported(in_place, stream)
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
        locks.append(fsutil.DirLock(target, exclusive=True, what="a conversion writes there",
                                    record=journal.path_of(target, journal.LOCK)))
        if not in_place and hub is None:   # an in-place conversion would pull the source from under us
            locks.append(fsutil.DirLock(src, exclusive=False, what="an in-place conversion of it"))
        grafted = None
        if options.mtp == grafting.GRAFT:
            with Checkpoint.open(src) as base:
                grafted = grafting.graft(base, options.donor, options.model,
                                         hub={"progress": progress, "token": token, "cache_dir": cache_dir})
            if os.path.isdir(options.donor):   # the donor too is read until the end (a Hub donor's files are the cache's)
                locks.append(fsutil.DirLock(options.donor, exclusive=False, what="an in-place conversion of it"))
            request["donor"] = grafted.donor
        if resume and not journal.exists(target):
            finished = resuming.finished_conversion(target, request.get("source") or src, out_format)
            if finished:
                raise AlreadyFinished(finished)
        resume = resume and journal.exists(target)   # nothing journaled yet: --resume starts afresh
        source, snapshot = resuming.open_source(src, target, in_place, resume, request, hub,
                                                grafted.checkpoint if grafted else None)
        journaled = resume
        plan = _logged(make_plan(source, out_format, options, in_format))
        plan.label = request.get("source") or src
        plan.run = {"source": given_src, "destination": dst, "in_place": in_place,
                    **({"donor": grafted.donor["path"]} if grafted else {})}
        outputs.choose_verbatim_as(plan, dst, copy_all)
        entries = {e["name"]: e for e in snapshot["shards"]}
        aborting.remove_temporaries(target, snapshot, outputs.final_metadata(plan))
        done = [resuming.shard_done(shard, target, in_place, entries[shard.name]) for shard in plan.shards]
        shard_files = set(plan.source.shard_names) | set(grafted.source_shards if grafted else ())
        ancillary = [] if in_place else outputs.ancillary_files(source.path, shard_files)
        outputs.final_metadata(plan)   # fails now, not after the shards, on a config the target cannot extend
        outputs.check_space(plan, target, in_place, done, streamed=hub is not None)
        if not resume:
            request["shards"] = [{"name": s.name, "done": False, "stats": None} for s in plan.shards]
            journal.create(target, snapshot, request)
            journaled = True
        record = journal.load(target)[0]
        for is_done, state in zip(done, record["shards"]):
            state["done"] = state["done"] or is_done   # renamed, then stopped before the journal said so
        if in_place:
            outputs.set_aside_source_metadata(target, source)
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
        kept = (f"the converted shards are kept, and the source's config.json and index in {journal.path_of(target)}"
                if in_place else aborting.start_over_advice(target, hint).removeprefix("or "))
        raise Stopped(f"{e}; {kept}", 1) from None
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
                f"kept in {journal.path_of(target)} until the conversion finishes "
                f"({aborting.start_over_advice(target, record['resume'])})")
    return SourceDamaged(f"the source is damaged: {what}; {kept}; "
                         f"{journal.damage_advice(record).split('; ', 1)[1]}", e.damage)


def _check_overlap(src: str, dst: str) -> None:
    src_real, real = os.path.realpath(src), os.path.realpath(dst)
    if real == src_real or real.startswith(src_real + os.sep) or src_real.startswith(real + os.sep):
        raise RequantError(f"destination {dst} overlaps the source {src} (use --in-place to convert in place)")


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
                    stats.add(Stats(**state["stats"]))
                bar.update(shard.file_size)
                log.info("kept %s: converted by the run this one resumes", shard.name)
                continue
            if hub:
                _fetch(plan, shard, hub, entries[shard.name])

            def remember(shard_stats: Stats, state=state) -> None:
                # Journaled before the rename: a run killed between rename and "done" resumes
                # with this shard's stats, so the config's summary still covers every shard.
                state["stats"] = dataclasses.asdict(shard_stats)
                journal.save(target, record)

            shard_started = time.monotonic()
            shard_stats = outputs.write_shard(plan, shard, target, encoders, bar, entries[shard.name], in_place,
                                              remember)
            log.info("wrote %s: %d tensors, %d bytes in %.2f s", shard.name, len(shard.specs), shard.file_size,
                     time.monotonic() - shard_started)
            if hub:   # the disk never holds more than one source shard
                os.remove(plan.source.reads[shard.name].path)
                plan.source.relocate(shard.name, None)
            state["done"] = True
            journal.save(target, record)
            stats.add(shard_stats)
    if not in_place:
        outputs.copy_ancillary(plan.source.path, target, ancillary)
    else:
        outputs.set_aside_source_card(target)
    # converted by a run whose journal (and so these shards' stats) was lost since
    unmeasured = [shard.name for shard, state in zip(plan.shards, record["shards"])
                  if state["done"] and state["stats"] is None and not outputs.untouched(shard)]
    if unmeasured:
        log.warning("the accuracy in requant.json leaves out %s: converted before the journal holding their stats "
                    "was lost", ", ".join(unmeasured))
    files = outputs.final_metadata(plan, stats, unmeasured)
    # verify's own checks on what was written, before config.json and the index make it loadable
    check_written(target, files, force=plan.target.options.force)
    outputs.finish_metadata(target, files)   # after the shards: a target may summarise them
    journal.remove(target)
    converted = [shard for shard in plan.shards if shard.name not in kept]
    log.info("converted %d shards (%d kept from before) into %s in %.2f s", len(converted), len(kept), target,
             time.monotonic() - started)
    return Result(plan, stats, plan.input_bytes, outputs.dir_tensor_bytes(target, plan), time.monotonic() - started,
                  shards_kept=len(kept) if resumed else 0, shards_converted=len(converted),
                  bytes_converted=sum(shard.file_size for shard in converted))


def _fetch(plan: Plan, shard: ShardPlan, hub: hub_lib.HubSource, entry: dict) -> None:
    path = hub.fetch(shard.name, plan.source.path)
    if not journal.matches(path, entry["size"], base64.b64decode(entry["header"])):
        raise CheckpointError("downloaded shard does not match the header read when the conversion began "
                              "(the repository changed?)", file=path)
    plan.source.relocate(shard.name, read_header(path))
