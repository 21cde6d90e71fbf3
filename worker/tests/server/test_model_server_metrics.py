"""The Gateway API Inference Extension's model-server protocol on the worker's /metrics: the
metric names its doc lists for vLLM (docs/proposals/003-model-server-protocol/README.md in
kubernetes-sigs/gateway-api-inference-extension: TotalQueuedRequests, TotalRunningRequests,
KVCacheUtilization, BlockSize/NumGPUBlocks, the LoRA info gauge and its three labels), parsed
back from the exposition text with prometheus_client's own parser, and KV utilisation as the
binding pool's fraction."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from dsv4_worker.mem.usage import PoolUsage
from dsv4_worker.server.metrics import Metrics
from dsv4_worker.server.runner import Snapshot

# The protocol's table, the vLLM column (what a stock endpoint picker scrapes by default).
QUEUED = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_UTILIZATION = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"  # labels block_size, num_gpu_blocks
LORA_INFO = "vllm:lora_requests_info"  # labels max_lora, running_lora_adapters, waiting_...
LORA_LABELS = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}


def scrape(snapshot: Snapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    metrics = Metrics(lambda: snapshot, model_name="tiny", page_size=16)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_the_protocol_metrics_are_there_under_vllm_names() -> None:
    snap = Snapshot(
        usage=(PoolUsage("full", 30, 100), PoolUsage("swa", 45, 50), PoolUsage("req_slots", 2, 8)),
        running=2,
        waiting=5,
    )
    got = scrape(snap)
    assert got[QUEUED] == [({"model_name": "tiny"}, 5.0)]
    assert got[RUNNING] == [({"model_name": "tiny"}, 2.0)]
    # The SWA pool binds (45/50), not the full pool vLLM's figure would report (30/100).
    assert got[KV_UTILIZATION] == [({"model_name": "tiny"}, 0.9)]
    assert got[CACHE_INFO] == [({"block_size": "16", "num_gpu_blocks": "100"}, 1.0)]
    ((labels, stamp),) = got[LORA_INFO]
    assert set(labels) == LORA_LABELS and labels["max_lora"] == "0" and stamp > 0
    # Our own names stay: the aliases are additions.
    assert got["dsv4_requests_waiting"] == [({}, 5.0)]


def test_an_idle_worker_reports_zero_utilisation_and_the_request_state_pool_can_bind() -> None:
    assert scrape(Snapshot())[KV_UTILIZATION] == [({"model_name": "tiny"}, 0.0)]
    snap = Snapshot(usage=(PoolUsage("full", 1, 100), PoolUsage("req_slots", 8, 8)), running=8)
    assert scrape(snap)[KV_UTILIZATION] == [({"model_name": "tiny"}, 1.0)]
