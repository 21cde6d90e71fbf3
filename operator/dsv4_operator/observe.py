"""What the operator observes: worker pods (as small frozen records), the router's readiness and
each worker's realized capacity: our workers' `/status` documents
(`dsv4_common.api.worker_status`), or SGLang's `/server_info` from PP rank 0 of each group
(`flavors.sglang.info`). The engine's flavor decides which (`EngineFlavor.observe`). Pure:
`probe.HttpWorkerProbe` fetches the documents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.worker_status import WorkerStatus, parse_worker_status
from dsv4_operator import labels as L
from dsv4_operator.flavors.sglang.info import ServerInfo


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
class Observed:
    pods: tuple[PodState, ...] = ()
    reports: Mapping[str, WorkerStatus] = field(default_factory=dict)  # by pod name
    router_ready_replicas: int = 0
    # Engine sglang: /server_info of each group's PP rank 0, by pod name; and the pods whose
    # document could not be read as one, with why.
    server_info: Mapping[str, ServerInfo] = field(default_factory=dict)
    unreadable: Mapping[str, str] = field(default_factory=dict)


class WorkerProbe(Protocol):
    def fetch(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        """Raw /status documents by pod name; pods that do not answer are left out."""
        ...

    def server_info(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        """Raw SGLang /server_info documents of the PP rank 0 pods, by pod name; pods that do
        not answer are left out."""
        ...

    def progress(self, ip: str) -> Mapping[str, Any] | None:
        """A download Job pod's GET /progress document (`dsv4_operator.weights`); None when it
        does not answer."""
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


def parse_report(doc: Mapping[str, Any]) -> WorkerStatus | None:
    """A worker's status document, or None when it is malformed (treated as not reporting)."""
    try:
        return parse_worker_status(doc)
    except DocumentError:
        return None


def parse_reports(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, WorkerStatus]:
    return {name: r for name, doc in raw.items() if (r := parse_report(doc)) is not None}
