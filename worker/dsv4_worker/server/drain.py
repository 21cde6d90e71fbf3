"""Draining on SIGTERM (issue #25 item 4): a worker that is told to stop finishes what it
started and takes nothing new.

From the first signal on, `/ready` answers 503 `draining`, `/status` says `draining: true`
(and `accepting: false`), and a new completion gets 503 + Retry-After with code `draining`.
Requests in flight get until the drain deadline to finish; those still running then are
aborted with an error (a stream's last event, then `[DONE]`; a non-stream's 503) and their
pages are freed; then the process exits 0. A second signal skips the rest of the wait. A
prefill has no HTTP requests of its own: it waits for its engine to go idle, so the
transfers a decode asked for before finish. A later PP stage follows its leader: it stays
until the leader's stop order (`serve`).

`lifecycle.next_move` is the decision (pure); `Drain` is the state the apps read and the
requests in flight, on the event loop's thread only; `drain` runs the wait and the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dsv4_common.api.lifecycle import DRAIN_CODE, Move, next_move
from dsv4_worker.server.runner import Done, EngineRunner, Handle

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a draining worker looks at what is left

REFUSED = "the worker is shutting down (draining); retry on another instance"
ABORTED = "the worker is shutting down: the request did not finish within its drain"


@dataclass(slots=True, eq=False)
class Drain:
    """Whether the worker is draining, and the engine requests of the completions in flight
    (one tuple of handles per HTTP request)."""

    draining: bool = False
    _in_flight: dict[int, tuple[Handle, ...]] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def start(self) -> None:
        self.draining = True

    @contextlib.contextmanager
    def track(self, handles: tuple[Handle, ...]) -> Iterator[None]:
        """The completion owning `handles` is in flight while inside."""
        key = id(handles)
        self._in_flight[key] = handles
        try:
            yield
        finally:
            self._in_flight.pop(key, None)

    def abort_all(self, abort: Callable[[Handle], None]) -> int:
        """End every request in flight with the drain's error (its handler answers it as a
        failure: an error event or a 503) and `abort` its engine request (which frees its
        pages). How many completions were aborted."""
        for handles in self._in_flight.values():
            for h in handles:
                h.events.put_nowait(Done("error", ABORTED, code=DRAIN_CODE))
                abort(h)
        return len(self._in_flight)


def engine_busy(runner: EngineRunner) -> bool:
    """The engine has requests (running, waiting or in transfer); a dead one has none left."""
    snap = runner.snapshot()
    return runner.alive and snap.running + snap.waiting + snap.retracted > 0


async def drain(
    state: Drain,
    runner: EngineRunner,
    *,
    timeout_s: float,
    hurried: asyncio.Event,
    busy: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Wait for the requests in flight (`state.start()` was called) and while `busy` (default:
    `engine_busy`) until the deadline `timeout_s` from now, or `hurried`; abort the rest. How
    many were aborted."""
    busy = busy or (lambda: engine_busy(runner))
    deadline_s, aborted_at_s, aborted = clock() + timeout_s, None, 0
    while True:
        now_s = clock()
        move = next_move(
            now_s,
            deadline_s=deadline_s,
            aborted_at_s=aborted_at_s,
            in_flight=state.in_flight,
            engine_busy=busy(),
            hurried=hurried.is_set(),
        )
        if move is Move.EXIT:
            return aborted
        if move is Move.ABORT:
            aborted_at_s, aborted = now_s, state.abort_all(runner.abort)
            log.warning("drain: aborting %d requests still in flight", aborted)
        await asyncio.sleep(POLL_S)
