"""Prometheus metrics of one worker, in a registry of its own (no process globals).

Pool gauges are read from the runner's latest snapshot at scrape time, the queue's depth
from the runner's own count; counters and latency histograms are fed by the request handlers
(`dsv4_requests_shed_total{reason}`: requests answered 503 + Retry-After by admission, reasons
as in `admission.SHED_REASONS`). The threads' health is read at scrape time too
(`runner.Health`): `dsv4_engine_thread_deaths_total{thread}`, `dsv4_engine_serving` (0 once
`/live` fails) and `dsv4_engine_call_errors_total`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dsv4_worker.server.admission import SHED_REASONS, QueueView
from dsv4_worker.server.model_server_metrics import ModelServerCollector
from dsv4_worker.server.runner import Health, Snapshot

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _PoolCollector(Collector):
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        queue: Callable[[], QueueView] | None,
        max_queue_requests: int,
    ) -> None:
        self.snapshot = snapshot
        self.queue = queue
        self.max_queue_requests = max_queue_requests

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot()
        used = GaugeMetricFamily("dsv4_kv_used_pages", "Units in use per pool", labels=["pool"])
        total = GaugeMetricFamily("dsv4_kv_total_pages", "Usable units per pool", labels=["pool"])
        for u in snap.usage:
            used.add_metric([u.pool], u.used)
            total.add_metric([u.pool], u.total)
        yield used
        yield total
        for name, value in (
            ("running", snap.running),
            ("waiting", snap.waiting),
            ("retracted", snap.retracted),
        ):
            yield GaugeMetricFamily(f"dsv4_requests_{name}", f"Requests {name}", value=value)
        depth = self.queue().waiting if self.queue is not None else snap.waiting
        yield GaugeMetricFamily(
            "dsv4_queue_depth_requests", "Requests accepted and not yet scheduled", value=depth
        )
        yield GaugeMetricFamily(
            "dsv4_queue_limit_requests",
            "Bound of the queue (a request past it is shed)",
            value=self.max_queue_requests,
        )


class _HealthCollector(Collector):
    def __init__(self, health: Callable[[], Health]) -> None:
        self.health = health

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        health = self.health()
        deaths = CounterMetricFamily(
            "dsv4_engine_thread_deaths",
            "Threads of this worker that died (the worker fails /live: it must be restarted)",
            labels=["thread"],
        )
        for thread, count in health.deaths:
            deaths.add_metric([thread], count)
        yield deaths
        yield GaugeMetricFamily(
            "dsv4_engine_serving",
            "1 while the engine can serve, 0 once it never will again (/live fails)",
            value=int(health.serving),
        )
        yield CounterMetricFamily(
            "dsv4_engine_call_errors",
            "Calls on the engine thread that raised (each failed alone)",
            value=health.call_errors,
        )


class Metrics:
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        queue: Callable[[], QueueView] | None = None,
        max_queue_requests: int = 0,
        health: Callable[[], Health] = Health,
        *,
        model_name: str = "",
        page_size: int = 0,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(snapshot, queue, max_queue_requests))
        self.registry.register(_HealthCollector(health))
        # The Inference Extension's model-server protocol, under vLLM's names.
        self.registry.register(ModelServerCollector(snapshot, queue, model_name, page_size))
        r = self.registry
        self.shed = Counter(
            "dsv4_requests_shed", "Requests shed with 503 + Retry-After", ["reason"], registry=r
        )
        for reason in SHED_REASONS:
            self.shed.labels(reason)  # every reason is exported from the start, at 0
        self.prompt_tokens = Counter("dsv4_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("dsv4_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            "dsv4_requests_finished", "Finished requests", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "dsv4_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            "dsv4_inter_token_latency_seconds",
            "Time between tokens",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "dsv4_e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
