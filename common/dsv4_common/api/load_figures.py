"""A role's load figures, the autoscaling decision's input, from what its workers report: each
rank's `/status` (`worker_status`) and, for latency targets, its `/metrics` histograms. Pure.

KV utilisation means the BINDING pool's: a DSV4 rank holds three pools at once and is full
when any one is, so a rank's figure is the largest of

    pool        used fraction                                   (its /status figures)
    full        1 - free_full_tokens / capacity.full_tokens     every token of every request
    swa         1 - free_swa_tokens / capacity.swa_tokens       the window of every request
    req_slots   1 - free_request_slots / max_running_requests   request-scoped (compressed) state

A PP group is as full as its fullest rank; a role's figure is the mean over its groups (the
router spreads load over them), and `binding_pool` names the pool of its fullest group.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from dsv4_common.api.scaling import RoleFigures
from dsv4_common.api.worker_status import Load, WorkerStatus

POOLS: Final = ("full", "swa", "req_slots")
TTFT_HISTOGRAM: Final = "dsv4_time_to_first_token_seconds"
ITL_HISTOGRAM: Final = "dsv4_inter_token_latency_seconds"
_BUCKET: Final = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)"
)
_LE: Final = re.compile(r'le="(?P<le>[^"]+)"')

# Cumulative bucket counts by upper bound (`le`), +Inf last.
Buckets = tuple[tuple[float, float], ...]


def reports_load(status: WorkerStatus) -> bool:
    """Whether the rank reported its load (`Load()`, the defaults, is a rank that reports
    none: an older worker, or one not started)."""
    return status.load != Load()


def pool_utilization(status: WorkerStatus) -> dict[str, float]:
    """Each pool's used fraction on one rank (pools it does not have are left out; none for a
    rank that reports no load)."""
    if not reports_load(status):
        return {}
    cap, load = status.capacity, status.load
    out: dict[str, float] = {}
    for pool, total, free in (
        ("full", cap.full_tokens, load.free_full_tokens),
        ("swa", cap.swa_tokens, load.free_swa_tokens),
        ("req_slots", cap.max_running_requests, load.free_request_slots),
    ):
        if total > 0:
            out[pool] = min(1.0, max(0.0, 1 - free / total))
    return out


def binding(statuses: Iterable[WorkerStatus]) -> tuple[float, str] | None:
    """(utilisation, pool) of the fullest pool over these ranks (one group), or None."""
    best: tuple[float, str] | None = None
    for status in statuses:
        for pool, used in pool_utilization(status).items():
            if best is None or used > best[0]:
                best = (used, pool)
    return best


@dataclass(frozen=True, slots=True)
class Latency:
    ttft_s: float | None = None
    inter_token_latency_s: float | None = None


def role_figures(
    groups: Mapping[str, Sequence[WorkerStatus]], latency: Latency | None = None
) -> RoleFigures | None:
    """The figures of a role whose groups (by name) reported these ranks; None if none did."""
    reporting = {g: s for g, s in groups.items() if any(reports_load(r) for r in s)}
    if not reporting:
        return None
    per_group = {g: binding(s) for g, s in reporting.items()}
    known = [b for b in per_group.values() if b is not None]
    queue = sum(max(s.load.waiting for s in statuses) for statuses in reporting.values())
    fullest = max(known, default=None)
    return RoleFigures(
        groups=len(reporting),
        queue_depth=queue,
        kv_utilization=sum(u for u, _ in known) / len(known) if known else None,
        binding_pool=fullest[1] if fullest is not None else None,
        ttft_s=latency.ttft_s if latency is not None else None,
        inter_token_latency_s=latency.inter_token_latency_s if latency is not None else None,
    )


def histogram_buckets(text: str, name: str) -> Buckets:
    """The cumulative buckets of histogram `name` in Prometheus text (summed over label sets
    other than `le`); () when it is absent."""
    counts: dict[float, float] = {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m is None or m["name"] != name or (le := _LE.search(m["labels"])) is None:
            continue
        try:
            bound, value = float(le["le"]), float(m["value"])
        except ValueError:
            continue
        counts[bound] = counts.get(bound, 0.0) + value
    return tuple(sorted(counts.items()))


def bucket_delta(now: Buckets, before: Buckets) -> Buckets:
    """What was observed between two scrapes (a restarted worker's counts start over: then
    all of `now`)."""
    old = dict(before)
    delta = tuple((b, c - old.get(b, 0.0)) for b, c in now)
    return now if any(c < 0 for _, c in delta) else delta


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile (0 < q < 1) of cumulative buckets, interpolated linearly inside its
    bucket as Prometheus' histogram_quantile does; None without observations. A quantile in
    the +Inf bucket is the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def merge_buckets(parts: Iterable[Buckets]) -> Buckets:
    """Several workers' buckets as one histogram (the same bounds summed)."""
    counts: dict[float, float] = {}
    for part in parts:
        for bound, count in part:
            counts[bound] = counts.get(bound, 0.0) + count
    return tuple(sorted(counts.items()))
