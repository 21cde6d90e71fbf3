"""The model-server protocol's metrics of the Gateway API Inference Extension (what a stock
endpoint picker scrapes: docs/proposals/003-model-server-protocol), under vLLM's names, as
aliases of the worker's own gauges (docs/operator.md, "Gateway API Inference Extension"):

    protocol metric        name here                     ours
    TotalQueuedRequests    vllm:num_requests_waiting     dsv4_queue_depth_requests
    TotalRunningRequests   vllm:num_requests_running     dsv4_requests_running
    KVCacheUtilization     vllm:kv_cache_usage_perc      the BINDING pool's used fraction (0..1):
                                                         the fullest of full, swa and req_slots
    BlockSize, NumGPUBlocks vllm:cache_config_info       page_size, full pages (labels; value 1)
    LoRA adapters          vllm:lora_requests_info       max_lora 0, no adapters (we serve none)

A DSV4 rank is full when any one of its three pools is: reporting the full pool alone (what
vLLM's figure means) would let a picker send work to a worker whose SWA or request-state pool
is exhausted. Pure reads of the runner's snapshot at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dsv4_worker.server.admission import QueueView
from dsv4_worker.server.runner import Snapshot

MODEL_LABEL = "model_name"


def binding_fraction(snap: Snapshot) -> float:
    """The used fraction of the fullest pool (0 when there is none)."""
    return max((u.fraction for u in snap.usage), default=0.0)


class ModelServerCollector(Collector):
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        queue: Callable[[], QueueView] | None,
        model_name: str = "",
        page_size: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.snapshot = snapshot
        self.queue = queue
        self.model_name = model_name
        self.page_size = page_size
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot()
        waiting = self.queue().waiting if self.queue is not None else snap.waiting
        model = [self.model_name]
        for name, doc, value in (
            ("vllm:num_requests_waiting", "Requests waiting (dsv4_queue_depth_requests)", waiting),
            ("vllm:num_requests_running", "Requests running (dsv4_requests_running)", snap.running),
            (
                "vllm:kv_cache_usage_perc",
                "Used fraction of the binding KV pool (full, SWA or request state; 1 = full)",
                binding_fraction(snap),
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=[MODEL_LABEL])
            family.add_metric(model, value)
            yield family
        full = next((u.total for u in snap.usage if u.pool == "full"), 0)
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache configuration (labels): page size in tokens, full-pool pages",
            labels=["block_size", "num_gpu_blocks"],
        )
        config.add_metric([str(self.page_size), str(full)], 1)
        yield config
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters (none are served): the time of this report",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], self.clock())
        yield lora
