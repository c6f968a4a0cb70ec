"""Sources on the Hugging Face Hub, through the huggingface_hub client.

A repository is normally downloaded into the Hugging Face cache (snapshot_download) and converted
from that snapshot like any local directory. Streamed (--stream-source), only metadata comes
first: config.json, the index and the other small files, then each shard's header through two
HTTP range requests (length prefix, then the JSON), which is all a plan needs. The shards follow
one at a time into the journal folder; each is checked against the header fetched at the start
(and against the Hub's sha256 ETag), converted, and deleted before the next.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import logging
import os
import re
import struct
import sys
import tempfile

from requant.errors import CheckpointError, RequantError
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json, resolve_inside, shard_names_of
from requant.io.safetensors import MAX_HEADER_BYTES, Header, parse_header

log = logging.getLogger(__name__)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DOWNLOAD_TRIES = 3
HUB_PREFIX = "hf://"   # names a Hub repository explicitly, even where a local folder shares its owner's name
_TRUE = ("1", "ON", "YES", "TRUE")


def _is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name


def hub_repo(src: str) -> str | None:
    """The Hub repository SRC names, or None when SRC is a local path.

    `hf://owner/name` is always the Hub. A bare `owner/name` that does not exist locally is the Hub
    only when it cannot be a local path the user meant: if `owner/` is a local directory, SRC is
    taken for a mistyped path and refused here, without a network lookup."""
    if src.startswith(HUB_PREFIX):
        repo = src[len(HUB_PREFIX):].strip("/")
        if not _is_repo_id(repo):
            raise RequantError(f"{src}: not a Hub repository id (hf://owner/name)")
        return repo
    if os.path.exists(src) or not _is_repo_id(src):
        return None
    owner, name = src.split("/")
    if os.path.isdir(owner):
        close = difflib.get_close_matches(name, os.listdir(owner), n=1)
        guess = f"; did you mean {owner}/{close[0]}?" if close else ""
        raise RequantError(f"{src}: no such directory ({owner}/ exists here{guess}); "
                           f"for the Hub repository {src}, write {HUB_PREFIX}{src}")
    return src


def cache_snapshot(path: str) -> bool:
    """Whether `path` is a snapshot folder of a Hugging Face cache (models--O--N/snapshots/REV)."""
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    return os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith("models--")


def hub_cache_dir(cache_dir: str | None = None) -> str:
    """--cache-dir, else HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default. Read at call
    time: huggingface_hub reads its environment once, at import."""
    if cache_dir:
        return cache_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def offline() -> bool:
    from huggingface_hub import constants
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or constants.HF_HUB_OFFLINE


def _endpoint() -> dict:
    # Read at call time (as is the cache above): huggingface_hub reads them once, at import.
    return {"endpoint": os.environ["HF_ENDPOINT"]} if os.environ.get("HF_ENDPOINT") else {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _hub_error(what: str, e: BaseException) -> RequantError:
    return RequantError(f"{what} failed: {_first_line(e)}")


def _http_errors() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(any failure, failure to connect or a connection broken off) of the HTTP client this
    huggingface_hub raises from: httpx in its 1.x, httpx2 from 2.0 (pyproject asks for >= 1.0)."""
    import huggingface_hub

    client = importlib.import_module("httpx" if huggingface_hub.__version__.startswith("1.") else "httpx2")
    return (client.HTTPError,), (client.TransportError,)


def call(what: str, fn):
    """Run a huggingface_hub call; its failures become one-line RequantErrors."""
    any_failure, _ = _http_errors()
    try:
        return fn()
    except RequantError:
        raise
    except (OSError, ValueError, *any_failure) as e:   # HfHubHTTPError is an OSError
        raise _hub_error(what, e) from None


def _unreachable(e: BaseException) -> bool:
    """A failure to reach the Hub at all (no network, DNS, refused), as opposed to its answer."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    _, no_connection = _http_errors()
    return isinstance(e, (*no_connection, OfflineModeIsEnabled, ConnectionError))


@contextlib.contextmanager
def open_headers(src: str, revision: str | None = None, token: str | None = None, cache_dir: str | None = None):
    """Checkpoint `src` (a directory, or a Hub repository) for reading headers and config only: a Hub
    source from the cache where it is there, else by range requests (nothing large is downloaded)."""
    repo = hub_repo(src)
    if not repo:
        with Checkpoint.open(src) as ck:
            yield ck
        return
    hub = HubSource(repo, revision, progress=False, token=token, cache_dir=cache_dir, explicit=src.startswith(HUB_PREFIX))
    if hub.cached:
        with Checkpoint.open(hub.cached) as ck:
            yield ck
        return
    with tempfile.TemporaryDirectory(prefix="requant-headers-") as staging:
        yield hub.open_streamed(staging)


class HubSource:
    """A Hub repository at one commit. Online, the Hub names the commit and its files; offline
    (HF_HUB_OFFLINE, or the Hub unreachable) the Hugging Face cache must hold the snapshot."""

    def __init__(self, repo: str, revision: str | None, progress: bool = True, token: str | None = None,
                 cache_dir: str | None = None, explicit: bool = True):
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars

        if not progress:
            disable_progress_bars()
        self.repo, self.revision, self.token, self.cache_dir = repo, revision, token, hub_cache_dir(cache_dir)
        # A bare owner/name was a guess between a path and the Hub: when the Hub says no, say both.
        self.not_local = "" if explicit else f"{repo} is no local directory; "
        self.cached = None   # the snapshot folder, when the source comes from the cache without the Hub
        if offline():
            self._from_cache(revision, "HF_HUB_OFFLINE is set")
            return
        any_failure, _ = _http_errors()
        try:
            info = HfApi(**_endpoint()).model_info(repo, revision=revision, token=token)
        except (OSError, ValueError, *any_failure) as e:
            if not _unreachable(e):
                raise _hub_error(f"{self.not_local}looking up {repo} on the Hub", e) from None
            self._from_cache(revision, f"the Hub is unreachable ({_first_line(e)})")
            return
        self.commit = info.sha
        self.files = [s.rfilename for s in info.siblings or []]

    def _from_cache(self, revision: str | None, why: str) -> None:
        from huggingface_hub import snapshot_download

        try:
            self.cached = snapshot_download(self.repo, revision=revision, cache_dir=self.cache_dir,
                                            local_files_only=True)
        except Exception:   # noqa: BLE001 - whatever the reason, the cache cannot serve it
            held = ("holds it only in part (some of its files, as a graft downloads a donor's drafter alone, or a "
                    "download that stopped)" if self._partial_snapshot(revision) else "holds no snapshot of it")
            raise RequantError(f"{self.not_local}{self.repo}: {why}, and the Hugging Face cache {self.cache_dir} "
                               f"{held}{f' at {revision}' if revision else ''}") from None
        self.commit = os.path.basename(self.cached)
        self.files = None
        print(f"requant: {why}; converting {self.repo} from the cache: {self.cached}", file=sys.stderr)

    def _partial_snapshot(self, revision: str | None) -> bool:
        """Whether the cache has a snapshot folder for `revision` (a name the cache records, or a commit)."""
        from huggingface_hub.file_download import repo_folder_name

        folder = os.path.join(self.cache_dir, repo_folder_name(repo_id=self.repo, repo_type="model"))
        commit = revision or "main"
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, "refs", commit)) as f:
                commit = f.read().strip()
        return os.path.isdir(os.path.join(folder, "snapshots", commit))

    def snapshot(self) -> str:
        """The whole repository in the Hugging Face cache; returns the snapshot folder (its name is
        the commit)."""
        from huggingface_hub import snapshot_download

        if self.cached:
            return self.cached
        # By the name asked for, so the cache records it (refs/main -> commit) for a later offline run.
        path = call(f"downloading {self.repo}", lambda: snapshot_download(
            self.repo, revision=self.revision, cache_dir=self.cache_dir, token=self.token, **_endpoint()))
        self.commit = os.path.basename(path)
        return path

    def download(self, names: list[str]) -> str:
        """Files `names` of the repository at the commit looked up, into the Hugging Face cache;
        returns the snapshot folder, which holds them (and whatever else the cache had)."""
        from huggingface_hub import snapshot_download

        if self.files is None:
            raise RequantError(f"{self.repo}: the Hub is offline or unreachable, and {', '.join(names)} must come "
                               "from it")
        # By the name asked for, as `snapshot` does, so the cache records which commit it named.
        path = call(f"downloading {', '.join(names)} of {self.repo}", lambda: snapshot_download(
            self.repo, revision=self.revision, cache_dir=self.cache_dir, token=self.token, allow_patterns=names,
            **_endpoint()))
        if os.path.basename(path) != self.commit:
            raise RequantError(f"{self.repo} moved from commit {self.commit} to {os.path.basename(path)} while "
                               "requant read it; run the command again")
        self._check_sha256(path, names)
        return path

    def open_streamed(self, staging: str) -> Checkpoint:
        """Metadata only: small files into `staging`, shard headers by range requests. No shard
        is readable until `fetch` brings it."""
        if self.files is None:
            raise RequantError(f"--stream-source fetches {self.repo} from the Hub, which is offline or unreachable; "
                               "without it, requant converts the cached snapshot")
        os.makedirs(staging, exist_ok=True)
        for name in self.files:
            if not name.endswith(".safetensors"):
                self.fetch(name, staging)
        config = read_json(os.path.join(staging, CONFIG_NAME))
        index = read_json(os.path.join(staging, INDEX_NAME)) if INDEX_NAME in self.files else None
        headers = {}
        for shard in shard_names_of(staging, index):
            resolve_inside(staging, shard, "shard")   # a plain name, nothing that escapes
            if shard not in self.files:
                raise CheckpointError("shard named by the index is not in the repository", file=f"{self.repo}/{shard}")
            headers[shard] = self._remote_header(shard, staging)
        ck = Checkpoint.from_parts(staging, config, index, headers)
        ck.reads.clear()
        return ck

    def _remote_header(self, name: str, staging: str) -> Header:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo, name, revision=self.commit, **_endpoint())
        where = f"{self.repo}/{name}"
        meta = self._metadata(name)
        if meta.size is None:
            raise CheckpointError("the Hub reports no size", file=where)

        def fetch_range(start: int, end: int) -> bytes:
            def get():
                response = get_session().get(url, headers={**build_hf_headers(token=self.token),
                                                          "Range": f"bytes={start}-{end - 1}"})
                hf_raise_for_status(response)
                return response.content
            data = call(f"reading the header of {where}", get)
            if len(data) != end - start:
                raise CheckpointError(f"range request for bytes {start}-{end - 1} returned {len(data)} bytes", file=where)
            return data

        if meta.size < 8:
            raise CheckpointError("file is shorter than a safetensors header", file=where)
        prefix = fetch_range(0, 8)
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > meta.size:
            raise CheckpointError(f"header length {length} is over the limit or past the end ({meta.size} bytes)", file=where)
        return parse_header(prefix + fetch_range(8, 8 + length), meta.size, os.path.join(staging, name))

    def _metadata(self, name: str):
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.repo, name, revision=self.commit, **_endpoint())
        return call(f"reading the size of {self.repo}/{name}", lambda: get_hf_file_metadata(url, token=self.token))

    def fetch(self, name: str, staging: str) -> str:
        """Download one file into `staging` (resuming a partial download); check a shard's bytes
        against the Hub's sha256 ETag where the Hub gives one."""
        from huggingface_hub import hf_hub_download

        target = resolve_inside(staging, name)

        def download():
            # A download that breaks off is resumed from its partial file; some huggingface_hub
            # releases do that themselves, others raise.
            for attempt in range(1, _DOWNLOAD_TRIES + 1):
                try:
                    return hf_hub_download(self.repo, name, revision=self.commit, local_dir=staging,
                                           cache_dir=self.cache_dir, token=self.token, **_endpoint())
                except Exception as e:
                    if attempt == _DOWNLOAD_TRIES or not _unreachable(e):
                        raise
                    log.info("download of %s/%s broke off (%s): resuming, try %d of %d", self.repo, name,
                             _first_line(e), attempt + 1, _DOWNLOAD_TRIES)
        path = call(f"downloading {self.repo}/{name}", download)
        if os.path.realpath(path) != os.path.realpath(target):
            raise CheckpointError("download landed outside the staging folder", file=path)
        self._check_sha256(staging, [name])
        return path

    def _check_sha256(self, folder: str, names: list[str]) -> None:
        """Downloaded shards' bytes against the Hub's sha256 ETags, where the Hub gives them. Every
        file that differs is removed (a cache link with its blob), so running again downloads it
        anew; the first is named."""
        bad = []
        for name in names:
            etag = self._metadata(name).etag or "" if name.endswith(".safetensors") else ""
            if not _SHA256.match(etag):
                continue
            path, digest = os.path.join(folder, name), hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != etag:
                stored = os.path.realpath(path)
                os.remove(path)
                if stored != os.path.abspath(path):
                    os.remove(stored)
                bad.append((name, etag))
        if bad:
            more = f" ({len(bad) - 1} more such files removed too)" if len(bad) > 1 else ""
            raise CheckpointError(f"downloaded bytes do not match the Hub's sha256 {bad[0][1]}{more}",
                                  file=f"{self.repo}/{bad[0][0]}")


def upload(folder: str, repo: str, token: str | None = None, private: bool = False, message: str | None = None,
           progress: bool = True) -> str:
    """Upload a finished conversion (every file in `folder` but hidden ones) to Hub repository
    `repo`, creating it if needed; returns the commit URL (or the repository's, where the client
    does not say). Resumable: run again after a failure and files the Hub already holds are not
    sent again (huggingface_hub's folder upload: the Hub answers which large files it holds)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import disable_progress_bars

    if not _is_repo_id(repo):
        raise RequantError(f"{repo}: not a Hub repository id (owner/name)")
    with Checkpoint.open(folder):   # a finished conversion: config, index, every shard's header
        pass
    if not progress:
        disable_progress_bars()
    api = HfApi(token=token, **_endpoint())
    call(f"creating {repo}", lambda: api.create_repo(repo, private=private, exist_ok=True))
    ignore = [".*", "**/.*"]   # journals, caches, editor files
    what = f"uploading {folder} to {repo} (run the same command again to resume)"
    try:
        info = call(what, lambda: api.upload_folder(
            repo_id=repo, folder_path=folder, ignore_patterns=ignore,
            commit_message=message or f"requant: upload {os.path.basename(os.path.abspath(folder))}"))
    except RuntimeError as e:   # huggingface_hub wraps a failed file upload, with the HTTP error as cause
        cause = f" ({_first_line(e.__cause__)})" if e.__cause__ else ""
        raise RequantError(f"{what} failed: {_first_line(e)}{cause}") from None
    return getattr(info, "commit_url", None) or f"{api.endpoint}/{repo}"
