"""Overload and a dead engine answer 503 with Retry-After (never a hang or a crash), and
/ready says so; checked on the app with a runner that reports those states."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_worker.server.admission import (
    ADMIT,
    AdmissionPolicy,
    QueueView,
    Verdict,
    decide,
)
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.runner import Done, Handle, Health, Snapshot
from dsv4_worker.server.tokenizer import ByteTokenizer


class StubRunner:
    def __init__(self, *, alive: bool, overloaded: bool) -> None:
        self.alive = alive
        self.failure = None if alive else "PP stage 1: receive from rank 0 failed"
        self._overloaded = overloaded
        self.submitted = 0

    def snapshot(self) -> Snapshot:
        return Snapshot()

    def health(self) -> Health:
        return Health(serving=self.alive)

    policy = AdmissionPolicy(max_queue_requests=4, queue_timeout_s=5.0)

    def queue_view(self) -> QueueView:
        return QueueView(
            waiting=4 if self._overloaded else 0,
            oldest_wait_s=0.0,
            free_request_slots=0,
            free_full_tokens=0,
        )

    def admission(self, need_tokens: int) -> Verdict:
        verdict = decide(self.queue_view(), self.policy, need_tokens)
        assert verdict.admitted or self._overloaded
        return verdict if self._overloaded else ADMIT

    def overloaded(self) -> bool:
        return self._overloaded

    def submit(self, *_: Any) -> Any:
        self.submitted += 1
        raise AssertionError("nothing may be submitted")


INFO = ServeInfo(
    model_name="tiny",
    vocab_size=256,
    max_context_tokens=4096,
    status=WorkerStatus("colocated", 0, RankCapacity(1, 1, 1, 1)),
)


async def _post(runner: StubRunner) -> tuple[int, dict[str, Any], dict[str, str], int]:
    status, body, headers, ready, _ = await _post_and_scrape(runner)
    return status, body, headers, ready


async def _post_and_scrape(
    runner: StubRunner,
) -> tuple[int, dict[str, Any], dict[str, str], int, str]:
    app = build_app(runner, ByteTokenizer(), INFO)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        ready = await client.get("/ready")
        metrics = await (await client.get("/metrics")).text()
        return resp.status, await resp.json(), dict(resp.headers), ready.status, metrics


def test_a_full_queue_is_503_with_retry_after() -> None:
    runner = StubRunner(alive=True, overloaded=True)
    status, body, headers, ready, metrics = asyncio.run(_post_and_scrape(runner))
    assert status == 503 and headers["Retry-After"] == "1"
    assert "too many requests waiting" in body["error"]["message"]
    assert body["error"]["code"] == "queue_full"
    assert ready == 200 and runner.submitted == 0
    assert 'dsv4_requests_shed_total{reason="queue_full"} 1.0' in metrics
    assert 'dsv4_requests_shed_total{reason="queue_timeout"} 0.0' in metrics


def test_a_dead_engine_is_503_and_not_ready() -> None:
    runner = StubRunner(alive=False, overloaded=False)
    status, body, headers, ready = asyncio.run(_post(runner))
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["error"]["message"] == (
        "the engine is not running: PP stage 1: receive from rank 0 failed"
    )
    assert ready == 503 and runner.submitted == 0


class ExpiringRunner(StubRunner):
    """Admits, then removes the request at its queue deadline (what `EngineRunner._expire`
    sends): no token ever comes."""

    def __init__(self) -> None:
        super().__init__(alive=True, overloaded=False)

    def submit(self, *_: Any, **__: Any) -> Handle:
        self.submitted += 1
        handle = Handle(self.submitted, asyncio.Queue(), time.monotonic())
        handle.events.put_nowait(Done("error", "the request waited 5 s", code="queue_timeout"))
        return handle

    def abort(self, handle: Handle) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_removed_at_its_queue_deadline_is_503(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream that has sent nothing gets the 503 status too, never a 200 with an error
    event; a shed is counted, not logged one line each."""
    runner = ExpiringRunner()

    async def post() -> tuple[int, dict[str, Any], dict[str, str], str]:
        app = build_app(runner, ByteTokenizer(), INFO)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
            resp = await client.post("/v1/completions", json=body)
            metrics = await (await client.get("/metrics")).text()
            return resp.status, await resp.json(), dict(resp.headers), metrics

    with caplog.at_level(logging.INFO):
        status, body, headers, metrics = asyncio.run(post())
    assert status == 503 and headers["Retry-After"] == "1", body
    assert body["error"]["code"] == "queue_timeout" and runner.submitted == 1
    assert 'dsv4_requests_shed_total{reason="queue_timeout"} 1.0' in metrics
    assert not [r for r in caplog.records if "-> 503" in r.getMessage()], caplog.text


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


@pytest.mark.parametrize("alive", [True, False])
def test_a_shed_reads_no_body_and_tokenizes_nothing(alive: bool) -> None:
    """Overload (or a dead engine) is refused before the body is parsed: a body that is not
    even JSON gets the 503, and the tokenizer never runs (sheds stay cheap in a 503 storm)."""
    runner = StubRunner(alive=alive, overloaded=alive)
    tok = CountingTokenizer()

    async def post() -> tuple[int, dict[str, Any]]:
        app = build_app(runner, tok, INFO)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            bad = await client.post("/v1/completions", data=b"{not json")
            good = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert good.status == 503
            return bad.status, await bad.json()

    status, body = asyncio.run(post())
    assert status == 503 and body["error"]["code"] == (
        "queue_full" if alive else "engine_unavailable"
    )
    assert tok.encoded == 0 and runner.submitted == 0
