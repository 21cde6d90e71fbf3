"""A request fails alone, over HTTP (issue #37 item 1), on the app with a real engine runner
(tiny, CPU): the issue's degenerate body is served and so is the next request; a request
whose sampling raises is a 500 with a code (an error event once its stream has begun) while
the request beside it succeeds; a response_format schema no JSON value satisfies (a `$ref`
cycle) is a 400 naming the schema; an engine thread that dies anyway fails `/live`,
`/health` and `/ready`, is counted in /metrics, and every later request gets a 503 at once
(none hangs)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from runner_support import tiny_engine

from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_common.core.presets import tiny
from dsv4_worker.engine import loop
from dsv4_worker.engine.grammar import GrammarCompiler
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.runner import Done, EngineRunner
from dsv4_worker.server.tokenizer import ByteTokenizer

INFO = ServeInfo(
    model_name="tiny",
    vocab_size=tiny().weights.vocab_size,
    max_context_tokens=1024,
    status=WorkerStatus("colocated", 0, RankCapacity(1024, 1024, 4, 1024)),
)
WAIT_S = 120
Check = Callable[[TestClient[Any, Any], EngineRunner], Awaitable[None]]


def with_app(check: Check) -> None:
    async def run() -> None:
        tok = ByteTokenizer()
        engine = tiny_engine()
        engine.grammar = GrammarCompiler(tok, INFO.vocab_size)  # response_format
        runner = EngineRunner(engine)
        runner.start()
        try:
            app = build_app(runner, tok, INFO)
            async with TestClient(TestServer(app)) as client:
                await asyncio.wait_for(check(client, runner), WAIT_S)
        finally:
            runner.stop()

    asyncio.run(run())


async def post(client: TestClient[Any, Any], body: dict[str, Any]) -> tuple[int, Any]:
    resp = await client.post("/v1/completions", json=body)
    text = await resp.text()
    return resp.status, json.loads(text) if not body.get("stream") or resp.status != 200 else text


async def probes(client: TestClient[Any, Any]) -> dict[str, int]:
    return {p: (await client.get(p)).status for p in ("/live", "/health", "/ready")}


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name))
    return float(line.split()[-1])


def test_the_issues_body_is_served_and_so_is_the_next_request() -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 5e-324}
        status, doc = await post(client, body)
        assert status == 200 and doc["choices"][0]["finish_reason"] == "length", doc
        status, doc = await post(client, {"prompt": "Hello", "max_tokens": 2})
        assert status == 200, doc
        assert await probes(client) == {"/live": 200, "/health": 200, "/ready": 200}

    with_app(check)


@pytest.fixture
def broken_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests seeded 13 raise in the draw (a sampler bug); the rest sample as ever."""
    original = loop.draw

    def draw(scores: torch.Tensor, params: SamplingParams, gen: Any) -> int:
        if params.seed == 13:
            raise RuntimeError("injected: the sampler broke")
        return original(scores, params, gen)

    monkeypatch.setattr(loop, "draw", draw)


@pytest.mark.usefixtures("broken_sampler")
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_sampling_raises_is_a_500_and_its_neighbour_succeeds(
    stream: bool,
) -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        bad = {"prompt": "Hello", "max_tokens": 8, "temperature": 1, "seed": 13, "stream": stream}
        good = {"prompt": "Hello", "max_tokens": 8, "temperature": 1, "seed": 12}
        (bad_status, bad_doc), (good_status, good_doc) = await asyncio.gather(
            post(client, bad), post(client, good)
        )
        assert bad_status == 500, bad_doc  # a stream fails before its first token: a status
        assert bad_doc["error"]["code"] == "internal_error"
        assert "the sampler broke" in bad_doc["error"]["message"]
        assert good_status == 200 and good_doc["choices"][0]["finish_reason"] == "length"
        assert await probes(client) == {"/live": 200, "/health": 200, "/ready": 200}
        idle = runner.engine
        await asyncio.to_thread(lambda: runner.call(idle.mem.check_integrity))

    with_app(check)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"enum": []},
        {"enum": [f"value-{i}" for i in range(20_000)]},  # past the schema size bound
    ],
    ids=["ref root", "ref required", "defs cycle", "empty enum", "huge enum"],
)
def test_a_schema_no_value_satisfies_is_a_400_naming_it(schema: dict[str, Any]) -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        status, doc = await post(
            client, {"prompt": "Hello", "max_tokens": 4, "response_format": fmt}
        )
        assert status == 400, doc
        assert doc["error"]["param"] == "response_format.json_schema.schema", doc

    with_app(check)


def test_a_recursive_schema_with_a_way_out_is_served() -> None:
    """Recursion itself is fine (a tree whose children may be empty): only no-value ones go."""

    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        tree = {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"],
        }
        fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
        status, doc = await post(
            client, {"prompt": "Hello", "max_tokens": 4, "response_format": fmt}
        )
        assert status == 200, doc

    with_app(check)


def test_a_dead_engine_thread_fails_live_and_answers_every_request_at_once() -> None:
    async def check(client: TestClient[Any, Any], runner: EngineRunner) -> None:
        before = await (await client.get("/metrics")).text()
        assert metric(before, 'dsv4_engine_thread_deaths_total{thread="engine"}') == 0
        assert metric(before, "dsv4_engine_serving") == 1

        def broken() -> Any:
            raise RuntimeError("injected: the scheduler broke")

        runner.engine.plan = broken  # type: ignore[method-assign]
        status, doc = await post(client, {"prompt": "Hello", "max_tokens": 4})
        assert status == 503 and doc["error"]["code"] == "engine_unavailable", doc
        assert await probes(client) == {"/live": 503, "/health": 503, "/ready": 503}
        live = await (await client.get("/live")).text()
        assert "the scheduler broke" in live
        after = await (await client.get("/metrics")).text()
        assert metric(after, 'dsv4_engine_thread_deaths_total{thread="engine"}') == 1
        assert metric(after, "dsv4_engine_serving") == 0
        status, doc = await post(client, {"prompt": "Hello", "max_tokens": 4, "stream": True})
        assert status == 503 and doc["error"]["code"] == "engine_unavailable", doc
        # A submission that raced the death (past the app's check) is answered, not queued.
        handle = runner.submit((1, 2), SamplingParams(), asyncio.get_running_loop())
        done = await handle.events.get()
        assert isinstance(done, Done) and done.code == "engine_unavailable" and done.retryable

    with_app(check)
