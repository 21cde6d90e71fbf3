"""When a serving thread next wakes by itself (pure): the earliest of the times at which
something it holds depends on the clock (a heartbeat to send or to miss, a deadline, a check
that waits for quiet), each a `time.monotonic()` instant or None (nothing). A thread blocks on
what wakes it otherwise (its inbox, its sockets) for `wait_s` of those: forever when nothing
is due, else until the earliest, but at least `MIN_WAIT_S` so that a deadline computed in the
past (a bug, or a boundary the clock sits on: `now - t > x` is false at `now == t + x`) makes
it turn a few hundred times a second at worst, never spin. Waking early is harmless: the
thread checks, finds nothing due yet and asks again.
"""

from __future__ import annotations

import math
from typing import Final

MIN_WAIT_S: Final = 0.005


def earliest(*due_s: float | None) -> float | None:
    """The first of the instants given (None: none is)."""
    times = [t for t in due_s if t is not None]
    return min(times) if times else None


def wait_s(due_s: float | None, now_s: float, min_wait_s: float = MIN_WAIT_S) -> float | None:
    """How long to block for something due at `due_s` (None: until woken)."""
    if due_s is None:
        return None
    return max(min_wait_s, due_s - now_s)


def wait_ms(due_s: float | None, now_s: float, min_wait_s: float = MIN_WAIT_S) -> int | None:
    """`wait_s` in whole milliseconds, rounded up (a zmq poll's timeout; None: forever, which
    zmq's `Poller.poll` takes as None)."""
    wait = wait_s(due_s, now_s, min_wait_s)
    return None if wait is None else max(1, math.ceil(wait * 1000))
