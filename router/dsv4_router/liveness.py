"""Whether the router still trusts an instance: judged on consecutive missed probes and a
silence that scales with the probe interval, never on the age of one status alone (a starved
machine delays answers and the router's own rounds; a healthy worker must not look dead).

Pure: `observe` folds one status probe into a `Liveness`, `stale_reason` decides at a given
clock reading. One table:

    last probe      effect on the state             the instance is stale when
    ok (a status)   ok_at_s = now, misses = 0       never (until later probes miss)
    late (timeout)  misses + 1                      misses >= rule.misses AND
    failed          misses + 1                        now - ok_at_s >= rule.grace_s
    refused         misses + 1, refused             at once: nothing listens (the process
                                                      is gone; a stopped one still accepts)
    (none yet)      -                               always: no status to route by

Invariants (tests/test_liveness.py): an instance whose probes succeed at least every
`rule.grace_s` is never stale; one whose probes all miss is stale once `rule.misses` probes
missed and `rule.grace_s` passed since its last status; staleness only grows with time and
misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ProbeOutcome = Literal["ok", "late", "failed", "refused"]


@dataclass(frozen=True, slots=True)
class LivenessRule:
    misses: int  # consecutive status probes without a status, at least
    grace_s: float  # and at least this long since the last status

    def __post_init__(self) -> None:
        if self.misses < 1:
            raise ValueError(f"misses: must be >= 1, got {self.misses}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")


def liveness_rule(
    *, poll_interval_s: float, min_grace_s: float, misses: int, grace_polls: float
) -> LivenessRule:
    """The grace scales with the probe interval: max(min_grace_s, grace_polls intervals)."""
    return LivenessRule(misses=misses, grace_s=max(min_grace_s, grace_polls * poll_interval_s))


@dataclass(frozen=True, slots=True)
class Liveness:
    ok_at_s: float | None = None  # clock when the last status arrived (None: never)
    misses: int = 0  # status probes since then that gave none
    refused: bool = False  # the last probe found nothing listening


def observe(state: Liveness, outcome: ProbeOutcome, now_s: float) -> Liveness:
    if outcome == "ok":
        return Liveness(ok_at_s=now_s)
    return Liveness(state.ok_at_s, state.misses + 1, refused=outcome == "refused")


def stale_reason(state: Liveness, now_s: float, rule: LivenessRule) -> str | None:
    """Why the instance is stale, or None while it is live."""
    if state.ok_at_s is None:
        return "no status yet"
    if state.refused:
        return "nothing listens on its status port"
    silent_s = now_s - state.ok_at_s
    if state.misses >= rule.misses and silent_s >= rule.grace_s:
        return f"{state.misses} probes in a row failed, no status for {silent_s:.1f} s"
    return None
