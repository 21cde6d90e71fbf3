"""In-memory stand-ins for the reconciler's two ports: `FakeKube` (the `Kube` protocol, recording
every write, plus the StatefulSet/Deployment controllers' and the kubelet's part) and
`FakeProbe` (the workers' `GET :8081/status`, SGLang's `GET :8080/server_info`)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from support.fake_apiserver import selector_matches

from dsv4_common.api import RankCapacity
from dsv4_common.api.rank_config import parse_rank_config
from dsv4_common.api.worker_status import WorkerStatus, build_worker_status
from dsv4_operator import labels as L
from dsv4_operator.observe import PodState

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name
_uids = itertools.count(1)


def _matches(obj: Mapping[str, Any], selector: str) -> bool:
    return selector_matches(selector, obj.get("metadata", {}).get("labels") or {})


def conditions(kube: FakeKube) -> dict[str, dict[str, Any]]:
    """The CR's status conditions by type."""
    return {c["type"]: c for c in kube.cr["status"]["conditions"]}


class FakeKube:
    """Objects keyed by (apiVersion, kind, namespace, name). Apply replaces what the field
    manager owns (the whole object here) and keeps server-set metadata and status."""

    def __init__(self, cr: dict[str, Any]) -> None:
        self.cr = cr
        self.cr_deleted = False
        self.objects: dict[Key, dict[str, Any]] = {}
        self.writes: list[tuple[str, ...]] = []
        self.clock = itertools.count(1)

    # --- the Kube protocol -------------------------------------------------------------------
    def apply(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        key = (obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        new = copy.deepcopy(dict(obj))
        old = self.objects.get(key)
        new["metadata"]["uid"] = old["metadata"]["uid"] if old else f"uid-{next(_uids)}"
        if old and "status" in old:
            new["status"] = old["status"]
        self.objects[key] = new
        self.writes.append(("apply", obj["kind"], meta["name"]))

    def create(self, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        key = (obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if key in self.objects:
            return False
        self.apply(obj)
        self.writes[-1] = ("create", obj["kind"], meta["name"])
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        cr_meta = self.cr.get("metadata", {})
        if (api_version, kind, namespace, name) == (
            L.API_VERSION,
            L.KIND,
            cr_meta.get("namespace"),
            cr_meta.get("name"),
        ):
            return None if self.cr_deleted else copy.deepcopy(self.cr)
        obj = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        cr_meta = self.cr.get("metadata", {})
        if (api_version, kind, namespace) == (L.API_VERSION, L.KIND, cr_meta.get("namespace")):
            return [] if self.cr_deleted else [copy.deepcopy(self.cr)]
        return [
            copy.deepcopy(o)
            for (av, k, ns, _), o in sorted(self.objects.items())
            if (av, k, ns) == (api_version, kind, namespace) and _matches(o, selector)
        ]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((api_version, kind, namespace, name), None)
        self.writes.append(("delete", kind, name))
        if kind == "StatefulSet":  # the garbage collector: its pods go too
            group = f"{L.GROUP_LABEL}={name}"
            for key in [k for k, o in self.objects.items() if k[1] == "Pod" and _matches(o, group)]:
                del self.objects[key]

    def delete_pods(self, namespace: str, selector: str) -> None:
        for key in [k for k, o in self.objects.items() if k[1] == "Pod" and _matches(o, selector)]:
            del self.objects[key]
        self.writes.append(("delete_pods", selector))

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        status = self.cr.setdefault("status", {})
        for key, value in patch.items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = copy.deepcopy(value)
        self.writes.append(("patch_status", name))

    # --- what the cluster's controllers would do ---------------------------------------------
    def of_kind(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k[3]: o for k, o in self.objects.items() if k[1] == kind}

    def run_controllers(self, *, ready: bool = True) -> None:
        """StatefulSets get their pods (from the current template), the router gets ready."""
        for sts in self.of_kind("StatefulSet").values():
            ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
            template = sts["spec"]["template"]
            for index in range(sts["spec"]["replicas"]):
                key = ("v1", "Pod", ns, f"{name}-{index}")
                if key in self.objects:
                    continue
                tick = next(self.clock)
                self.objects[key] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": key[3],
                        "namespace": ns,
                        "uid": f"uid-{next(_uids)}",
                        "creationTimestamp": f"2026-01-01T00:00:{tick:02d}Z",
                        "labels": {**template["metadata"]["labels"], L.POD_INDEX_LABEL: str(index)},
                        "annotations": dict(template["metadata"].get("annotations", {})),
                    },
                    "status": {},
                }
        for pod in self.of_kind("Pod").values():
            if ready:
                self.set_pod(pod["metadata"]["name"], ready=True)
        for dep in self.of_kind("Deployment").values():
            dep["status"] = {"readyReplicas": dep["spec"]["replicas"] if ready else 0}

    def set_pod(
        self, name: str, *, ready: bool = True, restarts: int = 0, phase: str = "Running"
    ) -> None:
        pod = self.of_kind("Pod")[name]
        created = pod["metadata"]["creationTimestamp"]
        pod["status"] = {
            "phase": phase,
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [
                {
                    "name": "worker",
                    "restartCount": restarts,
                    "state": {"running": {"startedAt": created.replace("00:00:", "00:01:")}},
                }
            ],
        }

    def writes_since(self, mark: int) -> list[tuple[str, ...]]:
        return self.writes[mark:]


class FakeProbe:
    """Worker status documents by pod name (what GET :8081/status would return), and SGLang's
    /server_info documents by pod name (GET :8080/server_info on PP rank 0)."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.infos: dict[str, dict[str, Any]] = {}
        self.progress_docs: dict[str, dict[str, Any]] = {}  # by pod IP: GET :8081/progress

    def progress(self, ip: str) -> Mapping[str, Any] | None:
        return self.progress_docs.get(ip)

    def fetch(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        return {p.name: self.docs[p.name] for p in pods if p.name in self.docs}

    def server_info(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        return {p.name: self.infos[p.name] for p in pods if p.name in self.infos}

    def report_planned(self, kube: FakeKube, *, backend: str = "nixl", scale: float = 1.0) -> None:
        """Every worker reports the capacity its ConfigMap planned (times `scale`)."""
        cm = next(iter(kube.of_kind("ConfigMap").values()))
        for pod in kube.of_kind("Pod").values():
            labels = pod["metadata"]["labels"]
            role, rank = labels[L.ROLE_LABEL], int(labels[L.POD_INDEX_LABEL])
            config = parse_rank_config(yaml.safe_load(cm["data"][f"{role}-rank-{rank}.json"]))
            planned = config.planned
            self.docs[pod["metadata"]["name"]] = build_worker_status(
                WorkerStatus(
                    role=role,
                    pp_rank=rank,
                    capacity=RankCapacity(
                        full_tokens=int(planned.capacity.full_tokens * scale),
                        swa_tokens=int(planned.capacity.swa_tokens * scale),
                        max_running_requests=planned.capacity.max_running_requests,
                        max_context_tokens=int(planned.capacity.max_context_tokens * scale),
                    ),
                    kv_backend=backend,
                    kv_ready=True,
                    kv_layout_hash="abc",
                )
            )
