"""An engine keys its requests by the id its caller gives (one id end to end): it refuses a
second request of an id still in flight (unfinished, or holding pages until released), takes it
again once that one is gone, names a request itself only when the caller gives no id, and
schedules by arrival, whatever the ids are."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import DuplicateRequest, Engine
from dsv4_worker.engine.role import Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import Phase

MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=5)
PARAMS = SamplingParams(max_new_tokens=2)


def test_an_id_in_flight_is_refused_and_free_again_once_finished() -> None:
    eng = engine(MODEL, WEIGHTS)
    first = eng.submit([1, 2, 3], PARAMS, rid="abc")
    assert first.rid == "abc" and eng.requests["abc"] is first
    with pytest.raises(DuplicateRequest, match="'abc' is already in flight"):
        eng.submit([4, 5], PARAMS, rid="abc")
    assert list(eng.requests) == ["abc"] and eng.requests["abc"] is first  # untouched
    eng.run_until_idle()
    assert first.finished and not eng.requests
    again = eng.submit([4, 5], PARAMS, rid="abc")
    assert again is not first and again.seq > first.seq
    eng.run_until_idle()
    assert again.finished


def test_a_held_id_is_refused_until_released() -> None:
    """A PD prefill keeps a finished request's pages (keep_pages) until its transfer ends:
    its id stays taken until `release`."""
    eng = engine(MODEL, WEIGHTS)
    kept = eng.submit([1, 2, 3], PARAMS, rid="room-1", keep_pages=True)
    eng.run_until_idle()
    assert kept.finished and "room-1" in eng.held
    with pytest.raises(DuplicateRequest):
        eng.submit([1, 2, 3], PARAMS, rid="room-1")
    eng.release("room-1")
    assert eng.submit([1, 2, 3], PARAMS, rid="room-1").rid == "room-1"


def test_an_aborted_decode_transfer_holds_its_id_until_released() -> None:
    base = engine(MODEL, WEIGHTS)
    config = dataclasses.replace(base.config, role=Role.DECODE)
    eng = Engine(base.paged, config, events=EngineEvents())
    req = eng.submit([1, 2, 3], PARAMS, rid="d-1", prefill="p")
    eng.step()  # preallocated: its KV may be landing now
    assert req.phase is Phase.TRANSFER
    eng.abort("d-1")
    with pytest.raises(DuplicateRequest):
        eng.submit([1, 2, 3], PARAMS, rid="d-1", prefill="p")
    eng.release("d-1")
    assert eng.submit([1, 2, 3], PARAMS, rid="d-1", prefill="p").rid == "d-1"


def test_without_an_id_the_engine_names_the_request_and_never_reuses_a_callers_name() -> None:
    eng = engine(MODEL, WEIGHTS)
    assert eng.submit([1], PARAMS).rid == "req-0"
    eng.submit([1], PARAMS, rid="req-2")  # a caller's id that is the engine's next name
    with pytest.raises(DuplicateRequest, match="'req-2'"):
        eng.submit([1], PARAMS)
    assert set(eng.requests) == {"req-0", "req-2"}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text("zyxab", min_size=1, max_size=3), min_size=2, max_size=6, unique=True))
def test_the_schedule_follows_arrival_not_the_ids(ids: list[str]) -> None:
    """The same prompts under any ids (in any sort order) give the same steps and tokens."""
    prompts = [[3 + i, 4, 5 + i] for i in range(len(ids))]

    def run(names: list[str]) -> list[list[int]]:
        eng = engine(MODEL, WEIGHTS)
        reqs = [eng.submit(p, PARAMS, rid=n) for p, n in zip(prompts, names, strict=True)]
        order = []
        while eng.has_work:
            plan = eng.plan()
            order.append([names.index(r) for r in (*plan.decodes, *(c for c, _ in plan.chunks))])
            eng.execute(plan)
        assert order
        return [r.output for r in reqs] + order

    assert run(ids) == run([f"req-{i}" for i in range(len(ids))])
