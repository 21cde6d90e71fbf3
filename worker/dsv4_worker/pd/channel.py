"""The threading rule of the PD control plane: one thread owns every zmq socket of an agent.

Other threads (the engine thread) hand it outgoing messages through `Outbox.put`, an inproc
PUSH socket guarded by a lock that wakes the owner's poller at once (no polling delay).

A control thread that dies does not die quietly: `guarded` records why and reports it, so the
worker turns unready, fails what it holds and exits non-zero (a supervisor restarts it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import zmq

_ids = itertools.count()
log = logging.getLogger(__name__)


def guarded(name: str, body: Callable[[], None], on_crash: Callable[[str], None]) -> None:
    """Run a control thread's `body`; if it raises, log it and call `on_crash(why)`."""
    try:
        body()
    except BaseException as exc:  # the thread is gone: whatever it was, the worker must know
        why = f"PD {name} thread died: {exc!r}"
        log.exception("%s", why)
        on_crash(why)


class Outbox:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], name: str) -> None:
        address = f"inproc://dsv4-{name}-{next(_ids)}"
        self.pull = ctx.socket(zmq.PULL)  # read by the owner thread only
        self.pull.bind(address)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._lock = threading.Lock()

    def put(self, frames: Sequence[bytes]) -> None:
        """Queue one multipart message for the owner thread (any thread)."""
        with self._lock:
            self._push.send_multipart(list(frames))

    def kick(self, frame: bytes) -> None:
        """Queue a one-frame wake-up that may be dropped: never blocks or raises (any thread;
        also after `close`)."""
        # zmq.Again: the owner is far behind and will see the state anyway; other errors: closed
        with self._lock, contextlib.suppress(zmq.ZMQError):
            self._push.send(frame, zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.pull.close(linger=0)
