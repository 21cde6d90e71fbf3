"""Giving up on a frozen decode (issue #25: an open request fails within 2 s): the pure rule
(`liveness.frozen_reason`, `give_up_frozen`) as tables and properties, the silence accounting
(`liveness.Silence`) over a simulated event loop that may starve, and `upstream.Watch` against
a worker thread on 127.0.0.1 that goes silent or keeps sending while the router's loop is
blocked. The relay's side (a retry, a wait, a 503, never a cut while probes answer) is in
test_stall_relay.py; a SIGSTOPped decode process in test_stall_process.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_router.liveness import (
    Liveness,
    Silence,
    StallRule,
    frozen_reason,
    give_up_frozen,
)
from dsv4_router.upstream import Upstream, UpstreamStalled, Watch

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RULE: Final = StallRule(silence_s=1.0)
HOST: Final = "127.0.0.1"
REQUEST: Final = b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Length: 2\r\n\r\n{}"
STREAM_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
DEADLINE_S: Final = 15.0  # generous: the tests must pass on a loaded 2-core machine


# ---- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("silent_s", "probe", "frozen"),
    [
        (0.0, Liveness(5.0, 3), False),  # bytes flow: whatever the probes say
        (0.99, Liveness(5.0, 3), False),  # a pause shorter than the rule
        (1.0, Liveness(5.0, 0), False),  # silent but its latest probe answered: slow, alive
        (30.0, Liveness(5.0, 0), False),
        (1.0, Liveness(None, 0), False),  # no probe yet: nothing says it stopped
        (1.0, Liveness(5.0, 1), True),  # silent and its latest probe missed
        (1.0, Liveness(5.0, 1, refused=True), True),  # nothing listens any more
    ],
)
def test_frozen_when_silent_and_its_latest_probe_missed(
    silent_s: float, probe: Liveness, frozen: bool
) -> None:
    assert (frozen_reason(silent_s, probe, RULE) is not None) == frozen


def test_reasons_say_what_was_seen() -> None:
    assert frozen_reason(1.25, Liveness(5.0, 2), RULE) == (
        "no byte for 1.2 s and its last 2 status probe(s) got no status"
    )
    assert frozen_reason(3.0, Liveness(5.0, 1, refused=True), RULE) == (
        "no byte for 3.0 s and its last 1 status probe(s) found nothing listening"
    )


@pytest.mark.parametrize(
    ("answered", "other_pair", "stale", "give_up"),
    [
        (True, False, False, True),  # the client has bytes: end the stream
        (True, True, True, True),
        (False, True, False, True),  # nothing sent, another pair free: retry there
        (False, False, True, True),  # nothing sent, nowhere else, stale for new ones: 503
        (False, True, True, True),
        (False, False, False, False),  # nothing sent, nowhere else, in its grace: wait
    ],
)
def test_what_a_frozen_decode_costs_its_requests(
    answered: bool, other_pair: bool, stale: bool, give_up: bool
) -> None:
    assert give_up_frozen(answered=answered, other_pair=other_pair, stale=stale) == give_up


probes = st.builds(
    Liveness,
    st.none() | st.floats(0.0, 100.0),
    st.integers(0, 10),
    st.booleans(),
)


@PROPERTY
@given(st.floats(0.0, 60.0), probes, st.floats(0.0, 60.0), st.integers(0, 5))
def test_frozen_only_grows_with_silence_and_misses(
    silent_s: float, probe: Liveness, more_s: float, more_misses: int
) -> None:
    reason = frozen_reason(silent_s, probe, RULE)
    if probe.misses == 0 or silent_s < RULE.silence_s:
        assert reason is None  # never frozen while probes answer or bytes came lately
        return
    assert reason is not None
    later = Liveness(probe.ok_at_s, probe.misses + more_misses, probe.refused)
    assert frozen_reason(silent_s + more_s, later, RULE) is not None


@pytest.mark.parametrize(("silence_s", "looks"), [(0.0, 5), (-1.0, 5), (1.0, 0)])
def test_a_bad_stall_rule_is_refused(silence_s: float, looks: int) -> None:
    with pytest.raises(ValueError):
        StallRule(silence_s=silence_s, looks=looks)


# ---- silence over a simulated event loop -----------------------------------------------------


def simulate(
    iteration_gaps: list[float], arrivals: list[float], looks_first: bool, rule: StallRule
) -> list[tuple[float, float]]:
    """(time, silence) of every look of a connection watched from 0 by a loop whose iterations
    come `iteration_gaps` apart (a long gap: the router starved). Each iteration runs the look
    if it is due and reads every byte that arrived by then, in either order (asyncio reads
    first; uvloop runs timers first)."""
    silence, now_s, next_look_s, unread = Silence(0.0, 0.0), 0.0, rule.look_every_s, 0
    looks = []
    for gap_s in iteration_gaps:
        now_s += gap_s
        for step in ("look", "read") if looks_first else ("read", "look"):
            if step == "look" and now_s >= next_look_s:
                looks.append((now_s, silence.look(now_s)))
                next_look_s = now_s + rule.look_every_s
            elif step == "read" and unread < len(arrivals) and arrivals[unread] <= now_s:
                silence.heard_s = now_s
                while unread < len(arrivals) and arrivals[unread] <= now_s:
                    unread += 1
    return looks


def every(gap_s: float, until_s: float) -> list[float]:
    return [i * gap_s for i in range(int(until_s / gap_s) + 1)]


@PROPERTY
@given(
    st.lists(st.floats(0.001, 3.0), min_size=1, max_size=60),
    st.floats(0.05, 0.99),
    st.booleans(),
)
def test_a_starved_router_never_takes_its_own_lag_for_silence(
    iteration_gaps: list[float], fraction: float, looks_first: bool
) -> None:
    """A decode that sends a byte every `gap` < the rule's silence is never silent for the
    rule, however late the router's loop iterations come (up to 3 s apart here)."""
    gap_s = fraction * RULE.silence_s
    arrivals = every(gap_s, sum(iteration_gaps) + 1.0)
    for _, silent_s in simulate(iteration_gaps, arrivals, looks_first, RULE):
        assert silent_s < gap_s


@PROPERTY
@given(st.floats(0.0, 10.0), st.floats(0.005, 0.05), st.booleans())
def test_a_decode_that_stops_is_silent_for_the_rule_in_bounded_time(
    stop_s: float, tick_s: float, looks_first: bool
) -> None:
    """It stops sending at `stop_s` and the router's loop runs every `tick_s`: some look says
    silence >= the rule's by stop + a tick + the silence + two looks (and a tick each)."""
    end_s = stop_s + 2 * RULE.silence_s + 1.0
    arrivals = every(0.02, stop_s)
    looks = simulate([tick_s] * int(end_s / tick_s), arrivals, looks_first, RULE)
    bound_s = stop_s + tick_s + RULE.silence_s + 2 * (RULE.look_every_s + tick_s) + 1e-9
    first = next(t for t, silent_s in looks if silent_s >= RULE.silence_s)
    assert first <= bound_s


# ---- upstream.Watch against a worker thread --------------------------------------------------


@dataclass
class ThreadWorker:
    """Answers one connection from its own thread (so it keeps going while the router's loop
    is blocked): the stream's head, `chunks` SSE chunks `gap_s` apart, then the last chunk
    (`end`) or silence until the client closes."""

    chunks: int
    gap_s: float
    head: bool = True
    end: bool = True
    port: int = 0
    closed: threading.Event = field(default_factory=threading.Event)  # the client closed it

    @contextlib.contextmanager
    def serving(self) -> Iterator[ThreadWorker]:
        with socket.create_server((HOST, 0)) as server:
            self.port = server.getsockname()[1]
            thread = threading.Thread(target=self._serve, args=(server,), daemon=True)
            thread.start()
            try:
                yield self
            finally:
                thread.join(DEADLINE_S)

    def _serve(self, server: socket.socket) -> None:
        server.settimeout(DEADLINE_S)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(DEADLINE_S)
            request = b""
            while not request.endswith(b"{}"):
                request += conn.recv(4096)
            if self.head:
                conn.sendall(STREAM_HEAD)
                for i in range(self.chunks):
                    if i:
                        time.sleep(self.gap_s)
                    data = b"data: %d\n\n" % i
                    conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))
                if self.end:
                    conn.sendall(b"0\r\n\r\n")
            with contextlib.suppress(OSError):
                while conn.recv(4096):
                    pass
            self.closed.set()


def silent_for(threshold_s: float, seen: list[float]) -> Watch:
    """Gives up once the worker is silent `threshold_s`; notes every silence it is shown."""

    def verdict(silent_s: float) -> str | None:
        seen.append(silent_s)
        return f"silent {silent_s:.2f} s" if silent_s >= threshold_s else None

    return verdict


def looking(threshold_s: float) -> Upstream:
    """An upstream that looks at its watched connections 5 times per `threshold_s`."""
    return Upstream(connect_timeout_s=5, look_every_s=threshold_s / 5)


def on_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """A test run on asyncio's loop and on uvloop's (the router's), failing past a deadline."""

    @pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
    def run(loop: str) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(4 * DEADLINE_S):
                await test()

        factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(bounded())

    run.__name__ = test.__name__
    run.__doc__ = test.__doc__
    return run


@on_loops
async def test_a_worker_silent_mid_body_fails_the_read_and_is_closed() -> None:
    seen: list[float] = []
    with ThreadWorker(chunks=2, gap_s=0.01, end=False).serving() as worker:
        upstream = looking(0.3)
        answer = await upstream.send(
            HOST, worker.port, REQUEST, b"", timeout_s=60, watch=silent_for(0.3, seen)
        )
        started_s = time.monotonic()
        with pytest.raises(UpstreamStalled, match="silent"):
            while await answer.read_chunk():
                pass
        assert time.monotonic() - started_s < DEADLINE_S
        answer.close()
        assert await asyncio.to_thread(worker.closed.wait, DEADLINE_S)  # the worker aborts


@on_loops
async def test_a_worker_silent_before_its_head_fails_the_send() -> None:
    seen: list[float] = []
    with ThreadWorker(chunks=0, gap_s=0.0, head=False).serving() as worker:
        upstream = looking(0.3)
        started_s = time.monotonic()
        with pytest.raises(UpstreamStalled):
            await upstream.send(
                HOST, worker.port, REQUEST, b"", timeout_s=60, watch=silent_for(0.3, seen)
            )
        assert time.monotonic() - started_s < DEADLINE_S  # long before timeout_s
        assert await asyncio.to_thread(worker.closed.wait, DEADLINE_S)


@on_loops
async def test_a_blocked_router_loop_is_not_the_workers_silence() -> None:
    """The worker sends every 50 ms; the router's loop is blocked for 1.5 s (3x the
    threshold) twice while reading: the whole body arrives, never a stall."""
    seen: list[float] = []
    with ThreadWorker(chunks=60, gap_s=0.05).serving() as worker:
        upstream = looking(0.5)
        answer = await upstream.send(
            HOST, worker.port, REQUEST, b"", timeout_s=60, watch=silent_for(0.5, seen)
        )
        pieces = []
        while piece := await answer.read_chunk():
            pieces.append(piece)
            if len(pieces) in (5, 30):
                time.sleep(1.5)  # starve the loop, as a loaded machine would
        assert b"".join(pieces).count(b"data: ") == 60
        assert answer.complete
        answer.release()
        assert seen and max(seen) < 0.5, seen
        upstream.close()
        assert await asyncio.to_thread(worker.closed.wait, DEADLINE_S)


@on_loops
async def test_one_ticker_judges_each_watched_connection_on_its_own() -> None:
    """Two answers at once: the silent worker's fails, the trickling one's (a chunk every
    0.1 s) is read to the end; an unwatched answer is never judged."""
    with (
        ThreadWorker(chunks=1, gap_s=0.0, end=False).serving() as silent,
        ThreadWorker(chunks=20, gap_s=0.1).serving() as trickling,
        ThreadWorker(chunks=3, gap_s=0.6).serving() as unwatched,
    ):
        upstream = looking(0.4)
        seen: list[float] = []
        answers = [
            await upstream.send(
                HOST, worker.port, REQUEST, b"", timeout_s=60, watch=silent_for(0.4, seen)
            )
            for worker in (silent, trickling)
        ]
        plain = await upstream.send(HOST, unwatched.port, REQUEST, b"", timeout_s=60)
        results = await asyncio.gather(
            *(a.read() for a in (*answers, plain)), return_exceptions=True
        )
        assert isinstance(results[0], UpstreamStalled), results[0]
        assert isinstance(results[1], bytes) and results[1].count(b"data: ") == 20
        assert isinstance(results[2], bytes) and results[2].count(b"data: ") == 3
        for answer in (*answers, plain):
            answer.close()
        for worker in (silent, trickling, unwatched):
            assert await asyncio.to_thread(worker.closed.wait, DEADLINE_S)
