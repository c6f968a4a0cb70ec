"""Hostile and broken checkpoints: each ends in a correct conversion or one clean error line, with
the source untouched and nothing written outside DST. Most cases run in-process through the
CLI's own entry (click's CliRunner), a sample through a real subprocess."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.io.checkpoint import Checkpoint
from tests.helpers.cli import run_cli
from tests.helpers.files import output_tree, tree

DIMS = synth.Dims(layers=2, experts=6, hidden=128, intermediate=128, vocab=64, hash_layers=1)
INDEX = "model.safetensors.index.json"
FUZZ_CASES = 300
SUBPROCESS_SAMPLE = 8


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(source, tree of its clean conversion)."""
    base = tmp_path_factory.mktemp("hostile")
    src = str(base / "src")
    synth.write_checkpoint(src, DIMS, seed=5)
    result = CliRunner().invoke(cli, ["convert", src, str(base / "clean"), "--out", "nvfp4", "--quiet"])
    assert result.exit_code == 0, result.output
    return src, output_tree(str(base / "clean"))


def read_shard(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_raw(path: str, header: bytes, body: bytes) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + body)


def shards(src: str) -> list[str]:
    return sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))


class Case:
    """One damaged copy of the source, set up in `work/src`; DST is `work/out/dst`."""

    def __init__(self, pristine_src: str, work: str):
        self.work = work
        self.src = os.path.join(work, "src")
        shutil.copytree(pristine_src, self.src)
        os.makedirs(os.path.join(work, "out"))
        self.dst = os.path.join(work, "out", "dst")

    def shard(self, i: int) -> str:
        return os.path.join(self.src, shards(self.src)[i % len(shards(self.src))])

    def edit_json(self, name: str, fn) -> None:
        path = os.path.join(self.src, name)
        with open(path) as f:
            obj = json.load(f)
        obj = fn(obj) or obj
        with open(path, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj))

    def edit_header(self, i: int, fn) -> None:
        path = self.shard(i)
        header, body = read_shard(path)
        header = fn(header) or header
        write_raw(path, header if isinstance(header, bytes) else json.dumps(header).encode(), body)


def check_outcome(case: Case, result_code: int, stderr: str, src_before: dict, clean: dict, what: str) -> str:
    """'ok' or 'error'; fails the test on anything else."""
    assert tree(case.src) == src_before, f"{what}: source changed"
    assert set(os.listdir(os.path.join(case.work, "out"))) <= {"dst"}, f"{what}: wrote beside DST"
    assert set(os.listdir(case.work)) - {"outside.safetensors"} == {"src", "out"}, f"{what}: wrote outside DST"
    if result_code == 0:
        with Checkpoint.open(case.dst) as ck:
            assert ck.shard_names, what
        return "ok"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("requant: error:") and result_code in (1, 2), \
        f"{what}: exit {result_code}, stderr {stderr!r}"
    if os.path.exists(case.dst):   # stopped mid-way: finished shards kept, nothing that loads
        assert not os.path.exists(os.path.join(case.dst, INDEX)), what
    return "error"


def run_inprocess(case: Case) -> tuple[int, str]:
    def hang(*_):
        raise TimeoutError("conversion hung")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        result = CliRunner().invoke(cli, ["convert", case.src, case.dst, "--out", "nvfp4", "--quiet"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {result.exception!r}") from result.exception
    return result.exit_code, result.stderr


# --- targeted cases ------------------------------------------------------------------------------

def _escape_index(path_value):
    def fn(case: Case):
        case.edit_json(INDEX, lambda ix: ix["weight_map"].update(
            {next(iter(ix["weight_map"])): path_value}))
    return fn


def _symlink_out(case: Case):
    outside, path = os.path.join(case.work, "outside.safetensors"), case.shard(0)
    shutil.move(path, outside)
    os.symlink(outside, path)


def _ancillary_symlink_out(case: Case):
    os.symlink("/etc", os.path.join(case.src, "inference", "etc"))


def _header_len_past_end(case: Case):
    with open(case.shard(1), "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(case.shard(1))))


def _offsets_past_end(case: Case):
    def fn(h):
        name = [k for k in h if k != "__metadata__"][-1]
        h[name]["data_offsets"][1] += 8
    case.edit_header(1, fn)


def _overlap(case: Case):
    def fn(h):
        a, b = [k for k in h if k != "__metadata__"][:2]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]
    case.edit_header(1, fn)


def _duplicate_key(case: Case):
    def fn(h):
        text = json.dumps(h)
        first = [k for k in h if k != "__metadata__"][0]
        entry = json.dumps({first: h[first]})[1:-1]
        return (text[:-1] + ", " + entry + "}").encode()
    case.edit_header(1, fn)


def _dtype_mismatch(case: Case):
    def fn(h):
        name = next(k for k in h if k != "__metadata__" and h[k]["dtype"] == "BF16")
        h[name]["dtype"] = "F32"
    case.edit_header(1, fn)


def _shape_mismatch(case: Case):
    def fn(h):
        name = next(k for k in h if k.endswith("experts.0.w1.weight"))
        h[name]["shape"] = [h[name]["shape"][1], h[name]["shape"][0]]
    case.edit_header(1, fn)


def _truncated(case: Case):
    with open(case.shard(1), "r+b") as f:
        f.truncate(os.path.getsize(case.shard(1)) - 100)


def _not_json(case: Case):
    case.edit_header(1, lambda h: b"{not json" + b" " * 7)


def _enormous_header(case: Case):
    with open(case.shard(1), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))


def _deep_json(case: Case):
    case.edit_header(1, lambda h: b"[" * 100000 + b"]" * 100000)


def _config_lies_hidden(case: Case):
    case.edit_json("config.json", lambda c: c.update(hidden_size=c["hidden_size"] * 2))


def _config_wrong_type(case: Case):
    case.edit_json("config.json", lambda c: c.update(hidden_size="4096"))


def _config_not_object(case: Case):
    case.edit_json("config.json", lambda c: "[1, 2]")


def _index_not_json(case: Case):
    case.edit_json(INDEX, lambda ix: "{")


def _nan_scale(case: Case):
    path = case.shard(1)
    header, body = read_shard(path)
    name = next(k for k in header if k.endswith("experts.2.w3.scale"))
    start = header[name]["data_offsets"][0]
    body = body[:start] + b"\xff" + body[start + 1:]
    write_raw(path, json.dumps(header).encode(), body)


def _gaps_and_offset(case: Case):
    """Legal safetensors: data not starting at 0, gaps between tensors. Must convert unchanged."""
    for i in range(len(shards(case.src))):
        path = case.shard(i)
        header, body = read_shard(path)
        new_body, new_header = b"\0" * 24, {}
        for name, entry in header.items():
            if name == "__metadata__":
                new_header[name] = entry
                continue
            a, b = entry["data_offsets"]
            new_header[name] = dict(entry, data_offsets=[len(new_body), len(new_body) + b - a])
            new_body += body[a:b] + b"\x5a" * 40
        write_raw(path, json.dumps(new_header).encode(), new_body)


TARGETED = {
    "index-dotdot": (_escape_index("../x.safetensors"), "error"),
    "index-absolute": (_escape_index("/etc/passwd"), "error"),
    "index-subdir": (_escape_index("sub/model.safetensors"), "error"),
    "index-missing-shard": (_escape_index("model-99999-of-99999.safetensors"), "error"),
    "shard-symlink-out": (_symlink_out, "error"),
    "ancillary-symlink-out": (_ancillary_symlink_out, "error"),
    "header-len-past-end": (_header_len_past_end, "error"),
    "offsets-past-end": (_offsets_past_end, "error"),
    "overlap": (_overlap, "error"),
    "duplicate-tensor": (_duplicate_key, "error"),
    "dtype-bytes-mismatch": (_dtype_mismatch, "error"),
    "shape-vs-config": (_shape_mismatch, "error"),
    "truncated": (_truncated, "error"),
    "header-not-json": (_not_json, "error"),
    "header-enormous": (_enormous_header, "error"),
    "header-deeply-nested": (_deep_json, "error"),
    "config-lies-hidden": (_config_lies_hidden, "error"),
    "config-wrong-type": (_config_wrong_type, "error"),
    "config-not-object": (_config_not_object, "error"),
    "index-not-json": (_index_not_json, "error"),
    "nan-scale": (_nan_scale, "error"),
    "gaps-and-offset": (_gaps_and_offset, "ok"),
}


@pytest.mark.parametrize("name", list(TARGETED))
def test_targeted(pristine, tmp_path, name):
    damage, expected = TARGETED[name]
    case = Case(pristine[0], str(tmp_path))
    damage(case)
    before = tree(case.src)
    code, stderr = run_inprocess(case)
    assert check_outcome(case, code, stderr, before, pristine[1], name) == expected, stderr
    if expected == "ok":
        assert output_tree(case.dst) == pristine[1], "a legal layout must convert to the same output"


# --- fuzzing -------------------------------------------------------------------------------------

JUNK = [None, True, -1, 0, 1, 2**63, 2**70, 1.5, "x", "", [], {}, [1], [-1, 2], [2, 1], [0, 2**64], "F32"]


def _mutate_value(rng: random.Random, value):
    if isinstance(value, list) and value and rng.random() < 0.5:
        i = rng.randrange(len(value))
        value = list(value)
        value[i] = rng.choice(JUNK) if rng.random() < 0.5 else (value[i] + rng.choice([-8, -1, 1, 8, 1024])
                                                                if isinstance(value[i], int) else value[i])
        return value
    return rng.choice(JUNK)


def fuzz_case(rng: random.Random, case: Case) -> str:
    """Apply one random mutation; return what it did."""
    kind = rng.choice(["header-field", "header-field", "header-field", "header-entry", "header-bytes",
                       "index", "index", "config", "file-size"])
    i = rng.randrange(len(shards(case.src)))
    if kind == "header-field":
        field = rng.choice(["dtype", "shape", "data_offsets"])

        def fn(h):
            name = rng.choice([k for k in h if k != "__metadata__"])
            h[name][field] = _mutate_value(rng, h[name][field])
        case.edit_header(i, fn)
        return f"shard {i} {field}"
    if kind == "header-entry":
        op = rng.choice(["delete", "rename", "add", "metadata", "not-object"])

        def fn(h):
            names = [k for k in h if k != "__metadata__"]
            name = rng.choice(names)
            if op == "delete":
                del h[name]
            elif op == "rename":
                h[rng.choice(names) + rng.choice(["", "_scale", ".x"])] = h.pop(name)
            elif op == "add":
                h[name + ".extra"] = dict(h[name])
            elif op == "metadata":
                h["__metadata__"] = rng.choice(JUNK)
            else:
                return json.dumps(rng.choice(JUNK)).encode()
        case.edit_header(i, fn)
        return f"shard {i} entry {op}"
    if kind == "header-bytes":
        def fn(h):
            raw = bytearray(json.dumps(h).encode())
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            return bytes(raw)
        case.edit_header(i, fn)
        return f"shard {i} header bytes"
    if kind == "index":
        op = rng.choice(["value", "drop", "add", "weight_map", "metadata"])

        def fn(ix):
            names = list(ix["weight_map"])
            if op == "value":
                ix["weight_map"][rng.choice(names)] = rng.choice(
                    JUNK + ["../a.safetensors", "/tmp/a.safetensors", ".", "model.safetensors",
                            rng.choice(list(ix["weight_map"].values()))])
            elif op == "drop":
                del ix["weight_map"][rng.choice(names)]
            elif op == "add":
                ix["weight_map"]["ghost.tensor"] = rng.choice(list(ix["weight_map"].values()))
            elif op == "weight_map":
                ix["weight_map"] = rng.choice(JUNK)
            else:
                ix["metadata"] = rng.choice(JUNK)
        case.edit_json(INDEX, fn)
        return f"index {op}"
    if kind == "config":
        key = rng.choice(["hidden_size", "moe_intermediate_size", "n_routed_experts", "num_hidden_layers",
                          "model_type", "swiglu_limit", "routed_scaling_factor", "quantization_config",
                          "num_nextn_predict_layers", "expert_dtype"])
        case.edit_json("config.json", lambda c: c.update({key: _mutate_value(rng, c.get(key))}))
        return f"config {key}"
    size = os.path.getsize(case.shard(i))
    with open(case.shard(i), "r+b") as f:
        f.truncate(rng.choice([0, 4, 8, 12, rng.randrange(size), size + rng.randrange(1, 64)]))
    return f"shard {i} size"


def test_fuzz(pristine, tmp_path):
    rng = random.Random(20240611)
    outcomes = {"ok": 0, "error": 0}
    subprocess_cases = set(rng.sample(range(FUZZ_CASES), SUBPROCESS_SAMPLE))
    for n in range(FUZZ_CASES):
        work = str(tmp_path / f"c{n}")
        os.makedirs(work)
        case = Case(pristine[0], work)
        what = f"case {n}: " + fuzz_case(rng, case)
        before = tree(case.src)
        if n in subprocess_cases:
            proc = run_cli("convert", case.src, case.dst, "--out", "nvfp4", "--quiet")
            assert "Traceback" not in proc.stderr, f"{what}: {proc.stderr}"
            code, stderr = proc.returncode, proc.stderr
        else:
            code, stderr = run_inprocess(case)
        outcomes[check_outcome(case, code, stderr, before, pristine[1], what)] += 1
        shutil.rmtree(work)
    print(f"fuzzed {FUZZ_CASES} cases ({SUBPROCESS_SAMPLE} in subprocesses): {outcomes}")
    assert outcomes["error"] > FUZZ_CASES // 2
