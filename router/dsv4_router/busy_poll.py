"""Busy polling: after a write on the completion path the event loop keeps polling, without
sleeping, for `window_s` before it may block again.

Why: at low load most of the router's added latency is waking up, not working. The answer of
an upstream arrives while the router's thread sleeps in epoll; the kernel then wakes an idle
CPU (on a virtual machine, an inter-processor interrupt and a halted vCPU's exit), which on
the 2-core benchmark VM cost more than everything the router does for a request
(bench/README.md, "The router hop"). A loop that polls for a few tens of microseconds after
its last I/O is awake when the next event of the same exchange comes. HAProxy's
`busy-polling` and the kernel's `net.core.busy_poll` make the same trade, without a bound;
here it is bounded by the window after the last I/O, so an idle router sleeps as before.

Cost: up to `window_s` of CPU after each burst of I/O (bench/router.py's `cpu us/req`: ~5 us
per request at one connection). Between idle and saturated, the polling takes CPU that
processes sharing the router's CPUs would use: on the 2-core VM, where the stub and the load
generator share them, 8-10% of the requests/s at 8 connections and 1-5% at 64.
`window_s` 0 turns it off (`--router-busy-poll-us 0`).

How: the router kicks after each write on the completion path (a read is always followed by
one); a kick opens the window, or while it is open marks it to be moved on; a callback
re-schedules itself with `call_soon` until the window ends, and a loop with a ready callback
polls its sockets with a zero timeout instead of blocking. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class BusyPoll:
    """Keeps the running loop polling for `window_s` after each `kick()`."""

    __slots__ = ("_clock", "_kicked", "_loop", "_spinning", "_until_s", "window_s")

    def __init__(self, window_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: a fine clock (uvloop's `loop.time()` moves in milliseconds)."""
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None  # the first kick's
        self._until_s = 0.0
        self._spinning = False
        self._kicked = False  # a kick since the last poll (it moves the window's end there)

    @property
    def spinning(self) -> bool:
        """The loop is being kept awake now."""
        return self._spinning

    def kick(self) -> None:
        """A write went out (on the loop's thread): keep polling until `window_s` from now (from
        the next poll, for a kick while polling: two attribute reads and a write, as it
        runs several times a request)."""
        if self._spinning:
            self._kicked = True
        elif self.window_s:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._until_s = self._clock() + self.window_s
            self._spinning = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        assert self._loop is not None
        now_s = self._clock()
        if self._kicked:
            self._kicked = False
            self._until_s = now_s + self.window_s
        if now_s < self._until_s:
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False
