"""A file object that hashes what is written through it, so a download is verified as it
streams (no second pass over the bytes). It keeps the hash right when the writer seeks back and
truncates (huggingface_hub's `http_get` does when a server ignores a Range request) by hashing
the kept prefix again, and reports each change of the file's length to a callback (progress).
The hashing runs on one background thread, in order, while the caller receives the next chunk
(hashlib releases the GIL on large updates): on a CPU-bound link the check costs no wall time.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Final

from dsv4_fetch.hub import RepoFile

READ_CHUNK_BYTES: Final = 8 << 20
MAX_PENDING_UPDATES: Final = 4  # chunks queued for the hash thread (~40 MB at hf's 10 MB)
# One thread for every writer: a writer's updates run in the order it queued them (FIFO).
_HASH_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-hash")


def new_hasher(f: RepoFile) -> Any:
    """sha256 for an LFS file; git's blob hash (sha1 of `blob <size>\\0` + content) otherwise."""
    if f.sha256 is not None:
        return hashlib.sha256()
    return hashlib.sha1(f"blob {f.size}\0".encode(), usedforsecurity=False)


def expected_digest(f: RepoFile) -> str:
    return f.sha256 if f.sha256 is not None else f.blob_id


class HashingWriter:
    """Writes to `raw` (positioned at the end of what `path` holds) and hashes every byte the
    file ends up with. `grew(delta)` is told of each change in length."""

    def __init__(self, raw: BinaryIO, path: Path, f: RepoFile, grew: Callable[[int], None]) -> None:
        self._raw = raw
        self._path = path
        self._file = f
        self._grew = grew
        self._hasher = new_hasher(f)
        self._hashed = 0
        self._pending: deque[Future[None]] = deque()
        self._rehash(raw.tell())

    def _drain(self) -> None:
        """Wait until every queued update is in the hash."""
        while self._pending:
            self._pending.popleft().result()

    def _rehash(self, length: int) -> None:
        """Hash the file's first `length` bytes afresh."""
        self._drain()
        self._raw.flush()
        self._hasher = new_hasher(self._file)
        left = length
        with self._path.open("rb") as src:
            while left > 0:
                chunk = src.read(min(READ_CHUNK_BYTES, left))
                if not chunk:
                    break
                self._hasher.update(chunk)
                left -= len(chunk)
        self._hashed = length - left

    def write(self, data: bytes) -> int:
        written = self._raw.write(data)
        self._pending.append(_HASH_THREAD.submit(self._hasher.update, bytes(data)))
        while len(self._pending) > MAX_PENDING_UPDATES:
            self._pending.popleft().result()
        self._hashed += len(data)
        self._grew(len(data))
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self._raw.seek(offset, whence)
        if position != self._hashed:
            before = self._hashed
            self._rehash(position)
            self._grew(self._hashed - before)
        return position

    def truncate(self, size: int | None = None) -> int:
        length = self._raw.truncate(size)
        if length < self._hashed:
            before = self._hashed
            self._rehash(length)
            self._grew(self._hashed - before)
        return length

    def flush(self) -> None:
        self._raw.flush()

    @property
    def length(self) -> int:
        return self._hashed

    def hexdigest(self) -> str:
        self._drain()
        return str(self._hasher.hexdigest())
