"""What `dsv4 up` does when a process exits while the deployment serves, as a Kubernetes
Deployment would: restart it with exponential backoff, within a budget. Pure: process specs,
exit codes and clock readings in; units, decisions, event lines and the status document out.
`supervisor.py` carries the decisions out.

A unit is what restarts together:

    unit         members                          why
    <role>-<r>   every PP rank of that replica    a PP group fails as a unit: once one stage
                                                  dies the others cannot go on
    router       the router process

A member whose liveness URL (`ProcessSpec.live_url`, the worker's `/live`) answers non-200
`failure_threshold` times in a row, probed every `period_s` while its unit is ready, is taken
as exited (its engine can never serve again; the kubelet does the same with the pod's
livenessProbe); so is one that answered nothing for `silent_s` (hung: a stop of seconds, or a
busy process on a loaded machine, is not). `LivenessPolicy`, `liveness_verdict`.

When a member of a unit exits, the others of its unit are stopped and then:

    restarts of the unit in the last window_s   decision
    k < budget                                  restart number k+1 after
                                                  min(max_backoff_s, initial_backoff_s * 2^k)
    k >= budget                                 give up on the unit; the others keep serving
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from dsv4_local.plan import ProcessSpec

__all__ = [
    "Decision",
    "GiveUp",
    "Liveness",
    "LivenessPolicy",
    "Restart",
    "RestartPolicy",
    "Unit",
    "UnitState",
    "UnitStatus",
    "decide",
    "describe_exit",
    "exit_line",
    "liveness_verdict",
    "observe_liveness",
    "policy_line",
    "status_document",
    "units_of",
]

ROUTER: Final = "router"
STATUS_VERSION: Final = 1

# starting: launched, not every member ready yet; ready: every member answers its ready URL;
# waiting: stopped, restarts when the backoff has passed; gave_up: the budget is spent;
# stopping: the autoscaler retired it, its members drain and exit (then it is gone).
UnitState = Literal["starting", "ready", "waiting", "gave_up", "stopping"]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    budget: int = 5  # restarts of one unit within window_s
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"backoff: need 0 <= initial ({self.initial_backoff_s}) <= max "
                f"({self.max_backoff_s})"
            )
        if self.budget < 0:
            raise ValueError(f"budget: must be >= 0, got {self.budget}")
        if not self.window_s > 0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")


@dataclass(frozen=True, slots=True)
class LivenessPolicy:
    period_s: float = 1.0  # between probes of one process
    failure_threshold: int = 3  # non-200 answers in a row that count as an exit
    silent_s: float = 60.0  # no answer at all for this long counts as an exit
    timeout_s: float = 0.5  # one probe's wait

    def __post_init__(self) -> None:
        if not (self.period_s > 0 and self.timeout_s > 0 and self.silent_s > 0):
            raise ValueError("liveness: period_s, timeout_s and silent_s must be > 0")
        if self.failure_threshold < 1:
            raise ValueError(
                f"liveness: failure_threshold must be >= 1, got {self.failure_threshold}"
            )


@dataclass(frozen=True, slots=True)
class Liveness:
    """One process's liveness probes so far (since its unit became ready)."""

    failures: int = 0  # non-200 answers in a row
    last_status: int | None = None  # the last answer's status
    answered_s: float | None = None  # the clock at the last answer (or when probing began)


def observe_liveness(seen: Liveness, status: int | None, now_s: float) -> Liveness:
    """`seen` after a probe that answered `status` (None: nothing answered) at `now_s`."""
    if status is None:
        since_s = now_s if seen.answered_s is None else seen.answered_s
        return Liveness(seen.failures, seen.last_status, since_s)
    return Liveness(0 if status == 200 else seen.failures + 1, status, now_s)


def liveness_verdict(seen: Liveness, now_s: float, policy: LivenessPolicy) -> str | None:
    """Why the process counts as exited, or None while it is live."""
    if seen.failures >= policy.failure_threshold:
        return f"its /live answered {seen.last_status} {seen.failures} times in a row"
    if seen.answered_s is not None and now_s - seen.answered_s >= policy.silent_s:
        return f"its /live answered nothing for {now_s - seen.answered_s:.0f} s"
    return None


def policy_line(policy: RestartPolicy) -> str:
    """The policy, for people."""
    return (
        f"a process that exits while serving restarts with its PP group after "
        f"{policy.initial_backoff_s:g} s, doubling up to {policy.max_backoff_s:g} s, at most "
        f"{policy.budget} times in {policy.window_s:g} s"
    )


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    members: tuple[str, ...]  # process names, in start order

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1


def units_of(processes: Sequence[ProcessSpec]) -> tuple[Unit, ...]:
    """The units of a launch plan, in the order their first member starts; every process is
    in exactly one unit."""
    members: dict[str, list[str]] = {}
    for spec in processes:
        key = ROUTER if spec.role == ROUTER else f"{spec.role}-{spec.replica}"
        members.setdefault(key, []).append(spec.name)
    return tuple(Unit(name, tuple(names)) for name, names in members.items())


@dataclass(frozen=True, slots=True)
class Restart:
    delay_s: float
    number: int  # this restart's number within the window, from 1
    budget: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    restarts: int  # restarts within the window, already spent
    window_s: float


Decision = Restart | GiveUp


def decide(restarts_at_s: Sequence[float], now_s: float, policy: RestartPolicy) -> Decision:
    """A unit exited at `now_s`, having restarted at `restarts_at_s` before."""
    recent = sum(1 for t in restarts_at_s if now_s - t < policy.window_s)
    if recent >= policy.budget:
        return GiveUp(recent, policy.window_s)
    delay_s = min(policy.max_backoff_s, policy.initial_backoff_s * 2**recent)
    return Restart(delay_s, recent + 1, policy.budget)


def describe_exit(code: int) -> str:
    """`code 3`, or `code -9 (SIGKILL)` for a process a signal ended."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"code {code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"code {code}"


def exit_line(unit: Unit, process: str, code: int | None, decision: Decision, why: str = "") -> str:
    """The one line an exit while serving prints, e.g. `decode-0 exited with code -9 (SIGKILL);
    restarting in 2 s (restart 2 of 5)`; a process taken as exited (code None) says `why`:
    `decode-0 is not live (its /live answered 503 3 times in a row); restarting ...`."""
    what = f"its PP group {unit.name} ({len(unit.members)} processes)" if unit.is_group else ""
    if code is None:
        head = f"{process} is not live ({why}); "
    else:
        head = f"{process} exited with {describe_exit(code)}; "
    if isinstance(decision, Restart):
        target = f"{what} " if what else ""
        return (
            f"{head}restarting {target}in {decision.delay_s:g} s "
            f"(restart {decision.number} of {decision.budget})"
        )
    target = what or "it"
    return (
        f"{head}giving up on {target} after {decision.restarts} restarts in "
        f"{decision.window_s:g} s; the other processes keep serving"
    )


@dataclass(frozen=True, slots=True)
class UnitStatus:
    unit: Unit
    state: UnitState
    pids: dict[str, int]  # the members running now
    restarts: int  # since `dsv4 up` started
    last_exit: str | None  # e.g. "decode-0-rank-1 exited with code -9 (SIGKILL)"
    restart_in_s: float | None  # while waiting


def status_document(units: Sequence[UnitStatus]) -> dict[str, Any]:
    """WORKDIR/status.json: every unit's state, pids, restarts and last exit."""
    return {
        "version": STATUS_VERSION,
        "units": [
            {
                "name": u.unit.name,
                "members": list(u.unit.members),
                "state": u.state,
                "pids": dict(u.pids),
                "restarts": u.restarts,
                "last_exit": u.last_exit,
                "restart_in_s": None if u.restart_in_s is None else round(u.restart_in_s, 1),
            }
            for u in units
        ],
    }
