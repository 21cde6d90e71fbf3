"""Busy polling (`busy_poll`): a kick keeps the event loop polling for its window, then lets
it sleep; a zero window never schedules anything; the router's completion path kicks on its
writes, to the client and to the upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from router_support import StubWorker, routed, run_async
from test_fast_path import connect, read_answer
from test_fast_path import request as fast_request
from test_fast_path import serving as fast_serving
from test_upstream import BODY, REQUEST, answer, read_request, serving

from dsv4_router.busy_poll import BusyPoll
from dsv4_router.upstream import Upstream

# Far past any test's length: the window is still open when the test looks.
OPEN_S = 600.0


class FakeLoop:
    """`call_soon` only: the callbacks a step of the loop would run."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.ready.append(callback)

    def step(self) -> None:
        ready, self.ready = self.ready, []
        for callback in ready:
            callback()


def fake_poll(window_s: float) -> tuple[BusyPoll, FakeLoop, list[float]]:
    now = [0.0]
    poll = BusyPoll(window_s, clock=lambda: now[0])
    loop = FakeLoop()
    poll._loop = loop  # type: ignore[assignment]
    return poll, loop, now


def test_a_kick_polls_until_its_window_ends_then_lets_the_loop_sleep() -> None:
    poll, loop, now = fake_poll(50e-6)
    poll.kick()
    assert poll.spinning and len(loop.ready) == 1
    for t in (10e-6, 49e-6):  # inside the window: one callback ready at every step
        now[0] = t
        loop.step()
        assert poll.spinning and len(loop.ready) == 1
    now[0] = 50e-6
    loop.step()
    assert not poll.spinning and loop.ready == []  # nothing ready: the loop may block


def test_a_kick_while_polling_moves_the_end_at_the_next_poll_and_schedules_nothing() -> None:
    poll, loop, now = fake_poll(50e-6)
    poll.kick()
    now[0] = 40e-6
    poll.kick()
    assert len(loop.ready) == 1
    now[0] = 60e-6  # past the first window: the kick moved its end to 60 + 50 us
    loop.step()
    assert poll.spinning and len(loop.ready) == 1
    now[0] = 109e-6
    loop.step()
    assert poll.spinning and len(loop.ready) == 1
    now[0] = 110e-6
    loop.step()
    assert not poll.spinning and loop.ready == []
    poll.kick()  # a later burst starts over
    assert poll.spinning and len(loop.ready) == 1


def test_a_zero_window_never_schedules() -> None:
    poll, loop, _ = fake_poll(0.0)
    for _ in range(3):
        poll.kick()
    assert not poll.spinning and loop.ready == []


@pytest.mark.parametrize("window_s", [-1e-6, float("nan")])
def test_a_negative_window_is_refused(window_s: float) -> None:
    with pytest.raises(ValueError, match="window_s must be >= 0"):
        BusyPoll(window_s)


@run_async
async def test_on_a_real_loop_it_polls_while_a_task_waits_and_stops_at_the_window() -> None:
    reads = [0]

    def clock() -> float:  # every read is a millisecond later
        reads[0] += 1
        return reads[0] * 1e-3

    poll = BusyPoll(0.02, clock=clock)  # the window: 20 reads
    poll.kick()
    await asyncio.sleep(0.05)  # meanwhile the loop runs the poll's callback, step by step
    assert not poll.spinning
    assert reads[0] == 21  # the kick's read, then one per step until the window closed


class CountingPoll(BusyPoll):
    """Counts its kicks (a zero window: it never spins)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.kicks = 0

    def kick(self) -> None:
        self.kicks += 1
        super().kick()


@run_async
async def test_the_fast_path_kicks_when_it_answers() -> None:
    poll = CountingPoll()
    at_handler: list[int] = []
    async with fast_serving(
        busy_poll=poll, on_complete=lambda: at_handler.append(poll.kicks)
    ) as front:
        reader, writer = await connect(front.port)
        writer.write(fast_request())
        await writer.drain()
        status, _, _ = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 200")
        assert at_handler == [0]  # reading the request: no kick (a write follows)
        assert poll.kicks >= 1  # the answer's write
        writer.close()


@run_async
async def test_the_upstream_kicks_when_it_sends() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(answer(b"done", b"Content-Type: application/json"))

    async with serving(script) as (worker, _):
        poll = CountingPoll()
        upstream = Upstream(connect_timeout_s=5, busy_poll=poll)
        try:
            got = await upstream.send("127.0.0.1", worker.port, REQUEST, BODY, timeout_s=10)
            assert poll.kicks == 1  # the request sent
            assert await got.read() == b"done"
            got.release()
        finally:
            upstream.close()


@run_async
async def test_the_router_runs_with_its_window_and_a_zero_window_never_spins() -> None:
    for window_s, spinning in ((OPEN_S, True), (0.0, False)):
        prefill, decode = StubWorker("prefill"), StubWorker("decode")
        async with routed([prefill], [decode], busy_poll_s=window_s) as h:
            poll = h.listening.state.busy_poll
            assert poll.window_s == window_s
            status, _, _ = await h.post({"model": "m", "prompt": "hi"})
            assert status == 200
            assert poll.spinning is spinning
