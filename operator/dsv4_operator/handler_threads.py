"""The threads our handlers' blocking work runs on: daemon threads, so that SIGTERM ends the
process even while a reconcile waits on the API server or a worker. Two things held it: kopf
waits for a sync handler's thread before the handler's task may end (it never orphans one),
and the interpreter joins non-daemon threads (a ThreadPoolExecutor's) at exit; a handler stuck
in a 30 s API call kept the pod past its grace. So the handlers that call out are async
(`handlers.in_thread`): cancelled when the operator stops, they return at once and leave their
work here, which the process's exit ends.

Abandoning a reconcile midway is safe: every write is one idempotent server-side apply (or
delete), and the next operator process reconciles from what the API server holds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadExecutor(Executor):
    """Up to `max_workers` daemon threads, started as work arrives, kept while idle."""

    def __init__(self, max_workers: int, name: str = "dsv4-handler") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self._max_workers = max_workers
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # threads waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut_down = False
        self._running = 0  # calls in progress

    @property
    def running(self) -> int:
        """Calls in progress now."""
        with self._lock:
            return self._running

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future[T] = Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return future

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self._running += 1
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the caller's to see, as Executor's contract says
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                finally:
                    with self._lock:
                        self._running -= 1
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut_down = True
            threads = list(self._threads)
        if cancel_futures:
            pending: list[_Work | None] = []
            while True:
                try:
                    pending.append(self._work.get_nowait())
                except queue.Empty:
                    break
            for item in pending:
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()
