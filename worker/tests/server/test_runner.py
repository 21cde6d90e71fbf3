"""The engine runner thread: a request the engine refuses is answered with an error event and
the runner keeps serving; an abort frees the request's pages at the runner's next turn; a PD
decode's first token (delivered by a call when its KV lands) goes out before the next step,
and its listener's loop takes it before that step begins (bounded)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from runner_support import tiny_engine, tiny_runner

from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.role import Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.sched.scheduler import Phase
from dsv4_worker.server.runner import Done, EngineRunner, Handle, Token


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
    r = tiny_runner()
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


def _pd_decode_engine() -> tuple[Engine, list[Request]]:
    """A PD decode engine on tiny, and the requests it preallocated (its `on_prealloc`)."""
    preallocated: list[Request] = []

    class Events(EngineEvents):
        def on_prealloc(self, req: Request) -> None:
            preallocated.append(req)

    return tiny_engine(Role.DECODE, Events()), preallocated


async def _landed(r: EngineRunner, eng: Engine, preallocated: list[Request]) -> Handle:
    """Submit a 3-token PD request and, once the engine preallocated it, land its KV with a
    first token of 7 (as the decode agent's call does); its handle."""
    loop = asyncio.get_running_loop()
    handle = r.submit((1, 2, 3), SamplingParams(max_new_tokens=3), loop, prefill="p")
    while not preallocated:  # the engine thread preallocates it and calls the hook
        await asyncio.sleep(0.01)
    rid = preallocated[0].rid
    r.call(lambda: eng.complete_transfer(rid, 7))
    return handle


def test_a_pd_first_token_goes_out_before_the_next_step() -> None:
    """The step after the KV lands is a forward (the second token): the first token, which the
    prefill side sampled, must not wait for it. The step is held until the token arrived."""
    eng, preallocated = _pd_decode_engine()
    gate, real_step = threading.Event(), eng.step

    def gated_step() -> list[Request]:
        if any(q.phase is Phase.DECODE for q in eng.requests.values()):
            gate.wait(20)  # the forward after the KV landed
        return real_step()

    eng.step = gated_step  # type: ignore[method-assign]
    r = EngineRunner(eng)

    async def drive() -> tuple[Token | Done, bool, list[Token | Done]]:
        handle = await _landed(r, eng, preallocated)
        first = await asyncio.wait_for(handle.events.get(), 10)
        before_the_step = not gate.is_set()
        gate.set()
        rest = [first]
        while not isinstance(rest[-1], Done):
            rest.append(await asyncio.wait_for(handle.events.get(), 30))
        return first, before_the_step, rest

    r.start()
    try:
        first, before_the_step, events = asyncio.run(drive())
    finally:
        gate.set()
        r.stop()
    assert isinstance(first, Token) and first.token_id == 7
    assert before_the_step, "the first token waited for the next forward"
    assert [type(e) for e in events] == [Token, Token, Token, Done]


def test_the_loop_takes_a_pd_first_token_before_the_next_step_starts() -> None:
    """A forward holds the GIL for most of its length: the listener's loop must have taken the
    first token (its task woke with it) before the step after the KV landed begins, not only
    have it queued. Without the hand-over the step starts a few lines after the token is
    queued."""
    eng, preallocated = _pd_decode_engine()
    got_first = threading.Event()  # set by the listener's task when the first token arrived
    taken_at_step: list[bool] = []
    real_step = eng.step

    def watched_step() -> list[Request]:
        if not taken_at_step and any(q.phase is Phase.DECODE for q in eng.requests.values()):
            taken_at_step.append(got_first.is_set())  # the forward after the KV landed
        return real_step()

    eng.step = watched_step  # type: ignore[method-assign]
    r = EngineRunner(eng, handoff_wait_s=30.0)  # bounded far above a loaded machine's turn

    async def drive() -> list[Token | Done]:
        handle = await _landed(r, eng, preallocated)
        async with asyncio.timeout(10):  # in this task, as the app reads one choice's queue
            events: list[Token | Done] = [await handle.events.get()]
        got_first.set()
        while not isinstance(events[-1], Done):
            events.append(await asyncio.wait_for(handle.events.get(), 30))
        return events

    r.start()
    try:
        events = asyncio.run(drive())
    finally:
        r.stop()
    assert [type(e) for e in events] == [Token, Token, Token, Done]
    assert taken_at_step == [True], "the next forward started before the loop took the token"


def test_a_loop_that_does_not_turn_holds_the_next_step_only_briefly() -> None:
    """The hand-over is bounded: a listener's loop that is busy elsewhere costs the engine at
    most `handoff_wait_s` before its next step."""
    eng, preallocated = _pd_decode_engine()
    stepped = threading.Event()
    real_step = eng.step

    def watched_step() -> list[Request]:
        if any(q.phase is Phase.DECODE for q in eng.requests.values()):
            stepped.set()  # the forward after the KV landed
        return real_step()

    eng.step = watched_step  # type: ignore[method-assign]
    r = EngineRunner(eng, handoff_wait_s=0.05)
    busy = threading.Event()  # the loop is stuck in a callback until this is set

    async def drive() -> list[Token | Done]:
        handle = await _landed(r, eng, preallocated)
        busy.wait(30)  # blocks this loop: it cannot take the token until the step ran
        events = [await asyncio.wait_for(handle.events.get(), 10)]
        while not isinstance(events[-1], Done):
            events.append(await asyncio.wait_for(handle.events.get(), 30))
        return events

    def release_when_stepped() -> None:
        stepped.wait(30)
        busy.set()

    releaser = threading.Thread(target=release_when_stepped, daemon=True)
    r.start()
    releaser.start()
    try:
        events = asyncio.run(drive())
    finally:
        busy.set()
        r.stop()
    assert stepped.is_set(), "the engine never stepped while the loop was busy"
    assert [type(e) for e in events] == [Token, Token, Token, Done]


def test_the_idle_check_runs_after_the_last_event_went_out() -> None:
    """`check_integrity` takes milliseconds: a request's last event (a PD prefill's `done`
    goes out the same way, in `after_step`) must not wait for it. The check is held until the
    client has its Done; it must still run once the engine is idle."""
    r = tiny_runner()
    mem = r.engine.mem
    gate, checked, real_check = threading.Event(), threading.Event(), mem.check_integrity

    def gated_check() -> None:
        gate.wait(20)
        real_check()
        checked.set()

    mem.check_integrity = gated_check  # type: ignore[method-assign]

    async def drive() -> tuple[list[Token | Done], bool]:
        loop = asyncio.get_running_loop()
        handle = r.submit((1, 2, 3), SamplingParams(max_new_tokens=2), loop)
        events = [await asyncio.wait_for(handle.events.get(), 10)]
        while not isinstance(events[-1], Done):
            events.append(await asyncio.wait_for(handle.events.get(), 10))
        before_the_check = not checked.is_set()
        gate.set()
        return events, before_the_check

    r.start()
    try:
        events, before_the_check = asyncio.run(drive())
        assert checked.wait(30), "the idle check never ran"
    finally:
        gate.set()
        r.stop()
    assert [type(e) for e in events] == [Token, Token, Done]
    assert before_the_check, "the last event waited for the idle check"


class _AtOnce:
    """An event loop stand-in that runs each handed-over callback at once, on the runner's
    thread: what a listener does the moment its Done arrives happens before the runner's
    next line."""

    def __init__(self, on_done: Callable[[Done], None]) -> None:
        self.on_done = on_done

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> None:
        fn(*args)
        if args and isinstance(args[0], Done):
            self.on_done(args[0])


def test_an_id_is_free_by_the_time_its_done_arrives() -> None:
    """A client that reuses its request id as soon as it has the answer is never refused."""
    r = tiny_runner()
    reused: list[str] = []
    ended = threading.Event()

    def again(done: Done) -> None:
        if not reused:  # the first request's Done: submit the same id again right away
            handle = r.submit((1, 2), SamplingParams(max_new_tokens=1), loop, rid="same")
            reused.append(handle.rid)
        else:
            ended.set()

    loop: Any = _AtOnce(again)
    r.start()
    try:
        r.submit((1, 2, 3), SamplingParams(max_new_tokens=2), loop, rid="same")
        assert ended.wait(30), "the reused id's request did not end"
        assert reused == ["same"]
    finally:
        r.stop()
