"""The router's drain (issue #25 item 4), in process against stub workers: once draining,
/ready answers 503 `draining` and new completions 503 + Retry-After (code `draining`) while
the listeners stay open; past the drain a stream still open ends with an error event and
`[DONE]`, a request with no byte sent gets a 503, and their upstream connections close."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from router_support import StubWorker, routed, run_async, wait_until

from dsv4_common.api.lifecycle import DRAIN_CODE
from dsv4_router.drain import drain

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


async def _stream_events(response: aiohttp.ClientResponse, first: asyncio.Event) -> list[str]:
    events = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
            first.set()
    return events


@run_async
async def test_the_router_refuses_new_requests_and_cuts_open_ones_with_an_error() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="hang_mid")
    async with routed([prefill], [decode]) as h:
        state = h.listening.state
        first = asyncio.Event()

        async def stream() -> list[str]:
            body = json.dumps({**BODY, "stream": True})
            async with h.client.post(h.url + "/v1/completions", data=body) as response:
                assert response.status == 200
                return await _stream_events(response, first)

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(first.wait(), 15.0)
        decode.mode = "hang_before"
        waiting = asyncio.create_task(h.post(BODY))

        async def both_upstream() -> bool:
            return len(decode.seen) == 2

        await wait_until(both_upstream, "both requests at the decode")
        state.drain.start()
        assert await h.get("/ready") == (503, f"{DRAIN_CODE}\n".encode())
        status, body, headers = await h.post(BODY)
        assert status == 503 and headers.get("Retry-After") == "1", body
        assert json.loads(body)["error"]["code"] == DRAIN_CODE

        assert await drain(state.drain, timeout_s=0.2, hurried=asyncio.Event()) == 2
        events = await asyncio.wait_for(streaming, 15.0)
        assert events[-1] == "[DONE]", events
        assert "shutting down" in json.loads(events[-2])["error"]["message"], events
        status, body, headers = await asyncio.wait_for(waiting, 15.0)
        assert status == 503 and headers.get("Retry-After") == "1", body
        assert json.loads(body)["error"]["code"] == DRAIN_CODE
        await asyncio.wait_for(decode.disconnected.wait(), 15.0)  # upstream closed: aborted
        assert state.drain.open == 0


@run_async
async def test_a_drain_with_nothing_open_ends_at_once() -> None:
    async with routed([StubWorker("prefill")], [StubWorker("decode")]) as h:
        state = h.listening.state
        state.drain.start()
        done = drain(state.drain, timeout_s=30.0, hurried=asyncio.Event())
        assert await asyncio.wait_for(done, 5.0) == 0


async def _answer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> tuple[int, bytes]:
    """(status, body) of one completion request sent on an open connection."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    headers = await reader.readuntil(b"\r\n\r\n")
    status = int(headers.split(b" ", 2)[1])
    length = [ln for ln in headers.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
    return status, await reader.readexactly(int(length[0].split(b":")[1]))


@run_async
async def test_past_its_drain_the_router_refuses_new_connections_and_answers_accepted_ones() -> (
    None
):
    """Past the drain the listeners close first (a new connection is refused) and a request
    that arrives meanwhile on a connection accepted before gets a 503 `draining` within the
    linger, not a connection closed without a response (issue #25's fault matrix saw one)."""
    async with routed([StubWorker("prefill")], [StubWorker("decode")]) as h:
        h.listening.state.drain.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", h.listening.api_port)
        body = json.dumps(BODY).encode()
        status, answer = await _answer(reader, writer, body)  # accepted, kept alive
        assert status == 503 and json.loads(answer)["error"]["code"] == DRAIN_CODE
        stopping = asyncio.create_task(h.listening.stop_accepting(linger_s=30.0))

        async def refused() -> bool:
            try:
                _, probe = await asyncio.open_connection("127.0.0.1", h.listening.api_port)
            except ConnectionRefusedError:
                return True
            except ConnectionResetError:  # caught in the listener's closing: look again
                return False
            probe.close()
            return False

        await wait_until(refused, "the listener to refuse new connections")
        status, answer = await _answer(reader, writer, body)
        assert status == 503 and json.loads(answer)["error"]["code"] == DRAIN_CODE
        assert not stopping.done()
        stopping.cancel()
        writer.close()
