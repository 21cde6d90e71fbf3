"""The request id over HTTP, on the app with a real engine runner: the client's X-Request-Id
(or a new id) names the completion (`cmpl-<id>`), comes back as a response header and keys the
engine request; a malformed one is a 400 naming the header; a second request of an id still in
flight is a 409 that disturbs nothing, and the id is free again once its request ended."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from runner_support import tiny_runner

from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_common.core.presets import tiny
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.runner import EngineRunner
from dsv4_worker.server.tokenizer import ByteTokenizer

INFO = ServeInfo(
    model_name="tiny",
    vocab_size=tiny().weights.vocab_size,
    max_context_tokens=1024,
    status=WorkerStatus("colocated", 0, RankCapacity(1024, 1024, 4, 1024)),
)
WAIT_S = 60


async def _with_app(check: Any) -> None:
    runner = tiny_runner()
    runner.start()
    try:
        app = build_app(runner, ByteTokenizer(), INFO)
        async with TestClient(TestServer(app)) as client:
            await check(client, runner)
    finally:
        runner.stop()


def _body(max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, **extra}


def test_the_clients_id_names_the_completion_and_comes_back() -> None:
    async def check(client: TestClient[Any, Any], _: EngineRunner) -> None:
        headers = {"X-Request-Id": "trace-1.a:b_c"}
        resp = await client.post("/v1/completions", json=_body(), headers=headers)
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Request-Id"] == "trace-1.a:b_c"
        assert (await resp.json())["id"] == "cmpl-trace-1.a:b_c"

        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
            headers={"X-Request-Id": "s-2"},
        )
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "s-2"
        events = [
            json.loads(line[6:])
            for line in (await resp.text()).splitlines()
            if line.startswith("data: {")
        ]
        assert events and {e["id"] for e in events} == {"chatcmpl-s-2"}

        resp = await client.post("/v1/completions", json=_body())  # no header: a new id
        made = resp.headers["X-Request-Id"]
        assert len(made) == 32 and (await resp.json())["id"] == f"cmpl-{made}"

    asyncio.run(_with_app(check))


def test_a_malformed_id_is_a_400_naming_the_header() -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        for bad in ("a b", "x/1", "é", "a" * 200):
            resp = await client.post("/v1/completions", json=_body(), headers={"X-Request-Id": bad})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["param"] == "X-Request-Id" and "X-Request-Id" in error["message"]
        assert runner.engine.steps == 0  # nothing reached the engine

    asyncio.run(_with_app(check))


def test_an_id_in_flight_is_a_409_and_free_again_once_it_ended() -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        headers = {"X-Request-Id": "dup"}
        first = await client.post("/v1/completions", json=_body(200, stream=True), headers=headers)
        assert first.status == 200
        await first.content.readline()  # its first event: the request runs
        second = await client.post("/v1/completions", json=_body(), headers=headers)
        assert second.status == 409
        error = (await second.json())["error"]
        assert error["code"] == "duplicate_request_id" and error["param"] == "X-Request-Id"
        assert "'dup' is already in flight" in error["message"]
        rest = await first.text()  # the first one is undisturbed: it runs to its end
        assert rest.rstrip().endswith("data: [DONE]")
        assert '"finish_reason": "length"' in rest
        third = await client.post("/v1/completions", json=_body(), headers=headers)
        assert third.status == 200 and (await third.json())["id"] == "cmpl-dup"
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while runner.engine.requests:  # the runner publishes a step's end after its answer
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)

    asyncio.run(_with_app(check))


def test_each_choice_gets_an_engine_request_named_after_the_request() -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        seen: list[str] = []
        submit = runner.engine.submit

        def recording(*args: Any, **kw: Any) -> Any:
            seen.append(kw["rid"])
            return submit(*args, **kw)

        runner.engine.submit = recording  # type: ignore[method-assign]
        resp = await client.post(
            "/v1/completions", json=_body(n=3), headers={"X-Request-Id": "many"}
        )
        assert resp.status == 200
        assert len((await resp.json())["choices"]) == 3
        resp = await client.post("/v1/completions", json=_body(), headers={"X-Request-Id": "one"})
        assert resp.status == 200
        assert seen == ["many/0", "many/1", "many/2", "one"]

    asyncio.run(_with_app(check))


def test_a_stream_asks_for_its_first_token_ahead_and_a_whole_answer_does_not() -> None:
    """PD decode shows a stream's first token as soon as prefill sampled it
    (`EngineRunner.show_first_token`); an answer sent whole gains nothing from that and keeps
    its failures retryable, so the app asks for it on streams only (every choice)."""

    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        asked: list[bool] = []
        real = runner.submit

        def submit(*args: Any, first_token_ahead: bool = False, **kw: Any) -> Any:
            asked.append(first_token_ahead)
            return real(*args, first_token_ahead=first_token_ahead, **kw)

        runner.submit = submit  # type: ignore[method-assign]
        for stream in (True, False):
            resp = await client.post("/v1/completions", json=_body(n=2, stream=stream))
            assert resp.status == 200, await resp.text()
            await resp.read()
        assert asked == [True, True, False, False]

    asyncio.run(_with_app(check))
