"""Admission at a worker's front door, pure: does a new request enter the queue, or is it shed
with 503 + Retry-After, and which queued requests have waited past their deadline?

The engine's scheduler admits by KV budgets (`sched.budget.admit`); what it cannot take yet
waits in its queue. This module bounds that queue in length and in time, so an overloaded
worker answers at once instead of letting clients time out:

    engine has room for the queue and this one  -> admit (it runs at the next step)
    queue holds `max_queue_requests`              -> shed "queue_full"
    its oldest request waited `queue_timeout_s`   -> shed "queue_stalled" (it does not drain)
    otherwise                                     -> admit (it waits its turn)

A request still waiting `queue_timeout_s` after it arrived is removed ("queue_timeout"): it
holds no KV pages while it waits (WAITING/PREALLOC requests have no slot), so nothing is freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

# Why a request was refused or removed (the `reason` label of the shed counters).
ShedReason = Literal["queue_full", "queue_stalled", "queue_timeout", "engine_unavailable"]
SHED_REASONS: Final[tuple[ShedReason, ...]] = (
    "queue_full",
    "queue_stalled",
    "queue_timeout",
    "engine_unavailable",
)
QUEUE_PER_RUNNING: Final = 2  # default queue bound: this many per request slot
DEFAULT_QUEUE_TIMEOUT_S: Final = 5.0
RETRY_AFTER_S: Final = 1


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    max_queue_requests: int  # requests that may wait for the engine at once (>= 1)
    queue_timeout_s: float  # how long one may wait before it is removed (> 0)

    def __post_init__(self) -> None:
        if self.max_queue_requests < 1:
            raise ValueError(f"max_queue_requests: must be >= 1, got {self.max_queue_requests}")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s: must be > 0, got {self.queue_timeout_s}")


def default_policy(
    max_running_requests: int,
    max_queue_requests: int | None = None,
    queue_timeout_s: float | None = None,
) -> AdmissionPolicy:
    """The policy from what was given, the rest derived: a queue of a small multiple of the
    engine's request slots, a deadline of a few seconds."""
    return AdmissionPolicy(
        max_queue_requests=max_queue_requests or QUEUE_PER_RUNNING * max(1, max_running_requests),
        queue_timeout_s=queue_timeout_s or DEFAULT_QUEUE_TIMEOUT_S,
    )


@dataclass(frozen=True, slots=True)
class QueueView:
    """The queue and the engine's free capacity as the runner last saw them."""

    waiting: int  # requests accepted but not yet scheduled
    oldest_wait_s: float  # how long the oldest of them has waited (0: none)
    free_request_slots: int
    free_full_tokens: int


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    reason: ShedReason | None = None  # set when shed
    message: str = ""


ADMIT: Final = Verdict(True)


def decide(view: QueueView, policy: AdmissionPolicy, need_tokens: int) -> Verdict:
    """Admit or shed one request that needs `need_tokens` (prompt + max_tokens) of KV."""
    # Room for everyone queued and this one: the next step schedules it, whatever the queue.
    fits_now = (
        view.waiting < view.free_request_slots
        and (view.waiting + 1) * need_tokens <= view.free_full_tokens
    )
    if fits_now:
        return ADMIT
    if view.waiting >= policy.max_queue_requests:
        return Verdict(
            False,
            "queue_full",
            f"too many requests waiting ({view.waiting}, the bound is "
            f"{policy.max_queue_requests}); retry later",
        )
    if view.oldest_wait_s >= policy.queue_timeout_s:
        return Verdict(
            False,
            "queue_stalled",
            f"the queue is not draining (its oldest request waited {view.oldest_wait_s:.1f} s, "
            f"the deadline is {policy.queue_timeout_s:g} s); retry later",
        )
    return ADMIT


def expired(waited_s: float, policy: AdmissionPolicy) -> bool:
    """A request that has waited this long without being scheduled is removed."""
    return waited_s >= policy.queue_timeout_s


def timeout_message(policy: AdmissionPolicy) -> str:
    return (
        f"the request waited {policy.queue_timeout_s:g} s in the queue without being scheduled; "
        "retry later"
    )
