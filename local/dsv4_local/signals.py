"""SIGINT and SIGTERM as a flag (side effects: signal handlers of the main thread).

The handler only records the signal: the supervisor polls `requested` between steps, so a
signal never interrupts it half-way through starting or stopping a process (an exception
raised from a handler could, and would leave a child nobody knows about).
"""

from __future__ import annotations

import signal
import types
from collections.abc import Callable
from typing import Any, Final

__all__ = ["StopSignals"]

STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)

# What `signal.signal` takes and returns (Handlers.SIG_DFL / SIG_IGN are ints).
_Handler = Callable[[int, types.FrameType | None], Any] | int | None


class StopSignals:
    """`with StopSignals() as stop:` ... `stop.requested`, `stop.count`; restores the old
    handlers on exit."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal received
        self.count = 0  # stop signals received (a second one hurries the stop)
        self._previous: dict[int, _Handler] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum
