"""The operator's autoscaler on the strict fake API server, with workers faked at the /status
level: `reconcile` on the official client (`ApiKube`) and the HTTP probe, the clock injected,
the test playing the StatefulSet controller, the garbage collector and the workers. A table of
load series -> the decode groups the operator runs after each reconcile, flapping input
included; every status it writes passes the CRD's schema (the fake validates it)."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from repo_paths import CRD_FILE
from support import crd_support as S
from support.fake_apiserver import FakeApiServer, load_crd
from support.live_operator import WORKER_IPS, Live
from support.status_servers import StatusServers

from dsv4_common.api.rank_config import parse_rank_config
from dsv4_common.api.worker_status import Load, WorkerStatus, build_worker_status
from dsv4_operator import labels as L
from dsv4_operator.kube_api import ApiKube
from dsv4_operator.latency import LatencyTracker
from dsv4_operator.metrics import OperatorMetrics
from dsv4_operator.probe import HttpWorkerProbe
from dsv4_operator.reconcile import ReconcileResult, reconcile

NS = "default"
T0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
SPEC = {
    "apiVersion": "serving.dsv4.io/v1alpha1",
    "kind": "DSV4Deployment",
    "metadata": {"name": "auto", "namespace": NS},
    "spec": {
        "model": {"preset": "tiny"},
        "maxContextTokens": 1024,
        "decode": {
            "maxRunningRequests": 8,
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "queueDepthPerReplica": 4,
                "kvUtilization": 0.8,
                "stabilizationWindowSeconds": 60,
                "cooldownSeconds": 30,
            },
        },
        "autoscaling": {"prefillDecodeRatio": {"min": 0.25, "max": 1}, "maxSkew": 1},
    },
}


@dataclass
class Cluster:
    server: FakeApiServer
    kube: ApiKube
    probe: HttpWorkerProbe
    live: Live  # its StatefulSet controller and kubelet (no operator runs here)

    latency: LatencyTracker | None = None

    def reconcile(self, at: datetime) -> ReconcileResult:
        body = self.server.get(L.API_VERSION, L.KIND, NS, "auto")
        assert body is not None
        return reconcile(body, self.kube, self.probe, clock=lambda: at, latency=self.latency)

    def play_controllers(self) -> None:
        """The StatefulSet controller and the garbage collector: pods for every StatefulSet,
        none for a deleted one; the new pods start Running and Ready."""
        sets = {s["metadata"]["name"] for s in self.server.list("apps/v1", "StatefulSet", NS)}
        for pod in self.server.list("v1", "Pod", NS):
            owner = pod["metadata"]["ownerReferences"][0]["name"]
            if owner not in sets:
                self.server.delete("v1", "Pod", NS, pod["metadata"]["name"])
        for name in self.live.create_pods():
            self.live.set_pod(name)

    def load(self, waiting_per_decode: int, used_slots: int = 0) -> None:
        """Every worker reports its planned capacity; each decode group `waiting_per_decode`
        requests queued and `used_slots` of its request slots taken."""
        cm = self.server.get("v1", "ConfigMap", NS, L.config_name("auto"))
        assert cm is not None
        for pod in self.server.list("v1", "Pod", NS, L.worker_selector("auto")):
            labels = pod["metadata"]["labels"]
            role, rank = labels[L.ROLE_LABEL], int(labels[L.POD_INDEX_LABEL])
            planned = parse_rank_config(yaml.safe_load(cm["data"][f"{role}-rank-{rank}.json"]))
            cap = planned.planned.capacity
            decode = role == "decode"
            load = Load(
                free_full_tokens=cap.full_tokens,
                free_swa_tokens=cap.swa_tokens,
                free_request_slots=cap.max_running_requests - (used_slots if decode else 0),
                running=used_slots if decode else 0,
                waiting=waiting_per_decode if decode else 0,
                accepting=True,
            )
            doc = WorkerStatus(
                role=role,
                pp_rank=rank,
                capacity=cap,
                kv_backend="nixl",
                kv_ready=True,
                kv_layout_hash="layout-1",
                load=load,
            )
            self.live.workers.docs[self.live.ips[pod["metadata"]["name"]]] = build_worker_status(
                doc
            )

    def groups(self, role: str) -> int:
        sets = self.server.list("apps/v1", "StatefulSet", NS, f"{L.ROLE_LABEL}={role}")
        return len(sets)

    def status(self) -> dict[str, Any]:
        body = self.server.get(L.API_VERSION, L.KIND, NS, "auto")
        assert body is not None
        return dict(body.get("status") or {})


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    workers = StatusServers(WORKER_IPS)
    server = FakeApiServer([load_crd(CRD_FILE)], namespaces=[NS], crd_admission=S.crd_admission)
    with server:
        config = kubernetes.client.Configuration()
        config.host = server.url
        with kubernetes.client.ApiClient(config) as api_client:
            server.create(dict(SPEC), keep_status=False)
            probe = HttpWorkerProbe(timeout_s=1.0, port=workers.port, http_port=workers.port)
            live = Live(server, workers, OperatorMetrics(), namespace=NS)
            yield Cluster(server, ApiKube(api_client, 5.0), probe, live)
    workers.close()


# (seconds after T0, queue per decode group, request slots used per decode group) -> decode
# groups after that reconcile. The StatefulSet controller runs between reconciles.
SERIES: list[tuple[int, int, int, int]] = [
    (0, 0, 0, 1),  # idle: minReplicas
    (10, 9, 0, 3),  # queue 9 on 1 group, 4 per group wanted: ceil(9/4) = 3 (prefill 1 allows 4)
    (20, 20, 8, 3),  # maxReplicas 3
    (30, 0, 2, 3),  # quiet: the window (60 s) keeps 3
    (40, 8, 2, 3),  # flapping input ...
    (50, 0, 0, 3),
    (60, 9, 8, 3),
    (70, 0, 0, 3),  # ... the replicas do not flap
    (140, 0, 0, 1),  # quiet for a window and the cooldown: down to the minimum at once
    (150, 0, 8, 1),  # request slots full (the binding pool), but within the cooldown (30 s)
    (160, 0, 7, 1),  # 7/8 = 0.875 is within 10% of the 0.8 target: no change
    (170, 0, 8, 2),  # 8/8: 1.0 / 0.8 on 1 group: 2
]


def test_a_load_series_scales_decode_without_flapping(cluster: Cluster) -> None:
    cluster.reconcile(T0 - timedelta(seconds=10))  # the children, before any pod
    decided = []
    changes = []
    for seconds, queue, slots, _ in SERIES:
        cluster.play_controllers()
        cluster.load(queue, slots)
        result = cluster.reconcile(T0 + timedelta(seconds=seconds))
        changes += [(seconds, c.role, c.reason, c.before, c.after) for c in result.scale_changes]
        decided.append(cluster.groups("decode"))
        entry = cluster.status()["autoscaling"]["decode"]
        assert entry["replicas"] == decided[-1]
    assert decided == [n for *_, n in SERIES]
    assert changes == [
        (10, "decode", "ScaledUp", 1, 3),
        (140, "decode", "ScaledDown", 3, 1),
        (170, "decode", "ScaledUp", 1, 2),
    ]
    entry = cluster.status()["autoscaling"]["decode"]
    assert entry["figures"]["bindingPool"] == "req_slots"
    assert entry["figures"]["kvUtilization"] == pytest.approx(1.0)
    assert "KV utilisation" in entry["message"] and entry["lastScaleTime"] == "2026-11-01T12:02:50Z"
    # The roles' readiness counts follow: decode 2 groups planned.
    assert cluster.status()["roles"]["decode"]["replicas"] == 2
    assert cluster.groups("prefill") == 1  # 1 prefill is within [0.25, 1] x 2 decode


def ttft_text(fast: int, slow: int) -> bytes:
    """A worker's TTFT histogram: `fast` answers under 0.1 s, `slow` between 1 and 2.5 s."""
    name = "dsv4_time_to_first_token_seconds"
    lines = [
        f'{name}_bucket{{le="0.1"}} {fast}',
        f'{name}_bucket{{le="1.0"}} {fast}',
        f'{name}_bucket{{le="2.5"}} {fast + slow}',
        f'{name}_bucket{{le="+Inf"}} {fast + slow}',
    ]
    return ("\n".join(lines) + "\n").encode()


def test_a_ttft_target_scales_from_the_histograms_of_the_last_window(cluster: Cluster) -> None:
    """TTFT p90 from the decode workers' /metrics (deltas over a 15 s window): 10 fast then
    10 slow answers put p90 in the slow bucket (about 2.2 s against a 1 s target on 1 group:
    3 groups); the first scrape only opens the window."""
    cluster.latency = LatencyTracker(window_s=15.0)
    cluster.server.delete(L.API_VERSION, L.KIND, NS, "auto")
    body = copy.deepcopy(SPEC)
    body["spec"]["decode"]["autoscaling"] = {"maxReplicas": 3, "ttftSeconds": 1.0}
    body["spec"]["autoscaling"] = {"engine": "operator"}
    cluster.server.create(body, keep_status=False)
    cluster.reconcile(T0 - timedelta(seconds=10))
    cluster.play_controllers()
    cluster.load(0)

    def serve_metrics(text: bytes) -> None:
        for pod in cluster.server.list("v1", "Pod", NS, f"{L.ROLE_LABEL}=decode"):
            cluster.live.workers.metrics[cluster.live.ips[pod["metadata"]["name"]]] = text

    serve_metrics(ttft_text(100, 0))
    cluster.reconcile(T0)  # the window opens: no latency figure yet
    assert "ttftSeconds" not in cluster.status()["autoscaling"]["decode"]["figures"]
    assert cluster.groups("decode") == 1
    serve_metrics(ttft_text(110, 10))  # since then: 10 fast, 10 slow
    result = cluster.reconcile(T0 + timedelta(seconds=20))
    entry = cluster.status()["autoscaling"]["decode"]
    assert entry["figures"]["ttftSeconds"] == pytest.approx(1.0 + 1.5 * (18 - 10) / 10)
    assert cluster.groups("decode") == 3
    (change,) = result.scale_changes
    assert "TTFT p90" in change.message
