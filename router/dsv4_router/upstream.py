"""HTTP/1.1 to the workers' APIs over pooled keep-alive connections: the completions' hot path
(asyncio protocols; aiohttp's client cost more per request than the rest of the router's hop).

`Upstream.send(host, port, head, body, timeout_s=...)` returns once the answer's status line
and headers have arrived (`Answer`), or raises TimeoutError past `timeout_s`. Its body then
comes with `read()` (all of it) or `read_chunk()` (what has arrived, as it arrives; chunked
transfer coding removed, any content coding kept). The caller ends every answer with
`release()`, which pools the connection only if the body was read to its end and both sides
keep it alive, or `close()`, which closes it at once (a worker takes that as an abort).
Cancelling `send`, or its timing out, closes the connection too. NOTE: the answer's head is
awaited without a timer of its own: the pool's ticker (below) looks at every connection
awaiting one, so `timeout_s` may be overrun by up to one `look_every_s`.

A connection taken from the pool may have been closed by the worker while idle: if it ends
before any byte of the answer, the request is sent once more on a new connection (the worker
never saw it). Every other failure is `UpstreamError` (a ConnectionError), a connect timeout
included.

`send(..., watch=verdict)` watches the worker's silence from the request on until the answer
is released or closed: every `look_every_s` (one ticker for all the looked-at connections) it
asks `verdict` about the seconds without a byte, and when that names a reason the connection
closes and the waiting `send` or read raises `UpstreamStalled`. NOTE: silence is counted up
to the previous look, by which time the event loop had read everything that had arrived
(each look runs in a later loop iteration than the one before): a starved router does not
take its own lag for the worker's silence (`liveness.Silence`). Bytes the caller has not
taken yet, or reading paused by flow control, count as heard (the router, not the worker,
holds them up).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
from typing import Final, cast

from dsv4_router.busy_poll import BusyPoll
from dsv4_router.liveness import Silence

MAX_HEAD_BYTES: Final = 65536
MAX_IDLE_PER_ADDRESS: Final = 512
# Idle connections older than this are not reused (a worker's own idle timeout is 75 s).
IDLE_REUSE_S: Final = 30.0
# How often watched connections are looked at (`send(..., watch=...)`).
LOOK_EVERY_S: Final = 0.2
# Reading pauses while this much of a body waits for the caller (flow control).
HIGH_WATER_BYTES: Final = 1 << 20
_NO_BODY_STATUS: Final = frozenset({204, 304})

Address = tuple[str, int]


class UpstreamError(ConnectionError):
    """No usable answer: connecting failed or timed out, the connection broke, or the answer
    is not HTTP/1.1 this client reads."""


class UpstreamStalled(UpstreamError):
    """A watch gave up on a silent worker (the message says why)."""


# Seconds the worker has been silent -> why to give up on it, or None to wait on.
Watch = Callable[[float], str | None]


class _Stale(Exception):
    """A pooled connection ended before any byte of the answer."""


class Answer:
    """One answer: status and headers (as received, in order), then the body."""

    __slots__ = ("_conn", "content_type", "headers", "status")

    def __init__(
        self, conn: _Connection, status: int, headers: list[tuple[str, str]], content_type: str
    ) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self.content_type = content_type  # the media type, lower-cased ("": none)

    @property
    def complete(self) -> bool:
        """The whole body has been read."""
        return self._conn.body_done and not self._conn.pieces

    def take_body(self) -> bytes | None:
        """The whole body, read now, if all of it has arrived; else None (nothing is read)."""
        conn = self._conn
        if not conn.body_done:
            return None
        body = b"".join(conn.pieces)
        conn.pieces.clear()
        return body

    async def read_chunk(self) -> bytes:
        """The next piece of the body as it arrives; b"" once it has all been read."""
        return await self._conn.next_piece()

    async def read(self) -> bytes:
        pieces = []
        while piece := await self._conn.next_piece():
            pieces.append(piece)
        return b"".join(pieces)

    def release(self) -> None:
        self._conn.finish(reuse=self.complete)

    def close(self) -> None:
        self._conn.finish(reuse=False)


class _Connection(asyncio.Protocol):
    """One connection and its answer parser (one request at a time)."""

    def __init__(self, pool: Upstream, address: Address) -> None:
        self._pool = pool
        self.address = address
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.idle_since_s = 0.0
        self._head_by_s = 0.0  # (time.monotonic) the awaited head's deadline
        self._watch: Watch | None = None
        self._silence = Silence(0.0, 0.0)
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._got_bytes = False
        self._head: asyncio.Future[Answer] | None = None
        self._in_body = False
        self._length: int | None = None  # bytes of body (or of the current chunk) left
        self._chunked = False
        self._chunk_state = 0  # 0: size line, 1: data, 2: CRLF after data, 3: trailers
        self._until_close = False
        self.keep_alive = True
        self.body_done = False
        self.pieces: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    @property
    def usable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    # -- the caller's side

    def send(
        self,
        head: bytes,
        body: bytes,
        watch: Watch | None = None,
        *,
        head_by_s: float = math.inf,
    ) -> asyncio.Future[Answer]:
        """`head_by_s`: the head's deadline (time.monotonic), past which it fails with
        TimeoutError (seen by the pool's ticker)."""
        assert self._transport is not None and self._head is None, "one request at a time"
        self._head = self._loop.create_future()
        self._head_by_s = head_by_s
        self._watch = watch
        if watch is not None:
            self._silence.heard_s = self._silence.looked_s = time.monotonic()
        self._pool.look_at(self)
        self._transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self._transport.write(body)
        self._pool.busy_poll.kick()  # the answer may be back soon: stay awake for it
        return self._head

    async def next_piece(self) -> bytes:
        while not self.pieces:
            if self.body_done:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        piece = self.pieces.popleft()
        self._queued -= len(piece)
        if self._paused and self._queued < HIGH_WATER_BYTES and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return piece

    def finish(self, *, reuse: bool) -> None:
        self._unwatch()
        if reuse and self.keep_alive and self.body_done and self.usable and not self._buf:
            if self._paused and self._transport is not None:
                self._transport.resume_reading()
            self._reset()
            self._pool.put_idle(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._unwatch()
        if self._transport is not None:
            self._transport.abort()
            self._transport = None

    # -- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._head is None:  # idle in the pool (the worker closed it)
            self._pool.forget(self)
            return
        if self._in_body and self._until_close and not self.body_done:
            self.body_done = True
            self._wake()
            return
        why = f": {exc}" if exc else ""
        if self._head is not None and not self._head.done():
            error: Exception = (
                _Stale() if not self._got_bytes else UpstreamError(f"closed mid-answer{why}")
            )
            self._head.set_exception(error)
        elif self._in_body and not self.body_done:
            self._fail(UpstreamError(f"the connection closed mid-body{why}"))

    def data_received(self, data: bytes) -> None:
        if self._head is None:  # bytes on an idle connection: not one to reuse
            self.abort()
            return
        self._got_bytes = True
        self._silence.heard_s = time.monotonic()
        self._buf += data
        try:
            if not self._in_body:
                self._parse_head()
            if self._in_body and self._buf:
                self._parse_body()
        except UpstreamError as exc:
            if self._head is not None and not self._head.done():
                self._head.set_exception(exc)
            else:
                self._fail(exc)
            self.abort()

    def _parse_head(self) -> None:
        while not self._in_body:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise UpstreamError(f"an answer head over {MAX_HEAD_BYTES} bytes")
                return
            lines = self._buf[:end].decode("latin-1").split("\r\n")
            self._buf = self._buf[end + 4 :]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise UpstreamError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
            status = int(code)
            headers = []
            connection = content_type = ""
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise UpstreamError(f"a malformed header line: {line[:80]!r}")
                name, value = name.strip(), value.strip()
                headers.append((name, value))
                name = name.lower()
                if name == "content-length":
                    if not value.isdigit():
                        raise UpstreamError(f"a bad Content-Length: {value[:40]!r}")
                    self._length = int(value)
                elif name == "transfer-encoding":
                    self._chunked = value.lower().endswith("chunked")
                elif name == "connection":
                    connection = value.lower()
                elif name == "content-type":
                    content_type = value.partition(";")[0].strip().lower()
            if 100 <= status < 200:  # informational: the real answer follows
                self._length, self._chunked = None, False
                continue
            self.keep_alive = "close" not in connection and (
                version == "HTTP/1.1" or "keep-alive" in connection
            )
            self._in_body = True
            if status in _NO_BODY_STATUS:
                self._chunked, self._length = False, 0
            if self._chunked:
                self._length = None
            elif self._length is None:
                self._until_close, self.keep_alive = True, False
            if self._length == 0 and not self._chunked:
                self.body_done = True
            assert self._head is not None
            if not self._head.done():
                self._head.set_result(Answer(self, status, headers, content_type))

    def _parse_body(self) -> None:
        if self._until_close:
            self._push(self._buf)
            self._buf = b""
        elif not self._chunked:
            assert self._length is not None
            if len(self._buf) <= self._length:  # the usual case: no copy
                piece, self._buf = self._buf, b""
            else:
                piece, self._buf = self._buf[: self._length], self._buf[self._length :]
            self._length -= len(piece)
            self.body_done = self._length == 0
            self._push(piece)
        else:
            self._parse_chunks()
        if self.body_done and self._buf:
            self.keep_alive = False  # bytes past the answer: the connection is not reusable

    def _parse_chunks(self) -> None:
        while self._buf and not self.body_done:
            if self._chunk_state == 0:
                end = self._buf.find(b"\r\n")
                if end < 0:
                    if len(self._buf) > 1024:
                        raise UpstreamError("a chunk size line over 1024 bytes")
                    return
                size_text = self._buf[:end].split(b";", 1)[0].strip()
                try:
                    self._length = int(size_text, 16)
                except ValueError:
                    raise UpstreamError(f"a bad chunk size: {size_text[:40]!r}") from None
                self._buf = self._buf[end + 2 :]
                self._chunk_state = 1 if self._length else 3
            elif self._chunk_state == 1:
                assert self._length is not None
                piece, self._buf = self._buf[: self._length], self._buf[self._length :]
                self._length -= len(piece)
                self._push(piece)
                if self._length == 0:
                    self._chunk_state = 2
            elif self._chunk_state == 2:
                if len(self._buf) < 2:
                    return
                if self._buf[:2] != b"\r\n":
                    raise UpstreamError("a chunk not followed by CRLF")
                self._buf = self._buf[2:]
                self._chunk_state = 0
            else:  # trailers: lines up to an empty one
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return
                self._buf = self._buf[end + 2 :]
                if end == 0:
                    self.body_done = True
                    self._wake()

    def _push(self, piece: bytes) -> None:
        if piece:
            self.pieces.append(piece)
            self._queued += len(piece)
            if self._queued >= HIGH_WATER_BYTES and not self._paused and self._transport:
                self._paused = True
                self._transport.pause_reading()
        if piece or self.body_done:
            self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:  # the first cause stays (closing after a stall is no news)
            self._error = error
        self._wake()

    def look(self, now_s: float) -> None:
        """The pool's ticker: time out a head past its deadline; give up on the worker if the
        watch says so."""
        head = self._head
        awaited = head is not None and not head.done()
        if awaited and now_s >= self._head_by_s:
            assert head is not None
            head.set_exception(TimeoutError())  # `send` closes the connection
            return
        watch = self._watch
        if watch is None or self.body_done or self._transport is None:
            if not awaited:
                self._unwatch()
            return
        if self.pieces or self._paused:  # held up here, not by the worker
            self._silence.heard_s = now_s
        why = watch(self._silence.look(now_s))
        if why is None:
            return
        error = UpstreamStalled(why)
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        else:
            self._fail(error)
        self.abort()

    def _unwatch(self) -> None:
        self._watch = None
        self._pool.unwatch(self)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Upstream:
    """Connections to the workers, idle ones kept per address (newest reused first)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        idle_reuse_s: float = IDLE_REUSE_S,
        look_every_s: float = LOOK_EVERY_S,
        busy_poll: BusyPoll | None = None,
    ) -> None:
        """`busy_poll`: kicked at each request sent (None: never spins)."""
        self.busy_poll = busy_poll if busy_poll is not None else BusyPoll(0.0)
        self._connect_timeout_s = connect_timeout_s
        self._idle_reuse_s = idle_reuse_s
        self._look_every_s = look_every_s
        self._idle: dict[Address, list[_Connection]] = {}
        self._watched: set[_Connection] = set()
        self._ticker: asyncio.TimerHandle | None = None  # while any connection is watched
        self._closed = False

    async def send(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes,
        *,
        timeout_s: float,
        watch: Watch | None = None,
    ) -> Answer:
        """Send one request (`head`: request line and headers, Content-Length included);
        returns when the answer's head has arrived. TimeoutError when it has not within
        `timeout_s` (connecting included); the connection is closed then. `watch`: give up
        on a silent worker (`UpstreamStalled`), from the request on to the answer's end."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        head_by_s = time.monotonic() + timeout_s
        address = (host, port)
        conn = self._take_idle(address)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(address, deadline_s)
        while True:
            try:
                return await conn.send(head, body, watch, head_by_s=head_by_s)
            except _Stale:
                conn.abort()
                if not reused:
                    raise UpstreamError("the connection closed before an answer") from None
            except BaseException:
                conn.abort()
                raise
            # Closed by the worker while idle (it never saw the request): once more, afresh.
            reused = False
            conn = await self._connect(address, deadline_s)

    async def _connect(self, address: Address, deadline_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        connect_s = min(self._connect_timeout_s, deadline_s - loop.time())
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, address), *address)
        except TimeoutError:
            if connect_s < self._connect_timeout_s:
                raise  # the caller's deadline came first
            raise UpstreamError(f"no connection within {self._connect_timeout_s:g} s") from None
        return conn

    def _take_idle(self, address: Address) -> _Connection | None:
        idle = self._idle.get(address)
        now_s = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable and now_s - conn.idle_since_s < self._idle_reuse_s:
                return conn
            conn.abort()
        return None

    def put_idle(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.address, [])
        if self._closed or len(idle) >= MAX_IDLE_PER_ADDRESS:
            conn.abort()
            return
        conn.idle_since_s = time.monotonic()
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.address)
        if idle is not None and conn in idle:
            idle.remove(conn)

    def look_at(self, conn: _Connection) -> None:
        """`conn.look` on every tick until `unwatch`."""
        self._watched.add(conn)
        if self._ticker is None:
            loop = asyncio.get_running_loop()
            self._ticker = loop.call_later(self._look_every_s, self._tick)

    def unwatch(self, conn: _Connection) -> None:
        self._watched.discard(conn)

    def _tick(self) -> None:
        now_s = time.monotonic()
        for conn in list(self._watched):
            conn.look(now_s)
        self._ticker = None
        if self._watched:
            loop = asyncio.get_running_loop()
            self._ticker = loop.call_later(self._look_every_s, self._tick)

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        """Close every idle connection; answers still open close as they end."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
