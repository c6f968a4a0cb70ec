"""--drafter graft DONOR: the source checkpoint with the drafter of another checkpoint of the same
model (the donor: a directory, or a Hub repository of which only the drafter's shards are
downloaded) in place of its own, presented as one Checkpoint that the plan reads like any
source. The donor's drafter tensors are taken byte for byte and kept as the donor stores them (the
keep mode's rules hold for them); the config fields only the drafter has, and the drafter's entries
of per-layer lists, come from the donor. Everything is checked from headers and config.json before a
byte is written; each refusal is one line naming the field, tensor or file."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
import tempfile
from dataclasses import dataclass

from requant.errors import CheckpointError, UnsupportedError, UsageError
from requant.experts import ExpertIndex
from requant.io import hub as hub_lib
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, resolve_inside
from requant.io.safetensors import read_header
from requant.model import ModelSpec
from requant.plan import check_against_config

GRAFT = "graft"
# where the donor's drafter tensors go: new shards, one per donor file holding some
DRAFTER_SHARD = "model-drafter-{index:05d}-of-{count:05d}.safetensors"
# config.json fields that say which program wrote the file, not what the model is
_NOT_MODEL_FIELDS = ("_name_or_path", "transformers_version")


@dataclass(frozen=True)
class Grafted:
    checkpoint: Checkpoint      # the source with the donor's drafter in place of its own
    donor: dict                 # {"path", "drafter_headers"}: what the journal and a resume compare
    source_shards: list[str]    # the source's own shard files (none of them is an output's ancillary file)


def refuse_unsupported(in_place: bool, streamed: bool) -> None:
    """The runs a graft is not made for, refused before anything is opened."""
    if in_place:
        raise UsageError("--drafter graft writes a new directory: in place, the source's drafter shards would be "
                         "replaced by the donor's before the conversion is known to finish; give DST")
    if streamed:
        raise UsageError("--drafter graft reads the source's shards where they are: not with --stream-source "
                         "(convert without it; the Hub source is then downloaded into the cache)")


def graft(base: Checkpoint, donor_ref: str, model: str | None = None, hub: dict | None = None,
          fetch: bool = True) -> Grafted:
    """`base` with the drafter of checkpoint `donor_ref`: a directory, or a Hub repository whose
    headers are read by range requests and whose drafter shards, only those, are downloaded into the
    Hugging Face cache (`hub`: HubSource's progress, token and cache_dir). `fetch` False reads
    headers only (a plan). `model` is --model (the named model the result must be)."""
    where = f"--drafter graft {donor_ref}"
    with _opened_donor(donor_ref, where, hub or {}) as (donor, remote):
        base_spec, donor_spec = ModelSpec.for_checkpoint(base), ModelSpec.for_checkpoint(donor)
        if base_spec.recipe.model_type != donor_spec.recipe.model_type:
            raise UnsupportedError(f"{where}: the donor is a {donor_spec.name} checkpoint (model_type "
                                   f"{donor_spec.recipe.model_type}), {base.path} a {base_spec.name} one (model_type "
                                   f"{base_spec.recipe.model_type}): a drafter is grafted within one model family")
        drafter = {n: donor_spec.drafter_block_of(n) for n in donor.names if donor_spec.drafter_block_of(n)}
        if not ExpertIndex(donor_spec, donor).drafter_blocks():
            raise UnsupportedError(f"{where}: the donor has no drafter (MTP block or DSpark stages) with routed "
                                   f"experts ({donor_spec.name})")
        own = {n for n in base.names if base_spec.drafter_block_of(n)}
        config = _grafted_config(base, donor, base_spec, len(set(drafter.values())),
                                 len({base_spec.drafter_block_of(n) for n in own}), where)
        grafted = _composite(base, donor, own, list(drafter), config)
        _check_drafter(grafted, donor_spec, model, where)
        shards = [name for name in donor.shard_names if any(donor.locations[t] == name for t in drafter)]
        digest = hashlib.sha256(b"".join(donor.headers[name].raw for name in shards)).hexdigest()
        label = os.path.realpath(donor_ref) if remote is None else f"{hub_lib.HUB_PREFIX}{remote.repo}@{remote.commit}"
        if remote is not None and remote.files is not None and fetch:   # online: now the drafter's bytes
            grafted = _composite(base, _downloaded(donor, remote, shards), own, list(drafter), config)
        return Grafted(grafted, {"path": label, "drafter_headers": digest}, list(base.shard_names))


@contextlib.contextmanager
def _opened_donor(ref: str, where: str, hub: dict):
    """(the donor checkpoint, its HubSource or None). A Hub donor online is its headers only (its
    config.json, index and small files in a temporary folder); offline, the cache's snapshot, which
    must hold it whole (HubSource refuses one that holds part of it)."""
    if os.path.isdir(ref):
        with Checkpoint.open(ref) as donor:
            yield donor, None
        return
    repo = hub_lib.hub_repo(ref)
    if not repo:
        raise CheckpointError("--drafter graft: the donor checkpoint is missing (a directory or a Hub repository id "
                              "is expected)", file=ref)
    remote = hub_lib.HubSource(repo, None, explicit=ref.startswith(hub_lib.HUB_PREFIX), **hub)
    if remote.cached:   # offline, from a complete snapshot in the cache
        with Checkpoint.open(remote.cached) as donor:
            yield donor, remote
        return
    with tempfile.TemporaryDirectory(prefix="requant-donor-") as staging:
        yield remote.open_streamed(staging), remote


def _downloaded(donor: Checkpoint, remote: hub_lib.HubSource, shards: list[str]) -> Checkpoint:
    """The headers-only Hub donor with its drafter shards downloaded into the cache, each checked
    to hold the header the plan was made from."""
    folder = remote.download(shards)
    headers = dict(donor.headers)
    for name in shards:
        local = read_header(resolve_inside(folder, name, "shard"))
        if local.raw != donor.headers[name].raw:
            raise CheckpointError("the downloaded shard's header is not the one the Hub served for the plan",
                                  file=f"{remote.repo}/{name}")
        headers[name] = local
    index = {"metadata": donor.index_metadata, "weight_map": donor.weight_map} if donor.weight_map is not None else None
    return Checkpoint.from_parts(folder, donor.config, index, headers)


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    """config.json's fields by dotted path (nested objects such as text_config opened), without
    quantization_config (each output writes its own)."""
    found = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if key == "quantization_config" or key in _NOT_MODEL_FIELDS:
            continue
        if isinstance(value, dict):
            found.update(_flat(value, path + "."))
        else:
            found[path] = value
    return found


def _grafted_config(base: Checkpoint, donor: Checkpoint, spec: ModelSpec, donor_stages: int, base_stages: int,
                    where: str) -> dict:
    """The source's config.json with the donor's drafter: the fields only the donor has, the drafter's
    layer count, and each per-layer list's drafter entries. Any other field that differs means
    another base model, refused."""
    layers = spec.value("num_layers")
    drafter_count = spec.config_key("num_mtp_layers")
    ours, theirs = _flat(base.config), _flat(donor.config)
    config = copy.deepcopy(base.config)
    for key, value in theirs.items():
        mine = ours.get(key, value)
        if isinstance(value, list) and isinstance(mine, list) and mine[:layers] == value[:layers] \
                and (len(mine), len(value)) == (layers + base_stages, layers + donor_stages):
            value = mine[:layers] + value[layers:]   # the main layers' entries, then the drafter's
        elif mine != value and key != drafter_count:
            raise UnsupportedError(f"{where}: config.json field {key} is {_shown(mine)} in {base.path}, "
                                   f"{_shown(value)} in the donor: not the same base model")
        *parents, last = key.split(".")
        node = config
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    return config


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _composite(base: Checkpoint, donor: Checkpoint, own: set[str], drafter: list[str], config: dict) -> Checkpoint:
    """The checkpoint the plan reads: the source's shards without its own drafter (a shard left
    empty is gone), then one shard per donor file holding drafter tensors, read from that file."""
    headers, weight_map, rewritten = {}, {}, set()
    for name in base.shard_names:
        header = base.headers[name]
        kept = {t: info for t, info in header.tensors.items() if t not in own}
        if len(kept) < len(header.tensors):
            rewritten.add(name)
        if kept:
            headers[name] = dataclasses.replace(header, tensors=kept)
    donor_files = [n for n in donor.shard_names if any(donor.locations[t] == n for t in drafter)]
    for index, source_name in enumerate(donor_files, 1):
        name = DRAFTER_SHARD.format(index=index, count=len(donor_files))
        if name in base.headers:
            raise UnsupportedError(f"--drafter graft: {base.path} already has a shard named {name}, the name the "
                                   "donor's drafter shard would take")
        header = donor.headers[source_name]
        headers[name] = dataclasses.replace(header, tensors={t: header.tensors[t] for t in header.tensors
                                                             if t in drafter})
        rewritten.add(name)
    for name, header in headers.items():
        weight_map.update(dict.fromkeys(header.tensors, name))
    composite = Checkpoint.from_parts(base.path, config, {"metadata": base.index_metadata, "weight_map": weight_map},
                                      headers)
    return dataclasses.replace(composite, rewritten=frozenset(rewritten))


def _check_drafter(grafted: Checkpoint, donor_spec: ModelSpec, model: str | None, where: str) -> None:
    """The result is the donor's kind of model (its drafter's tensors where the recipe expects
    them, and none of the source's left), its drafter's routed experts in the source's format
    (kept as they are, they must be what the engine rules are asked about) at the shapes the
    config gives."""
    spec = ModelSpec.for_checkpoint(grafted, f"{grafted.path} with the donor's drafter", model)
    if spec.recipe is not donor_spec.recipe:
        raise UnsupportedError(f"{where}: the source with the donor's drafter is a {spec.name} checkpoint, the donor "
                               f"a {donor_spec.name} one (see {CONFIG_NAME} and {INDEX_NAME} of both)")
    index = ExpertIndex(spec, grafted)
    main = index.main_codec
    for block in index.drafter_blocks():
        stored = index.blocks[block].codec
        if stored is not main:
            unit = index.blocks[block].units[0]
            raise UnsupportedError(f"{where}: the donor's drafter experts ({index.where(unit)}) are stored as "
                                   f"{stored.name.upper() if stored else 'an unknown format'}, the source's main "
                                   f"experts as {main.name.upper()}: a grafted drafter is kept as the donor stores it")
        for unit in index.blocks[block].units:
            check_against_config(spec, grafted, index.reader, unit)
