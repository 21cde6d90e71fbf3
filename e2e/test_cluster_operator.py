"""On a real cluster with the chart installed (e2e/kind.sh): the API server enforces the CRD
(including its CEL rules, which CI can only interpret offline), and the tiny model deployed in
CPU mode becomes Ready, answers a completion through the router, and is garbage-collected.

Environment: KUBECONFIG (required); DSV4_E2E_TIMEOUT_S (default 900).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import cluster_support
import pytest
import yaml
from repo_paths import SAMPLES, TOOLS_BIN

pytestmark = pytest.mark.cluster

TIMEOUT_S = int(os.environ.get("DSV4_E2E_TIMEOUT_S", "900"))


def kubectl_path() -> str | None:
    local = TOOLS_BIN / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


OWNED_KINDS = (
    "statefulsets,deployments,services,configmaps,poddisruptionbudgets,networkpolicies,"
    "serviceaccounts,pods"
)


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    kubectl_bin = kubectl_path()
    assert kubectl_bin is not None
    result = subprocess.run(
        [kubectl_bin, *args], input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
    return result.stdout + result.stderr


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"dsv4-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)


def get_cr(ns: str, name: str) -> dict[str, Any]:
    return json.loads(kubectl("get", "dsv4", name, "-n", ns, "-o", "json"))  # type: ignore[no-any-return]


def wait_condition(ns: str, name: str, ctype: str, status: str) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        cr = get_cr(ns, name)
        for cond in cr.get("status", {}).get("conditions", []):
            if cond["type"] == ctype and cond["status"] == status:
                return cr
        time.sleep(3)
    raise AssertionError(f"{ctype}={status} not reached: {json.dumps(cr.get('status'))}")


@contextlib.contextmanager
def port_forward(ns: str, service: str, port: int) -> Iterator[int]:
    kubectl_bin = kubectl_path()
    assert kubectl_bin is not None
    with cluster_support.port_forward(kubectl_bin, ns, service, port) as local:
        yield local


def owned_by(ns: str, uid: str) -> list[str]:
    items = json.loads(kubectl("get", OWNED_KINDS, "-n", ns, "-o", "json"))["items"]
    return [
        f"{i['kind']}/{i['metadata']['name']}"
        for i in items
        if any(ref["uid"] == uid for ref in i["metadata"].get("ownerReferences", []))
    ]


@pytest.mark.parametrize("path", sorted((SAMPLES / "invalid").glob("*.yaml")), ids=lambda p: p.name)
def test_api_server_rejects_invalid_sample(path: Path, namespace: str) -> None:
    expected = next(
        line.split(":", 1)[1].strip()
        for line in path.read_text().splitlines()
        if line.startswith("# expect:")
    )
    out = kubectl(
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-n",
        namespace,
        "-f",
        str(path),
        check=False,
    )
    assert "created (server dry run)" not in out, out
    assert expected in out, out


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_api_server_accepts_valid_sample(path: Path, namespace: str) -> None:
    out = kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", str(path)
    )
    assert "(server dry run)" in out


def test_context_that_cannot_fit_is_reported_before_any_pod(namespace: str) -> None:
    cr = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    cr["metadata"]["name"] = "too-long"
    cr["spec"]["maxContextTokens"] = 16777216
    kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(cr))
    got = wait_condition(namespace, "too-long", "ContextFits", "False")
    assert got["status"]["maxContextTokens"] < 16777216
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    assert pods == []


def test_tiny_cpu_serves_a_completion_and_is_cleaned_up(namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", str(SAMPLES / "tiny-cpu.yaml"))
    cr = wait_condition(namespace, "tiny", "Ready", "True")
    status = cr["status"]
    assert status["observedGeneration"] == cr["metadata"]["generation"]
    assert status["roles"]["prefill"]["ready"] == "1/1"
    # endpoint: http://<router service>.<namespace>.svc:<port>
    endpoint = urlparse(status["endpoint"])
    service = (endpoint.hostname or "").split(".")[0]
    with port_forward(namespace, service, endpoint.port or 80) as local:
        body = json.dumps({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{local}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as rsp:
            answer = json.load(rsp)
    assert answer["choices"][0]["text"] is not None
    assert answer["usage"]["completion_tokens"] >= 1

    uid = cr["metadata"]["uid"]
    assert owned_by(namespace, uid), "no owned children found"
    kubectl("delete", "dsv4", "tiny", "-n", namespace, "--wait=true", f"--timeout={TIMEOUT_S}s")
    deadline = time.monotonic() + TIMEOUT_S
    while (left := owned_by(namespace, uid)) and time.monotonic() < deadline:
        time.sleep(3)
    assert left == []


def group_pods(ns: str, group: str) -> dict[str, str]:
    """name -> uid of the live pods of one PP group."""
    items = json.loads(
        kubectl("get", "pods", "-n", ns, "-l", f"serving.dsv4.io/group={group}", "-o", "json")
    )["items"]
    return {
        i["metadata"]["name"]: i["metadata"]["uid"]
        for i in items
        if not i["metadata"].get("deletionTimestamp")
    }


def test_killing_one_pp_rank_restarts_its_whole_group(namespace: str) -> None:
    """prefill PP=2: deleting rank 1 alone must replace rank 0 too (one pipeline, one unit)."""
    kubectl("apply", "-n", namespace, "-f", str(SAMPLES / "tiny-cpu.yaml"))
    wait_condition(namespace, "tiny", "Ready", "True")
    group = "tiny-prefill-0"
    before = group_pods(namespace, group)
    assert sorted(before) == [f"{group}-0", f"{group}-1"]
    kubectl("delete", "pod", f"{group}-1", "-n", namespace, "--wait=false")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        now = group_pods(namespace, group)
        if len(now) == 2 and not set(now.values()) & set(before.values()):
            break
        time.sleep(2)
    else:
        raise AssertionError(f"group {group} was not restarted as a unit: {now} vs {before}")
    wait_condition(namespace, "tiny", "Ready", "True")
