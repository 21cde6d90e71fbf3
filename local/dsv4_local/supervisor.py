"""Run the processes of a launch plan until they are ready, while they serve, and stop them
(side effects: processes, files, signals to process groups).

Invariants: every child leads its own process group (`start_new_session`), so stopping a child
also stops whatever it started, and a Ctrl-C in the terminal reaches only `dsv4 up`, which
then stops the children in order. Leaving the `with Supervisor(...)` block always stops every
process started so far (also when starting fails half-way): SIGTERM to every group, up to
`stop_grace_s` for the leaders to exit, then SIGKILL to every group. On Linux a child also
gets SIGTERM if `dsv4 up` itself dies without stopping it. The supervisor never sleeps for
more than `poll_interval_s` without checking `stop_requested()` and every child's exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from dsv4_local.plan import ProcessSpec
from dsv4_local.probe import is_ready

__all__ = ["Outcome", "Supervisor", "tail_lines"]

PREFIX: Final = "dsv4 up:"
STOP_GRACE_S: Final = 10.0
LOG_TAIL_LINES: Final = 30
_TAIL_BYTES: Final = 64 * 1024
_PR_SET_PDEATHSIG: Final = 1

# Defaults for processes on one machine (the caller's environment wins): UCX (under NIXL)
# would otherwise stripe loopback transfers over the machine's external interfaces too.
LOCAL_ENV: dict[str, str] = {"UCX_NET_DEVICES": "lo"}


class Outcome(enum.Enum):
    READY = "ready"  # every process answers its ready URL
    DONE = "done"  # serving ended because the caller's condition held
    STOPPED = "stopped"  # SIGINT / SIGTERM
    FAILED = "failed"  # a process exited, or not ready in time (already reported)


@dataclass(slots=True)
class _Child:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_after_s: float | None = None


class Supervisor:
    def __init__(
        self,
        processes: Sequence[ProcessSpec],
        log_dir: Path,
        *,
        out: TextIO = sys.stderr,
        stop_requested: Callable[[], bool] = lambda: False,
        probe: Callable[[str], bool] = is_ready,
        poll_interval_s: float = 0.2,
        progress_interval_s: float = 5.0,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.processes = tuple(processes)
        self.log_dir = log_dir
        self._out = out
        self._stop_requested = stop_requested
        self._probe = probe
        self._poll_interval_s = poll_interval_s
        self._progress_interval_s = progress_interval_s
        self._stop_grace_s = stop_grace_s
        self._children: list[_Child] = []

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.popen.pid for c in self._children}

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    # ---- starting and waiting ------------------------------------------------------------

    def start(self) -> bool:
        """Start every process in order; False when a stop was requested first."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.processes:
            if self._stop_requested():
                return False
            log_path = self.log_path(spec.name)
            with log_path.open("wb") as log:
                log.write(f"# dsv4 up: {shlex.join(spec.argv)}\n".encode())
                log.flush()
                popen = subprocess.Popen(
                    spec.argv,
                    env={**LOCAL_ENV, **os.environ, **spec.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            self._children.append(_Child(spec, popen, log_path))
        return True

    def wait_ready(self, timeout_s: float) -> Outcome:
        """Poll until every process is ready (READY), one exits (FAILED, reported), the
        timeout passes (FAILED, reported) or a stop is requested (STOPPED)."""
        started_s = time.monotonic()
        next_progress_s = started_s + self._progress_interval_s
        while True:
            if self._stop_requested():
                return Outcome.STOPPED
            if self._report_exit():
                return Outcome.FAILED
            for child in self._waiting():
                if self._probe(child.spec.ready_url):
                    child.ready_after_s = time.monotonic() - started_s
                    self._say(f"{child.spec.name} ready ({child.ready_after_s:.1f} s)")
            waiting = self._waiting()
            if not waiting:
                return Outcome.READY
            elapsed_s = time.monotonic() - started_s
            names = ", ".join(c.spec.name for c in waiting)
            if elapsed_s >= timeout_s:
                self._say(
                    f"not ready after {timeout_s:g} s: {names} (logs: {self.log_dir}; a "
                    "larger --timeout-s may help)"
                )
                return Outcome.FAILED
            if time.monotonic() >= next_progress_s:
                self._say(f"waiting for: {names} ({elapsed_s:.0f} s)")
                next_progress_s += self._progress_interval_s
            time.sleep(self._poll_interval_s)

    def serve(self, until: Callable[[], bool] = lambda: False) -> Outcome:
        """Watch the ready processes until `until()` holds (DONE), one exits (FAILED,
        reported) or a stop is requested (STOPPED)."""
        while True:
            if self._stop_requested():
                return Outcome.STOPPED
            if self._report_exit():
                return Outcome.FAILED
            if until():
                return Outcome.DONE
            time.sleep(self._poll_interval_s)

    # ---- stopping ----------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every group, wait up to `stop_grace_s` for the leaders, SIGKILL every group
        (what is left of it), reap. Idempotent."""
        children, self._children = self._children, []
        if not children:
            return
        for child in children:
            _signal_group(child.popen.pid, signal.SIGTERM)
        deadline_s = time.monotonic() + self._stop_grace_s
        while any(c.popen.poll() is None for c in children) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        for child in children:
            _signal_group(child.popen.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=self._stop_grace_s)

    # ---- helpers -------------------------------------------------------------------------

    def _waiting(self) -> list[_Child]:
        return [c for c in self._children if c.ready_after_s is None]

    def _report_exit(self) -> bool:
        """Report the first child that has exited (with its log's tail); False if none has."""
        for child in self._children:
            code = child.popen.poll()
            if code is None:
                continue
            when = "before it was ready" if child.ready_after_s is None else "while serving"
            self._say(f"{child.spec.name} exited ({_describe_exit(code)}) {when}")
            lines = tail_lines(child.log_path, LOG_TAIL_LINES)
            self._say(f"last {len(lines)} lines of {child.log_path}:")
            for line in lines:
                self._out.write(f"    {line}\n")
            self._out.flush()
            return True
        return False

    def _say(self, message: str) -> None:
        self._out.write(f"{PREFIX} {message}\n")
        self._out.flush()


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a text file (at most its last 64 KiB); [] if unreadable."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-count:]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    # The group outlives its leader while anything it started runs; a gone group is fine.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _load_prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[[int, int], int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL: Final = _load_prctl()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when `dsv4 up` dies (Linux; best effort)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
