"""The router's HTTP rules, in-process in front of stub workers on 127.0.0.1: bad bodies are
400s naming the field that never reach a worker; 404/405/413/408 are OpenAI-shaped; idle and
half-sent connections are closed; past the connection bound the oldest incomplete connection
makes room (300 half-sent requests do not starve /health or a completion) and a new one gets a
fast 503 only when every open one is busy; a client that leaves a non-streaming request closes
the upstream at once; every rejection logs one line, never a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from router_support import StubWorker, routed, run_async, wait_until

from dsv4_common.api.http_rules import HttpLimits
from dsv4_router.http_guard import GUARD, guarded_app, make_runner
from dsv4_router.http_listen import GuardedSite, bind, serve_on

BODY = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
ANSWER_S = 1.0  # what a client may wait while others misbehave


def limits(**changes: Any) -> HttpLimits:
    base = {"body_timeout_s": 5.0, "idle_timeout_s": 5.0}
    return HttpLimits(**{**base, **changes})


async def raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sent before closing the connection (fails if it stays open)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


def port_of(router: Any) -> int:
    return int(router.listening.api_port)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt", "surrogate"),
        (
            b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}',
            "messages[0].content",
            "surrogate",
        ),
        (b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", None, "digits"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested deeper"),
        (b'{"prompt": "x", "temperature": NaN}', None, "NaN"),
        (b"\xff{}", None, "UTF-8"),
    ],
)
def test_bad_bodies_are_400_naming_the_field_and_reach_no_worker(
    body: bytes, param: str | None, says: str
) -> None:
    async def check() -> None:
        prefill, decode = StubWorker("prefill"), StubWorker("decode")
        async with routed([prefill], [decode]) as router:
            status, answer, _ = await router.post(body)
            error = json.loads(answer)["error"]
            assert status == 400 and error["param"] == param and says in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
            assert decode.seen == []
            assert await router.metric("dsv4_router_requests_total", outcome="client_error") == 1

    asyncio.run(check())


@run_async
async def test_unknown_paths_wrong_methods_and_big_bodies_are_openai_shaped() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode], http=limits(max_body_bytes=1000)) as router:
        url = router.url
        async with aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/nope", json=BODY) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 404 and error["message"] == "Invalid URL (POST /v1/nope)"
            async with client.get(url + "/v1/completions") as resp:
                error = (await resp.json())["error"]
                assert resp.status == 405 and resp.headers["Allow"] == "POST"
                assert error["type"] == "invalid_request_error"
            big = json.dumps({**BODY, "prompt": "x" * 2000}).encode()
            async with client.post(url + "/v1/completions", data=big) as resp:
                assert resp.status == 413
                assert (await resp.json())["error"]["code"] == "request_too_large"

            async def chunks() -> Any:  # no Content-Length: the limit holds while reading
                for _ in range(20):
                    yield b" " * 100

            async with client.post(url + "/v1/completions", data=chunks()) as resp:
                assert resp.status == 413
        assert decode.seen == []


@run_async
async def test_a_body_shorter_than_its_content_length_is_408_not_a_hang() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode], http=limits(body_timeout_s=0.3)) as router:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
        reader, writer = await raw(port_of(router), head + b'{"prompt": ')
        answer = await closed_within(reader, 10.0)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ")
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout"
        assert decode.seen == []


@run_async
async def test_idle_and_half_sent_header_connections_are_closed() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode], http=limits(idle_timeout_s=0.3)) as router:
        port = port_of(router)
        idle, w1 = await raw(port, b"")
        half, w2 = await raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        assert await closed_within(idle, 10.0) == b""
        assert await closed_within(half, 10.0) == b""
        # A kept-alive connection is closed once idle too, after its answer.
        answered, w3 = await raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await closed_within(answered, 10.0)).startswith(b"HTTP/1.1 200 ")
        for writer in (w1, w2, w3):
            writer.close()


async def timed(coro: Any) -> tuple[Any, float]:
    started_s = time.monotonic()
    result = await coro
    return result, time.monotonic() - started_s


@run_async
async def test_300_half_sent_requests_do_not_starve_health_or_a_completion() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode], http=limits(max_connections=64)) as router:
        port = port_of(router)
        heads = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",  # headers cut short
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{",  # body
        )
        # All at once: the listener accepts them in batches, before any is connected.
        slow = await asyncio.gather(*(raw(port, heads[i % 2]) for i in range(300)))
        (status, _), health_s = await timed(router.get("/health"))
        assert status == 200 and health_s < ANSWER_S, health_s
        (status, _, _), completion_s = await timed(router.post(BODY))
        assert status == 200 and completion_s < ANSWER_S, completion_s
        # Incomplete connections were closed to make room: at most 64 stay open.
        closed = [asyncio.ensure_future(reader.read()) for reader, _ in slow]

        async def bounded() -> bool:
            return sum(task.done() for task in closed) >= 300 - 64

        await wait_until(bounded, "the server to hold at most 64 connections")
        for task in closed:
            task.cancel()
        for _, writer in slow:
            writer.close()


@run_async
async def test_past_the_bound_with_every_connection_busy_a_new_one_gets_a_fast_503() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="hang_before")
    async with routed([prefill], [decode], http=limits(max_connections=16)) as router:
        request = json.dumps(BODY).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        busy = [await raw(port_of(router), head % len(request) + request) for _ in range(16)]

        async def all_forwarded() -> bool:
            return len(decode.seen) == 16

        await wait_until(all_forwarded, "16 requests to reach the decode stub")
        reader, writer = await raw(port_of(router), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, refused_s = await timed(closed_within(reader, 10.0))
        assert answer.startswith(b"HTTP/1.1 503 ") and refused_s < ANSWER_S
        assert b'"too_many_connections"' in answer
        writer.close()
        for _, w in busy:
            w.close()


@run_async
async def test_a_client_leaving_a_non_streaming_request_closes_the_upstream_at_once() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="hang_before")
    async with routed([prefill], [decode]) as router:
        request = json.dumps(BODY).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        _, writer = await raw(port_of(router), head % len(request) + request)

        async def forwarded() -> bool:
            return len(decode.seen) == 1

        await wait_until(forwarded, "the request to reach the decode stub")
        writer.close()
        _, closed_s = await timed(asyncio.wait_for(decode.disconnected.wait(), 15))
        assert closed_s < ANSWER_S, closed_s

        async def counted() -> bool:
            return await router.metric("dsv4_router_requests_total", outcome="aborted") == 1

        await wait_until(counted, "the aborted request to be counted")


def test_rejections_log_one_line_each_and_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def misbehave() -> None:
        prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="hang_before")
        async with routed([prefill], [decode], http=limits(body_timeout_s=0.3)) as router:
            await router.post(b"{bad json")
            await router.get("/nope")
            port = port_of(router)
            for data in (
                b"GARBAGE / HTTP/1.1\r\n\r\n",  # aiohttp's own 400s
                b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 10_000 + b"\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nHost: x\r\n\r\n" * 2 + b"BAD\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{",
            ):
                reader, writer = await raw(port, data)
                await closed_within(reader, 10.0)
                writer.close()
            # A non-streaming request whose client leaves: one "cancelled" line.
            request = json.dumps(BODY).encode()
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            _, writer = await raw(port, head % len(request) + request)

            async def forwarded() -> bool:
                return len(decode.seen) == 1

            await wait_until(forwarded, "the request to reach the decode stub")
            writer.close()
            await asyncio.wait_for(decode.disconnected.wait(), 15)

    with caplog.at_level(logging.INFO):
        asyncio.run(misbehave())
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    lines = [r.getMessage() for r in caplog.records]
    assert all("\n" not in line for line in lines)
    assert sum("-> 400: the body is not valid JSON" in line for line in lines) == 1
    assert sum("GET /nope -> 404" in line for line in lines) == 1
    assert sum("-> 408" in line for line in lines) == 1
    malformed = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(malformed) == 3 and all(": 400 " in r.getMessage() for r in malformed)
    assert sum("cancelled (the client disconnected)" in line for line in lines) == 1


@run_async
async def test_connections_of_one_accept_batch_count_against_the_bound() -> None:
    """The listener hands out a batch of protocols before any of them is connected: each
    counts at once, so a burst cannot overshoot the bound (and run out of descriptors)."""
    app = guarded_app(limits(max_connections=4))
    runner = make_runner(app)
    await runner.setup()
    try:
        [sock] = bind("127.0.0.1", 0)
        site = GuardedSite(runner, sock, app[GUARD])
        batch = [site._connection() for _ in range(10)]  # as asyncio's accept loop does
        assert sum(isinstance(p, RequestHandler) for p in batch) == 4
        sock.close()
    finally:
        await runner.cleanup()


@run_async
async def test_connections_that_came_and_went_leave_room() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode], http=limits(max_connections=16)) as router:
        for _ in range(40):  # short-lived clients, one after another
            reader, writer = await raw(port_of(router), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"ok\n")).startswith(b"HTTP/1.1 200 ")
            writer.close()
        status, _, _ = await router.post(BODY)
        assert status == 200


MALFORMED_HTTP = {
    "a bad request line": b"GARBAGE\r\n\r\n",
    "a bad method": b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n",
    "a header line of 10,000 bytes": b"GET /health HTTP/1.1\r\nX: " + b"a" * 10_000 + b"\r\n\r\n",
    "an invalid header name": b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n",
    "two Content-Lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    ),
    "a bad chunk size": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ),
    "a bad HTTP version": b"GET /health HTTP/9.x\r\nHost: x\r\n\r\n",
}


def answer_parts(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return int(status_line.split(" ")[1]), headers, body


@pytest.mark.parametrize("case", list(MALFORMED_HTTP))
def test_aiohttps_own_400s_for_malformed_http_are_openai_shaped(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def check() -> None:
        prefill, decode = StubWorker("prefill"), StubWorker("decode")
        async with routed([prefill], [decode]) as router:
            reader, writer = await raw(port_of(router), MALFORMED_HTTP[case])
            answer = await closed_within(reader, 10.0)
            writer.close()
            status, headers, body = answer_parts(answer)
            assert status == 400, answer[:300]
            assert headers["content-type"].startswith("application/json")
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["message"]
            assert decode.seen == []

    with caplog.at_level(logging.INFO):
        asyncio.run(check())
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_handler_failure_is_a_json_500_and_logs_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(request: web.Request) -> web.Response:
        raise ValueError("a bug")

    async def fetch() -> bytes:
        app = guarded_app(limits())
        app.router.add_get("/broken", broken)
        runner = make_runner(app)
        await runner.setup()
        try:
            port = await serve_on(runner, bind("127.0.0.1", 0))
            reader, writer = await raw(port, b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await closed_within(reader, 10.0)
            writer.close()
            return answer
        finally:
            await runner.cleanup()

    answer = asyncio.run(fetch())
    status, headers, body = answer_parts(answer)
    assert status == 500 and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["type"] == "server_error"
    assert any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records)
