"""One reconcile per DSV4Deployment at a time, with child events coalesced like a work queue.

Timers, change handlers and child events of one deployment may run concurrently (all in kopf's
thread pool). The gate holds one lock per deployment ("namespace/name") and remembers which
deployments have an event-triggered reconcile waiting for that lock: further events of such a
deployment are dropped, since the waiting reconcile reads the CR and its children afresh.

`settings.on_startup` creates the operator's gate and keeps it in kopf's memo; tests build
their own. Pure: no kopf, no API.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


def deployment_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


class ReconcileGate:
    def __init__(self) -> None:
        self._guard = threading.Lock()  # over the two fields below
        self._locks: dict[str, threading.Lock] = {}
        self._waiting: set[str] = set()  # keys with an event-triggered reconcile waiting

    def lock(self, key: str) -> threading.Lock:
        """The deployment's lock: whoever holds it is the one reconcile of `key`."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def waiting(self, key: str) -> bool:
        """An event-triggered reconcile of `key` waits for the lock."""
        with self._guard:
            return key in self._waiting

    @contextmanager
    def event_turn(self, key: str) -> Iterator[bool]:
        """For an event-triggered reconcile: yields True holding the deployment's lock, or
        False at once when another event-triggered reconcile already waits for it (this event
        is folded into that one)."""
        with self._guard:
            coalesced = key in self._waiting
            self._waiting.add(key)
        if coalesced:
            yield False
            return
        lock = self.lock(key)
        try:
            lock.acquire()
        finally:  # holding the lock (or given up): no longer waiting
            with self._guard:
                self._waiting.discard(key)
        try:
            yield True
        finally:
            lock.release()
