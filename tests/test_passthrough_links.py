"""Shards with nothing to convert: a new directory gets them as hard links to the source's files
(a copy with --copy-all, or where no link can be made), so its disk holds only the converted shards
and the metadata; nothing requant does afterwards (in place, a resume) writes through a link into
the source. Measured on a small DeepSeek-V4.1-Flash, whose Engram and vision shards pass through;
the same shards written by another tool (another header layout) are linked as they are."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from safetensors import SafetensorError, safe_open

from requant import synth
from requant.cli import cli
from requant.convert import convert, plan_conversion, space_needed
from requant.convert.outputs import verbatim
from requant.io import fsutil, journal
from requant.io.checkpoint import INDEX_NAME as INDEX
from requant.io.safetensors import encode_header, read_header
from requant.targets import Options
from requant.verify import verify
from tests.helpers.files import output_tree, tree

MODEL = "deepseek-v4.1-flash"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("links") / "src")
    synth.write_checkpoint(path, synth.Dims(MODEL), seed=11)
    return path


@pytest.fixture(scope="module")
def linked(source, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("links") / "out")
    before = fingerprint(source)
    convert(source, dst, "nvfp4", Options(), progress=False)
    assert fingerprint(source) == before
    return dst


def fingerprint(path: str) -> dict[str, tuple]:
    """Every file below `path`: its bytes' hash, inode, size and modification time."""
    hashes = tree(path)
    out = {}
    for name, digest in hashes.items():
        st = os.stat(os.path.join(path, name))
        out[name] = (digest, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def allocated(path: str, besides: str | None = None) -> int:
    """Bytes of disk the files below `path` take (st_blocks), less those of files that are also
    files of `besides` (the same inode, linked): what `path` adds to the disk."""
    shared = {(st.st_dev, st.st_ino) for st in _stats(besides)} if besides else set()
    return sum(st.st_blocks * 512 for st in {(st.st_dev, st.st_ino): st for st in _stats(path)}.values()
               if (st.st_dev, st.st_ino) not in shared)


def _stats(path: str):
    for root, _, files in os.walk(path):
        for name in files:
            yield os.stat(os.path.join(root, name))


def shard_plan(source: str):
    plan = plan_conversion(source, "nvfp4", Options())
    same = [s.name for s in plan.shards if verbatim(s)]
    return plan, same


def test_unchanged_shards_are_linked_and_the_disk_holds_only_the_rest(source, linked):
    plan, same = shard_plan(source)
    converted = [s for s in plan.shards if s.name not in same]
    # the Engram tables and the vision tower pass through, in shards of their own
    names = {s.name: {n for u in s.units for n in u.inputs} for s in plan.shards}
    assert any(any(".engram.embed." in n for n in names[s]) for s in same)
    assert any(any(n.startswith("vision.") for n in names[s]) for s in same)
    assert converted and same
    for name in same:
        assert os.path.samefile(os.path.join(source, name), os.path.join(linked, name)), name
    for shard in converted:
        assert os.stat(os.path.join(linked, shard.name)).st_nlink == 1
    record = json.load(open(os.path.join(linked, "requant.json")))
    assert record["linked_shards"] == same
    card = open(os.path.join(linked, "README.md")).read()
    assert "hard links to the source's files" in card and all(f"`{n}`" in card for n in same)
    assert verify(linked, progress=False)["ok"]

    # what the output adds to the disk: its converted shards and its metadata, nothing of the linked
    added = allocated(linked, besides=source)
    own_files = [os.path.join(r, n) for r, _, fs in os.walk(linked) for n in fs
                 if os.path.relpath(os.path.join(r, n), linked) not in same]
    assert added == sum(os.stat(p).st_blocks * 512 for p in own_files)
    converted_bytes = sum(os.path.getsize(os.path.join(linked, s.name)) for s in converted)
    assert converted_bytes == sum(s.file_size for s in converted)
    metadata_bytes = sum(os.path.getsize(p) for p in own_files) - converted_bytes
    linked_bytes = sum(os.path.getsize(os.path.join(linked, n)) for n in same)
    whole = allocated(linked)
    print(f"\nV4.1 (small): output {whole:,} bytes allocated in all; added to the disk {added:,} = converted "
          f"shards ({len(converted)}) {converted_bytes:,} + metadata {metadata_bytes:,} (apparent sizes); "
          f"linked ({len(same)} shards) {linked_bytes:,}")
    assert whole - added >= linked_bytes // 4096 * 4096   # the linked shards' blocks are the source's


def dry_run(source: str, dst: str, *extra: str) -> str:
    result = CliRunner().invoke(cli, ["convert", source, dst, "--out", "nvfp4", "--dry-run", *extra])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_dry_run_counts_no_disk_for_linked_shards(source, tmp_path):
    plan, same = shard_plan(source)
    rest = sum(s.file_size for s in plan.shards if s.name not in same)
    dst = str(tmp_path / "out")
    d = json.loads(dry_run(source, dst, "--json"))
    assert d["unchanged_shards"]["as"] == "link" and d["unchanged_shards"]["shards"] == same
    assert d["free_bytes_needed"] == rest < plan.output_bytes
    copied = json.loads(dry_run(source, dst, "--json", "--copy-all"))
    assert copied["unchanged_shards"]["as"] == "copy" and copied["free_bytes_needed"] == plan.output_bytes
    text = dry_run(source, dst)
    assert f"unchanged {len(same)} shards" in text and "hard-linked to the source's files" in text
    assert not os.path.exists(tmp_path / "out")
    assert [n for n in os.listdir(tmp_path) if "link-probe" in n] == []


def test_copy_all_and_refused_links_copy_the_same_bytes(source, linked, tmp_path, monkeypatch):
    copied = str(tmp_path / "copied")
    assert CliRunner().invoke(cli, ["convert", source, copied, "--out", "nvfp4", "--copy-all", "-q"]).exit_code == 0
    assert output_tree(copied) == output_tree(linked)
    assert not {st.st_ino for st in _stats(copied)} & {st.st_ino for st in _stats(source)}
    assert json.load(open(os.path.join(copied, "requant.json")))["linked_shards"] == []

    def refused(src, dst, **kw):   # another filesystem
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
    monkeypatch.setattr(os, "link", refused)
    plan = plan_conversion(source, "nvfp4", Options(), dst=str(tmp_path / "x"))
    assert plan.verbatim_as == "copy" and space_needed(plan, False)[0] == plan.output_bytes
    other = str(tmp_path / "other")
    convert(source, other, "nvfp4", Options(), progress=False)
    assert output_tree(other) == output_tree(linked)
    assert not {st.st_ino for st in _stats(other)} & {st.st_ino for st in _stats(source)}


def test_copy_all_is_refused_in_place(source):
    result = CliRunner().invoke(cli, ["convert", source, "--in-place", "--out", "nvfp4", "--copy-all"])
    assert result.exit_code == 2 and "--copy-all" in result.stderr


def _link_farm(source: str, path: str) -> str:
    """A directory whose shards are hard links to `source`'s (as `cp -al` or a requant output)."""
    os.makedirs(path)
    for name in os.listdir(source):
        (os.link if name.endswith(".safetensors") else shutil.copy)(os.path.join(source, name), os.path.join(path, name))
    return path


def test_in_place_conversion_of_linked_shards_leaves_the_source_alone(source, linked, tmp_path):
    before = fingerprint(source)
    # requant's own output holds converted experts, which no format converts again: refused, nothing written
    output_before = fingerprint(linked)
    assert CliRunner().invoke(cli, ["convert", linked, "--in-place", "--out", "nvfp4"]).exit_code == 2
    assert fingerprint(linked) == output_before and fingerprint(source) == before

    # a directory of links to every source shard, converted in place: each converted shard is a new
    # file renamed over its link, never written into the source's
    farm = _link_farm(source, str(tmp_path / "farm"))
    plan, same = shard_plan(farm)
    pending = [s for s in plan.shards if s.name not in same]
    need, _, growth = space_needed(plan, True)
    assert growth == sum(s.file_size for s in pending)   # a shared shard frees nothing when replaced
    convert(farm, None, "nvfp4", Options(), progress=False)
    assert fingerprint(source) == before
    for s in plan.shards:
        shared = os.path.samefile(os.path.join(source, s.name), os.path.join(farm, s.name))
        assert shared == (s.name in same), s.name
    assert output_tree(farm).keys() >= {n for n in output_tree(linked) if n.endswith(".safetensors")}
    for name in (n for n in output_tree(linked) if n.endswith(".safetensors")):
        assert tree(farm)[name] == tree(linked)[name]
    assert verify(farm, progress=False)["ok"]


def test_killed_while_linking_resumes_without_touching_the_source(source, linked, tmp_path):
    """SIGKILL after a shard's link was made under its temporary name, before the rename: the
    resume removes that name (unlinks it) and ends as an uninterrupted run, the source unchanged."""
    before = fingerprint(source)
    dst = str(tmp_path / "out")
    first = sorted(shard_plan(source)[1])[0]
    env = {**os.environ, "REQUANT_TEST_FAULT": "kill@6"}   # 1-4: the journal; 5: shard 1 begins; 6: linked
    killed = subprocess.run([sys.executable, "-m", "requant", "convert", source, dst, "--out", "nvfp4", "-q"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    partial = os.path.join(dst, first + ".partial")
    assert first == "model-00001-of-00014.safetensors" and os.path.samefile(partial, os.path.join(source, first))
    result = CliRunner().invoke(cli, ["convert", source, dst, "--out", "nvfp4", "--resume", "-q"])
    assert result.exit_code == 0, result.output
    assert fingerprint(source) == before
    assert output_tree(dst) == output_tree(linked)
    assert os.path.samefile(os.path.join(dst, first), os.path.join(source, first))


def test_link_or_copy(tmp_path):
    src = tmp_path / "a"
    src.write_bytes(b"x" * 100_000)
    assert fsutil.link_or_copy(str(src), str(tmp_path / "b")) is True
    assert os.path.samefile(src, tmp_path / "b")
    assert fsutil.link_or_copy(str(src), str(tmp_path / "c"), copy=True) is False
    assert (tmp_path / "c").read_bytes() == src.read_bytes() and not os.path.samefile(src, tmp_path / "c")
    with pytest.raises(FileExistsError):   # never onto an existing file: it could be a link
        fsutil.link_or_copy(str(src), str(tmp_path / "c"), copy=True)
    assert fsutil.can_link(str(src), str(tmp_path / "not" / "yet"))


def test_a_symlinked_shard_links_the_file_it_names(tmp_path):
    """A Hugging Face cache snapshot's shards are relative symlinks into blobs/: the link is to the
    blob (link(2) alone would link the symlink, dangling once moved)."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    (tmp_path / "out").mkdir()
    blob = tmp_path / "blobs" / "abc"
    blob.write_bytes(b"y" * 1000)
    os.symlink("../blobs/abc", tmp_path / "snap" / "s.safetensors")
    assert fsutil.link_or_copy(str(tmp_path / "snap" / "s.safetensors"), str(tmp_path / "out" / "s")) is True
    assert not os.path.islink(tmp_path / "out" / "s") and os.path.samefile(blob, tmp_path / "out" / "s")


# Shards of the small V4.1 rewritten as another tool lays them out (foreign_layout), by their
# __metadata__ (None: no such key). Linked as they are: the embedding (first in the plan), the
# vision tower, an Engram table ...
FOREIGN = {"model-00001-of-00014.safetensors": {"producer": "another tool", "format": "pt"},
           "model-00009-of-00014.safetensors": None,
           "model-00013-of-00014.safetensors": {"format": "pt"}}
# ... written anew in requant's layout: three files the reference safetensors parser refuses though
# requant's reader takes them (bytes between tensors; bytes after the last; a __metadata__ value
# that is no string), and two __metadata__ Transformers' load_state_dict refuses (no "format"; empty).
GAPPED, TRAILING, NUMERIC_METADATA = ("model-00014-of-00014.safetensors", "model-00012-of-00014.safetensors",
                                      "model-00008-of-00014.safetensors")
REWRITTEN = {GAPPED: {"format": "pt"}, TRAILING: {"format": "pt"}, NUMERIC_METADATA: {"format": "pt", "step": 3},
             "model-00010-of-00014.safetensors": {"producer": "another tool"},
             "model-00011-of-00014.safetensors": {}}


def _shard_tensors(path: str) -> dict[str, bytes]:
    header = read_header(path)
    with open(path, "rb") as f:
        return {n: os.pread(f.fileno(), i.nbytes, i.start) for n, i in header.tensors.items()}


def foreign_layout(path: str, metadata: dict | None, gap: int = 0, tail: int = 0) -> None:
    """Rewrite safetensors file `path` as another writer might: the data in tensor-name order, the
    keys in reverse name order with their fields in another order, `metadata` last (None: no
    __metadata__), JSON indented, the header padded with spaces so the data starts on a 4096-byte
    boundary; `gap` bytes before each tensor's data, `tail` after the last."""
    header, data = read_header(path), _shard_tensors(path)
    entries, body = {}, bytearray()
    for name in sorted(data):
        body += b"\xee" * gap
        info = header.tensors[name].spec
        entries[name] = {"shape": list(info.shape), "data_offsets": [len(body), len(body) + len(data[name])],
                         "dtype": info.dtype}
        body += data[name]
    entries = {n: entries[n] for n in sorted(entries, reverse=True)}
    if metadata is not None:
        entries["__metadata__"] = metadata
    text = json.dumps(entries, indent=2).encode()
    text += b" " * (-(8 + len(text)) % 4096)
    with open(path + ".new", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + bytes(body) + b"\xee" * tail)
    os.replace(path + ".new", path)


@pytest.fixture(scope="module")
def foreign(source, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("foreign") / "src")
    shutil.copytree(source, path)
    for name, metadata in {**FOREIGN, **REWRITTEN}.items():
        foreign_layout(os.path.join(path, name), metadata, gap=16 if name == GAPPED else 0,
                       tail=8 if name == TRAILING else 0)
    return path


def _opens_in_safetensors(path: str) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            return len(list(f.keys())) > 0
    except SafetensorError:
        return False


def _run(*args: str) -> None:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def foreign_linked(foreign, tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("foreign") / "out")
    before = fingerprint(foreign)
    _run("convert", foreign, dst, "--out", "nvfp4", "-q")
    assert fingerprint(foreign) == before
    return dst


def test_a_foreign_header_layout_is_linked_as_it_is(source, linked, foreign, foreign_linked, tmp_path):
    for name in [*FOREIGN, *REWRITTEN]:
        header = read_header(os.path.join(foreign, name))
        # what bf335bd required (requant's own header bytes) does not hold for any of them
        assert header.raw != encode_header([i.spec for i in header.tensors.values()])[0]
        assert _opens_in_safetensors(header.path) == (name not in (GAPPED, TRAILING, NUMERIC_METADATA)), name

    plan, same = shard_plan(foreign)
    assert set(same) == set(shard_plan(source)[1]) - set(REWRITTEN) and set(FOREIGN) <= set(same)
    d = json.loads(dry_run(foreign, str(tmp_path / "out"), "--json"))
    assert d["unchanged_shards"]["as"] == "link" and d["unchanged_shards"]["shards"] == same
    assert d["free_bytes_needed"] == sum(s.file_size for s in plan.shards if s.name not in same)

    out = foreign_linked
    for name in same:
        assert os.path.samefile(os.path.join(foreign, name), os.path.join(out, name)), name
    assert json.load(open(os.path.join(out, "requant.json")))["linked_shards"] == same
    for name in REWRITTEN:   # written anew in requant's layout ({"format": "pt"}), the same tensors
        written = read_header(os.path.join(out, name))
        assert os.stat(written.path).st_nlink == 1 and written.metadata == {"format": "pt"}
        assert written.raw == encode_header([i.spec for i in written.tensors.values()])[0]
        assert _shard_tensors(written.path) == _shard_tensors(os.path.join(foreign, name))
    # every output shard opens in the reference parser; the rest is what the original source gives
    assert all(_opens_in_safetensors(os.path.join(out, s.name)) for s in plan.shards)
    differ = {*FOREIGN, *REWRITTEN, INDEX}   # the index: its weight map in the shards' order
    assert json.load(open(os.path.join(out, INDEX))) == json.load(open(os.path.join(linked, INDEX)))
    assert ({k: v for k, v in output_tree(out).items() if k not in differ}
            == {k: v for k, v in output_tree(linked).items() if k not in differ})
    result = CliRunner().invoke(cli, ["verify", out])
    assert result.exit_code == 0, result.output


def test_copy_all_copies_a_foreign_layout_byte_for_byte(foreign, foreign_linked, tmp_path):
    before = fingerprint(foreign)
    copied = str(tmp_path / "copied")
    _run("convert", foreign, copied, "--out", "nvfp4", "--copy-all", "-q")
    assert output_tree(copied) == output_tree(foreign_linked)
    for name in FOREIGN:
        assert tree(copied)[name] == tree(foreign)[name]
        assert not os.path.samefile(os.path.join(copied, name), os.path.join(foreign, name))
    assert json.load(open(os.path.join(copied, "requant.json")))["linked_shards"] == []
    assert verify(copied, progress=False)["ok"]
    assert fingerprint(foreign) == before


# Durable steps: 1-4 the journal; 5 the shard begins; 6 placed under its temporary name; 7 checked;
# 8-9 its stats journaled; 10 renamed to its name. A copy has one more (copied, before its fsync).
@pytest.mark.parametrize("how,renamed", [("link", 10), ("copy", 11)])
def test_killed_after_a_foreign_shard_is_placed_resume_keeps_it(foreign, foreign_linked, tmp_path, how, renamed):
    """SIGKILL once the first shard (foreign, linked or copied) has its name, before the journal
    records it: the resume recognises it as finished (its bytes are the source file's, in the
    source's layout) and keeps it; the output ends as an uninterrupted run's."""
    before = fingerprint(foreign)
    dst = str(tmp_path / "out")
    first = next(iter(FOREIGN))
    extra = ["--copy-all"] if how == "copy" else []
    env = {**os.environ, "REQUANT_TEST_FAULT": f"kill@{renamed}"}
    killed = subprocess.run([sys.executable, "-m", "requant", "convert", foreign, dst, "--out", "nvfp4", "-q", *extra],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    placed = os.path.join(dst, first)
    assert not os.path.exists(placed + ".partial") and tree(dst)[first] == tree(foreign)[first]
    assert os.path.samefile(placed, os.path.join(foreign, first)) == (how == "link")
    journal_record = json.load(open(journal.path_of(dst, journal.JOURNAL)))
    assert [s["done"] for s in journal_record["shards"]] == [False] * len(journal_record["shards"])

    resumed = CliRunner().invoke(cli, ["convert", foreign, dst, "--out", "nvfp4", "--resume", "--json", "-q", *extra])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["shards_kept"] == 1   # recognised as finished, not placed again
    assert os.path.samefile(placed, os.path.join(foreign, first)) == (how == "link")
    assert output_tree(dst) == output_tree(foreign_linked)
    linked_now = json.load(open(os.path.join(dst, "requant.json")))["linked_shards"]
    assert linked_now == ([] if extra else shard_plan(foreign)[1])
    assert verify(dst, progress=False)["ok"]
    assert fingerprint(foreign) == before
