"""A PD stream shows its first token as soon as `done` brings it, before the prompt's KV has
landed (`Handle.first_token_ahead`); the request still decodes only once every tag landed and
fails if they never do. The prefill hands `done` to its control thread before its last write.

The landed tags are withheld by a gate on the target's `poll_landed`, so "before the landing"
is a state the test holds, not a race it hopes to win."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_helpers import engine
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_support import (
    Pair,
    drained,
    on_engine,
    pd_pair,
    wait_drained,
    wait_until,
    withheld_landings,
)
from runner_support import tiny_engine

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.role import Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import prefill
from dsv4_worker.pd.channel import Mailbox
from dsv4_worker.sched.scheduler import Phase
from dsv4_worker.server.runner import Done, EngineRunner, Handle, Token

WEIGHTS = init_weights(tiny(), seed=7)
PROMPT = tuple((3 * j) % 200 + 3 for j in range(50))
WAIT_S = 60.0
FIRST = 11  # the first token the tests' prefill "sampled"


def _make() -> Engine:
    return engine(tiny(), WEIGHTS)


async def _until_done_arrived(pair: Pair, count: int) -> None:
    """Until `count` flights have their `done`, then two engine turns and a turn of this
    loop: whatever decode did on them has run and reached the handles' queues."""
    deadline = time.monotonic() + WAIT_S
    while sum(f.done is not None for f in list(pair.decode_agent._flights.values())) < count:
        assert time.monotonic() < deadline, "no done from the prefill"
        await asyncio.sleep(0.005)
    for _ in range(2):
        await asyncio.to_thread(on_engine, pair.decode_runner, lambda: None)
    await asyncio.sleep(0)


async def _rest(handle: Handle) -> tuple[list[int], Done]:
    tokens: list[int] = []
    while isinstance(event := await asyncio.wait_for(handle.events.get(), WAIT_S), Token):
        tokens.append(event.token_id)
    assert isinstance(event, Done)
    return tokens, event


def _queued(handle: Handle) -> list[Token | Done]:
    out = []
    while not handle.events.empty():
        out.append(handle.events.get_nowait())
    return out


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_stream_gets_its_first_token_before_the_kv_lands_and_the_rest_after(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests at once, one asking for its first token ahead and one not: while the tags
    are withheld the first has exactly its first token and the second nothing; once they land
    both finish with the tokens of an ungated run, the first token never twice."""
    params = SamplingParams(max_new_tokens=5)
    with pd_pair(backend, _make, _make) as pair:
        [(expected, _)] = pair.generate([PROMPT], [params])
        with withheld_landings(backend, monkeypatch) as gate:

            async def run() -> None:
                loop = asyncio.get_running_loop()
                runner = pair.decode_runner
                ahead = runner.submit(PROMPT, params, loop, first_token_ahead=True)
                plain = runner.submit(PROMPT, params, loop)
                await _until_done_arrived(pair, 2)
                shown = _queued(ahead)
                assert [type(e) for e in shown] == [Token], shown
                assert isinstance(shown[0], Token) and shown[0].token_id == expected[0]
                assert _queued(plain) == [], "a request that did not ask got a token early"
                gate.open.set()
                tokens, done = await _rest(ahead)
                assert [expected[0], *tokens] == expected and done.reason == "length"
                tokens, done = await _rest(plain)
                assert tokens == expected and done.reason == "length"

            asyncio.run(run())
            wait_drained(pair)


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_first_token_shown_ahead_still_fails_when_its_kv_never_lands(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tags never land: the request fails at decode's transfer timeout after its first
    token was shown (an error after the token, which the stream carries), and both sides free
    every page."""
    params = SamplingParams(max_new_tokens=4)
    with pd_pair(backend, _make, _make, transfer_timeout_s=2.0) as pair:
        [(expected, _)] = pair.generate([PROMPT], [params])
        with withheld_landings(backend, monkeypatch):

            async def run() -> tuple[list[int], Done]:
                loop = asyncio.get_running_loop()
                handle = pair.decode_runner.submit(PROMPT, params, loop, first_token_ahead=True)
                return await _rest(handle)

            tokens, done = asyncio.run(run())
        assert tokens == expected[:1]
        assert done.reason == "error" and done.error is not None and "deliver" in done.error
        assert not done.retryable  # its first token went out: no other instance may redo it
        wait_drained(pair)


def test_show_first_token_goes_once_only_to_a_live_request_that_asked() -> None:
    """`EngineRunner.show_first_token` (colocated engine, runner not started: only the hand-off
    is tested): a request that asked gets the token once, with its prompt logprobs only if it
    asked for them; one that did not ask, an unknown id, a second call and a request that
    ended get nothing."""
    runner = EngineRunner(_make())

    async def run() -> None:
        loop = asyncio.get_running_loop()
        asked = runner.submit(
            PROMPT, SamplingParams(max_new_tokens=2), loop, first_token_ahead=True
        )
        plain = runner.submit(PROMPT, SamplingParams(max_new_tokens=2), loop)
        ended = runner.submit(
            PROMPT, SamplingParams(max_new_tokens=2), loop, first_token_ahead=True
        )
        runner._end(ended.rid)
        for rid in (asked.rid, asked.rid, plain.rid, ended.rid, "nobody"):
            runner.show_first_token(rid, 9)
        await asyncio.sleep(0)
        [first] = _queued(asked)
        assert isinstance(first, Token) and first.token_id == 9 and first.prompt_logprobs is None
        assert asked.first_shown and not plain.first_shown and not ended.first_shown
        assert _queued(plain) == [] and _queued(ended) == []
        scored = SamplingParams(max_new_tokens=2, prompt_logprobs=1)
        wants = runner.submit(PROMPT, scored, loop, first_token_ahead=True)
        runner.show_first_token(wants.rid, 9, None, ())
        await asyncio.sleep(0)
        [first] = _queued(wants)
        assert isinstance(first, Token) and first.prompt_logprobs == ()

    asyncio.run(run())


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_done_is_sent_before_the_last_write_starts(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the hand-over's bound far above a loaded machine's, every message the prefill
    queued (its `done` among them) has been handled by the control thread when the last
    write starts, even with a control thread that gets to its mailbox late."""
    monkeypatch.setattr(prefill, "DONE_HANDOFF_S", 30.0)
    real_take = Mailbox.take

    def slow_take(self: Mailbox[object]) -> list[object]:
        out = real_take(self)
        if any(type(m).__name__ == "_Send" for m in out):
            time.sleep(0.1)  # a control thread that gets to it late (the GIL, a busy core)
        return out

    monkeypatch.setattr(Mailbox, "take", slow_take)
    sent_before: list[bool] = []
    real_write = prefill._StageWriter._write

    def write(self: prefill._StageWriter, tx: object, step: object, k: int) -> None:
        if step.request_state and isinstance(self, prefill.PrefillAgent):  # type: ignore[attr-defined]
            box = self._outbox
            sent_before.append(box._handled == box._put)
        real_write(self, tx, step, k)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill._StageWriter, "_write", write)
    with pd_pair(backend, _make, _make) as pair:
        for _ in range(2):
            [(tokens, done)] = pair.generate([PROMPT], [SamplingParams(max_new_tokens=2)])
            assert len(tokens) == 2 and done.reason == "length"
        wait_until(lambda: drained(pair.decode_runner), "the decode side to drain")
    assert sent_before == [True, True]


OPS = st.sampled_from(["show", "complete", "fail", "abort", "turn"])


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OPS, max_size=8), ahead=st.booleans())
def test_any_order_of_show_landing_failure_and_abort_keeps_the_stream_whole(
    ops: list[str], ahead: bool
) -> None:
    """A decode request in TRANSFER and any interleaving of its first token shown ahead, its
    landing (`complete_transfer`), its failure and the client's abort, each followed by some
    runner turns (driven here, on this thread): its listener gets exactly one Done, last; a
    request that ran to its end got exactly its output, the first token once; a failure is
    retryable only when no token went out; and once it is released every page is back."""
    loop = asyncio.new_event_loop()
    try:
        runner = EngineRunner(tiny_engine(Role.DECODE))
        eng = runner.engine
        params = SamplingParams(max_new_tokens=3)
        handle = runner.submit(PROMPT[:20], params, loop, first_token_ahead=ahead)
        rid = handle.rid

        def turn() -> None:
            runner._drain(block=False)
            finished = eng.step() if eng.has_work else []
            finished += eng.take_finished()
            runner._publish(finished)
            loop.run_until_complete(asyncio.sleep(0))

        turn()  # admitted and preallocated: its KV would be landing now
        req = eng.requests[rid]
        assert req.phase is Phase.TRANSFER
        for op in [*ops, "complete"]:
            if op == "show":
                runner.show_first_token(rid, FIRST)
            elif op == "complete":
                runner.call(lambda: eng.complete_transfer(rid, FIRST))
            elif op == "fail":
                runner.call(lambda: eng.fail_transfer(rid, "lost"))
            elif op == "abort":
                runner.abort(handle)
            turn()
        for _ in range(10):  # the rest of its decode
            turn()
        eng.release(rid)  # an abort while in TRANSFER holds its pages until this
        events = _queued(handle)
        dones = [e for e in events if isinstance(e, Done)]
        assert len(dones) == 1 and events[-1] is dones[0], events
        tokens = [e.token_id for e in events if isinstance(e, Token)]
        done = dones[0]
        if done.reason == "length":
            assert tokens == req.output and tokens[0] == FIRST and len(tokens) == 3
        else:
            landed = req.output or [FIRST]  # (shown ahead, never landed: the output is empty)
            assert tokens == landed[: len(tokens)]
        if done.reason == "error":
            assert done.retryable == (not tokens)
        assert not eng.requests and not eng.held
        assert all(u.used == 0 for u in eng.mem.usage())
    finally:
        loop.close()
