"""Checkpoints the tests share, each made once per session (the `checkpoints` fixture in conftest.py).

A checkpoint is made by requant's public entry points only (`synth.write_checkpoint`,
`requant.convert.convert`), or written from the public DeepSeek-V4-Flash release's listing
(tests/fixtures) as headers alone, and cached under a key of everything that decides its bytes:
model and dimensions, seed, hard cases, sparseness, config edits, output format and options.

The paths handed out are shared by every test that asks for the same key, so they are made
read-only, and `changed()` lists any file that changed anyway (mode bits do not stop root): the
fixture fails the session on it. A test that modifies a checkpoint works on `copy()`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Callable

from requant import synth
from requant.io.safetensors import ShardWriter, TensorSpec
from requant.targets import Options
from tests import release_fixture


class Checkpoints:
    """Synthetic sources, header-only releases and their conversions, made once under `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._paths: dict[tuple, str] = {}
        self._stamps: dict[str, dict[str, tuple[int, int, int]]] = {}

    def source(self, dims: synth.Dims | None = None, seed: int = 0, hard: synth.HardCases = synth.HardCases(),
               sparse: bool = False) -> str:
        """A synthetic checkpoint (default: the default model's reduced dimensions); `sparse`:
        full-size headers over holes, for planning only."""
        dims = dims or synth.Dims()
        return self._made(("synth", repr(dims), seed, hard, sparse),
                          lambda dest: synthesize(dest, dims, seed, hard, sparse))

    def release(self, **config) -> str:
        """The public DeepSeek-V4-Flash release as headers alone (every tensor at its real name,
        dtype, shape, shard and offset; the data section a hole), with `config` replacing
        config.json's keys of those names."""
        return self._made(("release", json.dumps(config, sort_keys=True)),
                          lambda dest: write_release_headers(dest, config))

    def converted(self, source: str, out_format: str, options: Options | None = None) -> str:
        """`source` (a path this factory made) converted to `out_format`."""
        if source not in self._stamps:
            raise ValueError(f"{source} was not made by this factory: its conversion could not be shared")
        options = options or Options()
        return self._made(("convert", source, out_format, repr(options)),
                          lambda dest: convert(source, dest, out_format, options))

    def pair(self, out_format: str = "nvfp4", options: Options | None = None, dims: synth.Dims | None = None,
             seed: int = 0, hard: synth.HardCases = synth.HardCases()) -> tuple[str, str]:
        """(source, its conversion)."""
        src = self.source(dims, seed, hard)
        return src, self.converted(src, out_format, options)

    def copy(self, path: str, dest: str | Path) -> str:
        """A writable copy of `path` at `dest`, holes kept as holes (a full-scale sparse checkpoint
        copies in a blink), symlinks as symlinks."""
        shutil.copytree(path, dest, symlinks=True, copy_function=_copy_sparse)
        _set_writable(str(dest), True)
        return str(dest)

    def changed(self) -> list[str]:
        """Files of the handed-out checkpoints that were added, removed or rewritten since made."""
        out = []
        for path, stamps in self._stamps.items():
            now = _stamps(path)
            out += [os.path.join(path, rel) for rel in sorted(set(stamps) | set(now)) if stamps.get(rel) != now.get(rel)]
        return out

    def _made(self, key: tuple, build: Callable[[str], object]) -> str:
        if key not in self._paths:
            dest = str(self.root / f"{key[0]}-{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}")
            try:
                build(dest)
            except BaseException:
                _set_writable(dest, True)
                shutil.rmtree(dest, ignore_errors=True)
                raise
            _set_writable(dest, False)
            self._stamps[dest] = _stamps(dest)
            self._paths[key] = dest
        return self._paths[key]


def synthesize(dest: str, dims: synth.Dims, seed: int, hard: synth.HardCases = synth.HardCases(),
               sparse: bool = False) -> str:
    synth.write_checkpoint(dest, dims, seed=seed, hard=hard, sparse=sparse)
    return dest


def convert(src: str, dst: str, out_format: str, options: Options) -> str:
    from requant.convert import convert as convert_checkpoint

    convert_checkpoint(src, dst, out_format, options, progress=False)
    return dst


def converted_pair(root: Path, dims: synth.Dims, seed: int, hard: synth.HardCases | None = None,
                   options: Options | None = None) -> tuple[str, str]:
    """A synthetic source in root/src and its NVFP4 conversion in root/nvfp4, the module's own
    (not shared: for modules that damage or re-convert them)."""
    src = synthesize(str(root / "src"), dims, seed, hard or synth.HardCases())
    return src, convert(src, str(root / "nvfp4"), "nvfp4", options or Options())


def write_release_headers(dest: str, config: dict | None = None) -> None:
    """Write the release's shards (headers, then holes), index and metadata files into `dest`."""
    fixture = release_fixture.load()
    shards: dict[int, list[TensorSpec]] = {}
    for name, dtype, shape, number in release_fixture.expand(fixture):
        shards.setdefault(number, []).append(TensorSpec(name, dtype, tuple(shape)))
    os.makedirs(dest)
    weight_map = {}
    for number, specs in sorted(shards.items()):
        shard = synth.shard_name(number - 1, fixture["num_shards"])
        ShardWriter(os.path.join(dest, shard), specs).close()   # sized in full, nothing written
        weight_map.update({s.name: shard for s in specs})
    files = {"model.safetensors.index.json": {"metadata": {"total_size": fixture["total_size"]},
                                              "weight_map": weight_map},
             "config.json": {**fixture["config.json"], **(config or {})},
             "inference/config.json": fixture["inference/config.json"],
             "generation_config.json": fixture["generation_config.json"]}
    for rel, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        with open(os.path.join(dest, rel), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)


def _stamps(path: str) -> dict[str, tuple[int, int, int]]:
    """Each file and directory below `path` by (mode, size, mtime): what a write or a rename changes."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            out[os.path.relpath(p, path)] = (st.st_mode, 0 if stat.S_ISDIR(st.st_mode) else st.st_size, st.st_mtime_ns)
    return out


def _set_writable(path: str, writable: bool) -> None:
    if not os.path.isdir(path):
        return
    for root, dirs, files in os.walk(path):
        for p in [root] + [os.path.join(root, n) for n in files]:
            if os.path.islink(p):
                continue
            mode = os.stat(p).st_mode
            os.chmod(p, mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _copy_sparse(src: str, dst: str) -> str:
    """Copy a file's data extents only (SEEK_DATA / SEEK_HOLE), so its holes stay holes."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        for start, end in _data_extents(fin.fileno(), size):
            fin.seek(start)
            fout.seek(start)
            while start < end:
                chunk = fin.read(min(end - start, 64 << 20))
                fout.write(chunk)
                start += len(chunk)
        fout.truncate(size)
    return dst


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    extents, pos = [], 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:   # only a hole from pos to the end
                    break
                raise
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, pos))
    except (OSError, AttributeError):   # no SEEK_DATA on this system or filesystem: all of it is data
        return [(0, size)]
    return extents
