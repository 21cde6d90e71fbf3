"""How long a server drains after SIGTERM and how long `dsv4 up` waits before SIGKILL: one
number each, so the grace always exceeds the drain. Pure constants.

A worker (`dsv4_worker.server.drain`) turns unready at SIGTERM, gives its requests in flight
`DRAIN_S` to finish, aborts the rest (each gets an error: a stream's last event, then
`[DONE]`), gives them `ABORT_GRACE_S` to send it and closes its connections within
`ABORT_GRACE_S` more. The router gives open streams `ROUTER_DRAIN_S` (its
`shutdown_timeout_s`), past the workers' whole drain, so their error events reach clients. A
supervisor that killed either sooner would cut streams with no error event.

`next_move` is the drain's decision, the same for both (pure).
"""

from __future__ import annotations

import enum
from typing import Final

DRAIN_S: Final = 20.0  # a worker's requests in flight get this long after SIGTERM
ABORT_GRACE_S: Final = 2.0  # then the aborted ones this long to send their error
WORKER_STOP_S: Final = DRAIN_S + 2 * ABORT_GRACE_S  # a worker's longest exit after SIGTERM
ROUTER_DRAIN_S: Final = WORKER_STOP_S  # the router's open streams get this long after SIGTERM
STOP_GRACE_S: Final = DRAIN_S + 10.0  # dsv4 up: SIGTERM, then this long, then SIGKILL
DRAIN_CODE: Final = "draining"  # the OpenAI error code of what a draining server refuses


class Move(enum.Enum):
    WAIT = "wait"
    ABORT = "abort"  # abort every request in flight now
    EXIT = "exit"


def next_move(
    now_s: float,
    *,
    deadline_s: float,
    aborted_at_s: float | None,
    in_flight: int,
    engine_busy: bool,
    hurried: bool,
) -> Move:
    """What a draining server does next. Before the abort it waits while requests are in
    flight or its engine has work (a prefill's transfers), until the deadline or a second
    signal (`hurried`); after it, it waits only for the aborted requests to send their
    error, at most `ABORT_GRACE_S`."""
    if aborted_at_s is None:
        if in_flight == 0 and not engine_busy:
            return Move.EXIT
        return Move.ABORT if hurried or now_s >= deadline_s else Move.WAIT
    if in_flight == 0 or now_s >= aborted_at_s + ABORT_GRACE_S:
        return Move.EXIT
    return Move.WAIT
