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
