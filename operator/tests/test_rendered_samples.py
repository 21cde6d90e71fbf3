"""Every committed sample, rendered as scripts/checkov.sh renders it: the rules of checkov's
Kubernetes policies that we satisfy hold for every container of every pod the operator creates
(either engine, GPU and CPU, every sample), so a regression fails here and not only in the
opt-in scan. The rules we do not satisfy are explained in scripts/checkov-allowlist.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import checkov_scan

from dsv4_operator.objects import DesiredState
from dsv4_operator.quantities import quantity
from dsv4_operator.render import desired_state_for

SCAN = checkov_scan.load()
PATHS: list[Path] = SCAN.sample_paths()
Obj = dict[str, Any]


def _state(path: Path) -> DesiredState:
    body, model_config = SCAN.sample_input(path)
    state: DesiredState = desired_state_for(
        body, namespace=SCAN.SAMPLE_NAMESPACE, model_config=model_config
    )
    return state


STATES = {p.name: _state(p) for p in PATHS}


def _workloads(state: DesiredState) -> list[Obj]:
    """Every pod-bearing object, steady state and surge groups a roll may add."""
    surge = [o for g in state.surge_groups for o in g.objects]
    return [o for o in (*state.objects, *surge) if "template" in o.get("spec", {})]


def _containers(state: DesiredState) -> list[tuple[str, Obj]]:
    return [
        (f"{w['metadata']['name']}/{c['name']}", c)
        for w in _workloads(state)
        for c in w["spec"]["template"]["spec"]["containers"]
    ]


def test_every_sample_is_rendered() -> None:
    assert len(PATHS) >= 9 and all(_workloads(s) for s in STATES.values())
    names = {s.objects[0]["metadata"]["name"] for s in STATES.values()}
    assert len(names) == len(PATHS)  # one DSV4Deployment each


@pytest.mark.parametrize("sample", STATES)
def test_every_container_has_a_memory_limit_at_or_above_its_request(sample: str) -> None:
    """checkov CKV_K8S_12 / CKV_K8S_13. GPU workers (either engine) had none: a pod past its
    request was the first one the kubelet evicted, and an unbounded one could starve its node."""
    for where, container in _containers(STATES[sample]):
        resources = container.get("resources", {})
        request = quantity(resources.get("requests", {}).get("memory"))
        limit = quantity(resources.get("limits", {}).get("memory"))
        assert request is not None and limit is not None, where
        assert limit >= request > 0, where


@pytest.mark.parametrize("sample", STATES)
def test_every_container_requests_cpu(sample: str) -> None:
    """checkov CKV_K8S_10. GPU workers without a `resources.requests.cpu` in their CR had
    none (BestEffort CPU under contention)."""
    for where, container in _containers(STATES[sample]):
        cpu = quantity(container.get("resources", {}).get("requests", {}).get("cpu"))
        assert cpu is not None and cpu > 0, where


@pytest.mark.parametrize("sample", STATES)
def test_every_container_has_liveness_and_readiness_probes(sample: str) -> None:
    """checkov CKV_K8S_8 / CKV_K8S_9."""
    for where, container in _containers(STATES[sample]):
        assert "livenessProbe" in container and "readinessProbe" in container, where


@pytest.mark.parametrize("sample", STATES)
def test_every_pod_is_selected_by_a_network_policy(sample: str) -> None:
    """checkov CKV2_K8S_6."""
    state = STATES[sample]
    selectors = [
        o["spec"]["podSelector"]["matchLabels"]
        for o in state.objects
        if o["kind"] == "NetworkPolicy"
    ]
    for workload in _workloads(state):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(s.items() <= labels.items() for s in selectors), workload["metadata"]["name"]


@pytest.mark.parametrize("sample", STATES)
def test_every_pod_is_locked_down(sample: str) -> None:
    """checkov CKV_K8S_20/21/22/23/28/31/37/38/40: no privilege escalation, not in
    `default`, a read-only root, non-root with a high UID, no capabilities, the runtime's
    seccomp profile, no service account token."""
    state = STATES[sample]
    assert {o["metadata"]["namespace"] for o in state.objects} == {SCAN.SAMPLE_NAMESPACE}
    for workload in _workloads(state):
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] >= 10000
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
