"""The handlers' threads (`handler_threads`) and `handlers.in_thread`: results and exceptions
come back, at most `max_workers` threads run, they are daemons (the interpreter does not wait
for them at exit), and a cancelled `in_thread` returns at once while its work goes on (what
lets SIGTERM end the operator mid-reconcile: test_operator_process.py shows it end to end)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import kopf
import pytest

from dsv4_operator.handler_threads import DaemonThreadExecutor
from dsv4_operator.handlers import in_thread
from dsv4_operator.settings import DEFAULT_EXIT_TIMEOUT_S, HANDLER_THREADS, configure


def test_results_and_exceptions_come_back() -> None:
    pool = DaemonThreadExecutor(2)
    assert pool.submit(lambda a, b: a + b, 2, b=3).result(5) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)


def test_at_most_max_workers_daemon_threads_run() -> None:
    pool = DaemonThreadExecutor(3)
    release = threading.Event()
    running: set[str] = set()
    lock = threading.Lock()

    def work() -> str:
        with lock:
            running.add(threading.current_thread().name)
        assert threading.current_thread().daemon
        release.wait(10)
        return threading.current_thread().name

    futures = [pool.submit(work) for _ in range(7)]
    deadline = time.monotonic() + 10
    while pool.running < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.running == 3  # the other four wait for a thread
    release.set()
    names = {f.result(10) for f in futures}
    assert len(names) == 3 and pool.running == 0
    pool.shutdown(wait=True)


def test_shutdown_can_cancel_what_waits() -> None:
    pool = DaemonThreadExecutor(1)
    release = threading.Event()
    first = pool.submit(release.wait, 10)
    waiting = pool.submit(lambda: "never")
    deadline = time.monotonic() + 10
    while pool.running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    release.set()
    assert first.result(10) is True


def test_a_cancelled_in_thread_returns_at_once_and_its_work_goes_on() -> None:
    pool = DaemonThreadExecutor(2)
    memo = kopf.Memo(handler_threads=pool)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")

    def stuck() -> str:
        seen = marker.get()  # the caller's context (kopf's loggers read theirs)
        started.set()
        release.wait(30)
        finished.set()
        return seen

    async def main() -> float:
        marker.set("caller")
        assert await in_thread(memo, lambda: marker.get()) == "caller"
        task = asyncio.create_task(in_thread(memo, stuck))
        while not started.is_set():
            await asyncio.sleep(0.01)
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled_at

    assert asyncio.run(main()) < 1.0
    assert not finished.is_set()  # still running, on a daemon thread
    release.set()
    assert finished.wait(10)
    pool.shutdown()


def test_configure_sets_the_handler_threads_and_kopf_s_last_resort() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, {})
    assert isinstance(settings.execution.executor, DaemonThreadExecutor)
    assert settings.process.ultimate_exiting_timeout == DEFAULT_EXIT_TIMEOUT_S < 30
    configure(settings, {"DSV4_EXIT_TIMEOUT_S": "12"})
    assert settings.process.ultimate_exiting_timeout == 12.0
    assert HANDLER_THREADS >= 4
