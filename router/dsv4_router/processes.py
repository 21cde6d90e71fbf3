"""The router as several processes on one port: each its own event loop, upstream pool and
discovery, the kernel spreading new connections over them (SO_REUSEPORT: one listening socket
per process, all bound by the parent before the fork, so a busy port still fails at once).

The parent only supervises: it forks the processes, waits until every one listens, prints
where, and exits once all have: 0 after a signal, 1 if a process ended on its own (it takes
the others down: `dsv4 up` or Kubernetes restarts the router as one unit).

NOTE (signals): the processes ignore SIGTERM and SIGINT; the parent turns each one it gets
into one STOP_SIGNAL to every process (the first starts its drain, a second ends it, as
SIGTERM does to one router). So a signal sent to the whole process group (`dsv4 up`'s stop,
Ctrl-C in a terminal) counts once, not once from the group and again from the parent. A
process whose parent dies gets STOP_SIGNAL too (PR_SET_PDEATHSIG): nothing is left holding
the port.

What is per process (NOTE): each polls the workers itself, so `/status`, `/ready`,
`/instances` and `dsv4_router_instances` show the view of the process that answers (they
agree within one poll interval), and `router_inflight` / `router_pending` count that
process's requests only. The request counters of `/metrics` are the sum over all processes
(`metrics.SharedCounts`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Final

from dsv4_router.metrics import SharedCounts

# A process that has not said it listens within this long is taken as failed.
START_TIMEOUT_S: Final = 60.0
_POLL_S: Final = 0.2
_PR_SET_PDEATHSIG: Final = 1
STOP_SIGNAL: Final = signal.SIGUSR1  # parent -> processes: stop (drain); again: at once


@dataclass(frozen=True, slots=True)
class Prebound:
    """One process's listening sockets: the API's, and the status port's (None: none)."""

    api: list[socket.socket]
    status: list[socket.socket] | None

    def close(self) -> None:
        for sock in (*self.api, *(self.status or ())):
            sock.close()


# What a forked process runs: its sockets, the shared counters, its index, and a callback
# to call once it listens; returns its exit status.
ProcessMain = Callable[[Prebound, SharedCounts, int, Callable[[], None]], int]


def run_processes(prebound: list[Prebound], main: ProcessMain, on_ready: Callable[[], None]) -> int:
    """Fork one process per entry of `prebound`, call `on_ready` once all listen, and
    supervise them until they have all exited; the exit status (see the module docstring).
    Call before any event loop or thread exists in this process."""
    counts = SharedCounts(len(prebound))
    ready_r, ready_w = os.pipe()
    pids: list[int] = []
    parent = os.getpid()
    for index, own in enumerate(prebound):
        pid = os.fork()
        if pid == 0:  # the child: only its own sockets and the pipe's write end
            status = 1
            try:
                for sig in _SIGNALS:
                    signal.signal(sig, signal.SIG_IGN)
                _end_with_parent(parent)
                os.close(ready_r)
                for other in prebound:
                    if other is not own:
                        other.close()
                status = main(own, counts, index, lambda: _say_ready(ready_w))
            except BaseException:  # os._exit skips the interpreter's report: print it here
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        pids.append(pid)
    os.close(ready_w)
    for own in prebound:
        own.close()  # a socket left open here would get connections nobody accepts
    supervisor = _Supervisor(pids)
    try:
        with supervisor.signals():
            if supervisor.wait_ready(ready_r, len(pids)):
                on_ready()
            return supervisor.wait_all()
    finally:
        os.close(ready_r)


def _end_with_parent(parent: int) -> None:
    """STOP_SIGNAL to this process when the parent dies (say, SIGKILLed alone). Linux's
    PR_SET_PDEATHSIG; elsewhere nothing is set."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, STOP_SIGNAL)
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), STOP_SIGNAL)


def _say_ready(fd: int) -> None:
    os.write(fd, b"r")
    os.close(fd)


class _Supervisor:
    def __init__(self, pids: list[int]) -> None:
        self._running = set(pids)
        self._stopping = False
        self._failed = False

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            yield None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        self._stopping = True
        self._send(STOP_SIGNAL)

    def _send(self, sig: int) -> None:
        for pid in self._running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _reap(self, *, block: bool) -> None:
        """Collect exited processes; one that ended before a signal takes the others down."""
        while self._running:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                self._running.clear()
                return
            if pid == 0:
                return
            self._running.discard(pid)
            if not self._stopping or os.waitstatus_to_exitcode(status) != 0:
                if not self._stopping:
                    self._stopping = True
                    self._send(STOP_SIGNAL)
                self._failed = True
            if not block:
                continue
            return

    def wait_ready(self, ready_fd: int, count: int) -> bool:
        """True once `count` processes said they listen; False if one failed first (or a
        signal came, or START_TIMEOUT_S passed)."""
        deadline_s = time.monotonic() + START_TIMEOUT_S
        seen = 0
        while seen < count:
            if self._stopping or time.monotonic() > deadline_s:
                if not self._stopping:
                    self._stopping, self._failed = True, True
                    self._send(STOP_SIGNAL)
                return False
            try:
                readable, _, _ = select.select([ready_fd], [], [], _POLL_S)
            except InterruptedError:
                continue
            if readable:
                try:
                    seen += len(os.read(ready_fd, count - seen))
                except OSError as exc:
                    if exc.errno != errno.EINTR:
                        raise
            self._reap(block=False)
        return True

    def wait_all(self) -> int:
        while self._running:
            self._reap(block=True)
        return 1 if self._failed else 0


_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
