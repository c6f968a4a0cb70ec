"""Hub sources through the real huggingface_hub client, against a local server on 127.0.0.1 that
answers the way the Hub does: /api/models/{repo}/revision/{rev} for the file list and commit,
/{repo}/resolve/{rev}/{file} with ETag (sha256), X-Repo-Commit, Content-Length and Range."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.io import hub as hub_lib
from tests.conftest import output_tree, tree

DIMS = synth.Dims(layers=3, experts=6)
REPO = "deepseek-ai/Tiny-V4"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(ThreadingHTTPServer):
    def __init__(self, root: str):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files = {}
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    self.files[os.path.relpath(path, root)] = f.read()
        self.break_once: set[str] = set()   # the next full GET of these stops halfway
        self.fail: set[str] = set()         # whole-file GETs of these answer 500
        self.corrupt: set[str] = set()      # whole-file GETs of these flip a byte
        self.gets: list[str] = []           # whole-file GETs (not header range requests)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head=False):
        hub: FakeHub = self.server
        path = self.path.split("?")[0]
        if re.match(r"/api/models/", path) and not path.startswith(f"/api/models/{REPO}"):
            return self._send(404, b"no such repository", {"X-Error-Code": "RepoNotFound"}, head)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            body = json.dumps({"id": m[1], "modelId": m[1], "sha": COMMIT, "private": False,
                               "siblings": [{"rfilename": n} for n in sorted(hub.files)]}).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):   # one page, recursive
            body = json.dumps([{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                                **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                                   if n.endswith(".safetensors") else {})}
                               for n, d in sorted(hub.files.items())]).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m or m[1] != REPO or m[3] not in hub.files:
            return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
        name, data = m[3], hub.files[m[3]]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        if head:
            return self._send(200, data, headers, head=True)
        whole = not re.fullmatch(r"bytes=\d+-\d+", self.headers.get("Range", ""))   # not a header probe
        if whole:
            hub.gets.append(name)
        if name in hub.fail and whole:
            return self._send(500, b"boom", {}, head)
        if name in hub.corrupt and whole:
            data = data[:-1] + bytes([data[-1] ^ 1])
        start, status = 0, 200
        if r := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
            start, end = int(r[1]), int(r[2]) + 1 if r[2] else len(data)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data, status = data[start:end], 206
        if name in hub.break_once and start == 0 and whole:
            hub.break_once.discard(name)
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self._send(status, data, headers, head)

    def _send(self, status, body, headers, head):
        self.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    src = str(base / "src")
    synth.write_checkpoint(src, DIMS, seed=6)
    assert CliRunner().invoke(cli, ["convert", src, str(base / "clean"), "--out", "nvfp4", "--quiet"]).exit_code == 0
    server = FakeHub(src)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, output_tree(str(base / "clean"))
    server.shutdown()


@pytest.fixture
def hub(hub_repo, tmp_path, monkeypatch):
    server, clean = hub_repo
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server.break_once.clear(), server.fail.clear(), server.corrupt.clear(), server.gets.clear()
    return server, clean


def shard_names(server) -> list[str]:
    return sorted(n for n in server.files if n.endswith(".safetensors"))


def invoke(*args):
    result = CliRunner().invoke(cli, ["convert", REPO, *args, "--out", "nvfp4", "--quiet"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_repo_id_downloads_to_the_cache_and_converts(hub, tmp_path):
    server, clean = hub
    dst = str(tmp_path / "dst")
    assert invoke(dst, "--revision", "main").exit_code == 0
    assert output_tree(dst) == clean
    snapshot = tmp_path / "cache" / "models--deepseek-ai--Tiny-V4" / "snapshots" / COMMIT
    assert os.path.islink(snapshot / shard_names(server)[0])   # a cache snapshot (links into blobs/) works as SRC


def test_stream_source_holds_one_shard_at_a_time(hub, tmp_path, monkeypatch):
    server, clean = hub
    dst = str(tmp_path / "dst")
    staging = os.path.join(dst, ".requant-convert", "source")
    seen = []
    fetch = hub_lib.HubSource.fetch

    def watched(self, name, where):
        seen.append(sorted(n for n in os.listdir(staging) if n.endswith(".safetensors")))
        return fetch(self, name, where)
    monkeypatch.setattr(hub_lib.HubSource, "fetch", watched)
    result = invoke(dst, "--stream-source")
    assert result.exit_code == 0, result.stderr
    assert output_tree(dst) == clean
    assert all(s == [] for s in seen), f"a downloaded shard was still on disk: {seen}"
    assert not os.path.exists(tmp_path / "cache"), "streaming must not fill the Hugging Face cache"
    assert sorted(n for n in server.gets if n.endswith(".safetensors")) == shard_names(server)


def test_download_that_breaks_off_is_resumed(hub, tmp_path):
    server, clean = hub
    server.break_once.add(shard_names(server)[2])
    dst = str(tmp_path / "dst")
    result = invoke(dst, "--stream-source")
    assert result.exit_code == 0, result.stderr
    assert output_tree(dst) == clean


def test_failed_or_corrupt_download_is_a_clean_error_then_resumes(hub, tmp_path):
    server, clean = hub
    dst = str(tmp_path / "dst")
    bad = shard_names(server)[3]
    for damage in (server.fail, server.corrupt):
        damage.add(bad)
        result = invoke(dst, "--stream-source", "--resume")
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and "resume with" in lines[0], result.stderr
        assert bad in lines[0]
        assert not os.path.exists(os.path.join(dst, "model.safetensors.index.json"))
        damage.clear()
    assert invoke(dst, "--stream-source", "--resume").exit_code == 0
    assert output_tree(dst) == clean


def test_unknown_repository_is_one_line(hub, tmp_path):
    result = CliRunner().invoke(cli, ["convert", "nobody/nothing", str(tmp_path / "d"), "--out", "nvfp4"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "nobody/nothing" in result.stderr
    assert not os.path.exists(tmp_path / "d")
