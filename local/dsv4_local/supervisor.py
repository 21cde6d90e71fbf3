"""Run the processes of a launch plan until they are ready, keep them serving, and stop them
(side effects: processes, files, signals to process groups). What to restart and when is
`supervise`'s pure decision; this module carries it out.

Invariants: every child leads its own process group (`start_new_session`), so stopping a child
also stops whatever it started, and a Ctrl-C in the terminal reaches only `dsv4 up`, which
then stops the children. Leaving the `with Supervisor(...)` block always stops every process
started so far (also when starting fails half-way, and processes a restart is replacing):
SIGTERM to every group, up to `stop_grace_s` for the leaders to exit (saying which it waits
for; a second stop signal sends each a second SIGTERM, which ends its drain at once, and
leaves it `HURRY_GRACE_S`; a third kills at once), then SIGKILL to every group. On Linux a
child also gets SIGTERM if `dsv4 up` itself dies without stopping it. The supervisor never
sleeps for more than `poll_interval_s` without checking `stop_requested()` and every child's
exit (a readiness probe may take its own timeout, 1 s).

Until every process is ready, an exit fails the start-up (it is most likely a bad input, and
the log's tail says which). While serving, an exit stops the rest of its unit (a PP group
restarts as one) and restarts it after a backoff, within a budget; so does a process that
fails its liveness probe (`supervise.liveness_verdict`: its engine died, yet it runs). Each
event is one line, and `status_path` (when given) holds every unit's state as JSON.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import enum
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TextIO

from dsv4_common.api.lifecycle import ABORT_GRACE_S, STOP_GRACE_S
from dsv4_local.plan import ProcessSpec
from dsv4_local.probe import is_ready, status_of
from dsv4_local.supervise import (
    Liveness,
    LivenessPolicy,
    Restart,
    RestartPolicy,
    Unit,
    UnitState,
    UnitStatus,
    decide,
    describe_exit,
    exit_line,
    liveness_verdict,
    observe_liveness,
    status_document,
    units_of,
)

__all__ = ["STOP_GRACE_S", "Outcome", "Supervisor", "tail_lines"]

PREFIX: Final = "dsv4 up:"
# A restart stops what is left of a unit (a PP group whose stage died): it is broken anyway.
RESTART_STOP_GRACE_S: Final = 5.0
# After a second SIGTERM a server aborts what is in flight, gives the aborted requests
# ABORT_GRACE_S to send their error and closes its connections within ABORT_GRACE_S more.
HURRY_GRACE_S: Final = 2 * ABORT_GRACE_S + 1.0
FIRST_NOTE_S: Final = 1.0  # a stop that takes longer says what it waits for
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
    FAILED = "failed"  # a process exited before ready, not ready in time, or every unit gave up


@dataclass(slots=True)
class _Child:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_after_s: float | None = None
    live: Liveness = field(default_factory=Liveness)  # its probes while its unit is ready
    live_probed_s: float | None = None
    live_probe: concurrent.futures.Future[int | None] | None = None  # in flight


@dataclass(slots=True)
class _Unit:
    unit: Unit
    specs: tuple[ProcessSpec, ...]
    children: list[_Child] = field(default_factory=list)  # running, or not yet reaped
    state: UnitState = "starting"
    restarts_at_s: list[float] = field(default_factory=list)  # clock at each restart decision
    restart_at_s: float | None = None  # while waiting
    exited_at_s: float | None = None  # the last exit while serving
    last_exit: str | None = None
    added_at_s: float | None = None  # started by `add_unit` (while serving)
    retire_by_s: float | None = None  # while stopping: SIGKILL what is left then


class Supervisor:
    def __init__(
        self,
        processes: Sequence[ProcessSpec],
        log_dir: Path,
        *,
        out: TextIO = sys.stderr,
        stop_requested: Callable[[], bool] = lambda: False,
        stop_signals: Callable[[], int] = lambda: 0,
        probe: Callable[[str], bool] = is_ready,
        poll_interval_s: float = 0.2,
        progress_interval_s: float = 5.0,
        stop_grace_s: float = STOP_GRACE_S,
        restart_stop_grace_s: float = RESTART_STOP_GRACE_S,
        policy: RestartPolicy | None = None,
        status_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        liveness: LivenessPolicy | None = None,
        live_probe: Callable[[str, float], int | None] = status_of,
    ) -> None:
        self.processes = tuple(processes)
        self.log_dir = log_dir
        self._out = out
        self._stop_requested = stop_requested
        self._stop_signals = stop_signals  # how many arrived: 2 hurries the stop, 3 kills
        self._probe = probe
        self._poll_interval_s = poll_interval_s
        self._progress_interval_s = progress_interval_s
        self._stop_grace_s = stop_grace_s
        self._restart_stop_grace_s = restart_stop_grace_s
        self._policy = policy or RestartPolicy()
        self._status_path = status_path
        self._clock = clock
        self._liveness = liveness or LivenessPolicy()
        self._live_probe = live_probe
        # Liveness probes run here, off the loop: a slow answer must not delay exits/restarts.
        self._prober: concurrent.futures.ThreadPoolExecutor | None = None
        by_name = {p.name: p for p in self.processes}
        self._units = [
            _Unit(u, tuple(by_name[n] for n in u.members)) for u in units_of(self.processes)
        ]
        self._unit_of = {n: unit for unit in self._units for n in unit.unit.members}

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def policy(self) -> RestartPolicy:
        return self._policy

    @property
    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.popen.pid for c in self._children()}

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    # ---- starting and waiting ------------------------------------------------------------

    def start(self) -> bool:
        """Start every process in order; False when a stop was requested first."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.processes:
            if self._stop_requested():
                return False
            self._unit_of[spec.name].children.append(self._launch(spec, restart=None))
        self._write_status()
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
                for unit in self._units:
                    unit.state = "ready"
                self._write_status()
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

    def serve(
        self, until: Callable[[], bool] = lambda: False, every: Callable[[], None] | None = None
    ) -> Outcome:
        """Keep the deployment serving until `until()` holds (DONE), a stop is requested
        (STOPPED) or every unit gave up (FAILED, reported); a unit that exits meanwhile is
        restarted as `supervise.decide` says. `every()` runs on each pass (the autoscaler)."""
        while True:
            if self._stop_requested():
                return Outcome.STOPPED
            self._tend()
            if every is not None:
                every()
            if until():
                return Outcome.DONE
            if all(u.state == "gave_up" for u in self._units):
                self._say("every process gave up; nothing is left to serve")
                return Outcome.FAILED
            time.sleep(self._pause_s())

    def _pause_s(self) -> float:
        """The poll interval, or less when a restart falls due sooner."""
        due = [u.restart_at_s for u in self._units if u.restart_at_s is not None]
        until_s = min(due, default=float("inf")) - self._clock()
        return max(0.0, min(self._poll_interval_s, until_s))

    # ---- units the autoscaler adds and retires ---------------------------------------------

    def add_unit(self, name: str, specs: Sequence[ProcessSpec]) -> None:
        """Start a new unit while serving (a PP group the autoscaler added): `starting` until
        every member answers its ready URL, then tended like the others."""
        unit = _Unit(Unit(name, tuple(s.name for s in specs)), tuple(specs))
        unit.added_at_s = self._clock()
        self._units.append(unit)
        for spec in specs:
            self._unit_of[spec.name] = unit
        try:
            for spec in specs:
                unit.children.append(self._launch(spec, restart=None, append=True))
        except OSError as exc:
            self._say(f"{name}: cannot start ({exc}); giving up on it")
            self._stop_children(unit.children, self._restart_stop_grace_s)
            unit.children = []
            unit.state = "gave_up"
        else:
            pids = ", ".join(f"{c.spec.name} pid {c.popen.pid}" for c in unit.children)
            self._say(f"{name} started: {pids}")
        self._write_status()

    def retire_unit(self, name: str) -> None:
        """SIGTERM a unit's members: they drain (finish what they hold, take nothing new) and
        exit; past `stop_grace_s` what is left is killed. The unit is gone once they exited."""
        unit = next((u for u in self._units if u.unit.name == name), None)
        if unit is None or unit.state == "stopping":
            return
        for child in unit.children:
            _signal_group(child.popen.pid, signal.SIGTERM)
        unit.state = "stopping"
        unit.retire_by_s = self._clock() + self._stop_grace_s
        self._say(f"{name} retired: draining")
        self._write_status()

    def unit_states(self) -> dict[str, UnitState]:
        return {u.unit.name: u.state for u in self._units}

    def _tend_stopping(self, unit: _Unit) -> None:
        if any(c.popen.poll() is None for c in unit.children):
            if self._clock() < (unit.retire_by_s or 0.0):
                return
            self._say(f"{unit.unit.name} still running {self._stop_grace_s:g} s after SIGTERM")
        for child in unit.children:  # what is left of the groups (all of it, past the grace)
            _signal_group(child.popen.pid, signal.SIGKILL)
        for child in unit.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=self._restart_stop_grace_s)
        self._units.remove(unit)
        for member in unit.unit.members:
            if self._unit_of.get(member) is unit:
                del self._unit_of[member]
        self._say(f"{unit.unit.name} stopped")
        self._write_status()

    # ---- restarting ----------------------------------------------------------------------

    def _tend(self) -> None:
        """One pass over the units: exits -> decisions, due restarts -> starts, restarted
        members -> ready."""
        for unit in list(self._units):
            if unit.state == "stopping":
                self._tend_stopping(unit)
                continue
            if unit.state in ("starting", "ready"):
                self._check_exit(unit)
            if unit.state == "ready":
                self._check_live(unit)
            if unit.state == "waiting" and self._clock() >= (unit.restart_at_s or 0.0):
                self._restart(unit)
            if unit.state == "starting":
                self._check_ready(unit)

    def _check_exit(self, unit: _Unit) -> None:
        exited = [(c, code) for c in unit.children if (code := c.popen.poll()) is not None]
        if exited:
            self._lost(unit, *exited[0])

    def _check_live(self, unit: _Unit) -> None:
        """Take the members' finished liveness probes (one that fails counts as exited) and
        start those that are due, on the prober's thread."""
        policy = self._liveness
        for child in unit.children:
            if not child.spec.live_url:
                continue
            probe, now_s = child.live_probe, self._clock()
            if probe is not None and probe.done():
                child.live_probe = None
                child.live = observe_liveness(child.live, probe.result(), now_s)
                why = liveness_verdict(child.live, now_s, policy)
                if why is not None:
                    self._lost(unit, child, None, why)
                    return
            due = child.live_probed_s is None or now_s - child.live_probed_s >= policy.period_s
            if child.live_probe is None and due:
                if self._prober is None:
                    self._prober = concurrent.futures.ThreadPoolExecutor(1, "dsv4-up-live")
                url = child.spec.live_url
                child.live_probe = self._prober.submit(self._live_probe, url, policy.timeout_s)
                child.live_probed_s = now_s

    def _lost(self, unit: _Unit, child: _Child, code: int | None, why: str = "") -> None:
        """`child` exited with `code` (None: it runs, but is not live, `why`): stop its unit
        and restart it after the backoff, or give up on it."""
        now_s = self._clock()
        decision = decide(unit.restarts_at_s, now_s, self._policy)
        self._say(exit_line(unit.unit, child.spec.name, code, decision, why))
        if code is None:
            unit.last_exit = f"{child.spec.name} was not live: {why}"
        else:
            unit.last_exit = f"{child.spec.name} exited with {describe_exit(code)}"
        unit.exited_at_s = now_s
        self._stop_children(unit.children, self._restart_stop_grace_s, self._stop_requested)
        unit.children = []
        if isinstance(decision, Restart):
            unit.restarts_at_s.append(now_s)
            # The backoff counts from the exit (the stop above is part of it, as a pod's
            # restart delay counts from its container's exit).
            unit.restart_at_s = now_s + decision.delay_s
            unit.state = "waiting"
        else:
            unit.state = "gave_up"
            self._say(f"{unit.unit.name}: what it printed is in {self.log_path(child.spec.name)}")
        self._write_status()

    def _restart(self, unit: _Unit) -> None:
        number = len(unit.restarts_at_s)
        try:
            for spec in unit.specs:
                unit.children.append(self._launch(spec, restart=number))
        except OSError as exc:
            self._say(f"{unit.unit.name}: cannot restart ({exc}); giving up on it")
            self._stop_children(unit.children, self._restart_stop_grace_s)
            unit.children = []
            unit.state = "gave_up"
        else:
            pids = ", ".join(f"{c.spec.name} pid {c.popen.pid}" for c in unit.children)
            self._say(f"{unit.unit.name} restarted (restart {number}): {pids}")
            unit.state = "starting"
        unit.restart_at_s = None
        self._write_status()

    def _check_ready(self, unit: _Unit) -> None:
        for child in unit.children:
            if child.ready_after_s is None and self._probe(child.spec.ready_url):
                child.ready_after_s = self._clock() - (unit.exited_at_s or 0.0)
        if all(c.ready_after_s is not None for c in unit.children):
            unit.state = "ready"
            if unit.exited_at_s is None and unit.added_at_s is not None:
                after_s = self._clock() - unit.added_at_s
                self._say(f"{unit.unit.name} ready ({after_s:.1f} s after its start)")
            else:
                after_s = self._clock() - (unit.exited_at_s or 0.0)
                self._say(f"{unit.unit.name} ready again ({after_s:.1f} s after the exit)")
            self._write_status()

    # ---- stopping ----------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every group, wait up to `stop_grace_s` for the leaders (less after more
        stop signals), SIGKILL every group (what is left of it), reap. Idempotent."""
        children = self._children()
        for unit in self._units:
            unit.children = []
        if self._prober is not None:
            self._prober.shutdown(wait=False, cancel_futures=True)
            self._prober = None
        if not children:
            return
        for child in children:
            _signal_group(child.popen.pid, signal.SIGTERM)
        self._wait_drained(children)
        for child in children:
            _signal_group(child.popen.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=self._stop_grace_s)

    def _wait_drained(self, children: Sequence[_Child]) -> None:
        """Until every leader exited or the grace is over, saying which it waits for. A second
        stop signal: each living group gets a second SIGTERM (its server ends the drain now)
        and `HURRY_GRACE_S` more; a third: no more waiting."""
        started_s = time.monotonic()
        deadline_s = started_s + self._stop_grace_s
        signals_seen = self._stop_signals()
        next_note_s = started_s + FIRST_NOTE_S  # a quick exit says nothing
        while (living := [c for c in children if c.popen.poll() is None]) and (
            (now_s := time.monotonic()) < deadline_s
        ):
            names = ", ".join(c.spec.name for c in living)
            if (count := self._stop_signals()) > signals_seen:
                signals_seen = count
                if count >= 3:
                    self._say(f"another signal: killing {names} now")
                    return
                for child in living:
                    _signal_group(child.popen.pid, signal.SIGTERM)
                deadline_s = min(deadline_s, now_s + HURRY_GRACE_S)
                self._say(
                    f"second signal: {names} end their drains now (SIGKILL in "
                    f"{deadline_s - now_s:.0f} s; again: at once)"
                )
                next_note_s = now_s + self._progress_interval_s
            elif now_s >= next_note_s:
                waited_s = now_s - started_s
                self._say(
                    f"waiting for {names} to drain and exit ({waited_s:.0f} s; SIGKILL at "
                    f"{deadline_s - started_s:.0f} s; Ctrl-C again ends the drains now)"
                )
                next_note_s = now_s + self._progress_interval_s
            time.sleep(0.05)

    def _stop_children(
        self,
        children: Sequence[_Child],
        grace_s: float,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        """SIGTERM the groups, wait up to `grace_s` (less once `hurry()`), SIGKILL, reap."""
        if not children:
            return
        for child in children:
            _signal_group(child.popen.pid, signal.SIGTERM)
        deadline_s = time.monotonic() + grace_s
        while any(c.popen.poll() is None for c in children) and time.monotonic() < deadline_s:
            if hurry():
                break
            time.sleep(0.05)
        for child in children:
            _signal_group(child.popen.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=grace_s)

    # ---- helpers -------------------------------------------------------------------------

    def _launch(self, spec: ProcessSpec, *, restart: int | None, append: bool = False) -> _Child:
        """Start one process, its output appended to its log (a restart adds a marker; so
        does a unit added again under a name it had before)."""
        log_path = self.log_path(spec.name)
        with log_path.open("wb" if restart is None and not append else "ab") as log:
            what = "" if restart is None else f" restart {restart}:"
            log.write(f"# dsv4 up:{what} {shlex.join(spec.argv)}\n".encode())
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
        return _Child(spec, popen, log_path)

    def _children(self) -> list[_Child]:
        return [c for unit in self._units for c in unit.children]

    def _waiting(self) -> list[_Child]:
        return [c for c in self._children() if c.ready_after_s is None]

    def _report_exit(self) -> bool:
        """Report the first child that has exited (with its log's tail); False if none has."""
        for child in self._children():
            code = child.popen.poll()
            if code is None:
                continue
            self._say(f"{child.spec.name} exited ({_describe_exit(code)}) before it was ready")
            lines = tail_lines(child.log_path, LOG_TAIL_LINES)
            self._say(f"last {len(lines)} lines of {child.log_path}:")
            for line in lines:
                self._out.write(f"    {line}\n")
            self._out.flush()
            return True
        return False

    def _write_status(self) -> None:
        """WORKDIR/status.json, replaced atomically when a unit's state changed."""
        if self._status_path is None:
            return
        now_s = self._clock()
        doc = status_document(
            [
                UnitStatus(
                    unit=u.unit,
                    state=u.state,
                    pids={c.spec.name: c.popen.pid for c in u.children},
                    restarts=len(u.restarts_at_s),
                    last_exit=u.last_exit,
                    restart_in_s=None if u.restart_at_s is None else u.restart_at_s - now_s,
                )
                for u in self._units
            ]
        )
        tmp = self._status_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            os.replace(tmp, self._status_path)
        except OSError as exc:  # the status file is a convenience; serving goes on
            self._say(f"cannot write {self._status_path}: {exc}")

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
