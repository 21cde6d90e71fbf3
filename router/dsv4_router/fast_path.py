"""The completions' fast path: the API listener's connections start on `FastConnection`, an
asyncio protocol that reads plain completion requests itself (`client_head`) and answers each
with one write, where aiohttp's server machinery cost more per request than the rest of the
router's hop. Any other request (another path or method, or a head `client_head` leaves to
aiohttp) hands the connection to aiohttp's protocol for the rest of its life
(`transport.set_protocol`), with every byte read so far: it then answers as it always did.

The rules are aiohttp's (`http_guard`): a request's answers go out in order (the next request
is read once the previous one is answered); its handler is a task, cancelled when the client
disconnects; a head without the API key (`api_key`) is a 401 and closes the connection, its
body unread; Content-Length past max_body_bytes is a 413 and a body not in within
body_timeout_s of its head a 408, both closing the connection; no whole request within
idle_timeout_s of connecting or of the last answer closes it; HTTP/1.0 keeps the connection
only on `Connection: keep-alive`, and streams without chunks, to the close. Each connection
counts against the listener's bound (`Guard.fast`: busy while a request is answered).
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Final, cast

from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_protocol import RequestHandler

from dsv4_common.api.api_key import NO_API_KEY, ApiKeyRule
from dsv4_common.api.http_rules import (
    BodyError,
    body_timeout,
    check_content_length,
    error_document,
    one_line,
)
from dsv4_router.busy_poll import BusyPoll
from dsv4_router.client_head import ClientHead, parse_head
from dsv4_router.errors import json_answer, upstream_message
from dsv4_router.http_auth import unauthorized_answer
from dsv4_router.http_guard import Guard, log_level
from dsv4_router.reply import Headers, Incoming

# The paths served here (POST only); the rest goes to aiohttp.
FAST_PATHS: Final = frozenset({"/v1/completions", "/v1/chat/completions"})
# Bytes of later (pipelined) requests buffered while one is answered before reading pauses.
MAX_BUFFERED_BYTES: Final = 1 << 20
_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}
_SERVER: Final = f"Server: {SERVER_SOFTWARE}\r\n".encode()

Complete = Callable[[Incoming, "FastReply"], Awaitable[None]]


class FastFront:
    """What the fast connections of one listener share."""

    def __init__(
        self,
        complete: Complete,
        guard: Guard,
        hand_off: Callable[[], RequestHandler],
        busy_poll: BusyPoll | None = None,
        *,
        auth: ApiKeyRule = NO_API_KEY,
    ) -> None:
        """`complete`: answers one completion (its body in, within the size limit);
        `hand_off`: a new aiohttp protocol for a connection this path does not serve;
        `busy_poll`: kicked at each write (None: never spins); `auth`: the API key every
        completion must carry (its paths always want it: `api_key`)."""
        self.complete = complete
        self.auth = auth
        self.busy_poll = busy_poll if busy_poll is not None else BusyPoll(0.0)
        self.guard = guard
        self.limits = guard.limits
        self.hand_off = hand_off
        self.date = _Date()

    def __call__(self) -> FastConnection:
        return FastConnection(self)

    def close_all(self) -> None:
        """Close every connection still here (the listener is stopping)."""
        for conn in list(self.guard.fast):
            conn.close()


class _Date:
    """The Date header, made once a second."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n".encode()
        return self._line


class FastConnection(asyncio.Protocol):
    """One client connection (until handed to aiohttp)."""

    def __init__(self, front: FastFront) -> None:
        self._front = front
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._head: ClientHead | None = None  # its body still arriving
        self._task: asyncio.Task[None] | None = None  # the request being answered
        self._since_s = self._loop.time()  # connected, answered, or (body) the head came
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused
        self.opened_s = time.monotonic()
        self.evicted = False

    # -- what the listener's bound sees (`http_listen`)

    @property
    def busy(self) -> bool:
        """A whole request is in and being answered."""
        return self._task is not None

    def close(self) -> None:
        """Closed to make room (or the listener stops): an idle connection just closes."""
        self.evicted = True
        if self._transport is not None:
            self._transport.close()

    # -- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._front.guard.fast.add(self)
        self._arm(self._front.limits.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._front.guard.fast.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()  # the handler's cancellation closes its upstream request
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        if self._task is None:
            self._next()
        elif len(self._buf) > MAX_BUFFERED_BYTES and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None

    # -- reading requests

    def _next(self) -> None:
        """Start on the next request in the buffer, if all of it has arrived."""
        head = self._head
        if head is None:
            parsed = parse_head(self._buf)
            if parsed is None:
                return
            if not isinstance(parsed, ClientHead) or not _fast(parsed):
                self._hand_off()
                return
            head = parsed
            if self._front.auth.enabled and not self._front.auth.allows(_authorization(head)):
                self._unauthorized(head)
                return
            try:
                check_content_length(head.content_length, self._front.limits.max_body_bytes)
            except BodyError as exc:
                self._refuse(head, exc)
                return
            self._head, self._since_s = head, self._loop.time()
            self._arm_by(self._since_s + self._front.limits.body_timeout_s)
        end = head.end + head.content_length
        if len(self._buf) < end:
            return  # the body is still arriving (the timer watches it)
        buf = self._buf
        body = buf[head.end : end] if head.end or end < len(buf) else buf
        self._buf = buf[end:]
        self._head = None
        incoming = Incoming(head.method, head.target, head.path, head.headers, body)
        self._task = self._loop.create_task(self._answer(head, incoming))

    async def _answer(self, head: ClientHead, incoming: Incoming) -> None:
        reply = FastReply(self, head)
        front = self._front
        try:
            await front.complete(incoming, reply)
            if reply.started and not reply.ended:  # as aiohttp ends a handler's stream
                await reply.end()
        except asyncio.CancelledError:  # as aiohttp: the connection ends with the handler
            if not self.evicted:
                front.guard.log.info("%s: cancelled (the client disconnected)", _where(head))
            reply.keep_alive = False
        except ConnectionError:
            front.guard.log.info("%s: aborted (the client went away)", _where(head))
        except Exception:
            front.guard.log.exception("%s: failed", _where(head))
            if not reply.started:
                document = error_document("Internal Server Error", "server_error")
                reply.answer(*json_answer(500, document))
            reply.keep_alive = False
        finally:
            self._task = None
        if reply.status >= 400:
            level = log_level(reply.status, reply.retry_after)
            message = one_line(upstream_message(reply.body))
            front.guard.log.log(level, "%s -> %d: %s", _where(head), reply.status, message)
        self._done(reply.keep_alive)

    def _done(self, keep_alive: bool) -> None:
        """The answer is out: the next request, or the close."""
        transport = self._transport
        if transport is None:
            return
        if not keep_alive:
            transport.close()
            return
        self._since_s = self._loop.time()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if self._buf:
            self._next()

    def _refuse(self, head: ClientHead, exc: BodyError) -> None:
        """413 or 408: answered and closed, the rest of the body unread."""
        reply = FastReply(self, head)
        reply.keep_alive = False
        reply.answer(*json_answer(exc.status, exc.document()))
        log = self._front.guard.log
        log.log(log_level(exc.status, False), "%s -> %d: %s", _where(head), exc.status, exc)
        if self._transport is not None:
            self._transport.close()

    def _unauthorized(self, head: ClientHead) -> None:
        """401 before the body is read: answered and closed, the body unread."""
        reply = FastReply(self, head)
        reply.keep_alive = False
        reply.answer(*unauthorized_answer(_authorization(head)))
        self._front.guard.log.info("%s -> 401: %s", _where(head), upstream_message(reply.body))
        if self._transport is not None:
            self._transport.close()

    def _hand_off(self) -> None:
        """aiohttp's protocol takes the connection, and what was read."""
        transport = self._transport
        assert transport is not None and self._task is None
        self._front.guard.fast.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        protocol = self._front.hand_off()
        self._front.guard.opened_s[protocol] = self.opened_s
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._reading_paused:
            transport.resume_reading()
        buf, self._buf, self._transport = self._buf, b"", None
        if buf:
            protocol.data_received(buf)

    # -- timeouts: one timer per connection, moved on lazily

    def _arm(self, delay_s: float) -> None:
        self._timer = self._loop.call_at(self._loop.time() + delay_s, self._on_timer)

    def _arm_by(self, deadline_s: float) -> None:
        """The timer fires by `deadline_s` (a body's timeout may be shorter than idle's)."""
        timer = self._timer
        if timer is not None and timer.when() <= deadline_s:
            return
        if timer is not None:
            timer.cancel()
        self._timer = self._loop.call_at(deadline_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None:
            return
        limits, now_s = self._front.limits, self._loop.time()
        if self._task is not None:
            self._arm(limits.idle_timeout_s)  # answering: the next wait starts after
            return
        head = self._head
        timeout_s = limits.body_timeout_s if head is not None else limits.idle_timeout_s
        left_s = self._since_s + timeout_s - now_s
        if left_s > 0:
            self._arm(left_s)
        elif head is not None:
            self._refuse(head, body_timeout(limits.body_timeout_s))
        else:
            transport.close()  # no whole request in time: idle or headers still arriving

    # -- writing answers (`FastReply`)

    def write(self, data: bytes) -> bool:
        if self._transport is None:
            return False
        self._transport.write(data)
        self._front.busy_poll.kick()  # the client's next request may follow at once
        return True

    async def drained(self) -> bool:
        """Writing may go on (the client read enough); False: the client has gone."""
        if self._drained is not None:
            await self._drained
        return self._transport is not None

    def end(self) -> None:
        """A body that ends with the connection (HTTP/1.0 streaming)."""
        if self._transport is not None:
            self._transport.close()


class FastReply:
    """A Reply (`reply`) written straight to a fast connection."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_held",
        "_minor",
        "body",
        "ended",
        "keep_alive",
        "retry_after",
        "status",
    )

    def __init__(self, conn: FastConnection, head: ClientHead) -> None:
        self._conn = conn
        self._minor = head.minor
        self._chunked = False
        self._held = b""  # a streamed answer's head, until its first bytes of body
        self.keep_alive = head.keep_alive
        self.status = 0  # 0: nothing sent yet
        self.body = b""  # an error answer's, for the log line
        self.retry_after = False
        self.ended = False  # the whole answer is out (`answer`, or `end` after `start`)

    @property
    def started(self) -> bool:
        return self.status != 0

    def _head(self, status: int, headers: Headers, framing: bytes) -> bytes:
        self.status = status
        lines = [f"HTTP/1.{self._minor} {status} {_REASONS.get(status, '')}\r\n".encode()]
        for name, value in headers:
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
            if status >= 400 and name.lower() == "retry-after":
                self.retry_after = True
        lines.append(framing)
        lines.append(self._conn._front.date.line())
        lines.append(_SERVER)
        if not self.keep_alive:
            lines.append(b"Connection: close\r\n\r\n" if self._minor else b"\r\n")
        else:
            lines.append(b"\r\n" if self._minor else b"Connection: keep-alive\r\n\r\n")
        return b"".join(lines)

    def answer(self, status: int, headers: Headers, body: bytes) -> None:
        if status >= 400:
            self.body = body
        head = self._head(status, headers, b"Content-Length: %d\r\n" % len(body))
        self.ended = True
        self._conn.write(head + body)

    async def start(self, status: int, headers: Headers) -> None:
        if self._minor:
            self._chunked = True
            framing = b"Transfer-Encoding: chunked\r\n"
        else:
            self.keep_alive = False  # HTTP/1.0: the body runs to the close
            framing = b""
        # Held until the first write (or the end), as aiohttp holds a stream's head: the head
        # and the first event leave in one write, and the client wakes once for both.
        self._held = self._head(status, headers, framing)

    async def write(self, data: bytes) -> bool:
        if not data:
            return True
        framed = b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data
        if self._held:
            framed, self._held = self._held + framed, b""
        return self._conn.write(framed) and await self._conn.drained()

    async def end(self) -> None:
        self.ended = True
        last = b"0\r\n\r\n" if self._chunked else b""
        if self._held:
            last, self._held = self._held + last, b""
        if not self._conn.write(last):
            raise ConnectionResetError("the client has gone")
        if not self._chunked:
            self._conn.end()


def _fast(head: ClientHead) -> bool:
    return head.method == "POST" and head.path in FAST_PATHS


def _authorization(head: ClientHead) -> bytes | None:
    for name, value in head.headers:
        if len(name) == 13 and name.lower() == b"authorization":
            return value
    return None


def _where(head: ClientHead) -> str:
    return one_line(f"{head.method} {head.path}")
