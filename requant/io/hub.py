"""Sources on the Hugging Face Hub, through the huggingface_hub client.

A repository is normally downloaded into the Hugging Face cache (snapshot_download) and converted
from that snapshot like any local directory. Streamed (--stream-source), only metadata comes
first: config.json, the index and the other small files, then each shard's header through two
HTTP range requests (length prefix, then the JSON), which is all a plan needs. The shards follow
one at a time into the journal folder; each is checked against the header fetched at the start
(and against the Hub's sha256 ETag), converted, and deleted before the next.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct

from requant.errors import CheckpointError, RequantError
from requant.io.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json, resolve_inside, shard_names_of
from requant.io.safetensors import MAX_HEADER_BYTES, Header, parse_header

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_repo_id(src: str) -> bool:
    """A SRC that names no local path but reads as `owner/name`."""
    return not os.path.exists(src) and bool(_REPO_ID.match(src)) and ".." not in src


def _endpoint() -> dict:
    # Read at call time (as is HF_HUB_CACHE below): huggingface_hub reads them once, at import.
    return {"endpoint": os.environ["HF_ENDPOINT"]} if os.environ.get("HF_ENDPOINT") else {}


class HubSource:
    def __init__(self, repo: str, revision: str | None, progress: bool = True):
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars

        if not progress:
            disable_progress_bars()
        self.repo = repo
        info = self._call(f"looking up {repo}", lambda: HfApi(**_endpoint()).model_info(repo, revision=revision))
        self.commit = info.sha
        self.files = [s.rfilename for s in info.siblings or []]

    def _call(self, what: str, fn):
        """Run a huggingface_hub call; its failures become one-line RequantErrors."""
        import httpx2

        try:
            return fn()
        except RequantError:
            raise
        except (OSError, ValueError, httpx2.HTTPError) as e:   # HfHubHTTPError is an OSError
            raise RequantError(f"{what} failed: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None

    def snapshot(self) -> str:
        """The whole repository in the Hugging Face cache; returns the snapshot folder."""
        from huggingface_hub import snapshot_download

        return self._call(f"downloading {self.repo}", lambda: snapshot_download(
            self.repo, revision=self.commit, cache_dir=os.environ.get("HF_HUB_CACHE"), **_endpoint()))

    def open_streamed(self, staging: str) -> Checkpoint:
        """Metadata only: small files into `staging`, shard headers by range requests. No shard
        is readable until `fetch` brings it."""
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
                response = get_session().get(url, headers={**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"})
                hf_raise_for_status(response)
                return response.content
            data = self._call(f"reading the header of {where}", get)
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
        return self._call(f"reading the size of {self.repo}/{name}", lambda: get_hf_file_metadata(url))

    def fetch(self, name: str, staging: str) -> str:
        """Download one file into `staging` (resuming a partial download); check a shard's bytes
        against the Hub's sha256 ETag where the Hub gives one."""
        from huggingface_hub import hf_hub_download

        target = resolve_inside(staging, name)
        path = self._call(f"downloading {self.repo}/{name}", lambda: hf_hub_download(
            self.repo, name, revision=self.commit, local_dir=staging, cache_dir=os.environ.get("HF_HUB_CACHE"),
            **_endpoint()))
        if os.path.realpath(path) != os.path.realpath(target):
            raise CheckpointError("download landed outside the staging folder", file=path)
        etag = self._metadata(name).etag or "" if name.endswith(".safetensors") else ""
        if _SHA256.match(etag):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != etag:
                os.remove(path)
                raise CheckpointError(f"downloaded bytes do not match the Hub's sha256 {etag}", file=f"{self.repo}/{name}")
        return path
