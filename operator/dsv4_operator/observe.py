"""What the operator observes: worker pods (as small frozen records), the router's readiness and
each worker's self-reported realized capacity.

Worker status contract (`GET http://<pod-ip>:8081/status`, JSON, snake_case):
  {"role": "prefill", "pp_rank": 0,
   "capacity": {"full_tokens": int, "swa_tokens": int, "max_running_requests": int,
                "max_context_tokens": int},
   "kv_transfer": {"backend": "nixl", "ready": bool, "layout_hash": str}}
Parsing is pure; `HttpWorkerProbe` is the only network side effect here.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Protocol

from dsv4_operator import labels as L
from dsv4_operator.workerconfig import STATUS_PORT

PROBE_TIMEOUT_S: Final = 2.0
PROBE_THREADS: Final = 8


@dataclass(frozen=True, slots=True)
class PodState:
    name: str
    uid: str
    role: str  # prefill | decode
    group: str
    pp_rank: int | None
    phase: str
    ready: bool
    restart_count: int  # summed over containers
    deleting: bool
    template_hash: str | None
    created_at: datetime | None
    started_at: datetime | None  # earliest start of a currently running container
    ip: str | None


@dataclass(frozen=True, slots=True)
class WorkerReport:
    role: str
    pp_rank: int
    full_tokens: int
    swa_tokens: int
    max_running_requests: int
    max_context_tokens: int
    kv_backend: str | None
    kv_ready: bool
    kv_layout_hash: str | None


@dataclass(frozen=True, slots=True)
class Observed:
    pods: tuple[PodState, ...] = ()
    reports: Mapping[str, WorkerReport] = field(default_factory=dict)  # by pod name
    router_ready_replicas: int = 0


class WorkerProbe(Protocol):
    def fetch(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        """Raw status documents by pod name; pods that do not answer are left out."""
        ...


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def pod_state(pod: Mapping[str, Any]) -> PodState:
    meta = pod.get("metadata", {})
    labels = meta.get("labels", {}) or {}
    status = pod.get("status", {}) or {}
    containers = status.get("containerStatuses", []) or []
    conditions = status.get("conditions", []) or []
    starts = [
        t
        for c in containers
        if (t := _time(((c.get("state") or {}).get("running") or {}).get("startedAt"))) is not None
    ]
    index = labels.get(L.POD_INDEX_LABEL)
    return PodState(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=labels.get(L.ROLE_LABEL, ""),
        group=labels.get(L.GROUP_LABEL, ""),
        pp_rank=int(index) if isinstance(index, str) and index.isdigit() else None,
        phase=status.get("phase", "Pending"),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        restart_count=sum(int(c.get("restartCount", 0)) for c in containers),
        deleting=bool(meta.get("deletionTimestamp")),
        template_hash=(meta.get("annotations") or {}).get(L.TEMPLATE_HASH_ANNOTATION),
        created_at=_time(meta.get("creationTimestamp")),
        started_at=min(starts) if starts else None,
        ip=status.get("podIP"),
    )


def parse_report(doc: Mapping[str, Any]) -> WorkerReport | None:
    """A worker's status document, or None when it is malformed (treated as not reporting)."""
    try:
        capacity = doc["capacity"]
        kv = doc.get("kv_transfer") or {}
        report = WorkerReport(
            role=str(doc["role"]),
            pp_rank=int(doc["pp_rank"]),
            full_tokens=int(capacity["full_tokens"]),
            swa_tokens=int(capacity["swa_tokens"]),
            max_running_requests=int(capacity["max_running_requests"]),
            max_context_tokens=int(capacity["max_context_tokens"]),
            kv_backend=str(kv["backend"]) if kv.get("backend") else None,
            kv_ready=bool(kv.get("ready", False)),
            kv_layout_hash=str(kv["layout_hash"]) if kv.get("layout_hash") else None,
        )
    except (KeyError, TypeError, ValueError):
        return None
    return report


def parse_reports(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, WorkerReport]:
    return {name: r for name, doc in raw.items() if (r := parse_report(doc)) is not None}


class HttpWorkerProbe:
    """GETs each running worker's /status on its pod IP (the NetworkPolicy admits the operator
    on the status port only)."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S, port: int = STATUS_PORT) -> None:
        self.timeout_s = timeout_s
        self.port = port  # the rendered pods' status port; other values are for tests

    def _one(self, pod: PodState) -> tuple[str, Mapping[str, Any] | None]:
        url = f"http://{pod.ip}:{self.port}/status"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError):
            return pod.name, None
        return pod.name, doc if isinstance(doc, Mapping) else None

    def fetch(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        targets = [p for p in pods if p.ip and p.phase == "Running" and not p.deleting]
        if not targets:
            return {}
        with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(targets))) as pool:
            results = list(pool.map(self._one, targets))
        return {name: doc for name, doc in results if doc is not None}
