"""The engine runner thread: a request the engine refuses is answered with an error event and
the runner keeps serving; an abort frees the request's pages at the runner's next turn."""

from __future__ import annotations

import asyncio
import time

from mem_helpers import small_memory

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import SchedulerConfig
from dsv4_worker.server.runner import Done, EngineRunner, Token


def runner() -> EngineRunner:
    model = tiny()
    memory = small_memory("tiny", full_pages=64, swa_pages=32, slots=4, max_pages=64)
    sched = SchedulerConfig(page_size=16, chunk_tokens=64, max_tokens_per_request=1024)
    return EngineRunner(Engine(PagedModel(model, init_weights(model, seed=1), memory), sched))


async def _drive(r: EngineRunner) -> tuple[Done, list[int], Done]:
    loop = asyncio.get_running_loop()
    bad = r.submit((), SamplingParams(max_new_tokens=2), loop)  # the engine refuses it
    refused = await asyncio.wait_for(bad.events.get(), 30)
    assert isinstance(refused, Done)
    good = r.submit((1, 2, 3), SamplingParams(max_new_tokens=3), loop)
    tokens = []
    while True:
        event = await asyncio.wait_for(good.events.get(), 30)
        if isinstance(event, Done):
            break
        assert isinstance(event, Token)
        tokens.append(event.token_id)
    long = r.submit((5,) * 20, SamplingParams(max_new_tokens=500), loop)
    assert isinstance(await asyncio.wait_for(long.events.get(), 30), Token)
    r.abort(long)
    while not isinstance(last := await asyncio.wait_for(long.events.get(), 30), Done):
        pass
    return refused, tokens, last


def test_refused_requests_and_aborts_keep_the_runner_serving() -> None:
    r = runner()
    r.start()
    try:
        refused, tokens, aborted = asyncio.run(_drive(r))
        assert refused.reason == "error" and "prompt" in (refused.error or "")
        assert len(tokens) == 3 and aborted.reason == "abort" and r.alive
        deadline = time.monotonic() + 30  # until the runner publishes the freed pools
        while not all(u.used == 0 for u in r.snapshot().usage):
            assert time.monotonic() < deadline, r.snapshot()
            time.sleep(0.02)
    finally:
        r.stop()
