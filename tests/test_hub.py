"""Hub sources through the real huggingface_hub client, against a local server on 127.0.0.1 that
answers the way the Hub does: /api/models/{repo}/revision/{rev} for the file list and commit,
/{repo}/resolve/{rev}/{file} with ETag (sha256), X-Repo-Commit, Content-Length and Range."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from requant import synth
from requant.cli import cli
from requant.io import hub as hub_lib
from requant.io.checkpoint import Checkpoint
from tests.helpers.files import output_tree, tensor_bytes, tree

DIMS = synth.Dims(layers=3, experts=6)
REPO = "deepseek-ai/Tiny-V4"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _files(root: str) -> dict[str, bytes]:
    """Every file below `root` by its relative path: a repository's content."""
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                found[os.path.relpath(os.path.join(dirpath, name), root)] = f.read()
    return found


class FakeHub(ThreadingHTTPServer):
    def __init__(self, root: str):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files = _files(root)
        self.repos = {REPO: self.files}     # repository -> path -> bytes; uploads add repositories
        self.break_once: set[str] = set()   # the next full GET of these stops halfway
        self.fail: set[str] = set()         # whole-file GETs of these answer 500
        self.corrupt: set[str] = set()      # whole-file GETs of these flip a byte
        self.gets: list[str] = []           # whole-file GETs (not header range requests)
        self.requests: list[str] = []       # every request line, for "no network lookup" checks
        self.tokens: set[str] = set()       # bearer tokens seen
        self.lfs: dict[str, bytes] = {}     # uploaded large-file objects by sha256
        self.refuse_put: set[str] = set()   # LFS uploads of these paths' objects answer 403 once
        self.puts: list[str] = []           # LFS objects received, by path
        self.files_to_upload: dict[str, bytes] = {}   # what a test uploads, to name objects by path


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.do_GET(head=True)

    def _seen(self):
        hub: FakeHub = self.server
        hub.requests.append(f"{self.command} {self.path}")
        if auth := self.headers.get("Authorization"):
            hub.tokens.add(auth.removeprefix("Bearer "))

    def do_GET(self, head=False):
        self._seen()
        hub: FakeHub = self.server
        path = self.path.split("?")[0]
        repo = re.match(r"/(?:api/models/)?([^/]+/[^/]+)", path)
        files = hub.repos.get(repo[1]) if repo else None
        if re.match(r"/api/models/", path) and files is None:
            return self._send(404, b"no such repository", {"X-Error-Code": "RepoNotFound"}, head)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            body = json.dumps({"id": m[1], "modelId": m[1], "sha": COMMIT, "private": False,
                               "siblings": [{"rfilename": n} for n in sorted(files)]}).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):   # one page, recursive
            body = json.dumps([{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                                **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                                   if n.endswith(".safetensors") else {})}
                               for n, d in sorted(files.items())]).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m or files is None or m[3] not in files:
            return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
        name, data = m[3], files[m[3]]
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

    def _json(self, status, obj):
        return self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"}, False)

    def do_POST(self):
        """The Hub's upload protocol as huggingface_hub speaks it without Xet: create the repository,
        ask which files go through LFS, the LFS batch (no upload action for objects already held:
        what makes a re-run resume), then the NDJSON commit."""
        self._seen()
        hub: FakeHub = self.server
        path = self.path.split("?")[0]
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        endpoint = f"http://127.0.0.1:{hub.server_address[1]}"
        if path == "/api/repos/create":
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            if repo in hub.repos:
                return self._json(409, {"error": "You already created this model repo", "url": f"{endpoint}/{repo}"})
            hub.repos[repo] = {}
            return self._json(200, {"url": f"{endpoint}/{repo}", "name": repo})
        if path == "/api/validate-yaml":
            return self._json(200, {})
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path):
            return self._json(200, {"files": [{"path": f["path"], "shouldIgnore": False,
                                               "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular"}
                                              for f in json.loads(body)["files"]]})
        if m := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path):
            objects = [{"oid": o["oid"], "size": o["size"],
                        **({} if o["oid"] in hub.lfs else
                           {"actions": {"upload": {"href": f"{endpoint}/lfs-upload/{o['oid']}"}}})}
                       for o in json.loads(body)["objects"]]
            return self._json(200, {"transfer": "basic", "objects": objects})
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path):
            files = hub.repos[m[1]]
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "lfsFile":
                    files[item["value"]["path"]] = hub.lfs[item["value"]["oid"]]
            return self._json(200, {"commitUrl": f"{endpoint}/{m[1]}/commit/{COMMIT}", "commitOid": COMMIT})
        return self._json(404, {"error": f"no route {path}"})

    def do_PUT(self):
        self._seen()
        hub: FakeHub = self.server
        oid = self.path.rsplit("/", 1)[-1]
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        name = next((n for n, d in hub.files_to_upload.items() if hashlib.sha256(d).hexdigest() == oid), oid)
        if name in hub.refuse_put:
            hub.refuse_put.discard(name)
            return self._json(403, {"error": "storage refused the object"})
        assert hashlib.sha256(data).hexdigest() == oid
        hub.lfs[oid] = data
        hub.puts.append(name)
        return self._json(200, {})

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
    server.clean_path = str(base / "clean")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, output_tree(str(base / "clean"))
    server.shutdown()


@pytest.fixture
def hub(hub_repo, tmp_path, monkeypatch):
    server, clean = hub_repo
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    for record in (server.break_once, server.fail, server.corrupt, server.gets, server.requests, server.tokens,
                   server.lfs, server.refuse_put, server.puts, server.files_to_upload):
        record.clear()
    for repo in set(server.repos) - {REPO}:
        del server.repos[repo]
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


def snapshot_dir(tmp_path, cache="cache"):
    return tmp_path / cache / "models--deepseek-ai--Tiny-V4" / "snapshots" / COMMIT


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable"])
def test_offline_conversion_from_the_cache(hub, tmp_path, monkeypatch, how):
    server, clean = hub
    assert invoke(str(tmp_path / "first")).exit_code == 0   # fills the cache
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))   # a port nothing listens on: the network is gone
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{dead.getsockname()[1]}")
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server.requests.clear()
    dst = str(tmp_path / "offline")
    result = invoke(dst)
    dead.close()
    assert result.exit_code == 0, result.stderr
    assert output_tree(dst) == clean and server.requests == []
    assert "from the cache" in result.stderr and (how == "HF_HUB_OFFLINE") == ("HF_HUB_OFFLINE is set" in result.stderr)
    # a revision the cache does not hold: one line that says where it looked
    result = invoke(str(tmp_path / "other"), "--revision", "v2")
    assert result.exit_code == 1 and "holds no snapshot of it at v2" in result.stderr.splitlines()[-1]
    assert not os.path.exists(tmp_path / "other")


def test_cache_location_and_token(hub, tmp_path, monkeypatch):
    server, clean = hub
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert invoke(str(tmp_path / "a"), "--token", "hf_secret_1").exit_code == 0
    assert os.path.isdir(snapshot_dir(tmp_path, "home/hub")) and "hf_secret_1" in server.tokens
    assert invoke(str(tmp_path / "b"), "--cache-dir", str(tmp_path / "mine")).exit_code == 0
    assert os.path.isdir(snapshot_dir(tmp_path, "mine")) and output_tree(str(tmp_path / "b")) == clean
    # the token never lands in the resume command a failure prints (and the journal keeps)
    server.fail.add(shard_names(server)[1])
    result = invoke(str(tmp_path / "c"), "--stream-source", "--token", "hf_secret_2", "--cache-dir", str(tmp_path / "e"))
    assert result.exit_code == 1 and "resume with" in result.stderr and "hf_secret_2" not in result.stderr


def test_local_path_or_hub(hub, tmp_path, monkeypatch):
    server, clean = hub
    monkeypatch.chdir(tmp_path)
    os.makedirs("deepseek-ai/Tiny-V3")
    result = CliRunner().invoke(cli, ["convert", REPO, "out", "--out", "nvfp4"])   # owner/ is a local folder
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "no such directory (deepseek-ai/ exists here; did you mean deepseek-ai/Tiny-V3?)" in result.stderr
    assert f"write hf://{REPO}" in result.stderr and server.requests == [] and not os.path.exists("out")
    assert invoke("out", "--quiet").exit_code == 1   # the same bare id, still no lookup
    assert CliRunner().invoke(cli, ["convert", f"hf://{REPO}", "out", "--out", "nvfp4", "--quiet"]).exit_code == 0
    assert output_tree("out") == clean
    result = CliRunner().invoke(cli, ["convert", "nobody/nothing", "d", "--out", "nvfp4"])
    assert result.exit_code == 1 and result.stderr.startswith("requant: error: nobody/nothing is no local directory; ")


def test_in_place_refused_on_the_cache(hub, tmp_path):
    server, clean = hub
    assert invoke(str(tmp_path / "dst")).exit_code == 0
    snapshot = str(snapshot_dir(tmp_path))
    before = tree(snapshot)
    result = CliRunner().invoke(cli, ["convert", snapshot, "--in-place", "--out", "nvfp4"])
    assert result.exit_code == 1 and "Hugging Face cache snapshot" in result.stderr and "new directory" in result.stderr
    assert tree(snapshot) == before
    server.requests.clear()
    result = CliRunner().invoke(cli, ["convert", REPO, "--in-place", "--out", "nvfp4"])
    assert result.exit_code == 1 and "--local-dir" in result.stderr and server.requests == []


def test_upload_round_trips_and_resumes(hub, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import snapshot_download

    server, clean = hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)   # the plain LFS protocol
    folder = str(tmp_path / "out")
    shutil.copytree(server.clean_path, folder)
    with open(os.path.join(folder, "README.md"), "w") as f:   # a model card, which the Hub checks first
        f.write("---\nlicense: mit\nbase_model: deepseek-ai/Tiny-V4\n---\n# Tiny-V4 NVFP4\n")
    os.makedirs(os.path.join(folder, ".requant-scratch"))   # hidden: never uploaded
    with open(os.path.join(folder, ".requant-scratch", "x"), "w") as f:
        f.write("x")
    for name in tree(folder):
        if name.startswith("."):
            continue
        with open(os.path.join(folder, name), "rb") as f:
            server.files_to_upload[name] = f.read()
    shards = sorted(n for n in server.files_to_upload if n.endswith(".safetensors"))
    server.refuse_put.add(shards[2])
    target = "me/Tiny-V4-NVFP4"
    first = CliRunner().invoke(cli, ["upload", folder, target, "--token", "hf_write", "--quiet"])
    assert first.exit_code == 1 and first.stderr.count("\n") == 1 and "uploading" in first.stderr, first.stderr
    assert server.repos[target] == {}, "a failed upload must not commit"
    sent_first = list(server.puts)
    again = CliRunner().invoke(cli, ["upload", folder, target, "--token", "hf_write", "--quiet"])
    assert again.exit_code == 0, again.stderr
    assert not set(sent_first) & set(server.puts[len(sent_first):]), "a re-run sent a stored object again"
    assert sorted(server.puts) == shards and "hf_write" in server.tokens
    back = snapshot_download(target, local_dir=str(tmp_path / "down"), endpoint=os.environ["HF_ENDPOINT"])
    downloaded = {n: h for n, h in tree(back).items() if not n.startswith(".cache")}
    assert downloaded == {n: h for n, h in tree(folder).items() if not n.startswith(".requant")}
    assert set(downloaded) == set(clean) | {"README.md", "requant.json"} and "validate-yaml" in " ".join(server.requests)


def test_upload_refuses_an_unfinished_conversion(hub, tmp_path):
    server, _ = hub
    dst = str(tmp_path / "dst")
    server.fail.add(shard_names(server)[1])
    assert invoke(dst, "--stream-source").exit_code == 1   # stopped: the journal stays
    result = CliRunner().invoke(cli, ["upload", dst, "me/x"])
    assert result.exit_code == 1 and "conversion in progress" in result.stderr and "me/x" not in server.repos


def test_dry_run_reads_only_headers_from_the_hub(hub, tmp_path):
    server, _ = hub
    result = invoke(str(tmp_path / "dst"), "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["source"] == REPO and plan["shards"] == len(shard_names(server))
    assert not [n for n in server.gets if n.endswith(".safetensors")], "a dry run downloaded a shard"
    assert not os.path.exists(tmp_path / "dst") and not os.path.exists(tmp_path / "cache")


def test_advise_reads_only_headers_from_the_hub(hub):
    server, _ = hub
    result = CliRunner().invoke(cli, ["advise", REPO, "--engine", "sglang==0.5.23", "--gpu", "sm_120", "--json"])
    assert result.exit_code == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["source_format"] == "mxfp4" and answer["answers"][0]["paths"][0]["starts"]
    assert not [n for n in server.gets if n.endswith(".safetensors")], "advise downloaded a shard"


DONOR_REPO = "deepseek-ai/Tiny-V4-0731"
NO_DRAFTER = synth.Dims("deepseek-v4-flash", mtp_layers=0, layers=3, experts=6)


def donor_on_hub(server, tmp_path, source: synth.Dims = NO_DRAFTER) -> tuple[str, str]:
    """(a DSpark donor, served as DONOR_REPO; a local source of the same model): directories."""
    donor, src = str(tmp_path / "donor"), str(tmp_path / "src")
    synth.write_checkpoint(donor, synth.Dims("deepseek-v4-flash-0731", layers=3, experts=6), seed=4)
    synth.write_checkpoint(src, source, seed=3)
    server.repos[DONOR_REPO] = _files(donor)
    return donor, src


def test_graft_from_a_hub_donor_downloads_its_drafter_shards_alone(hub, tmp_path):
    """--drafter graft OWNER/NAME: the donor's config, index and headers come from the Hub (range
    requests; a dry run downloads no shard), then only the shards holding its drafter, into the
    Hugging Face cache; the output holds the donor's drafter byte for byte, names the donor and its
    commit, and verifies."""
    server, _ = hub
    donor, src = donor_on_hub(server, tmp_path)
    dst = tmp_path / "out"
    args = ["convert", src, str(dst), "--out", "nvfp4", "--engine", "vllm", "--drafter", "graft", DONOR_REPO, "-q"]
    dry = CliRunner().invoke(cli, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert not [n for n in server.gets if n.endswith(".safetensors")] and not dst.exists()
    missing = CliRunner().invoke(cli, [*args[:9], "deepseek-ai/No-Such-Donor", "-q"])
    assert missing.exit_code == 1 and "looking up deepseek-ai/No-Such-Donor on the Hub" in missing.output \
        and len(missing.output.strip().splitlines()) == 1 and not dst.exists(), missing.output
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    with Checkpoint.open(donor) as given, Checkpoint.open(str(dst)) as out:
        drafter = [n for n in given.names if n.startswith("mtp.")]
        assert drafter and {n for n in out.names if n.startswith("mtp.")} == set(drafter)
        for name in drafter:
            assert out.info(name).spec == given.info(name).spec, name
            assert tensor_bytes(out, name) == tensor_bytes(given, name), name
        wanted = {given.locations[n] for n in drafter}
        assert len(wanted) < len(given.shard_names)
    assert {n for n in server.gets if n.endswith(".safetensors")} == wanted
    cached = tmp_path / "cache" / "models--deepseek-ai--Tiny-V4-0731" / "snapshots" / COMMIT
    assert {p.name for p in cached.iterdir() if p.name.endswith(".safetensors")} == wanted
    record = json.loads((dst / "requant.json").read_text())
    assert record["drafter_donor"] == DONOR_REPO and record["drafter_donor_resolved"] == f"hf://{DONOR_REPO}@{COMMIT}"
    assert f"grafted from `{DONOR_REPO}` (`hf://{DONOR_REPO}@{COMMIT}`)" in (dst / "README.md").read_text()
    state = tree(str(dst))
    assert not any(".requant-convert" in n for n in state), state
    verified = CliRunner().invoke(cli, ["verify", str(dst), "--engine", "vllm", "--quiet"])
    assert verified.exit_code == 0, verified.output


def test_graft_from_a_hub_donor_offline_needs_it_whole_in_the_cache(hub, tmp_path, monkeypatch):
    """Offline, the cache holds only the drafter shards an earlier graft downloaded: one line saying
    so, and nothing written."""
    server, _ = hub
    _, src = donor_on_hub(server, tmp_path)
    args = ["convert", src, "", "--out", "nvfp4", "--engine", "vllm", "--drafter", "graft", DONOR_REPO, "-q"]
    assert CliRunner().invoke(cli, [*args[:2], str(tmp_path / "first"), *args[3:]]).exit_code == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(cli, [*args[:2], str(tmp_path / "second"), *args[3:]])
    assert result.exit_code == 1 and "only in part" in result.output and DONOR_REPO in result.output, result.output
    assert len(result.output.strip().splitlines()) <= 2, result.output   # the cache line, then the error
    assert not (tmp_path / "second").exists()


def test_a_graft_from_a_hub_donor_stopped_resumes_by_the_printed_command(hub, tmp_path, monkeypatch):
    """The journal records the donor repository at its commit; the printed resume command fetches
    nothing it has (the cache's drafter shards), finishes, and the result equals an uninterrupted graft."""
    from requant.io import fsutil

    server, _ = hub
    _, src = donor_on_hub(server, tmp_path, synth.Dims("deepseek-v4-flash", layers=3, experts=6))
    args = ["--out", "nvfp4", "--engine", "vllm", "--drafter", "graft", DONOR_REPO, "-q"]
    clean, dst = str(tmp_path / "clean"), str(tmp_path / "dst")
    assert CliRunner().invoke(cli, ["convert", src, clean, *args]).exit_code == 0
    monkeypatch.setattr(fsutil, "_fault_steps", 0)
    monkeypatch.setenv("REQUANT_TEST_FAULT", "enospc@20")
    stopped = CliRunner().invoke(cli, ["convert", src, dst, *args])
    monkeypatch.delenv("REQUANT_TEST_FAULT")
    assert stopped.exit_code != 0 and f"--drafter graft={DONOR_REPO}" in stopped.output, stopped.output
    assert json.load(open(os.path.join(dst, ".requant-convert", "journal.json")))["donor"]["path"] == \
        f"hf://{DONOR_REPO}@{COMMIT}"
    server.gets.clear()
    command = shlex.split(stopped.output.split("resume with `")[1].split("`")[0])
    resumed = CliRunner().invoke(cli, command[1:])
    assert resumed.exit_code == 0, resumed.output
    assert not [n for n in server.gets if n.endswith(".safetensors")], server.gets
    assert output_tree(dst) == output_tree(clean)


def test_a_corrupt_download_of_the_donors_drafter_is_one_line_then_downloaded_anew(hub, tmp_path):
    """The drafter shards are held to the Hub's sha256 like a streamed source's: bytes that differ
    are one line naming the file, nothing is written, and the cache keeps no bad copy, so the same
    command run again downloads the shard anew and grafts the donor's bytes."""
    server, _ = hub
    donor, src = donor_on_hub(server, tmp_path)
    with Checkpoint.open(donor) as given:
        wanted = {given.locations[n] for n in given.names if n.startswith("mtp.")}
    server.corrupt.update(wanted)
    dst = tmp_path / "out"
    args = ["convert", src, str(dst), "--out", "nvfp4", "--engine", "vllm", "--drafter", "graft", DONOR_REPO, "-q"]
    bad = CliRunner().invoke(cli, args)
    assert bad.exit_code == 1 and "do not match the Hub's sha256" in bad.output and DONOR_REPO in bad.output \
        and len(bad.output.strip().splitlines()) == 1, bad.output
    assert not dst.exists()
    server.corrupt.clear()
    server.gets.clear()
    good = CliRunner().invoke(cli, args)
    assert good.exit_code == 0, good.output
    assert {n for n in server.gets if n.endswith(".safetensors")} == wanted
    with Checkpoint.open(donor) as given, Checkpoint.open(str(dst)) as out:
        assert all(tensor_bytes(out, n) == tensor_bytes(given, n) for n in given.names if n.startswith("mtp."))
