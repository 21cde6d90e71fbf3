"""The decode agent drives its transfer target's hints: `expect(True)` when a request's `done`
arrived and it waits for its tags (never before: the prefill is still computing), `expect(False)`
once none waits. Its control loop has no polling timer, only the clock's due times (the next
ping): with a heartbeat of ten minutes, requests complete (messages and the target's
`on_landed` kicks wake it) and the agent stops cleanly (`stop()` kicks it; without the kick the
thread would outlive `stop` and fail on its closed sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import pytest
from engine_helpers import engine
from pd_support import drained, on_engine, pd_pair, wait_until, withheld_landings

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import decode
from dsv4_worker.pd.liveness import Heartbeat
from dsv4_worker.pd.transfer.nixl_backend import NixlTarget
from dsv4_worker.pd.transfer.zmq_backend import ZmqTarget
from dsv4_worker.server.runner import Done, Token

WEIGHTS = init_weights(tiny(), seed=5)


def _make() -> Engine:
    return engine(tiny(), WEIGHTS)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_decode_waits_on_wakeups_and_tells_its_target_when_writes_are_due(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    lock = threading.Lock()
    cls = NixlTarget if backend == "nixl" else ZmqTarget
    real = cls.expect

    def record(self: ZmqTarget | NixlTarget, expecting: bool) -> None:
        with lock:
            calls.append(expecting)
        real(self, expecting)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "expect", record)

    prompts = [[(7 * i + j) % 200 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    params = [SamplingParams(max_new_tokens=3) for _ in prompts]
    # no timer within the test: only messages and the target's on_landed kicks wake the loop
    with pd_pair(backend, _make, _make, heartbeat=Heartbeat(600.0, 1200.0)) as pair:
        for _ in range(2):  # two bursts: waiting starts and ends twice
            outputs = pair.generate(prompts, params)
            assert all(len(tokens) == 3 for tokens, _ in outputs)
            wait_until(lambda: drained(pair.decode_runner), "the decode pools to drain")
            wait_until(lambda: bool(calls) and not calls[-1], "expect(False) after the burst")
    with lock:
        seen = list(calls)
    assert seen[0] is True and seen[-1] is False
    assert all(a != b for a, b in itertools.pairwise(seen)), seen  # transitions only
    assert len(seen) >= 4, seen


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_done_that_arrives_before_its_tags_waits_for_them(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill sends `done` before its last write: decode must complete a request only
    once every tag `done` lists has landed. Here every tag is withheld until the test opens a
    gate; the request must stay silent after its `done` arrived, then finish with the same
    tokens as an ungated run."""
    prompt = tuple((5 * j) % 200 + 3 for j in range(70))
    params = SamplingParams(max_new_tokens=4)
    with contextlib.ExitStack() as stack, pd_pair(backend, _make, _make) as pair:
        [(expected, _)] = pair.generate([prompt], [params])
        gate = stack.enter_context(withheld_landings(backend, monkeypatch))
        agent = pair.decode_agent

        async def gated() -> tuple[bool, list[int]]:
            loop = asyncio.get_running_loop()
            handle = pair.decode_runner.submit(prompt, params, loop, prefill=pair.address)
            deadline = loop.time() + 60
            # until `done` arrived (or, wrongly, the request completed without its tags)
            while handle.events.empty() and not any(
                f.done is not None for f in list(agent._flights.values())
            ):
                assert loop.time() < deadline, "no done from the prefill"
                await asyncio.sleep(0.005)
            # Two engine turns: whatever the decode posted on `done` has run and been published.
            for _ in range(2):
                await asyncio.to_thread(on_engine, pair.decode_runner, lambda: None)
            await asyncio.sleep(0)
            silent = handle.events.empty()
            gate.open.set()
            tokens = []
            while isinstance(event := await asyncio.wait_for(handle.events.get(), 60), Token):
                tokens.append(event.token_id)
            assert isinstance(event, Done) and event.reason == "length", event
            return silent, tokens

        silent, tokens = asyncio.run(gated())
        assert gate.held == [] and silent, "decode completed before the tags landed"
        assert tokens == expected
        wait_until(lambda: drained(pair.decode_runner), "the decode pools to drain")


def test_decode_expects_writes_only_once_done_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before `done` the prefill computes: a nixl target told to expect writes then polls every
    0.2 ms, taking the CPU the prefill's forward needs on a shared host. Every `expect(True)`
    comes while some request's `done` is in."""
    seen: list[tuple[bool, bool]] = []  # (expecting, some flight's done arrived)
    agents: list[decode.DecodeAgent] = []
    real = NixlTarget.expect

    def record(self: NixlTarget, expecting: bool) -> None:  # on the control thread
        flights = agents[0]._flights.values()
        seen.append((expecting, any(f.done is not None for f in flights)))
        real(self, expecting)

    monkeypatch.setattr(NixlTarget, "expect", record)
    prompts = [[(5 * i + j) % 200 + 3 for j in range(30 + 40 * i)] for i in range(2)]
    params = [SamplingParams(max_new_tokens=2) for _ in prompts]
    with pd_pair("nixl", _make, _make) as pair:
        agents.append(pair.decode_agent)
        for prompt, p in zip(prompts, params, strict=True):  # one at a time, as at low load
            [(tokens, _)] = pair.generate([prompt], [p])
            assert len(tokens) == 2
            wait_until(lambda: drained(pair.decode_runner), "the decode pools to drain")
        wait_until(lambda: bool(seen) and not seen[-1][0], "expect(False) after the requests")
    assert any(expecting for expecting, _ in seen), seen
    assert all(done for expecting, done in seen if expecting), seen


def test_a_steps_first_admission_is_sent_before_its_step_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefill computes from the `prefill` message on: at a step's first admission the
    engine thread waits (bounded) until the control thread has handled it, instead of running
    the rest of its step while the control thread waits for the GIL. With the bound far above a
    loaded machine's hand-off, the request's flight exists (and its message is out) by the time
    `on_admit` returns; without the hand-over the control thread makes it later."""
    monkeypatch.setattr(decode, "ADMIT_HANDOFF_S", 30.0)
    handled: list[bool] = []
    real = decode.DecodeAgent.on_admit

    def on_admit(self: decode.DecodeAgent, req: Request) -> None:
        real(self, req)
        handled.append(req.rid in self._flights)

    monkeypatch.setattr(decode.DecodeAgent, "on_admit", on_admit)
    real_outgoing = decode.DecodeAgent._outgoing

    def slow_outgoing(self: decode.DecodeAgent, out: object) -> None:
        if isinstance(out, decode._Admitted):
            time.sleep(0.2)  # a control thread that gets to it late (the GIL, a busy core)
        real_outgoing(self, out)  # type: ignore[arg-type]

    monkeypatch.setattr(decode.DecodeAgent, "_outgoing", slow_outgoing)
    prompt = [(5 * j) % 200 + 3 for j in range(24)]
    with pd_pair("zmq", _make, _make) as pair:
        for _ in range(2):  # one request at a time: each is its step's first admission
            [(tokens, done)] = pair.generate([prompt], [SamplingParams(max_new_tokens=2)])
            assert len(tokens) == 2 and done.reason == "length"
    assert handled == [True, True]


def test_the_admission_hand_over_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control thread that does not get to the admission costs the engine at most
    `ADMIT_HANDOFF_S`: here it is held until `on_admit` has returned, which must happen
    before the control thread handled the request (which then completes normally)."""
    monkeypatch.setattr(decode, "ADMIT_HANDOFF_S", 0.05)
    gate = threading.Event()
    handled: list[bool] = []
    real = decode.DecodeAgent.on_admit

    def on_admit(self: decode.DecodeAgent, req: Request) -> None:
        real(self, req)
        handled.append(req.rid in self._flights)
        gate.set()

    real_outgoing = decode.DecodeAgent._outgoing

    def held_outgoing(self: decode.DecodeAgent, out: object) -> None:
        if isinstance(out, decode._Admitted):
            gate.wait(30)  # until the engine thread went on without it
        real_outgoing(self, out)  # type: ignore[arg-type]

    monkeypatch.setattr(decode.DecodeAgent, "on_admit", on_admit)
    monkeypatch.setattr(decode.DecodeAgent, "_outgoing", held_outgoing)
    prompt = [(3 * j) % 200 + 3 for j in range(24)]
    with pd_pair("zmq", _make, _make) as pair:
        [(tokens, done)] = pair.generate([prompt], [SamplingParams(max_new_tokens=2)])
    assert len(tokens) == 2 and done.reason == "length"
    assert handled == [False], "the engine thread waited for the control thread past the bound"
