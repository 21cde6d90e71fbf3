"""The operator's own Prometheus metrics, in a registry of its own (no process globals).

Reconciles: a counter by result (`ok`, `error`), a latency histogram and a counter of failures
by reason (the status problem, e.g. `InvalidSpec`, or the exception's type). Capacity, per
DSV4Deployment, role and PP rank: what the memory plan gives (tokens, requests, context and
the pages of each pool, comparable with the workers' `dsv4_kv_total_pages{pool}`) and what the
workers report on `/status` (least over replicas, as `status.plan[].observed`).

`capacity_series` maps a reconcile's outcome to gauge values purely; the collector keeps the
latest series per CR and yields them at scrape time, so `forget` drops a deleted CR's series.
The HTTP server that exposes the registry is started by `settings.on_startup`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dsv4_common.api.deployment import MemoryPlan
from dsv4_operator import labels as L
from dsv4_operator.capacity import CAPACITY_KEYS
from dsv4_operator.kube import KubeError
from dsv4_operator.reconcile import ReconcileResult

Result = Literal["ok", "error"]
RESULTS: Final[tuple[Result, ...]] = ("ok", "error")
RECONCILE_BUCKETS_S: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# Labels of every capacity series (`namespace` collides with the scrape target's own label:
# the chart's ServiceMonitor sets honorLabels so the CR's namespace wins).
RANK_LABELS: Final = ("namespace", "deployment", "role", "pp_rank")
# status.plan[] keys -> the suffix of the planned_* and observed_* gauges (the RankCapacity
# field's name).
CAPACITY_FIELDS: Final = {key: name for name, key in CAPACITY_KEYS.items()}
PLANNED_PREFIX: Final = "dsv4_operator_planned_"
OBSERVED_PREFIX: Final = "dsv4_operator_observed_"
PLANNED_PAGES: Final = "dsv4_operator_planned_kv_pages"  # + label `pool`: full | swa | req_slots
# An hf:// source's download, per CR (status.weights): bytes and files, `state` done | total.
WEIGHTS_BYTES: Final = "dsv4_operator_weights_bytes"
WEIGHTS_FILES: Final = "dsv4_operator_weights_files"
WEIGHTS_LABELS: Final = ("namespace", "deployment", "state")

# Every capacity gauge: name -> (help, label names).
CAPACITY_GAUGES: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    **{
        PLANNED_PREFIX + suffix: (f"Planned {suffix.replace('_', ' ')} per PP rank", RANK_LABELS)
        for suffix in CAPACITY_FIELDS.values()
    },
    PLANNED_PAGES: ("Planned usable units per pool and PP rank", (*RANK_LABELS, "pool")),
    **{
        OBSERVED_PREFIX + suffix: (
            f"Realized {suffix.replace('_', ' ')} per PP rank (workers' /status, least over "
            "replicas)",
            RANK_LABELS,
        )
        for suffix in CAPACITY_FIELDS.values()
    },
    WEIGHTS_BYTES: ("Bytes of an hf:// source's download, done and total", WEIGHTS_LABELS),
    WEIGHTS_FILES: ("Files of an hf:// source's download, done and total", WEIGHTS_LABELS),
}


class Series(NamedTuple):
    name: str  # a key of CAPACITY_GAUGES
    labels: tuple[str, ...]  # values, in the gauge's label order
    value: float


def capacity_series(
    namespace: str, name: str, memory: MemoryPlan | None, status: Mapping[str, Any]
) -> tuple[Series, ...]:
    """The capacity gauges of one CR: planned from the memory plan (none without one), observed
    from the status's plan entries. Pure."""
    if memory is None:
        return ()
    out: list[Series] = []
    for role in L.WORKER_ROLES:
        for rank in memory.role(role).ranks:
            key: tuple[str, ...] = (namespace, name, role, str(rank.pp_rank))
            planned = {k: getattr(rank.capacity, k) for k in CAPACITY_KEYS}
            out.extend(Series(PLANNED_PREFIX + k, key, v) for k, v in planned.items())
            pools = {
                "full": rank.pools.full_pages,
                "swa": rank.pools.swa_pages,
                "req_slots": rank.pools.request_slots,
            }
            out.extend(Series(PLANNED_PAGES, (*key, pool), v) for pool, v in pools.items())
    for entry in status.get("plan") or []:
        seen = entry.get("observed")
        if not seen:
            continue
        key = (namespace, name, str(entry["role"]), str(entry["ppRank"]))
        out.extend(  # a figure the engine does not report has no series
            Series(OBSERVED_PREFIX + suffix, key, seen[field])
            for field, suffix in CAPACITY_FIELDS.items()
            if field in seen
        )
    return tuple(out)


def weights_series(namespace: str, name: str, status: Mapping[str, Any]) -> tuple[Series, ...]:
    """The download gauges of one CR, from its status.weights (none without one). Pure."""
    weights = status.get("weights") or {}
    out = []
    for gauge, done, total in (
        (WEIGHTS_BYTES, "bytesDone", "bytesTotal"),
        (WEIGHTS_FILES, "filesDone", "filesTotal"),
    ):
        for state, key in (("done", done), ("total", total)):
            if isinstance(weights.get(key), int):
                out.append(Series(gauge, (namespace, name, state), weights[key]))
    return tuple(out)


def failure_reason(exc: BaseException) -> str:
    """The `reason` label of a reconcile that raised (a bounded set: exception types)."""
    if isinstance(exc, KubeError):
        return "KubeRetryable" if exc.retryable else "KubeError"
    return type(exc).__name__


class _CapacityCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], tuple[Series, ...]] = {}  # (namespace, name)

    def set(self, namespace: str, name: str, series: tuple[Series, ...]) -> None:
        with self._lock:
            self._series[(namespace, name)] = series

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._series.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            every = [s for series in self._series.values() for s in series]
        families = {
            gauge: GaugeMetricFamily(gauge, text, labels=labels)
            for gauge, (text, labels) in CAPACITY_GAUGES.items()
        }
        for s in every:
            families[s.name].add_metric(list(s.labels), s.value)
        yield from families.values()


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "dsv4_operator_reconciles", "Reconciles by result", ["result"], registry=r
        )
        for result in RESULTS:
            self.reconciles.labels(result)
        self.errors = Counter(
            "dsv4_operator_reconcile_errors",
            "Reconciles that failed or rejected the spec, by reason",
            ["reason"],
            registry=r,
        )
        self.duration = Histogram(
            "dsv4_operator_reconcile_duration_seconds",
            "Duration of one reconcile",
            buckets=RECONCILE_BUCKETS_S,
            registry=r,
        )
        self._capacity = _CapacityCollector()
        r.register(self._capacity)

    def reconciled(
        self, namespace: str, name: str, result: ReconcileResult, seconds: float
    ) -> None:
        """A reconcile returned: count it (an error when the spec was rejected) and replace the
        CR's capacity series."""
        self.duration.observe(seconds)
        if result.problem is None:
            self.reconciles.labels("ok").inc()
        else:
            self.reconciles.labels("error").inc()
            self.errors.labels(result.problem.reason).inc()
        series = capacity_series(namespace, name, result.memory, result.status)
        series += weights_series(namespace, name, result.status)
        self._capacity.set(namespace, name, series)

    def failed(self, exc: BaseException, seconds: float) -> None:
        """A reconcile raised (an API error, a bug); the CR's series stay as they were."""
        self.duration.observe(seconds)
        self.reconciles.labels("error").inc()
        self.errors.labels(failure_reason(exc)).inc()

    def forget(self, namespace: str, name: str) -> None:
        """The CR is gone: drop its capacity series."""
        self._capacity.forget(namespace, name)

    def render(self) -> bytes:
        text: bytes = generate_latest(self.registry)
        return text
