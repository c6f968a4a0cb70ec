"""What a conversion writes: each output shard (under a temporary name, checked, then renamed),
the shards left where they are in place or hard-linked to the source's files in a new directory,
the source's other files, and the metadata written last; and the free space all of that needs.

Nothing here opens an existing file for writing: every file is written new and renamed over its
name, so a file that is a hard link to the source's is replaced, never written through."""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait

from requant import card
from requant.errors import CheckpointError, FormatError, RequantError
from requant.formats import mxfp4
from requant.io import fsutil
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json, resolve_inside
from requant.io.safetensors import ShardWriter, read_header
from requant.plan import Plan, ShardPlan
from requant.targets import Stats
from requant.targets.nvfp4 import HF_QUANT_CONFIG
from requant.workers import Encoders

PARTIAL_SUFFIX = ".partial"


class SourceDamaged(RequantError):
    """Source bytes that are no valid encoding (a FormatError while encoding a unit): resuming reads
    the same bytes again, so the advice is to replace the shard, never to resume as it is.
    `damage` says where (journal.describe_damage)."""

    def __init__(self, message: str, damage: dict | None = None):
        super().__init__(message)
        self.damage = damage


def untouched(shard: ShardPlan) -> bool:
    """Whether a shard only passes tensors through: in place it is left where it is, as it is (a
    table larger than memory or than the free disk is never rewritten for nothing)."""
    return all(unit.encode is None for unit in shard.units)


def verbatim(shard: ShardPlan) -> bool:
    """Whether a shard's output is its source file as it is, whatever its header's layout
    (plan.whole_file_output). A new directory then gets the source's file itself
    (plan.verbatim_as: a hard link, or a copy)."""
    return shard.source_file is not None


def choose_verbatim_as(plan: Plan, dst: str | None, copy_all: bool = False) -> None:
    """How the verbatim shards reach `dst` (None: in place, where they stay): hard links where one
    can be made there (tried on one of them), else copies, and copies with `copy_all`."""
    first = next((s.name for s in plan.shards if verbatim(s)), None)
    if dst is None:
        plan.verbatim_as = "keep"
    elif copy_all or first is None:
        plan.verbatim_as = "copy"
    elif first not in plan.source.reads:   # streamed: each shard is fetched into the target's own folder
        plan.verbatim_as = "link"
    else:
        plan.verbatim_as = "link" if fsutil.can_link(plan.source.reads[first].path, dst) else "copy"


def linked_shards(plan: Plan) -> list[str]:
    """The output's shards that are the source's files (hard links), as they are on disk now."""
    dst = (plan.run or {}).get("destination")
    found = []
    for shard in plan.shards if dst else []:
        source = plan.source.reads.get(shard.name)
        try:
            if source is not None and os.path.samefile(source.path, os.path.join(dst, shard.name)):
                found.append(shard.name)
        except OSError:   # not written yet, or a streamed source's file already gone
            continue
    return found


def write_shard(plan: Plan, shard: ShardPlan, target: str, encoders: Encoders, bar, entry: dict,
                in_place: bool = False, before_rename=None) -> Stats:
    """Write one output shard. The encoders (workers.py) read, encode and write units at their
    offsets while this thread copies the other tensors inside the kernel (copy_file_range, in
    bounded pieces: a tensor larger than memory never passes through it).
    `before_rename(stats)` runs once the shard is written and checked, before it takes its name."""
    final = os.path.join(target, shard.name)
    partial = final + PARTIAL_SUFFIX
    source = plan.source
    source_path = source.reads[shard.name].path if shard.name in source.reads else source.shard_path(shard.name)
    check_unchanged(source_path, entry)
    fsutil.remove_quietly(partial)   # opened anew below, never written through (it could be a link)
    if not in_place and verbatim(shard):
        return _place_verbatim(plan, shard, source_path, target, bar, entry, before_rename)
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
        fsutil.fault_point()
        for i, unit in enumerate(shard.units):
            if i == half:
                fsutil.fault_point()
            if unit.encode is None:
                fd, info = source.locate(unit.inputs[0])
                writer.copy_from(unit.outputs[0].name, fd, info.start, progress=bar.update)
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
        fsutil.fault_point()
        verify_written(partial, shard)
        check_unchanged(source_path, entry)   # nothing rewrote the source while it was read
        if before_rename is not None:
            before_rename(stats)
    except BaseException:
        for future in pending:   # no worker may still write to the file once it is removed
            future.cancel()
        wait(pending)
        writer.abort()
        fsutil.remove_quietly(partial)
        raise
    os.replace(partial, final)
    fsutil.fsync_dir(target)
    if in_place:   # the source is gone; its pass-through tensors now live in the new file
        source.relocate(shard.name, read_header(final))
    fsutil.fault_point()
    bar.update(shard.file_size - sum(s.nbytes for s in shard.specs))  # header bytes
    return stats


def _place_verbatim(plan: Plan, shard: ShardPlan, source_path: str, target: str, bar, entry: dict,
                    before_rename=None) -> Stats:
    """A shard whose output is its source file as it is: hard-linked or copied whole (per
    plan.verbatim_as; a refused link falls back to a copy) under the temporary name, checked,
    renamed. The same durable steps as a written shard (fault_point), so crash tests see both alike."""
    final = os.path.join(target, shard.name)
    partial = final + PARTIAL_SUFFIX
    stats = Stats()
    fsutil.fault_point()
    try:
        linked = fsutil.link_or_copy(source_path, partial, copy=plan.verbatim_as != "link", progress=bar.update)
        fsutil.fault_point()
        verify_written(partial, shard)
        check_unchanged(source_path, entry)
        fsutil.fault_point()
        if before_rename is not None:
            before_rename(stats)
    except BaseException:
        fsutil.remove_quietly(partial)
        raise
    os.replace(partial, final)
    fsutil.fsync_dir(target)
    fsutil.fault_point()
    if linked:
        bar.update(shard.file_size)
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


def check_unchanged(path: str, entry: dict) -> None:
    st = os.stat(path)
    if st.st_size != entry["size"] or entry["mtime_ns"] not in (None, st.st_mtime_ns):
        raise CheckpointError("source shard was modified since the conversion began (its size or modification time "
                              "differs from the journal's record); put the original file back before resuming",
                              file=path)


def verify_written(path: str, shard: ShardPlan) -> None:
    header = read_header(path)
    expected = {s.name: s for s in shard.specs}
    if header.file_size != shard.file_size or {n: i.spec for n, i in header.tensors.items()} != expected:
        raise CheckpointError("written shard does not read back as planned", file=path)


def ancillary_files(src: str, shard_names: set[str]) -> list[str]:
    """Tokenizer files, generation config, reference code...: every file but the weights and the
    metadata the conversion rewrites, as paths relative to `src`. Hidden entries (caches, VCS,
    the journal) are skipped; a symlink leading out of the checkpoint is refused up front."""
    skip = shard_names | {INDEX_NAME, CONFIG_NAME, HF_QUANT_CONFIG, card.PROVENANCE_NAME}
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
        out = os.path.join(dst, card.SOURCE_CARD_NAME if name == card.CARD_NAME else name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fsutil.remove_quietly(out)   # a copy left by a killed run: replaced, never written into
        shutil.copyfile(resolve_inside(src, name), out)


def set_aside_source_card(target: str) -> None:
    """In place, the source's README.md moves to README.source.md before requant's card is written
    (a card left by a killed run of this conversion is requant's own and is simply replaced)."""
    path = os.path.join(target, card.CARD_NAME)
    if os.path.isfile(path) and not card.is_requant_card(path):
        os.replace(path, os.path.join(target, card.SOURCE_CARD_NAME))
        fsutil.fsync_dir(target)
        fsutil.fault_point()


def set_aside_source_metadata(target: str, source: Checkpoint) -> None:
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
            fsutil.fsync_dir(target)
            fsutil.fault_point()


def final_metadata(plan: Plan, stats: Stats | None = None, unmeasured: list[str] = ()) -> dict[str, dict | str]:
    """The files written last, in order: format side files, requant.json, the model card,
    config.json, then the index (whose arrival makes the output loadable). `stats` covers every
    shard, resumed runs included, but those `unmeasured` (their stats lost with a damaged journal),
    which requant.json's accuracy names."""
    stats = stats or Stats()
    files: dict[str, dict | str] = dict(plan.target.extra_files(plan.blocks))
    record = card.provenance(plan, stats, plan.label, linked_shards(plan))
    if unmeasured:
        record["accuracy"]["shards_not_measured"] = list(unmeasured)
    files[card.PROVENANCE_NAME] = record
    files[card.CARD_NAME] = card.model_card(record, plan.target.engine)
    files[CONFIG_NAME] = plan.target.config(plan.blocks, stats)
    files[INDEX_NAME] = plan.index
    return files


def finish_metadata(target: str, files: dict[str, dict | str]) -> None:
    for name, content in files.items():
        if isinstance(content, str):
            fsutil.atomic_write(os.path.join(target, name), content.encode())
        else:
            fsutil.atomic_write_json(os.path.join(target, name), content)


def dir_tensor_bytes(dst: str, plan: Plan) -> int:
    return sum(os.path.getsize(os.path.join(dst, s.name)) for s in plan.shards)


def space_needed(plan: Plan, in_place: bool, done: list[bool] | None = None) -> tuple[int, int, int]:
    """(free bytes needed, largest output shard, growth) for the shards not yet done.

    In place, shard k's output is written while its source still exists, after the shards
    before it have grown or shrunk: the peak is the largest of (growth so far + output k); a
    source shard with other hard links (st_nlink > 1) frees nothing when replaced. The shards
    left where they are (`untouched`), or hard-linked into a new directory, need nothing."""
    done = done or [False] * len(plan.shards)
    pending = [s for s, d in zip(plan.shards, done) if not d and not (in_place and untouched(s))
               and not (not in_place and plan.verbatim_as == "link" and verbatim(s))]
    largest = max((s.file_size for s in pending), default=0)
    if not in_place:
        total = sum(s.file_size for s in pending)
        return total, largest, total
    need = growth = 0
    for s in pending:
        need = max(need, growth + s.file_size)
        growth += s.file_size - (0 if _shared(plan, s) else plan.source.headers[s.name].file_size)
    return need, largest, growth


def _shared(plan: Plan, shard: ShardPlan) -> bool:
    """Whether a source shard's file has other hard links (a new directory made by requant, or
    `cp -l`): replacing it in place frees no space."""
    try:
        return os.stat(plan.source.shard_path(shard.name)).st_nlink > 1
    except OSError:
        return False


def check_space(plan: Plan, target: str, in_place: bool, done: list[bool], streamed: bool) -> None:
    need, largest, growth = space_needed(plan, in_place, done)
    if streamed:   # plus one downloaded source shard at a time
        need += max((plan.source.headers[s.name].file_size for s, d in zip(plan.shards, done) if not d), default=0)
    have = fsutil.free_bytes(target)
    if have < need:
        how = (f"the largest output shard is {largest:,} and the format grows the rest by {growth:,}" if in_place
               else f"{sum(1 for d in done if not d)} shards to write")
        raise RequantError(f"not enough free space in {target}: need {need:,} bytes ({how}), {have:,} available")
