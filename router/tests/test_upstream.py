"""The completions' HTTP/1.1 client (`upstream`): against scripted servers on 127.0.0.1 (keep-alive
reuse, a pooled connection the worker closed, timeouts and breaks that close the connection,
interim answers, bodies streamed as they arrive), and its answer parser fed every framing and
every split of the bytes (hypothesis)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_support import run_async, wait_until

from dsv4_router.upstream import Answer, Upstream, UpstreamError, _Connection

HOST = "127.0.0.1"
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Length: 2\r\n\r\n"
BODY = b"{}"


def answer(body: bytes, *extra: bytes, status: bytes = b"200 OK") -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n" % len(body)
    return head + b"".join(h + b"\r\n" for h in extra) + b"\r\n" + body


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class Worker:
    """A server whose connections each run `script` (with the connection's number)."""

    script: Script
    port: int = 0
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a client closed one

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer, self.connections)
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request (head and Content-Length body), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


async def until_closed(reader: asyncio.StreamReader, worker: Worker) -> None:
    """Wait for the client to close the connection; note it."""
    with contextlib.suppress(ConnectionError):
        await reader.read()
    worker.closed.set()


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[tuple[Worker, Upstream]]:
    worker = Worker(script)
    server = await asyncio.start_server(worker._serve, HOST, 0)
    worker.port = server.sockets[0].getsockname()[1]
    upstream = Upstream(connect_timeout_s=5)
    try:
        yield worker, upstream
    finally:
        upstream.close()
        server.close()


async def send(upstream: Upstream, worker: Worker, timeout_s: float = 10) -> Answer:
    return await upstream.send(HOST, worker.port, REQUEST, BODY, timeout_s=timeout_s)


@run_async
async def test_kept_alive_answers_share_one_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        n = 0
        while (request := await read_request(reader)) is not None:
            assert request == REQUEST + BODY  # head and body as given, nothing added
            n += 1
            writer.write(answer(b"answer %d" % n, b"Content-Type: application/json"))

    async with serving(script) as (worker, upstream):
        for n in (1, 2, 3):
            got = await send(upstream, worker)
            assert (got.status, got.content_type) == (200, "application/json")
            assert ("Content-Type", "application/json") in got.headers
            assert await got.read() == b"answer %d" % n
            assert got.complete
            got.release()
        assert worker.connections == 1
        assert upstream.idle_count() == 1


@run_async
async def test_connection_close_and_http10_answers_are_not_reused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(answer(b"a", b"Connection: close"))
        else:
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nb")
        await until_closed(reader, worker)

    async with serving(script) as (worker, upstream):
        for body in (b"a", b"b"):
            got = await send(upstream, worker)
            assert await got.read() == body
            got.release()
        assert (worker.connections, upstream.idle_count()) == (2, 0)


@run_async
async def test_a_pooled_connection_the_worker_closed_is_replaced_once() -> None:
    """The worker closes a kept-alive connection as the next request arrives, without an
    answer: the request goes again on a new connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(answer(b"first" if n == 1 else b"again"))
        if n == 1:
            await read_request(reader)  # dropped: the connection closes unanswered

    async with serving(script) as (worker, upstream):
        first = await send(upstream, worker)
        assert await first.read() == b"first"
        first.release()
        again = await send(upstream, worker)
        assert await again.read() == b"again"
        assert worker.connections == 2


@run_async
async def test_an_idle_connection_the_worker_closes_leaves_the_pool() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b"ok"))
        await done.wait()

    done = asyncio.Event()
    async with serving(script) as (worker, upstream):
        got = await send(upstream, worker)
        assert await got.read() == b"ok"
        got.release()
        assert upstream.idle_count() == 1
        done.set()  # the worker closes it
        await wait_until(_true_when(lambda: upstream.idle_count() == 0), "the pool to drop it")


@run_async
async def test_a_new_connection_closed_before_an_answer_is_an_error() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    async with serving(script) as (worker, upstream):
        with pytest.raises(UpstreamError, match="closed before an answer"):
            await send(upstream, worker)
        assert worker.connections == 1  # a new connection is never retried


@run_async
async def test_no_head_in_time_is_a_timeout_and_closes_the_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await until_closed(reader, worker)

    async with serving(script) as (worker, upstream):
        with pytest.raises(TimeoutError):
            await send(upstream, worker, timeout_s=0.2)
        await asyncio.wait_for(worker.closed.wait(), 15)


@run_async
async def test_a_send_arms_no_timer_of_its_own() -> None:
    """The head's deadline is the pool's ticker's to watch: a request on a kept-alive
    connection schedules no event-loop timer of its own (one per request cost the hot path)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(answer(b"ok"))

    async with serving(script) as (worker, upstream):
        first = await send(upstream, worker)  # connects (asyncio's connect timeout arms one)
        assert await first.read() == b"ok"
        first.release()
        loop = asyncio.get_running_loop()
        real_call_at = loop.call_at
        armed: list[object] = []

        def call_at(when: float, callback: Callable[..., object], *args: Any) -> Any:
            armed.append(callback)
            return real_call_at(when, callback, *args)

        setattr(loop, "call_at", call_at)  # call_later goes through it too  # noqa: B010
        try:
            for _ in range(5):
                got = await send(upstream, worker)
                assert await got.read() == b"ok"
                got.release()
        finally:
            delattr(loop, "call_at")
        assert worker.connections == 1
        assert all(callback == upstream._tick for callback in armed), armed


@run_async
async def test_cancelling_a_send_closes_the_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await until_closed(reader, worker)

    async with serving(script) as (worker, upstream):
        task = asyncio.create_task(send(upstream, worker))
        await wait_until(_true_when(lambda: worker.connections == 1), "a connection")
        task.cancel()
        await asyncio.wait_for(worker.closed.wait(), 15)
        assert upstream.idle_count() == 0


@run_async
async def test_a_break_mid_body_is_an_error_and_an_unread_body_closes() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        if n == 2:
            await until_closed(reader, worker)

    async with serving(script) as (worker, upstream):
        broken = await send(upstream, worker)
        with pytest.raises(UpstreamError, match="mid-body"):
            await broken.read()
        assert not broken.complete
        broken.close()
        unread = await send(upstream, worker)
        assert not unread.complete
        unread.release()  # not read to the end: closed, never pooled
        await asyncio.wait_for(worker.closed.wait(), 15)
        assert upstream.idle_count() == 0


@run_async
async def test_stream_pieces_arrive_as_they_are_sent() -> None:
    go_on = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata 1\r\n")
        await go_on.wait()
        writer.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        await read_request(reader)

    async with serving(script) as (worker, upstream):
        got = await send(upstream, worker)
        assert got.content_type == "text/event-stream"
        assert await got.read_chunk() == b"data 1"  # before the rest is sent
        go_on.set()
        assert await got.read() == b"data 2"
        assert await got.read_chunk() == b""
        got.release()
        assert upstream.idle_count() == 1


@run_async
async def test_interim_answers_are_skipped_and_a_204_has_no_body() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"done"))
        await read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await read_request(reader)

    async with serving(script) as (worker, upstream):
        got = await send(upstream, worker)
        assert (got.status, await got.read()) == (200, b"done")
        got.release()
        empty = await send(upstream, worker)
        assert (empty.status, empty.take_body()) == (204, b"")
        empty.release()
        assert (worker.connections, upstream.idle_count()) == (1, 1)


@run_async
async def test_bad_answers_and_refused_connections_are_errors() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await until_closed(reader, worker)

    async with serving(script) as (worker, upstream):
        with pytest.raises(UpstreamError, match=r"not an HTTP/1\.x answer"):
            await send(upstream, worker)
        await asyncio.wait_for(worker.closed.wait(), 15)
    free = await asyncio.start_server(lambda r, w: None, HOST, 0)
    port = free.sockets[0].getsockname()[1]
    free.close()
    await free.wait_closed()
    with pytest.raises(OSError):
        await Upstream(connect_timeout_s=5).send(HOST, port, REQUEST, BODY, timeout_s=10)


def _true_when(test: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return test()

    return check


# -- the parser alone: every framing, every split of the bytes


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def framed(body: bytes, framing: str, chunk_sizes: list[int]) -> bytes:
    if framing == "length":
        return answer(body)
    if framing == "close":  # no length: the body ends with the connection
        return b"HTTP/1.1 200 OK\r\n\r\n" + body
    out, rest = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"], body
    for size in chunk_sizes:
        if not rest:
            break
        piece, rest = rest[:size], rest[size:]
        out.append(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
    if rest:
        out.append(b"%X\r\n%s\r\n" % (len(rest), rest))
    out.append(b"0\r\nTrailer: x\r\n\r\n")
    return b"".join(out)


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=300),
    framing=st.sampled_from(["length", "chunked", "close"]),
    chunk_sizes=st.lists(st.integers(1, 64), max_size=8),
    cuts=st.lists(st.integers(0, 1000), max_size=12),
)
def test_every_framing_and_split_gives_the_body_back(
    body: bytes, framing: str, chunk_sizes: list[int], cuts: list[int]
) -> None:
    wire = framed(body, framing, chunk_sizes)
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    segments = [wire[a:b] for a, b in itertools.pairwise(points) if b > a]

    async def scenario() -> None:
        pool = Upstream(connect_timeout_s=1)
        conn = _Connection(pool, (HOST, 1))
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        head = conn.send(REQUEST, BODY)
        assert transport.written == [REQUEST + BODY]
        for segment in segments:
            conn.data_received(segment)
        if framing == "close":
            conn.connection_lost(None)
        got = await head
        assert got.status == 200
        assert await got.read() == body
        assert got.complete
        got.release()
        reused = framing != "close"  # else the connection is gone
        assert pool.idle_count() == int(reused)
        assert not transport.aborted

    asyncio.run(scenario())


def test_a_body_beyond_the_high_water_mark_pauses_reading_until_read() -> None:
    async def scenario() -> Any:
        pool = Upstream(connect_timeout_s=1)
        conn = _Connection(pool, (HOST, 1))
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        head = conn.send(REQUEST, BODY)
        big = bytes(3 << 20)
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(big) + 1))
        conn.data_received(big)
        assert not transport.reading
        got = await head
        assert len(await got.read_chunk()) == len(big)
        assert transport.reading
        conn.data_received(b"!")
        assert await got.read() == b"!"
        got.release()
        return pool.idle_count()

    assert asyncio.run(scenario()) == 1
