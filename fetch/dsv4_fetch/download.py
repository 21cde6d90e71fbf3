"""One file of a snapshot into the cache, resumably: `huggingface_hub` asks the hub for the file's
metadata (`get_hf_file_metadata`: its commit, ETag, size and where its bytes are, a CDN for LFS
files) and streams it (`file_download.http_get`, with a Range request from what the partial
blob already holds: a fetch killed mid-file goes on from there). Every byte is hashed as it is
written; a file whose hash differs from the hub's listing is downloaded once more from scratch,
then refused (HashMismatch). Only a verified file becomes its blob and gets its snapshot link.

Why not `hf_hub_download`: it resumes only within one process (its partial files are
per-process and deleted on failure), and it does not check the content's hash. Files the hub
serves through Xet (`hf_xet` installed and the hub offering it) go through `hf_hub_download`,
whose Xet client resumes by chunks, and are hashed afterwards.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from filelock import FileLock
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from dsv4_fetch.errors import FetchError
from dsv4_fetch.hashing import READ_CHUNK_BYTES, HashingWriter, expected_digest, new_hasher
from dsv4_fetch.hub import RepoFile, Snapshot, hub_errors
from dsv4_fetch.layout import RepoCache

ATTEMPTS = 2  # a hash mismatch is downloaded once more before it is refused


def fetch_file(
    snapshot: Snapshot,
    f: RepoFile,
    cache: RepoCache,
    *,
    endpoint: str | None,
    token: str | None,
    grew: Callable[[int], None],
) -> None:
    """Make `snapshots/<commit>/<f.path>` hold `f`, verified. `grew(delta)`: bytes gained (or
    lost, when a partial is discarded) on disk."""
    blob = cache.blob(f)
    if _complete(blob, f):
        cache.link(snapshot.commit, f)
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    # One writer per blob (two fetches of one repo in one cache: the second waits, then finds
    # the blob). Best effort on filesystems without working locks, as huggingface_hub's.
    with FileLock(str(cache.partial(f)) + ".lock"):
        if not _complete(blob, f):
            _download(snapshot, f, cache, endpoint=endpoint, token=token, grew=grew)
    cache.link(snapshot.commit, f)


def partial_bytes(f: RepoFile, cache: RepoCache) -> int:
    """What a download of `f` already holds on disk (its blob, or a partial not past its size)."""
    if _complete(cache.blob(f), f):
        return f.size
    try:
        size = cache.partial(f).stat().st_size
    except OSError:
        return 0
    return size if size <= f.size else 0


def _complete(blob: Path, f: RepoFile) -> bool:
    try:
        return blob.stat().st_size == f.size
    except OSError:
        return False


def _download(
    snapshot: Snapshot,
    f: RepoFile,
    cache: RepoCache,
    *,
    endpoint: str | None,
    token: str | None,
    grew: Callable[[int], None],
) -> None:
    source = snapshot.source
    url = hf_hub_url(snapshot.repo_id, f.path, revision=snapshot.commit, endpoint=endpoint)
    with hub_errors(source, f.path):
        meta = get_hf_file_metadata(url, token=token or False, endpoint=endpoint)
    if meta.commit_hash not in (None, snapshot.commit):
        raise FetchError(
            "HubUnavailable",
            f"{source.uri}: {f.path}: asked at {snapshot.commit}, the hub answered for "
            f"{meta.commit_hash}",
        )
    if meta.size is not None and meta.size != f.size:
        raise FetchError(
            "SizeMismatch",
            f"{source.uri}: {f.path}: the hub lists {f.size} bytes but serves {meta.size}",
        )
    if meta.xet_file_data is not None and _xet_available():
        _download_xet(snapshot, f, cache, endpoint=endpoint, token=token, grew=grew)
        return
    # The bytes may be on a CDN: send the token only to the endpoint's own origin.
    headers = build_hf_headers(
        token=(token or False) if _same_origin(url, meta.location) else False
    )
    partial = cache.partial(f)
    for attempt in range(1, ATTEMPTS + 1):
        if partial.exists() and partial.stat().st_size > f.size:
            grew(-partial.stat().st_size)
            partial.unlink()
        partial.touch()
        with partial.open("r+b") as raw, _space_errors(source, f, cache):
            raw.seek(0, os.SEEK_END)
            writer = HashingWriter(raw, partial, f, grew)
            with hub_errors(source, f.path):
                http_get(
                    meta.location,
                    writer,  # type: ignore[arg-type]
                    resume_size=writer.length,
                    headers=headers,
                    expected_size=f.size,
                    displayed_filename=f.path,
                )
            # No fsync: the blob is renamed into place after the bytes were hashed as written
            # (ext4 and XFS order a rename after its file's data; NFS flushes on close).
            raw.flush()
        digest = writer.hexdigest()
        if writer.length == f.size and digest == expected_digest(f):
            partial.replace(cache.blob(f))
            return
        grew(-writer.length)
        partial.unlink()
        if attempt == ATTEMPTS:
            raise FetchError(
                "HashMismatch",
                f"{source.uri}: {f.path}: downloaded {ATTEMPTS} times, its "
                f"{'sha256' if f.sha256 else 'git blob hash'} is {digest}, the hub lists "
                f"{expected_digest(f)}",
            )


def _download_xet(
    snapshot: Snapshot,
    f: RepoFile,
    cache: RepoCache,
    *,
    endpoint: str | None,
    token: str | None,
    grew: Callable[[int], None],
) -> None:
    """Through huggingface_hub's Xet client into the same cache, then hashed."""
    with hub_errors(snapshot.source, f.path), _space_errors(snapshot.source, f, cache):
        path = hf_hub_download(
            snapshot.repo_id,
            f.path,
            revision=snapshot.commit,
            cache_dir=cache.cache_dir,
            endpoint=endpoint,
            token=token or False,
        )
    hasher = new_hasher(f)
    with open(path, "rb") as src:
        while chunk := src.read(READ_CHUNK_BYTES):
            hasher.update(chunk)
    if hasher.hexdigest() != expected_digest(f):
        Path(path).unlink(missing_ok=True)
        cache.blob(f).unlink(missing_ok=True)
        raise FetchError("HashMismatch", f"{snapshot.source.uri}: {f.path}: hash differs (Xet)")
    grew(f.size)


def _xet_available() -> bool:
    try:
        from huggingface_hub.utils import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


def _same_origin(a: str, b: str) -> bool:
    pa, pb = urlparse(a), urlparse(b)
    return (pa.scheme, pa.hostname, pa.port) == (pb.scheme, pb.hostname, pb.port)


class _space_errors:
    """ENOSPC while writing: the volume is too small (VolumeTooSmall), naming what is free."""

    def __init__(self, source: object, f: RepoFile, cache: RepoCache) -> None:
        self._uri = getattr(source, "uri", str(source))
        self._f = f
        self._cache = cache

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            free = shutil.disk_usage(self._cache.cache_dir).free
            raise FetchError(
                "VolumeTooSmall",
                f"{self._uri}: {self._f.path}: no space left on the cache volume "
                f"({self._cache.cache_dir}: {free} bytes free)",
            ) from exc
