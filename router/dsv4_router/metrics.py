"""The router's Prometheus metrics, in a registry of its own (never the process-global one).

`dsv4_router_instances{role,state}` is computed at scrape time from the instance table, so it
can never disagree with `/ready` and `/instances`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dsv4_common.api.names import WORKER_ROLES
from dsv4_router.choice import METRIC_STATES, InstanceRecord, assess, metric_state
from dsv4_router.liveness import LivenessRule

Outcome = Literal["ok", "client_error", "upstream_error", "unavailable", "aborted"]
OUTCOMES: Final[tuple[Outcome, ...]] = (
    "ok",
    "client_error",
    "upstream_error",
    "unavailable",
    "aborted",
)
# First byte = decode's headers = its first token, so the buckets reach long prefills.
FIRST_BYTE_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CONTENT_TYPE: Final[str] = CONTENT_TYPE_LATEST
# The records and the clock reading to judge them at.
Snapshot = Callable[[], tuple[list[InstanceRecord], float]]


class _InstancesCollector:
    def __init__(self, snapshot: Snapshot, liveness: LivenessRule) -> None:
        self._snapshot = snapshot
        self._liveness = liveness

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily(
            "dsv4_router_instances",
            "Instances the router knows, by role and state",
            labels=["role", "state"],
        )
        records, now_s = self._snapshot()
        counts = {(role, state): 0 for role in WORKER_ROLES for state in METRIC_STATES}
        for record in records:
            health, _ = assess(record, now_s, self._liveness)
            counts[(record.role, metric_state(health))] += 1
        for (role, state), count in counts.items():
            family.add_metric([role, state], count)
        yield family


class RouterMetrics:
    def __init__(self, snapshot: Snapshot, liveness: LivenessRule) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dsv4_router_requests",
            "Client requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self._by_outcome = {outcome: self.requests.labels(outcome) for outcome in OUTCOMES}
        self.retries = Counter(
            "dsv4_router_retries",
            "Attempts on another pair after a pair failed before the first byte",
            registry=self.registry,
        )
        self.first_byte_s = Histogram(
            "dsv4_router_upstream_first_byte_seconds",
            "From sending a request to a decode instance to its response headers",
            buckets=FIRST_BYTE_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_InstancesCollector(snapshot, liveness))

    def count(self, outcome: Outcome) -> None:
        self._by_outcome[outcome].inc()

    def render(self) -> bytes:
        text: bytes = generate_latest(self.registry)
        return text
