"""On a real cluster with the chart installed (e2e/kind.sh): an hf:// source. The operator
resolves the revision, creates the RWX cache claim and one download Job for two DSV4Deployments
of the model, `kubectl get dsv4` shows the WEIGHTS column, the Job completes (its pod ran
`dsv4 fetch` in the worker image), both deployments become Ready with their pods mounting the
claim read-only, and the Job and claim are garbage-collected with the last deployment.

Opt-in (`-m cluster`), and it needs a hub the cluster's pods and the operator can reach:
- DSV4_E2E_HUB_HOST: an address of this machine the pods reach (kind: the docker network's
  gateway, e.g. 172.18.0.1); the test serves the fake hub there with the tiny model; or
- DSV4_E2E_HF_SOURCE (e.g. hf://ORG/NAME@REV, a small DeepSeek-V4-shaped CPU model) with
  optional DSV4_E2E_HF_ENDPOINT (a mirror) and DSV4_E2E_HF_TOKEN (put in a Secret).
The cluster needs a default StorageClass that provisions ReadWriteMany claims (kind's
local-path provisioner does not: set DSV4_E2E_STORAGE_CLASS to one that does, e.g. an NFS
provisioner). Environment otherwise as test_cluster_operator.py.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import SAMPLES
from test_cluster_operator import TIMEOUT_S, get_cr, kubectl, namespace, wait_condition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fetch" / "tests"))
from fake_hub import FakeHub
from hub_models import tiny_files

pytestmark = pytest.mark.cluster
__all__ = ["namespace"]  # the fixture, shared with test_cluster_operator


@pytest.fixture
def source(tmp_path: Path) -> Iterator[tuple[str, str | None, str | None]]:
    """(hf:// source, endpoint, token) the cluster can reach."""
    if (given := os.environ.get("DSV4_E2E_HF_SOURCE")) is not None:
        yield given, os.environ.get("DSV4_E2E_HF_ENDPOINT"), os.environ.get("DSV4_E2E_HF_TOKEN")
        return
    host = os.environ.get("DSV4_E2E_HUB_HOST")
    if host is None:
        pytest.skip("set DSV4_E2E_HUB_HOST (an address the pods reach) or DSV4_E2E_HF_SOURCE")
    with FakeHub(tmp_path / "hub", host=host, cdn_host=host) as hub:
        hub.add_repo("e2e/tiny", tiny_files())
        yield "hf://e2e/tiny@main", hub.endpoint, None


def _cr(name: str, source: str, endpoint: str | None, token: bool) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    body["metadata"]["name"] = name
    model: dict[str, Any] = {"source": source}
    if endpoint is not None or token:
        model["hub"] = {}
        if endpoint is not None:
            model["hub"]["endpoint"] = endpoint
        if token:
            model["hub"]["tokenSecretRef"] = {"name": "hf-token"}
    if (storage_class := os.environ.get("DSV4_E2E_STORAGE_CLASS")) is not None:
        model["cache"] = {"storageClassName": storage_class}
    body["spec"]["model"] = model
    return body


def test_two_deployments_share_one_download_then_serve(
    namespace: str, source: tuple[str, str | None, str | None]
) -> None:
    uri, endpoint, token = source
    if token:
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            # Its owner opts it in as a hub token (the operator refuses it otherwise).
            "metadata": {"name": "hf-token", "labels": {"serving.dsv4.io/hub-token": "true"}},
            "data": {"HF_TOKEN": base64.b64encode(token.encode()).decode()},
        }
        kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(secret))
    for name in ("hf-a", "hf-b"):
        body = _cr(name, uri, endpoint, bool(token))
        kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(body))
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        table = kubectl("get", "dsv4", "-n", namespace)
        if "WEIGHTS" in table and "%" in table:
            break
        time.sleep(2)
    assert "WEIGHTS" in table, table
    for name in ("hf-a", "hf-b"):
        wait_condition(namespace, name, "WeightsReady", "True")
    a, b = get_cr(namespace, "hf-a"), get_cr(namespace, "hf-b")
    assert a["status"]["weights"]["key"] == b["status"]["weights"]["key"]
    assert a["status"]["weights"]["progress"] == "100%"
    jobs = json.loads(kubectl("get", "jobs", "-n", namespace, "-o", "json"))["items"]
    assert len(jobs) == 1 and jobs[0]["status"].get("succeeded") == 1
    owners = {r["uid"] for r in jobs[0]["metadata"]["ownerReferences"]}
    assert owners == {a["metadata"]["uid"], b["metadata"]["uid"]}
    for name in ("hf-a", "hf-b"):
        wait_condition(namespace, name, "Ready", "True")
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    workers = [
        p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    claim = a["status"]["weights"]["claim"]
    for pod in workers:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["weights"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
    # The last user gone, the garbage collector takes the Job and the claim.
    kubectl("delete", "dsv4", "hf-a", "hf-b", "-n", namespace, "--wait=true")
    while time.monotonic() < deadline:
        left = kubectl("get", "jobs,pvc", "-n", namespace, "-o", "name")
        if not left.strip():
            return
        time.sleep(3)
    raise AssertionError(f"left behind: {left}")
