"""A loopback stand-in for the Hugging Face hub, answering its HTTP API the way `huggingface_hub`
calls it (read at huggingface_hub 2.4.0: hf_api.py `model_info`/`list_repo_tree`,
file_download.py `get_hf_file_metadata`/`http_get`, utils/_http.py `hf_raise_for_status`), for
tests and benchmarks that cannot reach the hub. Point `HF_ENDPOINT` (or an `endpoint=`) at
`hub.endpoint`.

Routes, on 127.0.0.1:
  GET  /api/models/{org}/{name}[/revision/{rev}]   model info; `blobs=true` adds each file's
       size, blobId and lfs {sha256, size, pointerSize}
  GET  /api/models/{org}/{name}/tree/{rev}[/{path}]   the file listing (`recursive`, `expand`)
  HEAD|GET /{org}/{name}/resolve/{rev}/{path}   a regular file: 200 with X-Repo-Commit and its
       git blob id as ETag (Range answered with 206); an LFS file: 302 to the CDN with
       X-Repo-Commit, X-Linked-Etag (its sha256) and X-Linked-Size, as the hub does
and the CDN, on 127.0.0.2 (another host, so the client sends it no token):
  HEAD|GET /cdn/{sha256}   the bytes, with Range (206, Content-Range; 416 past the end)

Refusals worded as the hub's (X-Error-Code, X-Error-Message headers that
`hf_raise_for_status` maps to its errors): an unknown repo is 401 RepoNotFound without a token
and 404 with one; an unknown revision 404 RevisionNotFound; an unlisted file 404 EntryNotFound;
a gated repo's files 401 GatedRepo without a granted token (403 with another token), its model
info is public; a private repo is 401 RepoNotFound to anyone not granted. Stricter than the hub
where a client bug would otherwise pass unseen: an unknown query parameter is 400, the CDN
refuses any Authorization header (400, as S3 refuses a second auth mechanism), a malformed Range
is 400.

Test controls: `corrupt(repo, path)` serves other bytes than the listing's hash; `hide(repo,
path)` lists a file but 404s it; `stall(sha256, after_bytes)` holds a download after that many
bytes until the returned event is set; `bytes_per_s` paces the CDN as a network link would;
`requests` records (method, path, Range, auth) of each request. A new commit on a branch moves
it (`commit`), so `@main` resolves to it from then on.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, unquote

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

CHUNK_BYTES: Final = 1 << 20
LFS_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".gguf")
LFS_MIN_BYTES: Final = 10 << 20
CDN_HOST: Final = "127.0.0.2"


@dataclass(frozen=True)
class HubFile:
    path: str
    data: Path  # the bytes on disk
    size: int
    blob_id: str  # git's blob hash
    sha256: str | None  # LFS files only


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None
    status: int


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    tokens: set[str] = field(default_factory=set)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()


class FakeHub:
    """Start with `start()` (or as a context manager); files live under `root`."""

    def __init__(
        self,
        root: Path,
        *,
        host: str = "127.0.0.1",
        cdn_host: str = CDN_HOST,
        bytes_per_s: float | None = None,
    ) -> None:
        """`host`, `cdn_host`: where the hub and its CDN listen (loopback in tests; the e2e suite
        gives an address a cluster's pods reach). `bytes_per_s`: the CDN's bytes are paced to
        this rate over all its connections together (a network link; None: as fast as the
        kernel's sendfile goes)."""
        self.root = root
        self.host = host
        self.cdn_host = cdn_host
        self.bytes_per_s = bytes_per_s
        self._paced_until = 0.0  # the event loop's clock: when the link is free again
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._corrupt: set[tuple[str, str]] = set()
        self._hidden: set[tuple[str, str]] = set()
        self._stalls: dict[str, tuple[int, threading.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runners: list[web.AppRunner] = []
        self.port = 0
        self.cdn_port = 0

    # --- contents -------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path],
        *,
        branch: str = "main",
        gated: bool = False,
        private: bool = False,
        tokens: tuple[str, ...] = (),
    ) -> str:
        """A repo whose `branch` holds `files` (bytes, or a file to serve as is); its commit."""
        with self._lock:
            self.repos[repo_id] = Repo(repo_id, gated=gated, private=private, tokens=set(tokens))
        return self.commit(repo_id, files, branch=branch)

    def commit(
        self, repo_id: str, files: Mapping[str, bytes | Path], *, branch: str = "main"
    ) -> str:
        """A new commit of `files` on `branch` (which moves to it); the commit id."""
        stored: dict[str, HubFile] = {}
        for path, content in files.items():
            stored[path] = self._store(path, content)
        digest = hashlib.sha1(repo_id.encode(), usedforsecurity=False)
        for path in sorted(stored):
            digest.update(f"{path}:{stored[path].blob_id}\n".encode())
        with self._lock:
            repo = self.repos[repo_id]
            digest.update(str(len(repo.commits)).encode())
            commit = digest.hexdigest()
            repo.commits[commit] = stored
            repo.refs[branch] = commit
        return commit

    def tag(self, repo_id: str, tag: str, commit: str) -> None:
        with self._lock:
            self.repos[repo_id].refs[tag] = commit

    def _store(self, path: str, content: bytes | Path) -> HubFile:
        if isinstance(content, Path):
            data_path, size = content, content.stat().st_size
            blob_hasher = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
            sha = hashlib.sha256()
            with content.open("rb") as f:
                while chunk := f.read(8 << 20):
                    blob_hasher.update(chunk)
                    sha.update(chunk)
            blob_id, sha256 = blob_hasher.hexdigest(), sha.hexdigest()
        else:
            blob_id, sha256, size = (
                git_blob_id(content),
                hashlib.sha256(content).hexdigest(),
                len(content),
            )
            data_path = self.root / "objects" / sha256
            data_path.parent.mkdir(parents=True, exist_ok=True)
            data_path.write_bytes(content)
        lfs = path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES
        return HubFile(path, data_path, size, blob_id, sha256 if lfs else None)

    def corrupt(self, repo_id: str, path: str) -> None:
        """Serve `path` with one byte flipped (its listing keeps the true hash)."""
        with self._lock:
            self._corrupt.add((repo_id, path))

    def hide(self, repo_id: str, path: str) -> None:
        """List `path` but answer 404 EntryNotFound for it."""
        with self._lock:
            self._hidden.add((repo_id, path))

    def stall(self, sha256: str, after_bytes: int) -> threading.Event:
        """Hold GETs of this LFS object after `after_bytes` bytes of the file, until set."""
        release = threading.Event()
        with self._lock:
            self._stalls[sha256] = (after_bytes, release)
        return release

    def file(self, repo_id: str, path: str, revision: str = "main") -> HubFile:
        with self._lock:
            repo = self.repos[repo_id]
            return repo.commits[repo.refs.get(revision, revision)][path]

    def served(self, method: str, prefix: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == method and r.path.startswith(prefix)]

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeHub:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self._start_sites())
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fake-hub", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the fake hub did not start")
        return self

    async def _start_sites(self) -> None:
        hub = web.Application()
        hub.router.add_route("GET", "/api/models/{org}/{name}", self._model_info)
        hub.router.add_route("GET", "/api/models/{org}/{name}/revision/{rev:.+}", self._model_info)
        hub.router.add_route("GET", "/api/models/{org}/{name}/tree/{rest:.+}", self._tree)
        hub.router.add_route("*", "/{org}/{name}/resolve/{rest:.+}", self._resolve)
        cdn = web.Application()
        cdn.router.add_route("*", "/cdn/{sha256}", self._cdn)
        for app, host, attr in ((hub, self.host, "port"), (cdn, self.cdn_host, "cdn_port")):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, 0)
            await site.start()
            server = site._server
            assert server is not None and server.sockets
            setattr(self, attr, server.sockets[0].getsockname()[1])
            self._runners.append(runner)

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        with self._lock:
            for _, release in self._stalls.values():
                release.set()

        async def cleanup() -> None:
            for runner in self._runners:
                await runner.cleanup()
            await loop.shutdown_default_executor()  # the threads stalled downloads waited in

        asyncio.run_coroutine_threadsafe(cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(30)
        self._loop = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- handlers ---------------------------------------------------------------------------

    def _log(self, request: web.Request, status: int) -> None:
        with self._lock:
            self.requests.append(
                Request(
                    request.method,
                    request.path,
                    request.headers.get("Range"),
                    request.headers.get("Authorization"),
                    status,
                )
            )

    def _refuse(
        self, request: web.Request, status: int, code: str | None, message: str, commit: str = ""
    ) -> web.Response:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self._log(request, status)
        body = b"" if request.method == "HEAD" else f'{{"error": "{message}"}}'.encode()
        return web.Response(
            status=status, body=body, headers=headers, content_type="application/json"
        )

    def _token(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    def _strict_query(self, request: web.Request, allowed: set[str]) -> web.Response | None:
        unknown = sorted(set(request.query) - allowed)
        if unknown:
            return self._refuse(request, 400, None, f"unknown query parameters {unknown}")
        return None

    def _repo(
        self, request: web.Request, *, files: bool
    ) -> tuple[Repo | None, web.Response | None]:
        """The repo of the route, or the refusal a client without access gets."""
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        token = self._token(request)
        with self._lock:
            repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token not in repo.tokens):
            status = 404 if token else 401
            message = "Repository not found"
            return None, self._refuse(request, status, "RepoNotFound", message)
        if files and repo.gated and token not in repo.tokens:
            if token is None:
                message = (
                    f"Access to model {repo_id} is restricted. You must have access to it and be "
                    "authenticated to access it. Please log in."
                )
                return None, self._refuse(request, 401, "GatedRepo", message)
            message = (
                f"Access to model {repo_id} is restricted and you are not in the authorized list."
            )
            return None, self._refuse(request, 403, "GatedRepo", message)
        return repo, None

    def _commit(self, repo: Repo, revision: str) -> str | None:
        with self._lock:
            commit = repo.refs.get(revision, revision)
            return commit if commit in repo.commits else None

    async def _model_info(self, request: web.Request) -> web.Response:
        if (bad := self._strict_query(request, {"blobs", "securityStatus", "expand"})) is not None:
            return bad
        repo, refusal = self._repo(request, files=False)
        if refusal is not None:
            return refusal
        assert repo is not None
        revision = unquote(request.match_info.get("rev", "main"))
        commit = self._commit(repo, revision)
        if commit is None:
            return self._refuse(request, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        blobs = request.query.get("blobs", "false").lower() == "true"
        siblings = []
        for f in sorted(repo.commits[commit].values(), key=lambda f: f.path):
            entry: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                entry["size"], entry["blobId"] = f.size, f.blob_id
                if f.sha256 is not None:
                    entry["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(entry)
        body = {
            "_id": repo.repo_id,
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }
        self._log(request, 200)
        return web.json_response(body)

    async def _tree(self, request: web.Request) -> web.Response:
        if (
            bad := self._strict_query(request, {"recursive", "expand", "cursor", "limit"})
        ) is not None:
            return bad
        repo, refusal = self._repo(request, files=False)
        if refusal is not None:
            return refusal
        assert repo is not None
        rest = request.match_info["rest"]
        revision, _, prefix = rest.partition("/")
        revision, prefix = unquote(revision), unquote(prefix)
        commit = self._commit(repo, revision)
        if commit is None:
            return self._refuse(request, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        recursive = request.query.get("recursive", "false").lower() == "true"
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for f in sorted(repo.commits[commit].values(), key=lambda f: f.path):
            if prefix and not f.path.startswith(prefix.rstrip("/") + "/"):
                continue
            relative = f.path[len(prefix.rstrip("/")) + 1 :] if prefix else f.path
            if not recursive and "/" in relative:
                folder = (prefix.rstrip("/") + "/" if prefix else "") + relative.split("/")[0]
                if folder not in folders:
                    folders.add(folder)
                    entries.append(
                        {"type": "directory", "oid": "0" * 40, "size": 0, "path": folder}
                    )
                continue
            entry: dict[str, Any] = {
                "type": "file",
                "oid": f.blob_id,
                "size": f.size,
                "path": f.path,
            }
            if f.sha256 is not None:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        self._log(request, 200)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("HEAD", "GET"):
            return self._refuse(request, 405, None, "method not allowed")
        if (bad := self._strict_query(request, {"download"})) is not None:
            return bad
        repo, refusal = self._repo(request, files=True)
        if refusal is not None:
            return refusal
        assert repo is not None
        revision, _, path = request.match_info["rest"].partition("/")
        revision, path = unquote(revision), unquote(path)
        commit = self._commit(repo, revision)
        if commit is None:
            return self._refuse(request, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        with self._lock:
            f = repo.commits[commit].get(path)
            hidden = (repo.repo_id, path) in self._hidden
        if f is None or hidden:
            return self._refuse(request, 404, "EntryNotFound", f"{path} does not exist", commit)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.sha256 is not None:
            headers.update(
                {
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(f.size),
                    "ETag": f'"{f.blob_id}"',
                    "Location": f"http://{self.cdn_host}:{self.cdn_port}/cdn/{f.sha256}?"
                    f"repo={quote(repo.repo_id, safe='')}&file={quote(path, safe='')}",
                    "Content-Length": "0",
                }
            )
            self._log(request, 302)
            return web.Response(status=302, headers=headers)
        headers["ETag"] = f'"{f.blob_id}"'
        return await self._send(request, f, repo.repo_id, headers)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("HEAD", "GET"):
            return self._refuse(request, 405, None, "method not allowed")
        if "Authorization" in request.headers:
            return self._refuse(request, 400, None, "Only one auth mechanism allowed")
        sha256 = request.match_info["sha256"]
        repo_id, path = request.query.get("repo", ""), request.query.get("file", "")
        with self._lock:
            repo = self.repos.get(repo_id)
            found = [
                f
                for c in (repo.commits.values() if repo else [])
                for f in c.values()
                if f.sha256 == sha256 and f.path == path
            ]
        if not found:
            return self._refuse(request, 404, None, "NoSuchKey")
        headers = {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"}
        return await self._send(request, found[0], repo_id, headers)

    async def _send(
        self, request: web.Request, f: HubFile, repo_id: str, headers: dict[str, str]
    ) -> web.StreamResponse:
        with self._lock:
            corrupt = (repo_id, f.path) in self._corrupt
            stall = self._stalls.get(f.sha256 or "")
        fast = self.bytes_per_s is None
        if request.method == "GET" and fast and not corrupt and stall is None and f.size:
            raw = request.headers.get("Range")
            if raw is not None and _parse_range(raw, f.size) is None:
                return self._refuse(request, 400, None, f"malformed Range {raw!r}")
            # The kernel's sendfile, as a CDN would serve it (Range and 416 by aiohttp).
            response = web.FileResponse(f.data, headers={"Accept-Ranges": "bytes"})
            self._log(request, 206 if raw is not None else 200)
            return response
        start, end = 0, f.size - 1
        status = 200
        if (raw := request.headers.get("Range")) is not None:
            parsed = _parse_range(raw, f.size)
            if parsed is None:
                return self._refuse(request, 400, None, f"malformed Range {raw!r}")
            if parsed == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{f.size}"
                return self._refuse(request, 416, None, "Range Not Satisfiable")
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        length = end - start + 1 if f.size else 0
        headers["Content-Length"] = str(length)
        response = web.StreamResponse(status=status, headers=headers)
        response.content_type = "application/octet-stream"
        await response.prepare(request)
        self._log(request, status)
        if request.method == "HEAD" or length == 0:
            await response.write_eof()
            return response
        loop = asyncio.get_running_loop()
        try:
            await self._stream(response, f, start, end, corrupt, stall, loop)
        except (ConnectionResetError, ClientConnectionResetError):
            return response  # the client went away (killed mid-file, as a test does)
        await response.write_eof()
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        f: HubFile,
        start: int,
        end: int,
        corrupt: bool,
        stall: tuple[int, threading.Event] | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        with f.data.open("rb") as src:
            src.seek(start)
            position = start
            while position <= end:
                want = min(CHUNK_BYTES, end + 1 - position)
                if stall is not None and position < stall[0] <= position + want:
                    want = stall[0] - position
                chunk = src.read(want)
                if not chunk:
                    break
                if corrupt and position <= f.size // 2 < position + len(chunk):
                    i = f.size // 2 - position
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
                await response.write(chunk)
                await self._pace(len(chunk), loop)
                position += len(chunk)
                if stall is not None and position == stall[0] and not stall[1].is_set():
                    await loop.run_in_executor(None, stall[1].wait)

    async def _pace(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        """Hold a sender until its `n` bytes fit the link's rate (one event loop: no lock)."""
        if self.bytes_per_s is None:
            return
        now = loop.time()
        self._paced_until = max(now, self._paced_until) + n / self.bytes_per_s
        if self._paced_until > now:
            await asyncio.sleep(self._paced_until - now)


def _parse_range(raw: str, size: int) -> tuple[int, int] | str | None:
    """`bytes=a-b`, `bytes=a-` or `bytes=-n` -> (first, last); "unsatisfiable"; None: malformed."""
    if not raw.startswith("bytes=") or "," in raw:
        return None
    first, sep, last = raw.removeprefix("bytes=").partition("-")
    if not sep or not (first.isdigit() or last.isdigit()):
        return None
    if not first:
        n = int(last)
        return (max(0, size - n), size - 1) if n else "unsatisfiable"
    start = int(first)
    end = min(int(last), size - 1) if last.isdigit() else size - 1
    if start >= size or end < start:
        return "unsatisfiable"
    return start, end
