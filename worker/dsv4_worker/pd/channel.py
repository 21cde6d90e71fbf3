"""The threading rule of the PD control plane: one thread owns every zmq socket of an agent.

Other threads (the engine thread) hand it outgoing messages through `Outbox.put`, an inproc
PUSH socket guarded by a lock that wakes the owner's poller at once (no polling delay); a
`Mailbox` carries typed messages (each side's small frozen dataclasses) the same way, and
`Post` is the other direction (run a function on the engine thread).

A control thread that dies does not die quietly: `guarded` records why and reports it, so the
worker turns unready, fails what it holds and exits non-zero (a supervisor restarts it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import zmq

from dsv4_worker.engine.logprobs import TokenLogprob

M = TypeVar("M")
_ids = itertools.count()
log = logging.getLogger(__name__)

Post = Callable[[Callable[[], None]], None]  # run a function on the engine thread
# (rid, token id, its logprob, the prompt's logprobs): show a PD request's first token to its
# client now (any thread: `EngineRunner.show_first_token`)
ShowFirst = Callable[[str, int, TokenLogprob | None, tuple[TokenLogprob, ...]], None]
Context = zmq.Context[zmq.Socket[bytes]]
OnFailure = Callable[[str], None]  # told, from the dying thread, why an agent's thread died


def no_hook(why: str) -> None:
    """The default `OnFailure`: nobody listens (the agent's `failure` still says why)."""


def socket(ctx: Context, kind: int) -> zmq.Socket[bytes]:
    """A socket that drops what it has not sent when closed (a peer may be gone for good)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def bound(ctx: Context, kind: int, bind: str) -> tuple[zmq.Socket[bytes], str]:
    """A socket bound at `bind` (port 0: any) and the endpoint it got."""
    sock = socket(ctx, kind)
    sock.bind(bind)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return sock, last.decode()


def guarded(name: str, body: Callable[[], None], on_crash: Callable[[str], None]) -> None:
    """Run a control thread's `body`; if it raises, log it and call `on_crash(why)`."""
    try:
        body()
    except BaseException as exc:  # the thread is gone: whatever it was, the worker must know
        why = f"PD {name} thread died: {exc!r}"
        log.exception("%s", why)
        on_crash(why)


class Outbox:
    """Multipart messages for the owner thread from any thread (`put`, blocking while the
    owner is far behind), and wake-ups (`kick`) on a pipe of their own.

    NOTE: a kick never shares `put`'s pipe. A PUSH socket sees its pipe as full until it has
    processed the reader's "read up to here" notes, which zmq may put off for a while after a
    send (it throttles command processing), so a pipe that just took its high-water mark of
    puts can refuse a non-blocking send although the owner already read every message: a kick
    on that pipe was dropped and the owner slept on (9 of 200 trials of 2,000 puts then a kick,
    under a CPU burner). Kicks alone never come near their pipe's mark."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], name: str) -> None:
        address = f"inproc://dsv4-{name}-{next(_ids)}"
        self.pull = ctx.socket(zmq.PULL)  # read by the owner thread only
        self.pull.bind(address)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._lock = threading.Lock()
        self._kicker = ctx.socket(zmq.PUSH)
        self._kicker.setsockopt(zmq.LINGER, 0)
        self._kicker.connect(address)
        self._kick_lock = threading.Lock()

    def put(self, frames: Sequence[bytes]) -> None:
        """Queue one multipart message for the owner thread (any thread)."""
        with self._lock:
            self._push.send_multipart(list(frames))

    def kick(self, frame: bytes) -> None:
        """Queue a one-frame wake-up that may be dropped: never blocks or raises (any thread;
        also after `close`)."""
        # zmq.Again: the owner has not read thousands of kicks and wakes anyway; other errors:
        # closed
        with self._kick_lock, contextlib.suppress(zmq.ZMQError):
            self._kicker.send(frame, zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        with self._kick_lock:
            self._kicker.close(linger=0)
        self.pull.close(linger=0)


class Mailbox(Generic[M]):
    """Typed messages for the owner thread, in order from any thread: each `put` queues the
    message, then a wake-up frame that is never dropped (it waits while the owner is far
    behind, as `Outbox.put`); the owner, woken by `pull`, `take`s everything queued and says
    when it has `handled` it, so a sender may wait for that (`wait_handled`) rather than for
    the GIL to come the owner's way.

    Invariant: handled <= taken <= put (counts of messages, in order)."""

    def __init__(self, ctx: Context, name: str) -> None:
        self._box = Outbox(ctx, name)
        self.pull = self._box.pull  # the owner polls it
        self._queue: deque[M] = deque()
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._put = self._taken = self._handled = 0
        self._handed_turn: int | None = None  # `hand_over`'s (its one sender thread's)

    def put(self, msg: M) -> int:
        """Queue `msg` (any thread); its number, for `wait_handled`."""
        with self._lock:
            self._queue.append(msg)
            self._put += 1
            ticket = self._put
        self._box.put([b"m"])  # a dropped one could strand the message: see `take`
        return ticket

    def handled(self) -> None:
        """Owner thread: everything it took so far is handled (sent on, acted on)."""
        with self._progress:
            if self._handled != self._taken:
                self._handled = self._taken
                self._progress.notify_all()

    def wait_handled(self, ticket: int, timeout_s: float) -> bool:
        """Wait until the owner handled message `ticket` (and so every one before it), at
        most `timeout_s`; whether it did. The wait releases the GIL: for a message that
        must leave now while the caller still has work that would hold it."""
        with self._progress:
            return self._progress.wait_for(lambda: self._handled >= ticket, timeout_s)

    def hand_over(self, ticket: int, timeout_s: float, turn: int) -> None:
        """`wait_handled` for the first message handed over in each `turn` (an engine step)
        only: later ones in that turn go on at once, so many of them do not wait one by one.
        Called from one thread (the engine's)."""
        if turn != self._handed_turn:
            self._handed_turn = turn
            self.wait_handled(ticket, timeout_s)

    def kick(self) -> None:
        """Wake the owner with nothing to take (any thread; also after `close`)."""
        self._box.kick(b"w")

    def take(self) -> list[M]:
        """Owner thread: every queued message, oldest first (the kicks are read first, so a
        message queued meanwhile is taken now or wakes the owner again)."""
        with contextlib.suppress(zmq.Again):
            while True:
                self.pull.recv(zmq.NOBLOCK)
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
            self._taken += len(out)
        return out

    def close(self) -> None:
        self._box.close()
