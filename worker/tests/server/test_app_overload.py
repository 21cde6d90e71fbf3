"""Overload and a dead engine answer 503 with Retry-After (never a hang or a crash), and
/ready says so; checked on the app with a runner that reports those states."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from dsv4_common.api.worker_status import WorkerStatus
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.runner import Snapshot
from dsv4_worker.server.tokenizer import ByteTokenizer


class StubRunner:
    def __init__(self, *, alive: bool, overloaded: bool) -> None:
        self.alive = alive
        self.failure = None if alive else "PP stage 1: receive from rank 0 failed"
        self._overloaded = overloaded
        self.submitted = 0

    def snapshot(self) -> Snapshot:
        return Snapshot()

    def overloaded(self) -> bool:
        return self._overloaded

    def submit(self, *_: Any) -> Any:
        self.submitted += 1
        raise AssertionError("nothing may be submitted")


INFO = ServeInfo(
    model_name="tiny",
    vocab_size=256,
    max_context_tokens=4096,
    status=WorkerStatus("colocated", 0, 1, 1, 1, 1),
)


async def _post(runner: StubRunner) -> tuple[int, dict[str, Any], dict[str, str], int]:
    app = build_app(runner, ByteTokenizer(), INFO)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        ready = await client.get("/ready")
        return resp.status, await resp.json(), dict(resp.headers), ready.status


def test_a_full_queue_is_503_with_retry_after() -> None:
    runner = StubRunner(alive=True, overloaded=True)
    status, body, headers, ready = asyncio.run(_post(runner))
    assert status == 503 and headers["Retry-After"] == "1"
    assert "too many requests waiting" in body["error"]["message"]
    assert ready == 200 and runner.submitted == 0


def test_a_dead_engine_is_503_and_not_ready() -> None:
    runner = StubRunner(alive=False, overloaded=False)
    status, body, headers, ready = asyncio.run(_post(runner))
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["error"]["message"] == (
        "the engine is not running: PP stage 1: receive from rank 0 failed"
    )
    assert ready == 503 and runner.submitted == 0
