"""What the router knows about each instance, whether it may take a request, and which
(prefill, decode) pair takes the next one.

Pure: records hold what discovery observed and what the router sent; every decision takes the
clock as an argument. Whether an instance is live is `liveness`'s rule (consecutive missed
probes and a grace), never the age of one status alone. A ready instance whose queue is full
(`queue_full`: what it reports, or the router's own open requests past its running slots) is
`busy` and skipped; when no pair is left the router sheds at once (`unavailable`: 503 +
Retry-After with a reason label). Invariants: `choose_pair` returns only
eligible, non-excluded instances of the right roles, and returns None only when no such pair
exists; ties fall to the lowest address, so the choice never depends on record order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.rank_config import Instance
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_router.liveness import Liveness, LivenessRule, ProbeOutcome, observe, stale_reason

# `busy` is a fresh, ready instance that refuses work now (not accepting); the metric folds it
# into `unready`.
Health = Literal["eligible", "busy", "unready", "stale"]
# Why the router found no pair (the `reason` label of `dsv4_router_shed_requests`): `busy`
# every ready instance of a role is full; `unavailable` a role has no ready instance; `failed`
# every ready one failed this request; `upstream_shed` the last decode tried answered 503.
ShedReason = Literal["busy", "unavailable", "failed", "upstream_shed"]
SHED_REASONS: Final[tuple[ShedReason, ...]] = ("busy", "unavailable", "failed", "upstream_shed")
MetricState = Literal["eligible", "unready", "stale"]
METRIC_STATES: Final[tuple[MetricState, ...]] = ("eligible", "unready", "stale")

AddressKey = tuple[str, int, int, int]


def address_key(instance: Instance) -> AddressKey:
    return (instance.host, instance.http_port, instance.status_port, instance.kv_port)


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class InstanceRecord:
    """One instance: the last status discovery took and the requests the router sent it.

    `pending` counts requests sent after the poll that produced `status` began, so the
    worker's own counts cannot include them yet.
    """

    role: WorkerRole
    instance: Instance
    status: WorkerStatus | None = None  # the last status a poll gave (None: none yet)
    liveness: Liveness = field(default_factory=Liveness)  # when it arrived, misses since
    ready: bool = False  # the last /ready answered 200
    error: str | None = None  # why the last poll failed (None: it did not)
    sent_total: int = 0  # requests the router ever sent here
    status_sent_total: int = 0  # `sent_total` when the poll that gave `status` began
    inflight: int = 0  # the router's requests open here now

    @property
    def pending(self) -> int:
        return self.sent_total - self.status_sent_total

    @property
    def status_at_s(self) -> float | None:
        """Clock when `status` arrived."""
        return self.liveness.ok_at_s

    def sent(self) -> None:
        self.sent_total += 1
        self.inflight += 1

    def done(self) -> None:
        assert self.inflight > 0, "done() without sent()"
        self.inflight -= 1


@dataclass(frozen=True, slots=True)
class Probe:
    """One poll's result. `status`/`ready` None: that probe timed out (keep the old value)."""

    status: WorkerStatus | None
    ready: bool | None
    error: str | None  # set when the status probe failed (not a timeout)
    sent_total_at_start: int
    refused: bool = False  # the status probe's connection was refused (nothing listens)

    @property
    def outcome(self) -> ProbeOutcome:
        if self.status is not None:
            return "ok"
        if self.refused:
            return "refused"
        return "late" if self.error is None else "failed"


def apply_probe(record: InstanceRecord, probe: Probe, now_s: float) -> None:
    """Fold a poll into the record: a status replaces the old one; a miss keeps it and counts
    towards staleness (`liveness`)."""
    record.liveness = observe(record.liveness, probe.outcome, now_s)
    if probe.status is not None:
        record.status = probe.status
        record.status_sent_total = probe.sent_total_at_start
        record.error = None
    else:
        record.error = probe.error or "status probe timed out"
    if probe.ready is not None:
        record.ready = probe.ready


def assess(record: InstanceRecord, now_s: float, rule: LivenessRule) -> tuple[Health, str]:
    """The record's health and, unless eligible, why not."""
    status = record.status
    stale = stale_reason(record.liveness, now_s, rule)
    if stale is not None or status is None:
        last_error = f" ({record.error})" if record.error else ""
        return "stale", f"{stale or 'no status yet'}{last_error}"
    if status.role != record.role:
        return "unready", f"reports role {status.role!r}"
    if not record.ready:
        return "unready", "/ready is not 200"
    if record.role == "decode" and not status.kv_ready:
        return "unready", "KV transfer not ready"
    if not status.load.accepting:
        return "busy", "not accepting requests"
    if queue_full(record):
        return "busy", "its queue is full"
    return "eligible", ""


def queue_full(record: InstanceRecord) -> bool:
    """The instance's queue is at its bound: as it reported, or as the router's own requests
    open there now beyond its running slots count it (fresher than any status). False when
    it reports no bound."""
    status = record.status
    assert status is not None, "only records with a status are judged"
    bound = status.load.max_queue_requests
    if bound <= 0:
        return False
    beyond_slots = record.inflight - status.capacity.max_running_requests
    return max(status.load.waiting, beyond_slots) >= bound


def metric_state(health: Health) -> MetricState:
    return "unready" if health == "busy" else health


def prefill_key(record: InstanceRecord) -> tuple[int, int, AddressKey]:
    """Fewest queued (its waiting plus the router's pending), then most free full tokens:
    prefill admits by the full pool."""
    assert record.status is not None, "only records with a status are ranked"
    load = record.status.load
    return (load.waiting + record.pending, -load.free_full_tokens, address_key(record.instance))


def decode_key(record: InstanceRecord) -> tuple[int, float, int, AddressKey]:
    """Fewest queued (its waiting, plus the router's pending requests beyond its free request
    slots), then the most headroom in its BINDING pool, then fewest running. A DSV4 decode is
    full when any of its three pools is: the headroom is the least, over the full pool, the
    SWA pool and the request slots (request-scoped state), of the fraction still free once
    each pending request took one average share (the pool / its request slots)."""
    status = record.status
    assert status is not None, "only records with a status are ranked"
    capacity, load = status.capacity, status.load
    slots = max(1, capacity.max_running_requests)
    pending = record.pending
    queued = load.waiting + max(0, pending - load.free_request_slots)
    headroom = (load.free_request_slots - pending) / slots
    for total, free in (
        (capacity.full_tokens, load.free_full_tokens),
        (capacity.swa_tokens, load.free_swa_tokens),
    ):
        if total > 0:
            headroom = min(headroom, (free - pending * total / slots) / total)
    return (queued, -headroom, load.running, address_key(record.instance))


def full_pool_decode_key(record: InstanceRecord) -> tuple[int, int, AddressKey]:
    """The choice before issue #41 (kept for bench/router_choice.py's comparison): most free
    full tokens less one share per pending request, then fewest running; blind to the SWA
    pool, the request slots and the queue."""
    status = record.status
    assert status is not None, "only records with a status are ranked"
    capacity = status.capacity
    share_tokens = capacity.full_tokens // max(1, capacity.max_running_requests)
    free_tokens = status.load.free_full_tokens - record.pending * share_tokens
    return (-free_tokens, status.load.running, address_key(record.instance))


# A decode's rank: the lowest is chosen (tuples compared in order).
DecodeRank = Callable[[InstanceRecord], Any]


@dataclass(frozen=True, slots=True)
class Pair:
    prefill: InstanceRecord
    decode: InstanceRecord


def eligible(
    records: Iterable[InstanceRecord],
    role: WorkerRole,
    now_s: float,
    rule: LivenessRule,
    excluded: frozenset[Instance] = frozenset(),
) -> list[InstanceRecord]:
    return [
        r
        for r in records
        if r.role == role
        and not (excluded and r.instance in excluded)
        and assess(r, now_s, rule)[0] == "eligible"
    ]


def choose(
    records: Iterable[InstanceRecord],
    role: WorkerRole,
    now_s: float,
    rule: LivenessRule,
    excluded: frozenset[Instance] = frozenset(),
) -> InstanceRecord | None:
    candidates = eligible(records, role, now_s, rule, excluded)
    if not candidates:
        return None
    return min(candidates, key=prefill_key if role == "prefill" else decode_key)


def choose_pair(
    records: Iterable[InstanceRecord],
    now_s: float,
    rule: LivenessRule,
    excluded: frozenset[Instance] = frozenset(),
    decode_rank: DecodeRank = decode_key,
) -> Pair | None:
    """The best eligible prefill and decode not in `excluded`, or None if a role has none.
    (What `choose` picks for each role, in one pass: it runs for every request.)
    `decode_rank`: how decodes are ordered (the bench compares the old rule)."""
    prefill = decode = None
    prefill_best: tuple[int, int, AddressKey] | None = None
    decode_best: Any = None
    for record in records:
        if excluded and record.instance in excluded:
            continue
        if assess(record, now_s, rule)[0] != "eligible":
            continue
        if record.role == "prefill":
            key = prefill_key(record)
            if prefill_best is None or key < prefill_best:
                prefill, prefill_best = record, key
        else:
            rank = decode_rank(record)
            if decode_best is None or rank < decode_best:
                decode, decode_best = record, rank
    if prefill is None or decode is None:
        return None
    return Pair(prefill=prefill, decode=decode)


def unavailable_reason(
    records: Iterable[InstanceRecord],
    now_s: float,
    rule: LivenessRule,
    excluded: frozenset[Instance] = frozenset(),
) -> str:
    """Why `choose_pair` found nothing (for the 503 message); "" if it would find a pair."""
    return unavailable(records, now_s, rule, excluded)[1]


def unavailable(
    records: Iterable[InstanceRecord],
    now_s: float,
    rule: LivenessRule,
    excluded: frozenset[Instance] = frozenset(),
) -> tuple[ShedReason, str]:
    """Why `choose_pair` found nothing: the reason label and the message ("" if it would find
    a pair; the label is then meaningless)."""
    pool = list(records)
    for role in WORKER_ROLES:
        of_role = [r for r in pool if r.role == role]
        health = [assess(r, now_s, rule)[0] for r in of_role]
        usable = [h for r, h in zip(of_role, health, strict=True) if r.instance not in excluded]
        if "eligible" in usable:
            continue
        if not of_role:
            return "unavailable", f"no {role} instance is known"
        if "eligible" in health:
            return "failed", f"every ready {role} instance failed this request"
        if "busy" in usable:
            return "busy", f"every ready {role} instance is busy"
        return "unavailable", f"no ready {role} instance"
    return "unavailable", ""


class InstanceTable:
    """Every instance the router knows, one record per (role, address). Discovery syncs the
    membership; a record that stays keeps its history."""

    def __init__(self) -> None:
        self._records: dict[tuple[WorkerRole, Instance], InstanceRecord] = {}
        self._sorted: list[InstanceRecord] | None = None  # records(), until membership changes

    def sync(self, role: WorkerRole, instances: Iterable[Instance]) -> None:
        wanted = set(instances)
        for key in [k for k in self._records if k[0] == role and k[1] not in wanted]:
            del self._records[key]
            self._sorted = None
        for instance in wanted:
            if (role, instance) not in self._records:
                self._records[(role, instance)] = InstanceRecord(role, instance)
                self._sorted = None

    def records(self) -> list[InstanceRecord]:
        """Sorted by role then address (the order /instances shows)."""
        if self._sorted is None:
            self._sorted = sorted(
                self._records.values(), key=lambda r: (r.role, address_key(r.instance))
            )
        return list(self._sorted)
