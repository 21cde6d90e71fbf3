"""The SGLang GPU variant (opt-in): on a real cluster with GPUs, the chart installed and the
DeepSeek-V4-Flash weights on a PersistentVolumeClaim, the engine-sglang CR becomes Ready without
worker reports (KVTransferReady Unknown), shows what SGLang realized next to the plan (from its
/server_info, within a page: CapacityMatchesPlan True), answers a completion through
sglang-router, and its children carry the rendered SGLang command lines.

Environment: KUBECONFIG (required, as for every `cluster` test); DSV4_E2E_SGLANG_PVC (required:
the PersistentVolumeClaim holding the weights; the test creates none); DSV4_E2E_NAMESPACE (where
that claim is and the CR goes; default dsv4-e2e); DSV4_E2E_SGLANG_PATH (the weights' mount path,
default /models/DeepSeek-V4-Flash); DSV4_E2E_GPU_TYPE (default h200); DSV4_E2E_TIMEOUT_S
(default 3600: SGLang loads the weights and compiles its kernels first).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import cluster_support
import pytest
import yaml
from repo_paths import ROOT, TOOLS_BIN

pytestmark = [pytest.mark.cluster, pytest.mark.gpu]

SAMPLE = ROOT / "e2e" / "sglang-flash-gpu.yaml"
TIMEOUT_S = int(os.environ.get("DSV4_E2E_TIMEOUT_S", "3600"))
NAMESPACE = os.environ.get("DSV4_E2E_NAMESPACE", "dsv4-e2e")
PVC = os.environ.get("DSV4_E2E_SGLANG_PVC")


def kubectl(*args: str, stdin: str | None = None) -> str:
    binary = str(TOOLS_BIN / "kubectl") if (TOOLS_BIN / "kubectl").exists() else "kubectl"
    assert shutil.which(binary) or Path(binary).exists()
    done = subprocess.run(
        [binary, *args], input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def cr_body() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    spec = body["spec"]
    spec["gpu"]["type"] = os.environ.get("DSV4_E2E_GPU_TYPE", "h200")
    spec["model"]["weights"] = {
        "persistentVolumeClaim": PVC,
        "path": os.environ.get("DSV4_E2E_SGLANG_PATH", "/models/DeepSeek-V4-Flash"),
    }
    return body


def conditions(name: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    cr = json.loads(kubectl("get", "dsv4", name, "-n", NAMESPACE, "-o", "json"))
    return cr, {c["type"]: c for c in cr.get("status", {}).get("conditions", [])}


@contextlib.contextmanager
def port_forward(service: str, port: int) -> Iterator[int]:
    binary = str(TOOLS_BIN / "kubectl") if (TOOLS_BIN / "kubectl").exists() else "kubectl"
    with cluster_support.port_forward(binary, NAMESPACE, service, port) as local:
        yield local


@pytest.fixture
def deployed() -> Iterator[str]:
    if not PVC:
        pytest.skip("the SGLang GPU variant is opt-in: set DSV4_E2E_SGLANG_PVC (the weights)")
    body = cr_body()
    name = body["metadata"]["name"]
    kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump(body))
    try:
        yield name
    finally:
        kubectl("delete", "dsv4", name, "-n", NAMESPACE, "--wait=true", f"--timeout={TIMEOUT_S}s")


def test_sglang_serves_a_completion_through_its_router(deployed: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        cr, cond = conditions(deployed)
        if cond.get("Ready", {}).get("status") == "True":
            break
        assert time.monotonic() < deadline, json.dumps(cr.get("status"))
        assert cond.get("PlanValid", {}).get("status") != "False", cond["PlanValid"]
        time.sleep(10)
    kv = cond["KVTransferReady"]
    assert (kv["status"], kv["reason"]) == ("Unknown", "NotReported")
    assert cr["status"]["roles"]["prefill"]["ready"] == "1/1"

    # The operator read /server_info from rank 0 of each group (on a reconcile after Ready,
    # within its 15 s timer): observed capacity next to the plan, within a page of it.
    while "observed" not in (cr["status"].get("plan") or [{}])[0]:
        assert time.monotonic() < deadline, json.dumps(cr.get("status"))
        time.sleep(5)
        cr, cond = conditions(deployed)
    fits = cond["CapacityMatchesPlan"]
    print(f"CapacityMatchesPlan: {fits['status']} {fits['reason']}: {fits['message']}")
    print(json.dumps([e.get("observed") for e in cr["status"]["plan"]]))
    assert fits["status"] == "True", fits["message"]

    sts = json.loads(
        kubectl("get", "statefulset", f"{deployed}-decode-0", "-n", NAMESPACE, "-o", "json")
    )
    worker = sts["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"] == ["python3", "-m", "sglang.launch_server"]
    assert "--max-total-tokens" in worker["args"] and "--disaggregation-mode" in worker["args"]

    endpoint = urlparse(cr["status"]["endpoint"])
    with port_forward((endpoint.hostname or "").split(".")[0], endpoint.port or 80) as local:
        body = {"model": "flash", "prompt": "The capital of France is", "max_tokens": 8}
        request = urllib.request.Request(
            f"http://127.0.0.1:{local}/v1/completions",
            data=json.dumps({**body, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.load(response)
    assert answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] >= 1
