"""The router over HTTP, in-process, in front of stub workers on 127.0.0.1: pass-through
(JSON and SSE), the prefill header, retries, 4xx, unavailability, load-following picks, client
disconnects, /ready, /metrics, /instances and /v1/models."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from router_support import (
    BAD_REQUEST,
    JSON_ANSWER,
    MODELS,
    ROUTE_KEY,
    STREAM_EVENTS,
    StubWorker,
    routed,
    run_async,
    wait_until,
)

from dsv4_common.api.pd_secret import PREFILL_AUTH_HEADER, check_route
from dsv4_common.api.worker_status import Load

BODY = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
STREAM_BODY = {**BODY, "stream": True}
# More headroom than the stubs' default load in the pool that binds (full: 8100 of 8192;
# SWA 1020 of 1024), so the router tries it first.
PREFERRED = Load(8100, 1020, 16, 0, 0, True)


@run_async
async def test_json_pass_through_names_the_prefill_kv_address() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        status, body, headers = await router.post(BODY)
        assert status == 200
        assert json.loads(body) == JSON_ANSWER
        assert headers["Content-Type"].startswith("application/json")
        [seen] = decode.seen
        assert seen.body == json.dumps(BODY).encode()  # the client's exact body
        assert seen.path == "/v1/completions"
        assert seen.prefill == prefill.kv_address
        assert prefill.seen == []  # the decode worker talks to the prefill, not the router
        assert await router.metric("dsv4_router_requests_total", outcome="ok") == 1


@run_async
async def test_the_router_signs_its_prefill_choice_and_drops_a_clients() -> None:
    """The decode honors `X-DSV4-Prefill` only with the router's signature over the request
    id, that address and an expiry; a client's own prefill headers never pass."""
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        forged = {"X-DSV4-Prefill": "evil:1", PREFILL_AUTH_HEADER: "9999999999.00"}
        status, _, _ = await router.post(BODY, headers=forged)
        assert status == 200
        [seen] = decode.seen
        assert seen.prefill == prefill.kv_address and seen.request_id is not None
        assert (
            check_route(ROUTE_KEY, seen.request_id, seen.prefill, seen.prefill_auth, time.time())
            is None
        )
        wrong = check_route(
            b"another-key" * 4, seen.request_id, seen.prefill, seen.prefill_auth, time.time()
        )
        assert wrong is not None and "not signed" in wrong


@run_async
async def test_stream_pass_through_on_chat() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="stream")
    async with routed([prefill], [decode]) as router:
        status, body, headers = await router.post(STREAM_BODY, path="/v1/chat/completions")
        assert status == 200
        assert headers["Content-Type"].startswith("text/event-stream")
        assert body == b"".join(STREAM_EVENTS)
        assert [s.path for s in decode.seen] == ["/v1/chat/completions"]


@run_async
async def test_the_pick_follows_load() -> None:
    """The decode with more free full tokens and the prefill with fewer waiting are picked."""
    busy_prefill = StubWorker("prefill", load=Load(8000, 1000, 16, 0, 4, True))
    idle_prefill = StubWorker("prefill", load=Load(2000, 1000, 16, 0, 0, True))
    small = StubWorker("decode", load=Load(1000, 1000, 16, 0, 0, True))
    large = StubWorker("decode", load=PREFERRED)
    async with routed([busy_prefill, idle_prefill], [small, large]) as router:
        status, _, _ = await router.post(BODY)
        assert status == 200
        assert small.seen == []
        [seen] = large.seen
        assert seen.prefill == idle_prefill.kv_address


@run_async
async def test_a_503_is_retried_on_the_other_decode() -> None:
    prefill = StubWorker("prefill")
    failing = StubWorker("decode", mode="fail503", load=PREFERRED)
    good = StubWorker("decode", load=Load(1000, 1000, 16, 0, 0, True))
    async with routed([prefill], [failing, good]) as router:
        status, body, _ = await router.post(BODY)
        assert status == 200
        assert json.loads(body) == JSON_ANSWER
        assert (len(failing.seen), len(good.seen)) == (1, 1)
        assert await router.metric("dsv4_router_retries_total") == 1
        assert await router.metric("dsv4_router_requests_total", outcome="ok") == 1


@run_async
async def test_an_unreachable_decode_is_retried() -> None:
    prefill, good = StubWorker("prefill"), StubWorker("decode")
    gone = StubWorker("decode", load=PREFERRED)
    async with routed([prefill], [gone, good]) as router:
        await gone.close_api()  # refuses connections; its status says it is eligible
        status, body, _ = await router.post(BODY)
        assert status == 200
        assert json.loads(body) == JSON_ANSWER
        assert await router.metric("dsv4_router_retries_total") == 1


@run_async
async def test_no_first_byte_in_time_is_retried_and_the_upstream_closed() -> None:
    prefill = StubWorker("prefill")
    hung = StubWorker("decode", mode="hang_before", load=PREFERRED)
    good = StubWorker("decode")
    async with routed([prefill], [hung, good], first_byte_timeout_s=0.5) as router:
        status, _, _ = await router.post(BODY)
        assert status == 200
        assert (len(hung.seen), len(good.seen)) == (1, 1)
        await asyncio.wait_for(hung.disconnected.wait(), 15)


@run_async
async def test_4xx_passes_through_without_retry() -> None:
    prefill = StubWorker("prefill")
    rejecting = StubWorker("decode", mode="bad400", load=PREFERRED)
    other = StubWorker("decode")
    async with routed([prefill], [rejecting, other]) as router:
        status, body, _ = await router.post(BODY)
        assert status == 400
        assert json.loads(body) == BAD_REQUEST
        assert other.seen == []
        assert await router.metric("dsv4_router_retries_total") == 0
        assert await router.metric("dsv4_router_requests_total", outcome="client_error") == 1


@run_async
async def test_every_decode_busy_gives_503_with_retry_after() -> None:
    prefill = StubWorker("prefill")
    decodes = [StubWorker("decode", mode="fail503"), StubWorker("decode", mode="fail503")]
    async with routed([prefill], decodes) as router:
        status, body, headers = await router.post(BODY)
        assert status == 503
        assert headers["Retry-After"] == "1"
        message = json.loads(body)["error"]["message"]
        assert "stub says 503" in message
        assert [len(d.seen) for d in decodes] == [1, 1]
        assert await router.metric("dsv4_router_requests_total", outcome="unavailable") == 1


@run_async
async def test_a_502_gives_502_with_the_upstream_message() -> None:
    """502: decode could not use the prefill; with the only prefill excluded, the router
    passes the decode's message on."""
    prefill = StubWorker("prefill")
    decodes = [StubWorker("decode", mode="fail502", load=PREFERRED), StubWorker("decode")]
    async with routed([prefill], decodes) as router:
        status, body, headers = await router.post(BODY)
        assert status == 502
        assert headers["Retry-After"] == "1"  # every 502/503 carries it
        assert "stub says 502" in json.loads(body)["error"]["message"]
        assert [len(d.seen) for d in decodes] == [1, 0]
        assert await router.metric("dsv4_router_requests_total", outcome="upstream_error") == 1


@pytest.mark.parametrize(
    ("change", "state", "words"),
    [
        ({"load": Load(8000, 1000, 16, 0, 0, accepting=False)}, "busy", "busy"),
        ({"ready": False}, "unready", "no ready decode"),
        ({"kv_ready": False}, "unready", "no ready decode"),
        ({"status_valid": False}, "stale", "no ready decode"),
    ],
)
def test_no_eligible_decode_gives_503(change: dict[str, object], state: str, words: str) -> None:
    async def scenario() -> None:
        prefill, decode = StubWorker("prefill"), StubWorker("decode")
        for name, value in change.items():
            setattr(decode, name, value)
        async with routed([prefill], [decode], wait_eligible=False) as router:
            await router.wait_state("eligible", prefill)
            await router.wait_state(state, decode)
            status, body, headers = await router.post(BODY)
            assert status == 503
            assert headers["Retry-After"] == "1"
            assert words in json.loads(body)["error"]["message"]
            assert decode.seen == []
            ready, text = await router.get("/ready")
            assert ready == 503
            assert words in text.decode()

    run_async(scenario)()


@run_async
async def test_no_prefill_status_gives_503() -> None:
    prefill = StubWorker("prefill", status_valid=False)
    decode = StubWorker("decode")
    async with routed([prefill], [decode], wait_eligible=False) as router:
        await router.wait_state("eligible", decode)
        status, body, _ = await router.post(BODY)
        assert status == 503
        assert "no ready prefill" in json.loads(body)["error"]["message"]
        [view] = [v for v in await router.instances() if v["role"] == "prefill"]
        assert view["state"] == "stale"
        assert "free_full_tokens" in view["error"]


@run_async
async def test_client_disconnect_mid_stream_closes_the_upstream() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="hang_mid")
    async with routed([prefill], [decode]) as router:
        url = router.url + "/v1/completions"
        async with aiohttp.ClientSession() as client:
            resp = await client.post(url, json=STREAM_BODY)
            assert resp.status == 200
            # The first event arrives while the stub still holds the stream: no buffering.
            assert await resp.content.readuntil(b"\n\n") == STREAM_EVENTS[0]
            resp.close()
        await asyncio.wait_for(decode.disconnected.wait(), 15)

        async def counted() -> bool:
            return await router.metric("dsv4_router_requests_total", outcome="aborted") == 1

        await wait_until(counted, "the aborted request to be counted")
        views = await router.instances()
        assert all(v["router_inflight"] == 0 for v in views)


@run_async
async def test_a_stream_that_breaks_ends_with_an_error_event() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", mode="break_mid")
    async with routed([prefill], [decode]) as router:
        status, body, _ = await router.post(STREAM_BODY)
        assert status == 200
        first, error, rest = body.split(b"\n\n", 2)
        assert first + b"\n\n" == STREAM_EVENTS[0]
        assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "server_error"
        assert rest == b""
        assert len(decode.seen) == 1  # never retried: the client had bytes
        assert await router.metric("dsv4_router_requests_total", outcome="upstream_error") == 1


@run_async
async def test_ready_follows_eligibility() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", ready=False)
    async with routed([prefill], [decode], wait_eligible=False) as router:

        async def ready_is(status: int) -> bool:
            return (await router.get("/ready"))[0] == status

        await router.wait_state("unready", decode)
        assert await ready_is(503)
        decode.ready = True
        await wait_until(lambda: ready_is(200), "/ready 200")
        decode.set_load(accepting=False)
        await wait_until(lambda: ready_is(503), "/ready 503 (decode busy)")
        assert (await router.get("/live"))[0] == 200
        assert (await router.get("/health"))[0] == 200


@run_async
async def test_metrics_names() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode", ready=False)
    async with routed([prefill], [decode], wait_eligible=False) as router:
        await router.wait_state("unready", decode)
        status, text = await router.get("/metrics")
        assert status == 200
        for name in (
            "dsv4_router_requests_total",
            "dsv4_router_retries_total",
            "dsv4_router_upstream_first_byte_seconds_bucket",
        ):
            assert name in text.decode()
        assert await router.metric("dsv4_router_instances", role="prefill", state="eligible") == 1
        assert await router.metric("dsv4_router_instances", role="decode", state="unready") == 1
        assert await router.metric("dsv4_router_instances", role="decode", state="stale") == 0
        for outcome in ("ok", "client_error", "upstream_error", "unavailable", "aborted"):
            assert await router.metric("dsv4_router_requests_total", outcome=outcome) == 0


@run_async
async def test_bad_bodies_are_400_and_reach_no_worker() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        for body in (b"{not json", b"[1, 2]", b'"text"'):
            status, answer, _ = await router.post(body)
            assert status == 400, body
            error = json.loads(answer)["error"]
            assert error["type"] == "invalid_request_error"
            assert set(error) == {"message", "type", "param", "code"}
        assert decode.seen == []


@run_async
async def test_models_and_instances() -> None:
    prefill, decode = StubWorker("prefill"), StubWorker("decode")
    async with routed([prefill], [decode]) as router:
        status, body = await router.get("/v1/models")
        assert (status, json.loads(body)) == (200, MODELS)
        views = await router.instances()
        assert [(v["role"], v["state"]) for v in views] == [
            ("decode", "eligible"),
            ("prefill", "eligible"),
        ]
        assert views[1]["kv_port"] == prefill.kv_port
        assert views[0]["load"]["free_full_tokens"] == decode.load.free_full_tokens
