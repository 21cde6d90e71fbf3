"""The fast completion path (`fast_path`) on 127.0.0.1: first its connection protocol alone, in
front of a recording `complete` and a recording aiohttp stand-in (split heads and bodies,
pipelining, keep-alive, HTTP/1.0, Connection: close, 413, 408, idle close, hand-off with every
byte, a client leaving); then the router end to end (X-Request-Id, hand-off mid-connection)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st
from router_support import (
    JSON_ANSWER,
    STREAM_EVENTS,
    StubWorker,
    routed,
    run_async,
    wait_until,
)

from dsv4_common.api.http_rules import HttpLimits
from dsv4_router.busy_poll import BusyPoll
from dsv4_router.errors import json_answer
from dsv4_router.fast_path import FastConnection, FastFront, FastReply
from dsv4_router.http_guard import Guard
from dsv4_router.reply import Incoming

BODY = b'{"prompt": "hi", "max_tokens": 3}'
STREAM = b'{"prompt": "hi", "stream": true}'
HANG = b'{"prompt": "hang"}'
EVENTS = (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")


def request(body: bytes = BODY, *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n%s" % (version, extra, len(body), body)
    )


class Taker(asyncio.Protocol):
    """aiohttp's stand-in: records what it is handed, answers HANDED once a head is in."""

    def __init__(self, got: list[bytes]) -> None:
        self.got = got
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got.append(data)
        if b"\r\n\r\n" in b"".join(self.got) and self.transport is not None:
            self.transport.write(b"HANDED")
            self.transport.close()


@dataclass
class Front:
    port: int
    guard: Guard
    seen: list[Incoming] = field(default_factory=list)
    handed: list[bytes] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


@asynccontextmanager
async def serving(
    busy_poll: BusyPoll | None = None,
    on_complete: Callable[[], None] = lambda: None,
    **limits: Any,
) -> AsyncIterator[Front]:
    """A fast front answering the test requests; `on_complete` is called as each starts."""
    guard = Guard(HttpLimits(**limits), 64, logging.getLogger("test_fast_path"))
    front_box: list[Front] = []

    async def complete(incoming: Incoming, reply: FastReply) -> None:
        on_complete()
        front = front_box[0]
        front.seen.append(incoming)
        if incoming.body == HANG:
            try:
                await asyncio.Event().wait()
            finally:
                front.cancelled.set()
        if incoming.body == STREAM:
            await reply.start(200, [("Content-Type", "text/event-stream")])
            for event in EVENTS:
                assert await reply.write(event)
            await reply.end()
            return
        document = {"echo": incoming.body.decode(), "target": incoming.target}
        reply.answer(*json_answer(200, document))

    handed: list[bytes] = []
    fast = FastFront(complete, guard, lambda: cast(Any, Taker(handed)), busy_poll)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(fast, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    front_box.append(Front(port, guard, handed=handed))
    try:
        yield front_box[0]
    finally:
        server.close()
        fast.close_all()
        await server.wait_closed()


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One answer: its status line, headers (lower-cased names), body (framing removed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head[:-4].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    if "content-length" in headers:
        return status.encode(), headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        assert await reader.readexactly(2) == b"\r\n"
        return status.encode(), headers, body
    return status.encode(), headers, await reader.read()  # to the close


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def closed(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(10):
        return await reader.read() == b""


@run_async
async def test_a_head_and_body_in_pieces_are_served_whole() -> None:
    async with serving() as front:
        reader, writer = await connect(front.port)
        data = request()
        for cut in range(0, len(data), 7):
            writer.write(data[cut : cut + 7])
            await writer.drain()
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK"
        assert json.loads(body)["echo"] == BODY.decode()
        assert headers["content-type"] == "application/json; charset=utf-8"
        assert "date" in headers and "connection" not in headers
        [seen] = front.seen
        assert (seen.method, seen.target, seen.body) == ("POST", "/v1/completions", BODY)
        assert (b"Host", b"x") in seen.headers
        writer.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=4))
def test_pipelined_requests_split_anywhere_are_answered_in_order(cuts: list[int]) -> None:
    bodies = [b'{"n": %d}' % i for i in range(3)]
    data = b"".join(request(b) for b in bodies)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})

    async def check() -> None:
        async with serving() as front:
            reader, writer = await connect(front.port)
            for a, b in itertools.pairwise(points):
                writer.write(data[a:b])
                await writer.drain()
            for body in bodies:
                status, _, answer = await read_answer(reader)
                assert status == b"HTTP/1.1 200 OK"
                assert json.loads(answer)["echo"] == body.decode()
            assert [s.body for s in front.seen] == bodies
            writer.close()

    asyncio.run(check())


@run_async
async def test_header_case_and_a_query_pass_as_sent() -> None:
    async with serving() as front:
        reader, writer = await connect(front.port)
        writer.write(
            b"POST /v1/completions?trace=1 HTTP/1.1\r\ncontent-length: %d\r\n"
            b"X-Request-Id: abc\r\n\r\n%s" % (len(BODY), BODY)
        )
        _, _, answer = await read_answer(reader)
        assert json.loads(answer)["target"] == "/v1/completions?trace=1"
        [seen] = front.seen
        assert seen.header(b"x-request-id") == "abc" and seen.header(b"nope") is None
        assert seen.headers[0] == (b"content-length", b"%d" % len(BODY))
        writer.close()


@run_async
async def test_connection_close_is_answered_and_closed() -> None:
    async with serving() as front:
        reader, writer = await connect(front.port)
        writer.write(request(extra=b"Connection: close\r\n") + request())  # the 2nd: never read
        _, headers, _ = await read_answer(reader)
        assert headers["connection"] == "close"
        assert await closed(reader)
        assert len(front.seen) == 1
        writer.close()


@run_async
async def test_http_1_0_closes_unless_kept_alive() -> None:
    async with serving() as front:
        reader, writer = await connect(front.port)
        writer.write(request(version=b"1.0"))
        status, headers, _ = await read_answer(reader)
        assert status == b"HTTP/1.0 200 OK" and "connection" not in headers
        assert await closed(reader)
        writer.close()

        reader, writer = await connect(front.port)
        for _ in range(2):
            writer.write(request(version=b"1.0", extra=b"Connection: keep-alive\r\n"))
            status, headers, _ = await read_answer(reader)
            assert status == b"HTTP/1.0 200 OK" and headers["connection"] == "keep-alive"
        assert len(front.seen) == 3
        writer.close()


@run_async
async def test_a_stream_is_chunked_on_1_1_and_runs_to_the_close_on_1_0() -> None:
    async with serving() as front:
        reader, writer = await connect(front.port)
        writer.write(request(STREAM) + request())
        _, headers, body = await read_answer(reader)
        assert headers["transfer-encoding"] == "chunked" and body == b"".join(EVENTS)
        _, _, answer = await read_answer(reader)  # the connection goes on
        assert json.loads(answer)["echo"] == BODY.decode()
        writer.close()

        reader, writer = await connect(front.port)
        writer.write(request(STREAM, version=b"1.0", extra=b"Connection: keep-alive\r\n"))
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.0 200 OK" and "transfer-encoding" not in headers
        assert body == b"".join(EVENTS)  # read to the close
        writer.close()


@run_async
async def test_a_streams_head_leaves_with_its_first_event_in_one_write() -> None:
    """As aiohttp does: the head waits for the first bytes of body, so the client wakes once
    for the head and the first event (the PD first token); the answer is the same."""
    writes: list[bytes] = []
    real = FastConnection.write

    def write(self: FastConnection, data: bytes) -> bool:
        writes.append(data)
        return real(self, data)

    FastConnection.write = write  # type: ignore[method-assign]
    try:
        async with serving() as front:
            reader, writer = await connect(front.port)
            writer.write(request(STREAM))
            _, headers, body = await read_answer(reader)
            assert headers["transfer-encoding"] == "chunked" and body == b"".join(EVENTS)
            writer.close()
    finally:
        FastConnection.write = real  # type: ignore[method-assign]
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert writes[0].endswith(b"\r\n\r\n%x\r\n%s\r\n" % (len(EVENTS[0]), EVENTS[0]))
    assert len(writes) == len(EVENTS) + 1  # the head rode on the first event; then the end


@run_async
async def test_a_body_over_the_limit_is_413_and_closes_before_it_is_read() -> None:
    async with serving(max_body_bytes=100) as front:
        reader, writer = await connect(front.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 101\r\n\r\n")
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.1 413 Request Entity Too Large"
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert await closed(reader)
        assert front.seen == []
        writer.close()


@run_async
async def test_a_body_timeout_shorter_than_the_idle_one_holds() -> None:
    async with serving(body_timeout_s=0.3, idle_timeout_s=60.0) as front:
        reader, writer = await connect(front.port)
        writer.write(request())  # answered: the connection then waits on idle's 60 s
        await read_answer(reader)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        async with asyncio.timeout(10):  # body_timeout_s, not idle_timeout_s, ends it
            status, _, _ = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 408 ")
        writer.close()


@run_async
async def test_a_body_short_of_its_length_is_408_and_idle_connections_close() -> None:
    async with serving(body_timeout_s=0.3, idle_timeout_s=0.3) as front:
        reader, writer = await connect(front.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        status, _, body = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert await closed(reader)
        writer.close()

        idle, w1 = await connect(front.port)
        half, w2 = await connect(front.port)
        w2.write(b"POST /v1/completions HTTP/1.1\r\nContent-")
        answered, w3 = await connect(front.port)
        w3.write(request())
        await read_answer(answered)
        assert await closed(idle) and await closed(half) and await closed(answered)
        assert len(front.seen) == 1
        for writer in (w1, w2, w3):
            writer.close()


@run_async
async def test_other_requests_hand_the_connection_over_with_every_byte() -> None:
    async with serving() as front:
        reader, writer = await connect(front.port)
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        writer.write(request() + health)  # a fast one first, then one for aiohttp
        _, _, answer = await read_answer(reader)
        assert json.loads(answer)["echo"] == BODY.decode()
        assert await reader.read() == b"HANDED"
        assert b"".join(front.handed) == health
        writer.close()

        for data in (
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
            b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
            b"GET /v1/completions HTTP/1.1\r\n\r\n",
            b"POST /v1/models HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
        ):
            front.handed.clear()
            reader, writer = await connect(front.port)
            writer.write(data)
            assert await reader.read() == b"HANDED"
            assert b"".join(front.handed) == data
            writer.close()
        assert len(front.seen) == 1


@run_async
async def test_a_client_leaving_cancels_its_request() -> None:
    async with serving() as front:
        _, writer = await connect(front.port)
        writer.write(request(HANG))

        async def busy() -> bool:
            return len(front.seen) == 1 and any(c.busy for c in front.guard.fast)

        await wait_until(busy, "the request to be answered")
        writer.close()
        await asyncio.wait_for(front.cancelled.wait(), 10)

        async def gone() -> bool:
            return not front.guard.fast

        await wait_until(gone, "the connection to leave the bound's count")


# -- the router end to end


async def raw_exchange(port: int, data: bytes, answers: int) -> list[tuple[bytes, bytes]]:
    reader, writer = await connect(port)
    writer.write(data)
    out = []
    for _ in range(answers):
        status, _, body = await read_answer(reader)
        out.append((status, body))
    writer.close()
    return out


@run_async
async def test_the_router_forwards_the_request_id_or_makes_one() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        port = router.listening.api_port
        data = request(extra=b"X-Request-Id: client-7\r\n") + request()
        answers = await raw_exchange(port, data, 2)
        assert [json.loads(body) for _, body in answers] == [JSON_ANSWER, JSON_ANSWER]
        first, second = decode.seen
        assert first.request_id == "client-7"
        assert second.request_id and second.request_id != "client-7"
        assert first.prefill == prefill.kv_address and first.body == BODY
        [(status, body)] = await raw_exchange(port, request(extra=b"X-Request-Id: a b\r\n"), 1)
        assert status == b"HTTP/1.1 400 Bad Request"
        assert json.loads(body)["error"]["param"] == "X-Request-Id"
        assert len(decode.seen) == 2


@run_async
async def test_the_router_serves_completions_and_other_paths_on_one_connection() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        port = router.listening.api_port
        data = request() + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + request()
        (s1, b1), (s2, b2), (s3, b3) = await raw_exchange(port, data, 3)
        assert (s1, s2, s3) == (b"HTTP/1.1 200 OK",) * 3
        assert json.loads(b1) == json.loads(b3) == JSON_ANSWER and b2 == b"ok\n"
        assert len(decode.seen) == 2
        assert await router.metric("dsv4_router_requests_total", outcome="ok") == 2


@run_async
async def test_the_router_answers_http_1_0_and_a_bad_body_through_the_fast_path() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        port = router.listening.api_port
        keep = b"Connection: keep-alive\r\n"
        data = request(version=b"1.0", extra=keep) + request(b"{bad", version=b"1.0", extra=keep)
        (s1, b1), (s2, b2) = await raw_exchange(port, data, 2)
        assert s1 == b"HTTP/1.0 200 OK" and json.loads(b1) == JSON_ANSWER
        assert s2 == b"HTTP/1.0 400 Bad Request"
        assert json.loads(b2)["error"]["type"] == "invalid_request_error"
        assert len(decode.seen) == 1
        assert await router.metric("dsv4_router_requests_total", outcome="client_error") == 1


@run_async
async def test_a_stream_that_breaks_ends_its_chunked_body_after_the_error_event() -> None:
    """As aiohttp ends a handler's stream: the client gets the error event and the body's end
    (its connection kept), never a body left open (a client waiting for the rest hung)."""
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="break_mid")
    async with routed([prefill], [decode]) as router:
        reader, writer = await connect(router.listening.api_port)
        stream = json.dumps({**json.loads(BODY), "stream": True}).encode()
        writer.write(request(stream) + request(stream))
        async with asyncio.timeout(10):
            for _ in range(2):  # the connection serves the next one, framed right
                status, headers, body = await read_answer(reader)
                assert status == b"HTTP/1.1 200 OK"
                assert headers["transfer-encoding"] == "chunked"
                first, error, rest = body.split(b"\n\n", 2)
                assert first + b"\n\n" == STREAM_EVENTS[0]
                event = json.loads(error.removeprefix(b"data: "))
                assert event["error"]["code"] == "upstream_broken"
                assert rest == b""  # no [DONE]: the stream broke
        writer.close()


@run_async
async def test_the_routers_own_refusals_name_the_request() -> None:
    """A 502 or 503 the router answers itself carries X-Request-Id as the workers' answers
    do: the client's id, or the one the router made (and sent upstream)."""
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="fail502")
    async with routed([prefill], [decode]) as router:
        port = router.listening.api_port

        async def ask(extra: bytes = b"") -> tuple[bytes, dict[str, str], bytes]:
            reader, writer = await connect(port)
            writer.write(request(extra=extra))
            try:
                return await read_answer(reader)
            finally:
                writer.close()

        named, unnamed = await ask(b"X-Request-Id: client-9\r\n"), await ask()
        assert named[0] == unnamed[0] == b"HTTP/1.1 502 Bad Gateway"
        assert named[1]["x-request-id"] == "client-9"
        made = unnamed[1]["x-request-id"]
        assert made and made != "client-9"
        assert [s.request_id for s in decode.seen] == ["client-9", made]  # never retried
        decode.mode = "fail503"
        status, headers, _ = await ask(b"X-Request-Id: c-10\r\n")
        assert status == b"HTTP/1.1 503 Service Unavailable"
        assert headers["x-request-id"] == "c-10"
