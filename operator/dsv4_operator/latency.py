"""Latency figures for autoscaling targets, from the workers' /metrics histograms
(`dsv4_time_to_first_token_seconds`, `dsv4_inter_token_latency_seconds`): the percentile of
what was observed since a snapshot at least `window_s` old, over a role's pods. The one piece
of autoscaling memory kept in the operator's process, not in status (a restarted operator
starts a new window: the latency targets wait one window before they count). No network: the
probe fetches the text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

from dsv4_common.api.load_figures import (
    ITL_HISTOGRAM,
    TTFT_HISTOGRAM,
    Buckets,
    Latency,
    bucket_delta,
    histogram_buckets,
    merge_buckets,
    quantile,
)
from dsv4_common.api.names import WorkerRole
from dsv4_operator.observe import PodState

DEFAULT_WINDOW_S: Final = 15.0


@runtime_checkable
class MetricsProbe(Protocol):
    def metrics(self, pods: Sequence[PodState]) -> dict[str, str]:
        """Prometheus text of each pod's /metrics, by pod name; pods that do not answer are
        left out."""
        ...


@dataclass(slots=True)
class _Snapshot:
    at_s: float
    buckets: dict[tuple[str, str], Buckets]  # (pod, histogram) -> cumulative buckets


@dataclass(slots=True)
class LatencyTracker:
    window_s: float = DEFAULT_WINDOW_S
    _snapshots: dict[tuple[str, str, WorkerRole], _Snapshot] = field(default_factory=dict)
    _last: dict[tuple[str, str, WorkerRole], Latency] = field(default_factory=dict)

    def update(
        self,
        deployment: tuple[str, str],
        role: WorkerRole,
        texts: Mapping[str, str],
        percentile: int,
        now_s: float,
    ) -> Latency | None:
        """The role's latency at `percentile` over the last window (None until one has
        passed); `texts` the /metrics of its serving pods now."""
        key = (*deployment, role)
        now = {
            (pod, name): histogram_buckets(text, name)
            for pod, text in texts.items()
            for name in (TTFT_HISTOGRAM, ITL_HISTOGRAM)
        }
        before = self._snapshots.get(key)
        if before is None:
            self._snapshots[key] = _Snapshot(now_s, now)
            return None
        for series, buckets in now.items():
            # A pod seen for the first time (a new group) starts its window now: what it
            # observed before is not this window's.
            before.buckets.setdefault(series, buckets)
        if now_s - before.at_s < self.window_s:
            return self._last.get(key)
        q = percentile / 100

        def figure(name: str) -> float | None:
            deltas = [
                bucket_delta(b, before.buckets[(pod, hist)])
                for (pod, hist), b in now.items()
                if hist == name
            ]
            return quantile(merge_buckets(deltas), q)

        latency = Latency(figure(TTFT_HISTOGRAM), figure(ITL_HISTOGRAM))
        self._snapshots[key] = _Snapshot(now_s, now)
        self._last[key] = latency
        return latency

    def forget(self, deployment: tuple[str, str]) -> None:
        for store in (self._snapshots, self._last):
            for key in [k for k in store if k[:2] == deployment]:
                del store[key]
