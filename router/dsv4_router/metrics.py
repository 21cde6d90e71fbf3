"""The router's Prometheus metrics, in a registry of its own (never the process-global one).

`dsv4_router_instances{role,state}` is computed at scrape time from the instance table, so it
can never disagree with `/ready` and `/instances` (of the process that answers the scrape).

NOTE (several router processes, `processes`): the counters and the histogram live in
`SharedCounts`, one row of doubles per process in an anonymous shared mapping made before the
fork. Each process writes only its own row; a scrape, answered by any of them, sums the rows,
so the counters are the router's whole and never go back.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dsv4_common.api.names import WORKER_ROLES
from dsv4_router.choice import (
    METRIC_STATES,
    SHED_REASONS,
    InstanceRecord,
    ShedReason,
    assess,
    metric_state,
)
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


# One row: the outcomes, the retries, the histogram's buckets (not cumulative; +Inf last), its
# sum, the sheds by reason.
_RETRIES: Final = len(OUTCOMES)
_BUCKETS: Final = _RETRIES + 1
_SUM: Final = _BUCKETS + len(FIRST_BYTE_BUCKETS_S) + 1
_SHED: Final = _SUM + 1
_ROW: Final = _SHED + len(SHED_REASONS)
_DOUBLE: Final = 8


class SharedCounts:
    """The counters of `processes` router processes, one row each, in memory every process
    forked after this is made shares (a private copy with one process)."""

    def __init__(self, processes: int = 1) -> None:
        if processes < 1:
            raise ValueError(f"processes={processes} must be >= 1")
        self.processes = processes
        # anonymous, shared on fork: the counter rows, then one "sees a pair" cell per process
        self._map = mmap.mmap(-1, processes * (_ROW + 1) * _DOUBLE)
        cells: memoryview[float] = memoryview(self._map).cast("d")
        self._values = cells[: processes * _ROW]
        self._ready = cells[processes * _ROW :]

    def row(self, process: int) -> memoryview[float]:
        """The row process `process` (0-based) writes."""
        if not 0 <= process < self.processes:
            raise ValueError(f"process {process} outside 0..{self.processes - 1}")
        return self._values[process * _ROW : (process + 1) * _ROW]

    def totals(self) -> list[float]:
        """Each column summed over the processes."""
        values = self._values
        return [sum(values[i::_ROW]) for i in range(_ROW)]

    def set_ready(self, process: int, ready: bool) -> None:
        """Whether process `process` saw a ready pair in its last discovery round."""
        self._ready[process] = 1.0 if ready else 0.0

    def all_ready(self) -> bool:
        """Every process saw a ready pair (a process yet to finish a round has not)."""
        return all(cell == 1.0 for cell in self._ready)


class _CountsCollector:
    def __init__(self, counts: SharedCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Any]:
        totals = self._counts.totals()
        requests = CounterMetricFamily(
            "dsv4_router_requests", "Client requests by outcome", labels=["outcome"]
        )
        for i, outcome in enumerate(OUTCOMES):
            requests.add_metric([outcome], totals[i])
        yield requests
        yield CounterMetricFamily(
            "dsv4_router_retries",
            "Attempts on another pair after a pair failed before the first byte",
            value=totals[_RETRIES],
        )
        cumulative, buckets = 0.0, []
        for bound, count in zip(
            (*FIRST_BYTE_BUCKETS_S, float("inf")), totals[_BUCKETS:_SUM], strict=True
        ):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(
            "dsv4_router_upstream_first_byte_seconds",
            "From sending a request to a decode instance to its response headers",
            buckets=buckets,
            sum_value=totals[_SUM],
        )
        shed = CounterMetricFamily(
            "dsv4_router_shed_requests",
            "Requests answered 503 + Retry-After because no instance pair could take them",
            labels=["reason"],
        )
        for i, reason in enumerate(SHED_REASONS):
            shed.add_metric([reason], totals[_SHED + i])
        yield shed


class _Retries:
    __slots__ = ("_row",)

    def __init__(self, row: memoryview[float]) -> None:
        self._row = row

    def inc(self) -> None:
        self._row[_RETRIES] += 1


class _FirstByte:
    __slots__ = ("_row",)

    def __init__(self, row: memoryview[float]) -> None:
        self._row = row

    def observe(self, seconds: float) -> None:
        row = self._row
        row[_BUCKETS + bisect.bisect_left(FIRST_BYTE_BUCKETS_S, seconds)] += 1
        row[_SUM] += seconds


class RouterMetrics:
    def __init__(
        self,
        snapshot: Snapshot,
        liveness: LivenessRule,
        counts: SharedCounts | None = None,
        process: int = 0,
    ) -> None:
        """`counts`: shared with the router's other processes (this one writes row
        `process`); None: this process's own."""
        self.registry = CollectorRegistry()
        counts = counts if counts is not None else SharedCounts()
        self._counts, self._process = counts, process
        self._row = counts.row(process)
        self._outcome_index = {outcome: i for i, outcome in enumerate(OUTCOMES)}
        self.retries = _Retries(self._row)
        self.first_byte_s = _FirstByte(self._row)
        self.registry.register(_CountsCollector(counts))
        self.registry.register(_InstancesCollector(snapshot, liveness))

    def count(self, outcome: Outcome) -> None:
        self._row[self._outcome_index[outcome]] += 1

    def shed(self, reason: ShedReason) -> None:
        """A 503 + Retry-After given because no pair could take the request, and why."""
        self._row[_SHED + SHED_REASONS.index(reason)] += 1

    def note_ready(self, ready: bool) -> None:
        """This process's view after a discovery round (shared with the other processes)."""
        self._counts.set_ready(self._process, ready)

    def every_process_ready(self) -> bool:
        """/ready's rule with several processes: a client's connection may land on any one."""
        return self._counts.all_ready()

    def render(self) -> bytes:
        text: bytes = generate_latest(self.registry)
        return text
