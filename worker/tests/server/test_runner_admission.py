"""The runner's queue: a request the engine cannot schedule within the queue deadline is removed
and answered with Done(code="queue_timeout") (it held no pages: the pools stay as the running
request left them), the queue's depth counts it until then, and a queue at its bound makes
`admission` shed."""

from __future__ import annotations

import asyncio
import time

from mem_helpers import small_memory

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import SchedulerConfig
from dsv4_worker.server.admission import AdmissionPolicy
from dsv4_worker.server.runner import Done, EngineRunner, Token

DEADLINE_S = 0.3
WAIT_S = 30.0  # generous bound for anything that must happen (a loaded 2-core machine)


def one_slot_runner(policy: AdmissionPolicy) -> EngineRunner:
    model = tiny()
    memory = small_memory("tiny", full_pages=64, swa_pages=32, slots=1, max_pages=64)
    sched = SchedulerConfig(page_size=16, chunk_tokens=64, max_tokens_per_request=1024)
    engine = Engine(PagedModel(model, init_weights(model, seed=1), memory), EngineConfig(sched))
    return EngineRunner(engine, policy)


def used_units(r: EngineRunner) -> dict[str, int]:
    return {u.pool: u.used for u in r.engine.mem.usage()}


async def _drive(r: EngineRunner) -> tuple[Done, float, int, bool, dict[str, int]]:
    loop = asyncio.get_running_loop()
    # The one slot runs a long request; the next one can only wait.
    long = r.submit((5,) * 8, SamplingParams(max_new_tokens=1000), loop)
    assert isinstance(await asyncio.wait_for(long.events.get(), WAIT_S), Token)
    held = used_units(r)
    start = time.monotonic()
    queued = r.submit((1, 2, 3), SamplingParams(max_new_tokens=4), loop)
    depth = r.queue_view().waiting
    second = r.submit((1, 2, 3), SamplingParams(max_new_tokens=4), loop)
    full = not r.admission(4).admitted  # two queued, the bound is two
    done = await asyncio.wait_for(queued.events.get(), WAIT_S)
    waited_s = time.monotonic() - start
    assert isinstance(done, Done)
    await asyncio.wait_for(second.events.get(), WAIT_S)
    # Only the long request holds a slot (its pages grow as it decodes): the shed ones never
    # had one, and the runner asserts it before it removes them.
    assert used_units(r)["req_slots"] == 1
    r.abort(long)
    while not isinstance(await asyncio.wait_for(long.events.get(), WAIT_S), Done):
        pass
    return done, waited_s, depth, full, held


def test_a_request_that_waits_past_its_deadline_is_shed_without_pages() -> None:
    r = one_slot_runner(AdmissionPolicy(max_queue_requests=2, queue_timeout_s=DEADLINE_S))
    r.start()
    try:
        done, waited_s, depth, full, held = asyncio.run(_drive(r))
        assert done.reason == "error" and done.code == "queue_timeout"
        assert "waited" in (done.error or "")
        assert waited_s >= DEADLINE_S
        assert depth >= 1 and full
        assert held["req_slots"] == 1 and held["full"] > 0
        deadline = time.monotonic() + WAIT_S  # until the abort is published
        while any(u.used for u in r.snapshot().usage) or r.queue_view().waiting:
            assert time.monotonic() < deadline, (r.snapshot(), r.queue_view())
            time.sleep(0.02)
        assert r.alive and r.admission(4).admitted
        r.engine.mem.check_integrity()
    finally:
        r.stop()
