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

The grace keeps a starved instance eligible for new requests; the requests already open on a
decode that stopped (SIGSTOP, a hung host) must not wait it out. The relay gives up on such a
decode when `frozen_reason` and `give_up_frozen` say so (tests/test_stall.py):

    no byte (`silent_s`)   its latest probe   client has bytes   other pair   stale   the relay
    < rule.silence_s       -                  -                  -            -       waits
    >= rule.silence_s      answered           -                  -            -       waits (slow)
    >= rule.silence_s      missed             yes                -            -       ends it
    >= rule.silence_s      missed             no                 yes          -       retries
    >= rule.silence_s      missed             no                 no           yes     gives up
    >= rule.silence_s      missed             no                 no           no      waits

A stopped process answers neither bytes nor probes; a slow one answers probes. NOTE:
`silent_s` counts only the router's own progress (up to when it last read everything that
had arrived), so a starved router never takes its own lag for the decode's silence. Waiting
is the right move with nothing sent and nowhere else to go: the decode may only be starved.
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


@dataclass(slots=True)
class Silence:
    """A peer's silence as far as the router can vouch for it: counted only up to its previous
    look, by when it had read everything that had arrived (a look runs in a later event-loop
    iteration than the one before, and each iteration reads what is there). A router starved
    between two looks never reports its own lag as the peer's silence."""

    heard_s: float  # when the router last read a byte from the peer (or began to listen)
    looked_s: float  # when it last looked

    def look(self, now_s: float) -> float:
        """The peer's silence at a look now, in seconds."""
        silent_s = max(0.0, self.looked_s - self.heard_s)
        self.looked_s = now_s
        return silent_s


@dataclass(frozen=True, slots=True)
class StallRule:
    silence_s: float  # no byte from the decode for this long (of the router's own progress)
    looks: int = 5  # the relay looks this often per `silence_s`

    def __post_init__(self) -> None:
        if not self.silence_s > 0:
            raise ValueError(f"silence_s: must be > 0, got {self.silence_s}")
        if self.looks < 1:
            raise ValueError(f"looks: must be >= 1, got {self.looks}")

    @property
    def look_every_s(self) -> float:
        return self.silence_s / self.looks


def frozen_reason(silent_s: float, probe: Liveness, rule: StallRule) -> str | None:
    """Why the decode of an open request looks frozen (no byte for `rule.silence_s` and its
    latest status probe missed), or None."""
    if silent_s < rule.silence_s or probe.misses == 0:
        return None
    how = "found nothing listening" if probe.refused else "got no status"
    return f"no byte for {silent_s:.1f} s and its last {probe.misses} status probe(s) {how}"


def give_up_frozen(*, answered: bool, other_pair: bool, stale: bool) -> bool:
    """Whether the relay ends an open request whose decode looks frozen: the client already
    has bytes (the stream ends with an error event), another pair can take it (a retry), or
    the decode is stale for new requests too (a 503)."""
    return answered or other_pair or stale
