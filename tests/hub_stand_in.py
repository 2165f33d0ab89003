# Copyright 2026 The tvopd-trl Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""A local, in-memory stand-in for the Hugging Face Hub HTTP API, for tests that push without the network.

This is not the Hub. It emulates just the requests that `huggingface_hub` (2.x) sends for `whoami`, `create_repo`,
`upload_file`/`upload_folder`/`create_commit`, `model_info`/`repo_info`, `list_repo_files`/`list_repo_tree` and
`hf_hub_download`, which is what `transformers.Trainer.push_to_hub` uses:

    GET       /api/whoami-v2
    POST      /api/repos/create                         409 (with the repo's "url") if it exists
    POST      /api/validate-yaml                        accepts any model card
    POST      /api/{type}s/{repo_id}/preupload/{rev}    "uploadMode": "regular" for every file
    POST      /api/{type}s/{repo_id}/commit/{rev}       NDJSON: "header", "file" (base64), "deletedFile", "deletedFolder"
    GET       /api/{type}s/{repo_id}[/revision/{rev}]   id, sha, private, siblings
    GET       /api/{type}s/{repo_id}/tree/{rev}[/{path}]
    HEAD, GET /[{type}s/]{repo_id}/resolve/{rev}/{path}

Because preupload answers "regular" for every file, `huggingface_hub` sends each file's bytes inline, base64, in the
commit payload, and never starts an LFS or Xet transfer: those are only run for files the Hub calls "lfs", both by
`create_commit`/`upload_file` (`_commit_api._upload_files`) and by `upload_folder`, which with `hf_xet` installed goes
through `_upload_pipeline.pipelined_upload` (it opens an in-process `XetSession` but registers only "lfs" files with
it, and commits in batches of up to 256 files / 100 MB, "(part 2)" and so on). `HF_HUB_DISABLE_XET=1` is not needed; it
is read at import into `huggingface_hub.constants.HF_HUB_DISABLE_XET`, and makes `upload_folder` take the one-commit
`create_commit` path instead. Files are kept in memory, so keep them to a few MB.

Write endpoints (create, preupload, commit) and whoami need `Authorization: Bearer <token>`; without it they answer 401
`{"error": "Invalid username or password."}`, with a wrong token 401 "Invalid credentials in Authorization header",
which `huggingface_hub` raises as `HfHubHTTPError` (`err.response.status_code == 401`). Private repos need the token to
be read. A client given no token falls back to `HF_TOKEN` or the saved login, which this server also refuses unless
it equals `token`. Not emulated: branches, tags and pull requests (every revision name reads and writes the single history),
namespace permissions (any namespace is writable), LFS, Xet, gated repos, rate limits, pagination.

Pointing a client at it:

- `HfApi(endpoint=hub.endpoint)` and `hf_hub_download(..., endpoint=hub.endpoint)` are enough for every call above.
- `HF_ENDPOINT` is read once, when `huggingface_hub.constants` is imported, into `constants.ENDPOINT`; `HfApi()`
  without `endpoint=` copies it when constructed, and the module-level functions (`huggingface_hub.upload_folder`, ...)
  are methods of an `HfApi()` built at import. So `HF_ENDPOINT=hub.endpoint` in the environment works for a subprocess
  (`hub.env` holds it with `HF_TOKEN`), but not in a process that has already imported `huggingface_hub`.
- In the same process, `with hub.as_default():` patches `constants.ENDPOINT` and the download-URL template, the
  module-level `HfApi` instance, and transformers' cached `HfApi` (`transformers.utils.hub._hf_api`, which
  `Trainer.init_hf_repo` and `Trainer.push_to_hub` use, and which takes no endpoint); all are restored on exit.

    from .hub_stand_in import local_hub

    with local_hub(token="hf_test") as hub:
        HfApi(endpoint=hub.endpoint, token="hf_test").upload_folder(repo_id="user/tiny", folder_path=path)
        assert b"..." == hub.repos["user/tiny"]["model.safetensors"]
        hub.commits  # [{"repo_id": "user/tiny", "repo_type": "model", "message": ..., "files": [...], ...}]
        with hub.as_default():  # for code that builds its own HfApi(), e.g. Trainer(args=...).push_to_hub()
            trainer.push_to_hub()
"""

import base64
import contextlib
import hashlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock
from urllib.parse import parse_qs, unquote, urlsplit

from .timeouts import time_limit


_REPO_API = re.compile(
    r"^/api/(models|datasets|spaces)/([^/]+/[^/]+?)(?:/(preupload|commit|tree|revision)/([^/]+)(/.*)?)?$"
)
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _git_oid(data):
    """The git blob id of `data`, which `huggingface_hub` compares with its own to skip unchanged files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _forget_transformers_hf_api():
    if (transformers_hub := sys.modules.get("transformers.utils.hub")) is not None:
        transformers_hub._hf_api = None


class LocalHub:
    """The server's state: `repos` maps a repo id (prefixed "datasets/" or "spaces/" for those types) to its files."""

    def __init__(self, token="hf_test", user="user"):
        self.token, self.user = token, user
        self.repos = {}  # repo key -> {path: bytes}
        self.private = set()  # keys of private repos
        self.heads = {}  # repo key -> sha of the last commit
        self.commits = []  # {"repo_id", "repo_type", "message", "files", "deleted", "oid"}, oldest first
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.hub = self
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def env(self):
        """Environment variables that point a subprocess's `huggingface_hub` at this server, with the valid token."""
        return {"HF_ENDPOINT": self.endpoint, "HF_TOKEN": self.token}

    @contextlib.contextmanager
    def as_default(self):
        """Make clients built without `endpoint=` in this process (`HfApi()`, `Trainer`) talk to this server."""
        import huggingface_hub.constants
        import huggingface_hub.hf_api

        template = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(huggingface_hub.constants, "ENDPOINT", self.endpoint))
            stack.enter_context(mock.patch.object(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template))
            stack.enter_context(mock.patch.object(huggingface_hub.hf_api.api, "endpoint", self.endpoint))
            # transformers caches one HfApi, built from ENDPOINT on first use: rebuild it inside, restore it after.
            if (transformers_hub := sys.modules.get("transformers.utils.hub")) is not None:
                stack.enter_context(mock.patch.object(transformers_hub, "_hf_api", None))
            else:  # if it gets imported inside the block, forget the HfApi it cached for this server
                stack.callback(_forget_transformers_hf_api)
            yield self

    def _commit(self, key, repo_type, repo_id, lines):
        header, added, deleted = {}, {}, []
        for line in filter(None, lines):
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                header = value
            elif item["key"] == "file":
                added[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:  # "lfsFile" never comes since preupload says "regular"; copies are not supported
                raise ValueError(f"unsupported commit operation {item['key']!r}")
        with self.lock:
            files = self.repos[key]
            for path in deleted:
                folder = path.rstrip("/") + "/"
                for name in [n for n in files if n == path or n.startswith(folder)]:
                    del files[name]
            files.update(added)
            oid = hashlib.sha1(f"{key} {len(self.commits)} {header.get('summary')}".encode()).hexdigest()
            self.heads[key] = oid
            self.commits.append(
                {
                    "repo_id": repo_id,
                    "repo_type": repo_type,
                    "message": header.get("summary"),
                    "description": header.get("description", ""),
                    "files": sorted(added),
                    "deleted": deleted,
                    "oid": oid,
                }
            )
        return oid


class _Handler(BaseHTTPRequestHandler):
    timeout = time_limit(60)  # seconds a connection may stall

    def log_message(self, *args):
        pass

    # ---- plumbing

    def _read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status, body=b"", headers=None, head_only=False):
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def _error(self, status, message, code=None):
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
        self._send(status, {"error": message}, headers)

    def _auth_error(self):
        """Sends a 401 and returns True unless the request carries the valid token."""
        hub = self.server.hub
        auth = self.headers.get("Authorization", "")
        if auth == f"Bearer {hub.token}":
            return False
        if auth:
            self._error(401, "Invalid credentials in Authorization header")
        else:
            self._send(401, {"error": "Invalid username or password."})
        return True

    def _repo(self, repo_type, repo_id, write=False):
        """The repo's key, or None once a 401 (writes and private repos need the token) or 404 has been sent."""
        hub = self.server.hub
        key = repo_id if repo_type in (None, "model") else f"{repo_type}s/{repo_id}"
        if (write or key in hub.private) and self._auth_error():
            return None
        if key not in hub.repos:
            self._error(404, "Repository not found", "RepoNotFound")
            return None
        return key

    # ---- routes

    def do_GET(self, head_only=False):
        hub = self.server.hub
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/api/whoami-v2":
            if not self._auth_error():
                self._send(
                    200,
                    {
                        "type": "user",
                        "name": hub.user,
                        "fullname": hub.user,
                        "orgs": [],
                        "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
                    },
                )
        elif match := _REPO_API.match(url.path):
            repo_type, repo_id, action, _, path = match.groups()
            if (key := self._repo(repo_type[:-1], repo_id)) is None:
                return
            with hub.lock:
                files = dict(hub.repos[key])
            if action == "tree":
                prefix = unquote(path or "").strip("/")
                prefix = prefix + "/" if prefix else ""
                recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                entries, folders = [], set()
                for name, data in sorted(files.items()):
                    if not name.startswith(prefix):
                        continue
                    rest = name[len(prefix) :]
                    if "/" in rest and not recursive:
                        folders.add(prefix + rest.split("/")[0])
                    else:
                        entries.append({"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)})
                folder_entries = [
                    {"type": "directory", "path": f, "oid": _git_oid(f.encode())} for f in sorted(folders)
                ]
                self._send(200, folder_entries + entries)
            elif action in (None, "revision"):
                self._send(
                    200,
                    {
                        "id": repo_id,
                        "sha": hub.heads[key],
                        "private": key in hub.private,
                        "siblings": [{"rfilename": n, "size": len(d)} for n, d in sorted(files.items())],
                    },
                )
            else:
                self._error(405, f"GET is not supported on {action}")
        elif match := _RESOLVE.match(url.path):
            repo_type, repo_id, _, path = match.groups()
            if (key := self._repo(repo_type and repo_type[:-1], repo_id)) is None:
                return
            with hub.lock:
                data, head = hub.repos[key].get(unquote(path)), hub.heads[key]
            if data is None:
                self._error(404, "Entry not found", "EntryNotFound")
            else:
                headers = {
                    "X-Repo-Commit": head,
                    "ETag": f'"{_git_oid(data)}"',
                    "Content-Type": "application/octet-stream",
                }
                self._send(200, data, headers, head_only=head_only)
        else:
            self._error(404, f"Not emulated by the local Hub: GET {url.path}")

    def do_HEAD(self):
        self.do_GET(head_only=True)

    def do_POST(self):
        hub = self.server.hub
        body = self._read_body()  # read before any answer, so the client is never cut off mid-upload
        url = urlsplit(self.path)
        if url.path == "/api/validate-yaml":
            self._send(200, {"errors": [], "warnings": []})
        elif url.path == "/api/repos/create":
            if self._auth_error():
                return
            payload = json.loads(body)
            repo_type = payload.get("type") or "model"
            repo_id = f"{payload.get('organization') or hub.user}/{payload['name']}"
            key = repo_id if repo_type == "model" else f"{repo_type}s/{repo_id}"
            answer = {"url": f"{hub.endpoint}/{key}", "name": repo_id, "id": repo_id}
            with hub.lock:
                if key in hub.repos:
                    self._send(409, {"error": "You already created this repo", **answer})
                    return
                hub.repos[key] = {}
                hub.heads[key] = hashlib.sha1(f"{key} created".encode()).hexdigest()
                if payload.get("visibility") == "private" or payload.get("private"):
                    hub.private.add(key)
            self._send(200, answer)
        elif (match := _REPO_API.match(url.path)) and match.group(3) in ("preupload", "commit"):
            repo_type, repo_id, action, _, _ = match.groups()
            if (key := self._repo(repo_type[:-1], repo_id, write=True)) is None:
                return
            if action == "preupload":
                with hub.lock:
                    files = dict(hub.repos[key])
                answer = [
                    {
                        "path": f["path"],
                        "uploadMode": "regular",
                        "shouldIgnore": False,
                        "oid": _git_oid(files[f["path"]]) if f["path"] in files else None,
                    }
                    for f in json.loads(body)["files"]
                ]
                self._send(200, {"files": answer, "commitOid": hub.heads[key]})
            else:
                try:
                    oid = hub._commit(key, repo_type[:-1], repo_id, body.decode().splitlines())
                except (ValueError, KeyError) as err:
                    self._error(400, f"Bad commit payload: {err}")
                    return
                self._send(200, {"success": True, "commitOid": oid, "commitUrl": f"{hub.endpoint}/{key}/commit/{oid}"})
        else:
            self._error(404, f"Not emulated by the local Hub: POST {url.path}")


@contextlib.contextmanager
def local_hub(token="hf_test", user="user"):
    """Serves a [`LocalHub`] on `127.0.0.1` (a free port) from a daemon thread for the duration of the block.

    `token` is the only valid token; `whoami` answers `user`, and repos created without a namespace go under `user`.
    """
    hub = LocalHub(token=token, user=user)
    thread = threading.Thread(target=hub.server.serve_forever, args=(0.05,), name="local-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.server.shutdown()
        hub.server.server_close()
        thread.join()
