"""The relay and a decode that goes silent (issue #25): with stub workers and the router in one
process, a decode "freezes" by answering neither its API nor /status (`status_hangs`). Before
any byte reached the client the request is retried on another pair, waits while there is none
and the decode is in its grace, and gets a 503 once it is stale; mid-stream it ends with an
error event (code `upstream_stalled`) and [DONE]. A decode that is silent but answers its
probes is never cut."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Final

from router_support import STREAM_EVENTS, Harness, StubWorker, routed, run_async, wait_until

from dsv4_router.errors import STALLED_CODE

STALL_S: Final = 0.5
# Quick probes: a frozen decode misses one within a probe timeout of its freezing.
FAST: Final = {"stall_after_s": STALL_S, "status_timeout_s": 0.3}
BODY: Final = {"prompt": "hi", "max_tokens": 3}
STREAM_BODY: Final = {**BODY, "stream": True}


async def missed_probes(h: Harness, worker: StubWorker) -> int:
    for view in await h.instances():
        if view["role"] == worker.role and view["http_port"] == worker.http_port:
            return int(view["missed_probes"])
    raise AssertionError(f"the router does not list {worker.http_port}")


@run_async
async def test_a_frozen_decode_before_the_first_byte_is_retried_on_another_pair() -> None:
    frozen, other = StubWorker("decode", mode="hang_before"), StubWorker("decode")
    other.set_load(free_full_tokens=10)  # the frozen one ranks first
    async with routed([StubWorker("prefill")], [frozen, other], **FAST) as h:
        posted = asyncio.create_task(h.post(BODY))
        await wait_until(_true(lambda: len(frozen.seen) == 1), "the request at the first decode")
        frozen.status_hangs = True
        status, body, _ = await asyncio.wait_for(posted, 15.0)
        assert status == 200, body
        assert len(other.seen) == 1
        await asyncio.wait_for(frozen.disconnected.wait(), 15.0)  # its connection closed
        assert await h.metric("dsv4_router_retries_total") == 1


@run_async
async def test_a_frozen_decode_with_nowhere_else_to_go_is_waited_for_in_its_grace() -> None:
    """Nothing sent and no other pair: it may only be starved, so the request waits; it
    succeeds once the decode answers again."""
    decode = StubWorker("decode", mode="hang_before")
    async with routed([StubWorker("prefill")], [decode], **FAST) as h:
        posted = asyncio.create_task(h.post(BODY))
        await wait_until(_true(lambda: len(decode.seen) == 1), "the request at the decode")
        decode.status_hangs = True
        frozen_s = time.monotonic()

        async def missed_and_silent() -> bool:
            silent = time.monotonic() - frozen_s > 4 * STALL_S
            return silent and await missed_probes(h, decode) >= 2

        await wait_until(missed_and_silent, "missed probes and a long silence")
        assert not posted.done()
        decode.status_hangs = False
        decode.release.set()
        status, body, _ = await asyncio.wait_for(posted, 15.0)
        assert status == 200, body
        assert len(decode.seen) == 1


@run_async
async def test_a_frozen_decode_gets_a_503_once_it_is_stale() -> None:
    decode = StubWorker("decode", mode="hang_before")
    grace = {"stale_after_s": 1.0, "stale_after_polls": 1.0, "stale_after_misses": 2}
    async with routed([StubWorker("prefill")], [decode], **FAST, **grace) as h:
        posted = asyncio.create_task(h.post(BODY))
        await wait_until(_true(lambda: len(decode.seen) == 1), "the request at the decode")
        decode.status_hangs = True
        status, body, headers = await asyncio.wait_for(posted, 15.0)
        assert status == 503 and headers.get("Retry-After") == "1", body
        assert "no byte for" in json.loads(body)["error"]["message"], body
        await asyncio.wait_for(decode.disconnected.wait(), 15.0)


@run_async
async def test_a_frozen_decode_mid_stream_ends_it_with_a_coded_error_and_done() -> None:
    decode = StubWorker("decode", mode="hang_mid")
    async with routed([StubWorker("prefill")], [decode], **FAST) as h:
        async with h.client.post(h.url + "/v1/completions", json=STREAM_BODY) as resp:
            assert resp.status == 200
            assert await resp.content.readuntil(b"\n\n") == STREAM_EVENTS[0]
            decode.status_hangs = True
            frozen_s = time.monotonic()
            rest = await asyncio.wait_for(resp.content.read(), 15.0)
            elapsed_s = time.monotonic() - frozen_s
        events = [e.removeprefix(b"data: ") for e in rest.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["code"] == STALLED_CODE and error["type"] == "server_error", error
        assert "no byte for" in error["message"], error
        print(f"frozen mid-stream -> error event: {elapsed_s:.2f} s")
        await asyncio.wait_for(decode.disconnected.wait(), 15.0)
        assert await h.metric("dsv4_router_requests_total", outcome="upstream_error") == 1


@run_async
async def test_a_silent_decode_that_answers_its_probes_is_never_cut() -> None:
    """Mid-stream silence 4x the rule's while /status answers: the stream stays open and
    goes on to [DONE]."""
    decode = StubWorker("decode", mode="trickle", gap_s=4 * STALL_S, trickle_events=3)
    async with routed([StubWorker("prefill")], [decode], stall_after_s=STALL_S) as h:
        status, body, _ = await asyncio.wait_for(h.post(STREAM_BODY), 30.0)
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) == 4, events
        assert b'"error"' not in body, body


def _true(condition: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return condition()

    return check
