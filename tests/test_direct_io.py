"""Direct writes (O_DIRECT): the whole pages of a large output stretch go from a staging copy to the
disk, past the page cache. The file must read back byte for byte as through the cache: at any
offsets, with neighbouring stretches written at once by other threads (they share the partial pages
at the ends), and where the platform or the file system refuses O_DIRECT."""

from __future__ import annotations

import errno
import fcntl
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from requant import synth
from requant.convert import convert
from requant.io import safetensors as st
from requant.targets import Options
from tests.helpers.files import direct_writes_supported, output_tree

PAGE = st.PAGE


def layout(seed: int) -> tuple[list[list[tuple[st.TensorSpec, torch.Tensor, int]]], bytes]:
    """Stretches of tensors packed back to back from an odd offset: sizes from a few bytes to many
    pages, so stretches start and end mid-page, inside one page, and on page boundaries."""
    rng = np.random.default_rng(seed)
    sizes = [[3, 4], [PAGE - 7], [5 * PAGE + 1, 4, 4], [PAGE], [2 * PAGE, 4096 * 3 + 17], [1], [9 * PAGE - 5, 6]]
    offset, stretches, image = 1234, [], bytearray(1234)
    for k, stretch in enumerate(sizes):
        items = []
        for j, n in enumerate(stretch):
            data = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
            items.append((st.TensorSpec(f"s{k}.t{j}", "U8", (n,)), data, offset))
            image += data.numpy().tobytes()
            offset += n
        stretches.append(items)
    return stretches, bytes(image)


def page_aligned(nbytes: int) -> torch.Tensor:
    """A staging buffer as a worker's would be: longer than asked, holding an earlier unit's bytes."""
    whole = torch.full((nbytes + 3 * PAGE,), 0xA5, dtype=torch.uint8)
    start = -whole.data_ptr() % PAGE
    return whole[start:]


def write_all(path: str, stretches, direct: bool, order: str = "threads") -> None:
    """Stretches in file order, in reverse, or each by its own thread as conversion workers write
    experts: a direct write that strayed into a shared page clobbers its neighbour in one order."""
    with open(path, "wb") as f:
        f.truncate(sum(spec.nbytes for items in stretches for spec, _, _ in items) + 1234)

    def write(items):
        fd = os.open(path, os.O_WRONLY)
        dfd = st.open_direct(path) if direct else None
        try:
            st.write_tensors(fd, items, dfd, page_aligned)
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)
    if order == "threads":
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(write, stretches))
    else:
        for items in stretches if order == "forward" else stretches[::-1]:
            write(items)


@pytest.fixture
def spy(monkeypatch):
    """Bytes written through O_DIRECT descriptors (by _pwrite_all, which direct writes go through)."""
    seen = {"direct": 0}
    pwrite = st._pwrite_all

    def recording(fd, data, offset):
        if getattr(os, "O_DIRECT", 0) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen["direct"] += len(memoryview(data))
        return pwrite(fd, data, offset)
    monkeypatch.setattr(st, "_pwrite_all", recording)
    return seen


@pytest.mark.parametrize("order", ["forward", "reverse", "threads"])
def test_direct_writes_read_back_as_buffered(tmp_path, monkeypatch, spy, order):
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)   # every stretch staged, even sub-page ones
    stretches, image = layout(len(order))
    write_all(str(tmp_path / "direct"), stretches, direct=True, order=order)
    write_all(str(tmp_path / "cached"), stretches, direct=False)
    assert (tmp_path / "direct").read_bytes() == image
    assert (tmp_path / "cached").read_bytes() == image
    if not direct_writes_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT: only the fallback ran")
    assert spy["direct"] >= 5 * PAGE, "the whole pages did not go through the O_DIRECT descriptor"


def test_without_o_direct_everything_goes_through_the_cache(tmp_path, monkeypatch, spy):
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    monkeypatch.delattr(os, "O_DIRECT", raising=False)   # macOS, Windows
    stretches, image = layout(2)
    path = str(tmp_path / "f")
    assert st.open_direct(path) is None
    write_all(path, stretches, direct=True)
    assert (tmp_path / "f").read_bytes() == image and not spy["direct"]


def refuse_fd_minus_2(monkeypatch, owner, name: str) -> list[int]:
    """owner.name(fd, data, offset) raising EINVAL for descriptor -2, as a file system that opens
    O_DIRECT but rejects the transfer does; -> the offsets refused."""
    original, refused = getattr(owner, name), []

    def refusing(fd, data, offset):
        if fd == -2:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return original(fd, data, offset)
    monkeypatch.setattr(owner, name, refusing)
    return refused


def test_refused_alignment_falls_back_to_the_cache(tmp_path, monkeypatch):
    """A file system that opens O_DIRECT but rejects the writes (EINVAL): same bytes, buffered."""
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    refused = refuse_fd_minus_2(monkeypatch, st, "_pwrite_all")
    stretches, image = layout(3)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.truncate(len(image))
    fd = os.open(path, os.O_WRONLY)
    try:
        for items in stretches:
            st.write_tensors(fd, items, -2, page_aligned)
    finally:
        os.close(fd)
    assert refused and (tmp_path / "f").read_bytes() == image


def test_conversion_with_direct_writes_is_byte_identical(tmp_path, monkeypatch, spy):
    src = str(tmp_path / "src")
    synth.write_checkpoint(src, synth.Dims(layers=2, experts=6), seed=5)
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 1 << 62)
    convert(src, str(tmp_path / "cached"), "nvfp4", Options(), progress=False, workers=2)
    assert not spy["direct"]
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    convert(src, str(tmp_path / "direct"), "nvfp4", Options(), progress=False, workers=2)
    assert output_tree(str(tmp_path / "direct")) == output_tree(str(tmp_path / "cached"))
    if not direct_writes_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT: only the fallback ran")
    assert spy["direct"]


# Direct reads -------------------------------------------------------------------------------

def tensor_file(path: str) -> list[tuple[st.TensorInfo, np.ndarray]]:
    """Tensors of several dtypes at offsets on and off page boundaries, the last one ending the
    file mid-page; -> (info, expected element values)."""
    rng = np.random.default_rng(7)
    layout_ = [("U8", np.uint8, 3 * PAGE + 5, 1000), ("I32", np.int32, 2 * PAGE, 4 * PAGE + 8),
               ("BF16", np.int16, 5 * PAGE + 3, 13 * PAGE - 8), ("U8", np.uint8, 17, 24 * PAGE + 1),
               ("I32", np.int32, PAGE - 4, 25 * PAGE + 3)]   # last: off an element boundary (buffered)
    image, found = bytearray(), []
    for k, (dtype, np_type, count, start) in enumerate(layout_):
        assert start >= len(image)
        image += bytes(start - len(image))
        values = rng.integers(0, 2**15, count).astype(np_type)
        image += values.tobytes()
        spec = st.TensorSpec(f"t{k}", dtype, (count,))
        found.append((st.TensorInfo(spec, start, start + values.nbytes), values))
    with open(path, "wb") as f:
        f.write(image)
    return found


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.fixture
def read_spy(monkeypatch):
    """Bytes read through O_DIRECT descriptors."""
    seen = {"direct": 0}
    preadv = os.preadv

    def recording(fd, buffers, offset):
        n = preadv(fd, buffers, offset)
        if getattr(os, "O_DIRECT", 0) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen["direct"] += n
        return n
    monkeypatch.setattr(os, "preadv", recording)
    return seen


@pytest.mark.parametrize("into", ["fresh", "reused"])
def test_direct_reads_match_buffered(tmp_path, monkeypatch, read_spy, into):
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    path = str(tmp_path / "f")
    tensors = tensor_file(path)
    fd, direct = os.open(path, os.O_RDONLY), st.open_direct(path, os.O_RDONLY)
    try:
        for info, values in tensors:
            # a reused buffer, as a worker's, misaligned on purpose and holding older bytes
            out = None if into == "fresh" else torch.full((st.read_buffer_bytes(info) + 64,), 0xA5,
                                                          dtype=torch.uint8)[64 - 8:]
            got = st.read_tensor(fd, info, path, out=out, direct=direct)
            assert got.dtype == st.DTYPES[info.spec.dtype][1] and tuple(got.shape) == info.spec.shape
            assert np.array_equal(as_numpy(got), values), info.spec.name
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)
    if not direct_writes_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT: only the buffered reads ran")
    assert read_spy["direct"] >= 10 * PAGE, "the tensors were not read through the O_DIRECT descriptor"


def test_direct_read_of_a_truncated_file_names_file_and_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    path = str(tmp_path / "f")
    info, _ = tensor_file(path)[2]
    os.truncate(path, info.start + 2 * PAGE + 100)   # mid-tensor, mid-page
    if not direct_writes_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    fd, direct = os.open(path, os.O_RDONLY), st.open_direct(path, os.O_RDONLY)
    try:
        with pytest.raises(st.CheckpointError) as e:
            st.read_tensor(fd, info, path, direct=direct)
    finally:
        os.close(fd)
        os.close(direct)
    assert "unexpected end of file" in str(e.value) and path in str(e.value) and "t2" in str(e.value)


def test_refused_direct_read_falls_back_to_the_cache(tmp_path, monkeypatch):
    """A file system that opens O_DIRECT but rejects the reads (EINVAL): the same values, buffered."""
    monkeypatch.setattr(st, "DIRECT_MIN_BYTES", 0)
    refused = refuse_fd_minus_2(monkeypatch, os, "preadv")
    path = str(tmp_path / "f")
    tensors = tensor_file(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for info, values in tensors:
            assert np.array_equal(as_numpy(st.read_tensor(fd, info, path, direct=-2)), values)
    finally:
        os.close(fd)
    assert len(refused) == len(tensors) - 1   # the one off an element boundary is never tried direct
