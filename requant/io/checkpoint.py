"""A checkpoint directory read from metadata: config, index and every shard header.

Opening reads no tensor data, so planning a 160 GB conversion takes a moment. Tensor bytes are
read on demand with pread.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from requant.errors import CheckpointError
from requant.io.safetensors import Header, TensorInfo, read_header, read_tensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
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
    headers: dict[str, Header]                      # shard name -> header
    locations: dict[str, str] = field(default_factory=dict)  # tensor name -> shard name
    index_metadata: dict = field(default_factory=dict)
    _fds: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str) -> "Checkpoint":
        if not os.path.isdir(path):
            raise CheckpointError("not a directory", file=path)
        config = read_json(os.path.join(path, CONFIG_NAME))
        index_path = os.path.join(path, INDEX_NAME)
        if os.path.exists(index_path):
            index = read_json(index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError("weight_map is missing or not a map of tensor name to shard file", file=index_path)
            index_metadata = index.get("metadata") or {}
        elif os.path.exists(os.path.join(path, SINGLE_FILE_NAME)):
            weight_map, index_metadata = None, {}
        else:
            raise CheckpointError(f"neither {INDEX_NAME} nor {SINGLE_FILE_NAME} found", file=path)
        shard_names = list(dict.fromkeys(weight_map.values())) if weight_map is not None else [SINGLE_FILE_NAME]
        headers = {}
        for shard in shard_names:
            shard_path = resolve_inside(path, shard, "shard")
            if not os.path.isfile(shard_path):
                raise CheckpointError("shard named by the index is missing", file=shard_path)
            headers[shard] = read_header(shard_path)
        locations = {}
        for shard, header in headers.items():
            for name in header.tensors:
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
        return cls(path, config, shard_names, headers, locations, index_metadata)

    @property
    def names(self) -> list[str]:
        return list(self.locations)

    def info(self, name: str) -> TensorInfo:
        return self.headers[self.locations[name]].tensors[name]

    def shard_path(self, shard: str) -> str:
        return os.path.join(self.path, shard)

    def fd(self, shard: str) -> int:
        if shard not in self._fds:
            self._fds[shard] = os.open(self.shard_path(shard), os.O_RDONLY)
        return self._fds[shard]

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.locations:
            raise CheckpointError("tensor not in checkpoint", file=self.path, tensor=name)
        shard = self.locations[name]
        return read_tensor(self.fd(shard), self.info(name), self.shard_path(shard))

    @property
    def tensor_bytes(self) -> int:
        return sum(i.nbytes for h in self.headers.values() for i in h.tensors.values())

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
