"""A tiny engine and runner for the runner's and the app's in-process tests."""

from __future__ import annotations

from mem_helpers import small_memory

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.events import NO_EVENTS, EngineEvents
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.role import EngineConfig, Role
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import SchedulerConfig
from dsv4_worker.server.runner import EngineRunner


def tiny_engine(role: Role = Role.COLOCATED, events: EngineEvents = NO_EVENTS) -> Engine:
    """tiny with seed-1 weights, 64 full pages, 32 SWA pages, 4 request slots, page 16."""
    model = tiny()
    memory = small_memory("tiny", full_pages=64, swa_pages=32, slots=4, max_pages=64)
    sched = SchedulerConfig(page_size=16, chunk_tokens=64, max_tokens_per_request=1024)
    paged = PagedModel(model, init_weights(model, seed=1), memory)
    return Engine(paged, EngineConfig(sched, role), events=events)


def tiny_runner() -> EngineRunner:
    """An EngineRunner (not started) over a colocated `tiny_engine`."""
    return EngineRunner(tiny_engine())
