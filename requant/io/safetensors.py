"""safetensors files read and written without loading whole files.

Reading parses and validates the header only; tensor bytes are fetched with pread on demand.
Writing lays out the header from a list of tensor specs first, so each tensor's place in the file
is known before any data exists and tensors can be written in any order, by any thread. Large
stretches can bypass the page cache (O_DIRECT, Linux): see write_tensors.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from requant.errors import CheckpointError

# safetensors dtype name -> (bytes per element, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
    "F8_E8M0": (1, torch.float8_e8m0fnu),
    "I16": (2, torch.int16),
    "U16": (2, torch.uint16),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, torch.uint32),
    "F32": (4, torch.float32),
    "I64": (8, torch.int64),
    "U64": (8, torch.uint64),
    "F64": (8, torch.float64),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference safetensors parser enforces
ALIGNMENT = 8
PAGE = 4096                   # direct writes cover whole pages: none is shared with a buffered write
DIRECT_MIN_BYTES = 1 << 20    # smaller stretches go through the page cache (a direct write waits for the disk)
COPY_CHUNK = 64 << 20        # a pass-through copy's piece: its memory when copied by hand


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, safetensors dtype and shape: all a header needs to place it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype][0] * math.prod(self.shape)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor inside a file: its spec and absolute byte range [start, end)."""

    spec: TensorSpec
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Header:
    path: str
    tensors: dict[str, TensorInfo]   # in file-offset order
    metadata: dict[str, str]
    data_start: int
    file_size: int
    raw: bytes = b""                 # the header bytes as stored, length prefix included


def read_header(path: str) -> Header:
    """Parse and validate a safetensors header; raise CheckpointError naming file and tensor."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = read_header_bytes(f, size, path)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror}", file=path) from None
    return parse_header(raw, size, path)


def read_header_bytes(f, size: int, path: str) -> bytes:
    """The length prefix and JSON of a safetensors file, checked against the file's size."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointError("file is shorter than a safetensors header", file=path)
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit", file=path)
    if 8 + header_len > size:
        raise CheckpointError(f"header length {header_len} runs past the end of the file ({size} bytes): truncated?", file=path)
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise CheckpointError("file shrank while its header was read", file=path)
    return prefix + raw


def parse_header(raw: bytes, size: int, path: str) -> Header:
    """Validate header bytes (length prefix included) of a file of `size` bytes.

    Gaps between tensors and a first tensor past offset 0 are legal safetensors; overlaps are not.
    """
    data_start = len(raw)
    try:
        entries = json.loads(raw[8:], object_pairs_hook=_reject_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"header is not valid JSON ({str(e).splitlines()[0]})", file=path) from None
    if not isinstance(entries, dict):
        raise CheckpointError("header is not a JSON object", file=path)
    metadata = entries.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError("__metadata__ is not an object", file=path)
    infos = [_parse_entry(path, name, entry, data_start, size) for name, entry in entries.items()]
    infos.sort(key=lambda i: (i.start, i.end))
    for prev, cur in zip(infos, infos[1:]):
        if cur.start < prev.end:
            raise CheckpointError(f"byte range overlaps tensor {prev.spec.name}", file=path, tensor=cur.spec.name)
    return Header(path=path, tensors={i.spec.name: i for i in infos}, metadata=metadata,
                  data_start=data_start, file_size=size, raw=raw)


def _reject_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _parse_entry(path, name, entry, data_start, size) -> TensorInfo:
    def bad(msg):
        return CheckpointError(msg, file=path, tensor=name)

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise bad(f"invalid data_offsets {offsets!r}")
    begin, end = offsets
    spec = TensorSpec(name, dtype, tuple(shape))
    if not 0 <= begin <= end:
        raise bad(f"invalid data_offsets {offsets}")
    if end - begin != spec.nbytes:
        raise bad(f"{end - begin} bytes stored but dtype {dtype} and shape {list(shape)} need {spec.nbytes}")
    if data_start + end > size:
        raise bad(f"data ends at byte {data_start + end}, past the end of the file ({size} bytes): truncated?")
    return TensorInfo(spec, data_start + begin, data_start + end)


def read_buffer_bytes(info: TensorInfo) -> int:
    """The bytes of an `out` buffer that read_tensor can read `info` into either way: the tensor
    and, for a direct read, the partial pages around it and the room to align them."""
    return info.nbytes + 3 * PAGE


def read_tensor(fd: int, info: TensorInfo, path: str = "?", out: torch.Tensor | None = None,
                direct: int | None = None) -> torch.Tensor:
    """Read one tensor's bytes with pread and return it in its stored dtype, in `out` (uint8, at
    least read_buffer_bytes, aligned for the dtype) when given: a reused buffer costs no page faults.

    With `direct` (the same file from open_direct(path, os.O_RDONLY)), a tensor of DIRECT_MIN_BYTES
    or more is read past the page cache: its whole pages go from the disk into the buffer. Cold, a
    3.6 GB shard read so took this machine's kernel 0.2 s of CPU time against 3.1 s through the
    cache (its copy and page bookkeeping), and less wall time (benchmarks/results/2026-12-01-2vcpu-convert.json)."""
    if direct is not None and info.nbytes >= DIRECT_MIN_BYTES:
        tensor = _read_direct(direct, info, path, out)
        if tensor is not None:
            return tensor
    buf = torch.empty(info.nbytes, dtype=torch.uint8) if out is None else out[: info.nbytes]
    view = memoryview(buf.numpy())
    done = 0
    while done < info.nbytes:
        n = os.preadv(fd, [view[done:]], info.start + done)
        if n <= 0:
            raise CheckpointError("unexpected end of file while reading tensor data", file=path, tensor=info.spec.name)
        done += n
    return buf.view(DTYPES[info.spec.dtype][1]).reshape(info.spec.shape)


def encode_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """Header bytes (length prefix included) and each tensor's offset from the file start.

    Data follows in the order of `specs`; the JSON is padded with spaces to 8-byte alignment.
    """
    entries: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    relative = {}
    for spec in specs:
        if spec.name in relative:
            raise ValueError(f"duplicate tensor {spec.name}")
        entries[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                              "data_offsets": [offset, offset + spec.nbytes]}
        relative[spec.name] = offset
        offset += spec.nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % ALIGNMENT)
    start = 8 + len(body)
    return struct.pack("<Q", len(body)) + body, {name: start + off for name, off in relative.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (any dtype), without a copy when it is contiguous."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class ShardWriter:
    """Writes one safetensors file whose layout is fixed up front by its tensor specs.

    The file is created at `path` (the caller picks a temporary name) and sized in full; tensors
    are then written at their offsets, in any order. `close()` fsyncs; renaming is the caller's.
    """

    def __init__(self, path: str, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = path
        self.specs = {s.name: s for s in specs}
        header, self.offsets = encode_header(specs, metadata)
        self.size = len(header) + sum(s.nbytes for s in specs)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, self.size)
            _pwrite_all(self.fd, header, 0)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, name: str, data) -> None:
        """Write a tensor (torch tensor or bytes-like) at its planned offset."""
        write_tensors(self.fd, [(self.specs[name], data, self.offsets[name])])

    def copy_from(self, name: str, src_fd: int, src_offset: int,
                  progress: Callable[[int], object] | None = None) -> None:
        """Copy a tensor's bytes from another file inside the kernel (no trip through Python), in
        pieces of at most COPY_CHUNK bytes: a tensor of any size (a 100 GB embedding table) costs
        no more memory than a small one. `progress(n)` after each piece."""
        remaining = self.specs[name].nbytes
        src, dst = src_offset, self.offsets[name]
        while remaining:
            step = min(remaining, COPY_CHUNK)
            try:
                n = os.copy_file_range(src_fd, self.fd, step, src, dst)
            except OSError:
                n = 0
            if n <= 0:  # unsupported across these filesystems, or a short source: copy by hand
                chunk = os.pread(src_fd, step, src)
                if not chunk:
                    raise CheckpointError("unexpected end of file while copying", tensor=name)
                n = _pwrite_all(self.fd, chunk, dst)
            src, dst, remaining = src + n, dst + n, remaining - n
            if progress is not None:
                progress(n)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Close without syncing; a no-op after close()."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_tensors(fd: int, items: list[tuple[TensorSpec, object, int]], direct: int | None = None,
                  staging: Callable[[int], torch.Tensor] | None = None) -> None:
    """Write (spec, tensor or bytes-like, offset) items into open file `fd`; tensors that follow
    each other in the file go out in one pwritev.

    With `direct` (the same file from open_direct) and `staging` (staging(n): a reused page-aligned
    uint8 buffer of at least n bytes), a stretch of DIRECT_MIN_BYTES or more is copied into the
    buffer and its whole pages go straight to the disk. Writing through the page cache costs this
    machine several times the CPU of that copy (benchmarks/results/2026-12-01-2vcpu-convert.json); the partial
    pages at the stretch's ends, which neighbouring writes share, still go through the cache.
    """
    runs: list[tuple[int, list[memoryview]]] = []   # (offset, buffers) of contiguous stretches
    end = None
    for spec, data, offset in sorted(items, key=lambda item: item[2]):
        raw = tensor_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data)
        if raw.nbytes != spec.nbytes:
            raise ValueError(f"{spec.name}: {raw.nbytes} bytes given, {spec.nbytes} planned")
        if offset != end or len(runs[-1][1]) >= _IOV_MAX:
            runs.append((offset, []))
        runs[-1][1].append(raw.cast("B"))
        end = offset + spec.nbytes
    for offset, buffers in runs:
        if direct is not None and staging is not None and sum(map(len, buffers)) >= DIRECT_MIN_BYTES:
            _write_staged(fd, direct, staging, buffers, offset)
        else:
            _pwritev_all(fd, buffers, offset)


def _read_direct(direct: int, info: TensorInfo, path: str, out: torch.Tensor | None) -> torch.Tensor | None:
    """read_tensor through an O_DIRECT descriptor: the whole pages around the tensor, into a
    page-aligned stretch of `out` (or a fresh buffer). None where this cannot be done (the tensor
    not on an element boundary, a file system that refuses the alignment): read it buffered then."""
    size, dtype = DTYPES[info.spec.dtype]
    lead = info.start % PAGE
    if lead % size:
        return None
    first, need = info.start - lead, lead + info.nbytes
    span = -(-need // PAGE) * PAGE
    buf = torch.empty(span + PAGE, dtype=torch.uint8) if out is None else out
    base = -buf.data_ptr() % PAGE
    if buf.numel() < base + span:
        return None
    view = memoryview(buf[base: base + span].numpy())
    done = 0
    while done < need:
        try:
            n = os.preadv(direct, [view[done:]], first + done)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return None
            raise
        done += n
        if n <= 0 or (n % PAGE and done < need):   # a short read ends the file: it is truncated
            raise CheckpointError("unexpected end of file while reading tensor data", file=path, tensor=info.spec.name)
    return buf[base + lead: base + need].view(dtype).reshape(info.spec.shape)


def open_direct(path: str, mode: int = os.O_WRONLY) -> int | None:
    """`path` opened with O_DIRECT (DMA between user memory and the disk, no page cache) for
    writing, or for reading with mode os.O_RDONLY; None where the platform (macOS, Windows) or the
    file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, mode | flag)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise


def _write_staged(fd: int, direct: int, staging: Callable[[int], torch.Tensor], buffers: list[memoryview],
                  offset: int) -> None:
    """One contiguous stretch: copied to a page-aligned buffer laid out as the file is (the stretch
    starts at its offset's place within a page), whole pages written direct, ends buffered."""
    lead = offset % PAGE
    size = sum(map(len, buffers))
    stage = staging(lead + size).numpy()
    pos = lead
    for b in buffers:
        stage[pos: pos + len(b)] = np.frombuffer(b, dtype=np.uint8)
        pos += len(b)
    view = memoryview(stage)
    first = -(-offset // PAGE) * PAGE
    last = max(first, (offset + size) // PAGE * PAGE)   # [first, last): whole pages
    base = offset - lead
    if first > offset:
        _pwrite_all(fd, view[lead: min(first, offset + size) - base], offset)
    if last > first:
        try:
            _pwrite_all(direct, view[first - base: last - base], first)
        except OSError as e:   # a file system that opens O_DIRECT but wants other alignments
            if e.errno != errno.EINVAL:
                raise
            _pwrite_all(fd, view[first - base: last - base], first)
    if offset + size > last:
        _pwrite_all(fd, view[last - base: lead + size], last)


_IOV_MAX = 1024   # buffers per pwritev (Linux's limit)


def _pwritev_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    buffers = [b for b in buffers if len(b)]
    while buffers:
        n = os.pwritev(fd, buffers, offset)
        offset += n
        while buffers and n >= len(buffers[0]):   # drop what went out; resume a partial buffer
            n -= len(buffers[0])
            buffers.pop(0)
        if n:
            buffers[0] = buffers[0][n:]


def _pwrite_all(fd: int, data, offset: int) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def save_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a small safetensors file in one go (synthetic checkpoints, tests)."""
    specs = [TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    writer = ShardWriter(path, specs, metadata)
    try:
        for name, t in tensors.items():
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    writer.close()


_TORCH_TO_NAME = {dtype: name for name, (_, dtype) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _TORCH_TO_NAME[dtype]

