"""Disk full, read-only targets, Ctrl-C, a source changed under the conversion, two conversions at
once, short free space, mismatched resumes: each a clean error, nothing corrupted, and (where the
cause is gone) a resume that ends byte-identical to an uninterrupted run."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading

import pytest
from click.testing import CliRunner

from requant import convert as convert_mod
from requant import synth
from requant.cli import cli
from requant.io import fsutil, journal, safetensors
from requant.io.fsutil import DirLock
from tests.helpers.files import direct_writes_supported, output_tree, tree

DIMS = synth.Dims(layers=3, experts=6)
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    src = str(base / "src")
    synth.write_checkpoint(src, DIMS, seed=4)
    assert invoke(src, str(base / "clean")).exit_code == 0
    return src, output_tree(str(base / "clean"))


def invoke(src, dst=None, *extra):
    args = ["convert", src, *([dst] if dst else ["--in-place"]), "--out", "nvfp4", "--quiet", *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("requant: error:"), result.stderr
    return lines[0]


def at_step(monkeypatch, n: int, action) -> None:
    """Run `action()` at the pipeline's Nth durable step (the crash-test hook's numbering)."""
    calls = {"n": 0}

    def hook():
        calls["n"] += 1
        if calls["n"] == n:
            action()
    monkeypatch.setattr(fsutil, "fault_point", hook)


def workdir(tiny, tmp_path, in_place):
    if in_place:
        shutil.copytree(tiny[0], tmp_path / "ip")
        return str(tmp_path / "ip"), None
    return tiny[0], str(tmp_path / "dst")


# Out of place: steps 1-4 write the journal, each shard has 6 (start, middle, fsynced, renamed,
# journal write, journal written), then two per metadata file. 6 = middle of shard 1;
# 43 = halfway through writing config.json; 45 = halfway through the index.
@pytest.mark.parametrize("step", [6, 17, 43, 45])
def test_disk_full_then_resume(tiny, tmp_path, monkeypatch, step):
    src, dst = workdir(tiny, tmp_path, False)
    monkeypatch.setenv("REQUANT_TEST_FAULT", f"enospc@{step}")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    result = invoke(src, dst)
    assert result.exit_code == 1
    line = one_line(result)
    assert "No space left on device" in line and "resume with" in line and "--resume" in line
    assert not os.path.exists(os.path.join(dst, INDEX))
    assert not [n for n in os.listdir(dst) if ".partial" in n or ".tmp-" in n], "temporaries left behind"
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    assert invoke(src, dst, "--resume").exit_code == 0
    assert output_tree(dst) == tiny[1]


def test_disk_full_in_place_then_resume(tiny, tmp_path, monkeypatch):
    src, _ = workdir(tiny, tmp_path, True)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@13")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    result = invoke(src)
    assert result.exit_code == 1 and "No space left" in one_line(result)
    inspect = CliRunner().invoke(cli, ["inspect", src])
    assert inspect.exit_code == 1 and "conversion in progress" in inspect.stderr and "--in-place" in inspect.stderr
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    assert invoke(src, None, "--resume").exit_code == 0
    assert output_tree(src) == tiny[1]


@contextlib.contextmanager
def tmpfs(path: str, size: str):
    """A small tmpfs at `path` for the test's duration (a skip where mounting is not allowed)."""
    os.makedirs(path)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the hook-driven disk-full tests cover the logic")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=False)


@pytest.mark.parametrize("direct", [False, True])
def test_real_disk_full_on_tmpfs(tiny, tmp_path, monkeypatch, direct):
    """A real ENOSPC from the kernel: a filler file takes the space the plan counted on, at the
    start of shard 2; or (direct) just as the first expert's outputs go out through the direct
    writes that a full-size model's experts take (tmpfs accepts O_DIRECT)."""
    mnt = str(tmp_path / "mnt")
    with tmpfs(mnt, "8m"):
        dst, filler = os.path.join(mnt, "dst"), os.path.join(mnt, "filler")
        lock = threading.Lock()

        def fill():
            with lock:
                if os.path.exists(filler):
                    return
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                            f.flush()
                    except OSError:
                        pass
        if direct:
            if not direct_writes_supported(mnt):
                pytest.skip("this kernel's tmpfs refuses O_DIRECT")
            monkeypatch.setattr(safetensors, "DIRECT_MIN_BYTES", 0)
            write_staged = safetensors._write_staged

            def fill_then_write(*args):
                fill()
                return write_staged(*args)
            monkeypatch.setattr(safetensors, "_write_staged", fill_then_write)
        else:
            at_step(monkeypatch, 11, fill)   # start of shard 2
        result = invoke(tiny[0], dst)
        assert result.exit_code == 1 and "No space left on device" in one_line(result)
        assert not os.path.exists(os.path.join(dst, INDEX))
        os.remove(filler)
        monkeypatch.undo()
        assert invoke(tiny[0], dst, "--resume").exit_code == 0
        assert output_tree(dst) == tiny[1]


def test_read_only_destination(tiny, tmp_path):
    mnt = str(tmp_path / "ro")
    with tmpfs(mnt, "1m"):
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        result = invoke(tiny[0], os.path.join(mnt, "dst"))
        assert result.exit_code == 1 and "Read-only file system" in one_line(result)
        assert os.listdir(mnt) == []


def test_read_only_in_place(tiny, tmp_path):
    mnt = str(tmp_path / "ro")
    with tmpfs(mnt, "16m"):
        shutil.copytree(tiny[0], os.path.join(mnt, "ck"))
        before = tree(mnt)
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        result = invoke(os.path.join(mnt, "ck"))
        assert result.exit_code == 1 and "Read-only file system" in one_line(result)
        assert tree(mnt) == before


def test_interrupt_stops_cleanly_and_resumes(tiny, tmp_path, monkeypatch):
    src, dst = workdir(tiny, tmp_path, False)

    def ctrl_c():
        raise KeyboardInterrupt
    at_step(monkeypatch, 12, ctrl_c)   # middle of shard 2
    result = invoke(src, dst, "--workers", "2")
    assert result.exit_code == 130
    line = one_line(result)
    assert "interrupted" in line and f"requant convert {src} {dst} --out nvfp4 --workers 2 --resume" in line
    monkeypatch.undo()
    assert invoke(src, dst, "--workers", "2", "--resume").exit_code == 0
    assert output_tree(dst) == tiny[1]


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_source_modified_during_conversion(tiny, tmp_path, monkeypatch, in_place):
    shutil.copytree(tiny[0], tmp_path / "src")   # this test damages its source
    src, dst = str(tmp_path / "src"), None if in_place else str(tmp_path / "dst")
    shard = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[1]

    def modify():   # someone rewrites the shard being read
        with open(os.path.join(src, shard), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
    at_step(monkeypatch, 12 if not in_place else 6, modify)
    result = invoke(src, dst)
    assert result.exit_code == 1 and "was modified since the conversion began" in one_line(result)
    monkeypatch.undo()
    again = invoke(src, dst, "--resume")
    assert again.exit_code == 1 and "changed since the conversion began" in one_line(again) \
        or "matches neither" in one_line(again)


def test_second_conversion_is_refused(tiny, tmp_path):
    src, dst = workdir(tiny, tmp_path, False)
    os.makedirs(dst)
    lock = DirLock(dst, exclusive=True, what="test")
    try:
        result = invoke(src, dst)
        assert result.exit_code == 1 and "in use by another requant process" in one_line(result)
        inplace = DirLock(src, exclusive=False, what="test")   # an out-of-place run reads src...
        try:   # ...so converting src in place at the same time is refused
            assert "in use" in one_line(invoke(src))
        finally:
            inplace.release()
    finally:
        lock.release()
    assert invoke(src, dst).exit_code == 0


def test_refusals_that_protect_the_journal(tiny, tmp_path, monkeypatch):
    src, dst = workdir(tiny, tmp_path, False)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@20")
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    assert invoke(src, dst).exit_code == 1
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    assert "unfinished conversion" in one_line(invoke(src, dst))            # no --resume
    line = one_line(invoke(src, dst, "--resume", "--mtp", "convert"))
    assert "(--mtp default then, convert now)" in line and "{" not in line, line
    assert "mode" in one_line(invoke(dst, None, "--resume"))                # not an in-place journal
    assert journal.exists(dst)
    assert invoke(src, dst, "--resume").exit_code == 0 and output_tree(dst) == tiny[1]


def test_not_enough_space_is_refused_with_numbers(tiny, tmp_path, monkeypatch):
    src, dst = workdir(tiny, tmp_path, True)
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 1000)
    line = one_line(invoke(src))
    assert "not enough free space" in line and "1,000 available" in line and "largest output shard" in line
    assert tree(src) == tree(tiny[0])
    line = one_line(invoke(tiny[0], str(tmp_path / "o")))
    assert "not enough free space" in line and not os.path.exists(tmp_path / "o")


def test_in_place_peak_is_one_shard_plus_growth(tiny, tmp_path):
    plan = convert_mod.plan_conversion(tiny[0], "nvfp4", convert_mod.Options())
    need, largest, growth = convert_mod.space_needed(plan, in_place=True)
    assert largest <= need <= largest + max(growth, 0) and need < plan.output_bytes / 2
    plan.source.close()


def test_in_place_refuses_symlinked_shards(tiny, tmp_path):
    src, _ = workdir(tiny, tmp_path, True)
    shard = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0]
    os.rename(os.path.join(src, shard), os.path.join(src, ".blob"))
    os.symlink(".blob", os.path.join(src, shard))
    assert "symbolic link" in one_line(invoke(src))


# -- a damaged source: resuming would read the same bytes again ------------------------------------

def expert_shards(ck: str) -> list[str]:
    return [n for n in sorted(os.listdir(ck)) if n.endswith(".safetensors")
            and any(".experts." in t and i.spec.dtype == "F8_E8M0"
                    for t, i in safetensors.read_header(os.path.join(ck, n)).tensors.items())]


def plant_nan(ck: str, shard: str) -> tuple[str, str, int]:
    """A NaN E8M0 byte (0xFF) in the third expert's w3 scale of `shard`: (file, tensor, byte offset)."""
    path = os.path.join(ck, shard)
    tensor, info = [(n, i) for n, i in safetensors.read_header(path).tensors.items()
                    if i.spec.dtype == "F8_E8M0" and ".experts." in n][7]
    offset = info.start + 5
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff")
    return path, tensor, offset


def run(src, dst, out, *extra):
    args = ["convert", src, *([dst] if dst else ["--in-place"]), "--out", out, "--quiet",
            *(["--device", "cpu", "--workers", "2"] if out == "w4a16" else []), *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_damaged_source_with_nothing_converted_leaves_nothing(tiny, tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(tiny[0], src)
    path, tensor, offset = plant_nan(src, expert_shards(src)[0])
    for extra in ((), ("--resume",)):   # a --resume finds nothing to resume and says the same
        line = one_line(run(src, dst, "nvfp4", *extra))
        assert f"the source is damaged: file {path}, tensor {tensor}, byte offset {offset:,}: E8M0 scale is NaN" in line
        assert "nothing was kept" in line and f"requant verify {src}" in line and "--resume" not in line, line
        assert not os.path.exists(dst)


@pytest.mark.parametrize("out,in_place", [("nvfp4", False), ("w4a16", False), ("nvfp4", True)],
                         ids=["nvfp4", "w4a16-processes", "nvfp4-in-place"])
def test_damaged_source_is_not_resumed_until_replaced(tiny, tmp_path, out, in_place):
    src = str(tmp_path / "src")
    shutil.copytree(tiny[0], src)
    dst = None if in_place else str(tmp_path / "dst")
    target = dst or src
    shard = expert_shards(src)[-1]
    good = os.path.join(tmp_path, "good.safetensors")
    shutil.copyfile(os.path.join(src, shard), good)
    path, tensor, offset = plant_nan(src, shard)

    line = one_line(run(src, dst, out))
    assert f"the source is damaged: file {path}, tensor {tensor}, byte offset {offset:,}: E8M0 scale is NaN" in line
    assert f"resuming will not help until {path} is replaced: re-download that shard" in line, line
    assert ("valid and kept" in line) == in_place, line
    assert journal.load(target)[0]["damaged"]["offset"] == offset
    before = tree(target)
    again = one_line(run(src, dst, out, "--resume"))   # the same bytes: refused, nothing touched
    assert "cannot resume: the source is damaged and has not changed since" in again and f"file {path}" in again
    assert tree(target) == before
    assert "damaged source" in one_line(CliRunner().invoke(cli, ["inspect", target]))

    shutil.copyfile(good, path)   # re-downloaded: the same bytes as the release, a new mtime
    assert run(src, dst, out, "--resume").exit_code == 0
    clean = tiny[1]
    if out != "nvfp4":
        assert run(tiny[0], str(tmp_path / "clean"), out).exit_code == 0
        clean = output_tree(str(tmp_path / "clean"))
    assert output_tree(target) == clean


def test_a_replacement_of_another_revision_is_refused(tiny, tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(tiny[0], src)
    shard = expert_shards(src)[-1]
    path, _, _ = plant_nan(src, shard)
    assert run(src, dst, "nvfp4").exit_code == 1
    with open(path, "ab") as f:   # not the shard the conversion began with
        f.write(b"\0")
    line = one_line(run(src, dst, "nvfp4", "--resume"))
    assert "differs in size or header" in line and journal.load(dst)[0].get("damaged"), line
