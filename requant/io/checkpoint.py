"""A checkpoint directory read from metadata: config, index and every shard header.

Opening reads no tensor data, so planning a 160 GB conversion takes a moment. Tensor bytes are
read on demand with pread.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

import torch

from requant.errors import CheckpointError, FormatError
from requant.io.diagnosis import path_problem
from requant.io.names import CONFIG_NAME, INDEX_NAME, SINGLE_FILE_NAME
from requant.io.safetensors import Header, TensorInfo, open_direct, parse_header, read_header, read_tensor

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 * 1024 * 1024
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.safetensors$")


def read_json(path: str) -> dict:
    """Read a JSON object from a metadata file, with a clear error for anything else."""
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise CheckpointError(f"larger than {MAX_JSON_BYTES} bytes; not a metadata file", file=path)
        with open(path, "rb") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise CheckpointError("missing", file=path) from None
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", file=path) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"not valid JSON ({str(e).splitlines()[0]})", file=path) from None
    if not isinstance(obj, dict):
        raise CheckpointError("not a JSON object", file=path)
    return obj


def resolve_inside(root: str, name: str, what: str = "file") -> str:
    """Resolve `name` under `root`, refusing names that escape it.

    Symlinks are allowed when they land inside `root` or, for a Hugging Face cache snapshot
    (`.../snapshots/<rev>/`), inside that cache's `blobs/` folder.
    """
    if not _SHARD_NAME.match(name) and what == "shard":
        raise CheckpointError(f"index names shard {name!r}, which is not a plain file name in the checkpoint directory",
                              file=os.path.join(root, INDEX_NAME))
    path = os.path.join(root, name)
    real = os.path.realpath(path)
    allowed = [os.path.realpath(root)]
    parent = os.path.dirname(os.path.realpath(root))
    if os.path.basename(parent) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(parent), "blobs"))
    if not any(real == a or real.startswith(a + os.sep) for a in allowed):
        raise CheckpointError(f"{what} resolves outside the checkpoint directory (to {real})", file=path)
    return path


@dataclass
class Checkpoint:
    path: str
    config: dict
    shard_names: list[str]                          # in index order of first appearance
    headers: dict[str, Header]                      # shard name -> header (as planned from)
    locations: dict[str, str] = field(default_factory=dict)  # tensor name -> shard name
    index_metadata: dict = field(default_factory=dict)
    weight_map: dict | None = None                  # the index's, None for a single-file checkpoint
    # Where each shard's bytes are read from now: its header, unless its file was replaced by a
    # converted shard (in place) or is a downloaded copy (streamed from the Hub).
    reads: dict[str, Header] | None = None
    # Shards whose output is always written anew, never the file they are read from (a grafted
    # drafter's, and the source's shards it leaves: requant/convert/graft.py)
    rewritten: frozenset[str] = frozenset()
    _fds: dict[str, int] = field(default_factory=dict, repr=False)
    _direct_fds: dict[str, int | None] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.reads is None:
            self.reads = dict(self.headers)

    @classmethod
    def open(cls, path: str, unfinished: bool = False) -> "Checkpoint":
        """`unfinished`: what the files say even with a conversion's state folder there (an abort
        whose journal is damaged reads the directory itself)."""
        problem = path_problem(path, unfinished)   # inspect's and verify's words for a missing path or a conversion in progress
        if problem:
            raise CheckpointError(problem, file=path)
        config = read_json(os.path.join(path, CONFIG_NAME))
        index_path = os.path.join(path, INDEX_NAME)
        if os.path.exists(index_path):
            index = read_json(index_path)
        elif os.path.exists(os.path.join(path, SINGLE_FILE_NAME)):
            index = None
        else:
            raise CheckpointError(f"neither {INDEX_NAME} nor {SINGLE_FILE_NAME} found", file=path)
        headers = {}
        started = time.monotonic()
        for shard in shard_names_of(path, index):
            shard_path = resolve_inside(path, shard, "shard")
            if not os.path.isfile(shard_path):
                raise CheckpointError("shard named by the index is missing", file=shard_path)
            headers[shard] = read_header(shard_path)
            log.debug("read the header of %s: %d tensors", shard_path, len(headers[shard].tensors))
        ck = cls.from_parts(path, config, index, headers)
        log.info("opened %s: model_type %s, %d shards, %d tensors (headers read in %.2f s)", path,
                 config.get("model_type"), len(headers), len(ck.locations), time.monotonic() - started)
        return ck

    @classmethod
    def from_parts(cls, path: str, config: dict, index: dict | None, headers: dict[str, Header]) -> "Checkpoint":
        """A checkpoint from its config, index (None: single file) and shard headers, checked for
        agreement: every tensor in exactly one shard, where the index says."""
        index_path = os.path.join(path, INDEX_NAME)
        shard_names = shard_names_of(path, index)
        weight_map = index["weight_map"] if index is not None else None
        index_metadata = (index.get("metadata") or {}) if index is not None else {}
        if not isinstance(index_metadata, dict):
            raise CheckpointError("metadata is not an object", file=index_path)
        locations = {}
        for shard in shard_names:
            for name in headers[shard].tensors:
                if name in locations:
                    raise CheckpointError(f"tensor also stored in {locations[name]}", file=os.path.join(path, shard), tensor=name)
                locations[name] = shard
        if weight_map is not None:
            for name, shard in weight_map.items():
                if locations.get(name) != shard:
                    raise CheckpointError(f"index places it in {shard} but that shard does not hold it",
                                          file=index_path, tensor=name)
            for name, shard in locations.items():
                if name not in weight_map:
                    raise CheckpointError("tensor stored in a shard but missing from the index",
                                          file=os.path.join(path, shard), tensor=name)
        return cls(path, config, shard_names, headers, locations, index_metadata, weight_map)

    @classmethod
    def from_snapshot(cls, path: str, snapshot: dict) -> "Checkpoint":
        """The checkpoint recorded in a conversion journal, whatever its files hold now."""
        headers = {s["name"]: parse_header(base64.b64decode(s["header"]), s["size"], os.path.join(path, s["name"]))
                   for s in snapshot["shards"]}
        index = {"metadata": snapshot["index_metadata"], "weight_map": snapshot["weight_map"]} \
            if snapshot["weight_map"] is not None else None
        return cls.from_parts(path, snapshot["config"], index, headers)

    def snapshot(self) -> dict:
        """Everything needed to rebuild this checkpoint's plan without its files (see journal.py)."""
        shards = []
        for name in self.shard_names:   # modification times of the files readable now (not of a streamed source)
            mtime = os.stat(self.reads[name].path).st_mtime_ns if name in self.reads else None
            shards.append({"name": name, "size": self.headers[name].file_size, "mtime_ns": mtime,
                           "header": base64.b64encode(self.headers[name].raw).decode()})
        return {"config": self.config, "weight_map": self.weight_map, "index_metadata": self.index_metadata,
                "shards": shards}

    @property
    def names(self) -> list[str]:
        return list(self.locations)

    def info(self, name: str) -> TensorInfo:
        return self.headers[self.locations[name]].tensors[name]

    def shard_path(self, shard: str) -> str:
        return os.path.join(self.path, shard)

    @contextlib.contextmanager
    def naming(self, name: str):
        """FormatErrors raised inside (bytes no valid file holds) name tensor `name` and its file."""
        try:
            yield
        except FormatError as e:
            raise FormatError(str(e), file=self.shard_path(self.locations[name]), tensor=name) from None

    def relocate(self, shard: str, header: Header | None) -> None:
        """Read `shard`'s tensors from `header`'s file from now on (None: nowhere). Closes the old
        file, so a replaced or deleted shard's space is freed at once."""
        with self._lock:
            fds = [self._fds.pop(shard, None), self._direct_fds.pop(shard, None)]
        for fd in fds:
            if fd is not None:
                os.close(fd)
        if header is None:
            self.reads.pop(shard, None)
        else:
            self.reads[shard] = header

    def locate(self, name: str) -> tuple[int, TensorInfo]:
        """An open file and the byte range holding tensor `name` now."""
        _, info = self.where(name)
        return self.fd(self.locations[name]), info

    def where(self, name: str) -> tuple[str, TensorInfo]:
        """The path of the file and the byte range holding tensor `name` now."""
        if name not in self.locations:
            raise CheckpointError("tensor not in checkpoint", file=self.path, tensor=name)
        shard = self.locations[name]
        header = self.reads.get(shard)
        info = header.tensors.get(name) if header else None
        if info is None or info.spec != self.info(name).spec:
            raise CheckpointError("its source bytes are no longer available (shard already converted or not fetched)",
                                  file=self.shard_path(shard), tensor=name)
        return header.path, info

    def fd(self, shard: str) -> int:
        with self._lock:   # worker threads read tensors
            if shard not in self._fds:
                self._fds[shard] = os.open(self.reads[shard].path, os.O_RDONLY)
            return self._fds[shard]

    def direct_fd(self, shard: str) -> int | None:
        """The shard opened for reading past the page cache (O_DIRECT), None where refused."""
        with self._lock:
            if shard not in self._direct_fds:
                self._direct_fds[shard] = open_direct(self.reads[shard].path, os.O_RDONLY)
            return self._direct_fds[shard]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` in its stored dtype; large ones read past the page cache where the file
        system allows (read_tensor): a report or verify reads each once."""
        fd, info = self.locate(name)
        shard = self.locations[name]
        return read_tensor(fd, info, self.reads[shard].path, direct=self.direct_fd(shard))

    @property
    def tensor_bytes(self) -> int:
        return sum(i.nbytes for h in self.headers.values() for i in h.tensors.values())

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._direct_fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shard_names_of(path: str, index: dict | None) -> list[str]:
    """Shard files in order of first appearance in the index's weight map."""
    if index is None:
        return [SINGLE_FILE_NAME]
    weight_map = index.get("weight_map")
    if (not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values())
            or not isinstance(index.get("metadata") or {}, dict)):
        raise CheckpointError("weight_map is missing or not a map of tensor name to shard file",
                              file=os.path.join(path, INDEX_NAME))
    return list(dict.fromkeys(weight_map.values()))
