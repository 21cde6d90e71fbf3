"""The operator as its container runs it: the command, arguments and environment of the chart's
StatefulSet (from `helm template`), as a separate process against the loopback API server.

Checks what only the real entry point shows: `kopf run -m dsv4_operator.main` imports and
registers everything, the liveness endpoint the chart probes answers, a CR is reconciled, and
SIGTERM (what the kubelet sends) stops the process cleanly and quickly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from chart_support import needs_helm, render
from fake_apiserver import FakeApiServer, load_crd

from dsv4_operator import labels as L

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if (got := probe()) is not None and got is not False:
                return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _operator_container() -> dict[str, Any]:
    (sts,) = [o for o in render() if o["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _command_line(container: dict[str, Any], liveness_port: int) -> list[str]:
    """The container's command + args, with the pod's address and port made loopback ones
    and the cluster-wide watch narrowed to the test namespace."""
    kopf_bin = Path(sys.executable).with_name("kopf")
    command = [str(kopf_bin), *container["command"][1:]]
    args = []
    for arg in container["args"]:
        if arg.startswith("--liveness="):
            arg = re.sub(r"0\.0\.0\.0:\d+", f"127.0.0.1:{liveness_port}", arg)
        elif arg == "--all-namespaces":
            arg = f"--namespace={NS}"
        args.append(arg)
    return command + args


def _environment(container: dict[str, Any], kubeconfig: Path, home: Path) -> dict[str, str]:
    """The container's env: literal values as given, `$(VAR)` expanded as the kubelet does,
    downward-API values as a pod named dsv4-dsv4-operator-0 would see them."""
    downward = {
        "metadata.name": "dsv4-dsv4-operator-0",
        "metadata.namespace": "dsv4-system",
        "metadata.labels['apps.kubernetes.io/pod-index']": "0",
    }
    env = {"PATH": os.environ["PATH"], "KUBECONFIG": str(kubeconfig)}
    for item in container["env"]:
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        else:
            value = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env[item["name"]] = value
    env["HOME"] = str(home)  # /tmp in the image; keep the test's files in its own folder
    return env


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    api = FakeApiServer([load_crd(ROOT / "crds" / "dsv4deployment.yaml")]).start()
    try:
        yield api
    finally:
        api.stop()


@needs_helm
def test_the_charts_command_line_runs_the_operator(server: FakeApiServer, tmp_path: Path) -> None:
    container = _operator_container()
    liveness_port = _free_port()
    command = _command_line(container, liveness_port)
    assert command[1:4] == ["run", "-m", "dsv4_operator.main"]
    env = _environment(container, server.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path)
    assert env["DSV4_PEERING"] == "" and env["DSV4_PRIORITY"] == "-0"  # standalone by default
    log = (tmp_path / "operator.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        # The chart's livenessProbe: GET /healthz on the liveness port answers 200.
        url = f"http://127.0.0.1:{liveness_port}/healthz"

        def healthy() -> bool:
            with urllib.request.urlopen(url, timeout=2) as rsp:
                return rsp.status == 200

        _wait("the liveness endpoint", healthy)

        cr = yaml.safe_load((ROOT / "crds" / "samples" / "tiny-cpu.yaml").read_text())
        cr["metadata"]["namespace"] = NS
        server.create(cr)

        def planned() -> dict[str, Any] | None:
            got = server.get(L.API_VERSION, L.KIND, NS, "tiny") or {}
            conds = (got.get("status") or {}).get("conditions") or []
            ok = any(c["type"] == "PlanValid" and c["status"] == "True" for c in conds)
            return got if ok else None

        got = _wait("status PlanValid=True", planned)
        assert got["metadata"]["finalizers"] == [f"{L.GROUP}/finalizer"]
        assert {s["metadata"]["name"] for s in server.list("apps/v1", "StatefulSet", NS)} == {
            "tiny-prefill-0",
            "tiny-decode-0",
        }
        # The default worker image comes from the chart's DSV4_WORKER_IMAGE.
        (sts, *_) = server.list("apps/v1", "StatefulSet", NS)
        image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == env["DSV4_WORKER_IMAGE"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    output = (tmp_path / "operator.log").read_text()
    assert code == 0, output
    assert "Traceback" not in output, output
