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
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from repo_paths import CRD_FILE, SAMPLES
from serve_support import free_port
from support.chart_support import CHART, needs_helm, render
from support.fake_apiserver import FakeApiServer, load_crd

from dsv4_operator import labels as L

NS = "default"
T = TypeVar("T")
# SIGTERM to exit, even with a reconcile stuck in an API call (the chart's grace is 30 s; kopf
# needs a few seconds to stop its tasks on a loaded machine).
STOP_WITHIN_S = 15.0


def _wait(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if (got := probe()) is not None and got is not False:
                return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _operator_container(*values: str) -> dict[str, Any]:
    (sts,) = [o for o in render(*values) if o["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` references, expanded as the kubelet does."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _environment(
    container: dict[str, Any],
    kubeconfig: Path,
    home: Path,
    pod_index: int = 0,
    metrics_port: int | None = None,
) -> dict[str, str]:
    """The container's env: literal values as given, downward-API values as pod `pod_index`
    of the operator's StatefulSet would see them; the metrics port a free loopback one."""
    downward = {
        "metadata.name": f"dsv4-dsv4-operator-{pod_index}",
        "metadata.namespace": "dsv4-system",
        "metadata.labels['apps.kubernetes.io/pod-index']": str(pod_index),
    }
    env = {"PATH": os.environ["PATH"], "KUBECONFIG": str(kubeconfig)}
    for item in container["env"]:
        if "value" in item:
            value = _expand(item["value"], env)
        else:
            value = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env[item["name"]] = value
    env["HOME"] = str(home)  # /tmp in the image; keep the test's files in its own folder
    env["DSV4_OPERATOR_METRICS_PORT"] = str(metrics_port or free_port())
    env["DSV4_OPERATOR_METRICS_HOST"] = "127.0.0.1"
    return env


def _command_line(container: dict[str, Any], env: dict[str, str], liveness_port: int) -> list[str]:
    """The container's command + args (expanded), with the pod's address and port made
    loopback ones and the cluster-wide watch narrowed to the test namespace."""
    kopf_bin = Path(sys.executable).with_name("kopf")
    command = [str(kopf_bin), *container["command"][1:]]
    args = []
    for arg in container["args"]:
        arg = _expand(arg, env)
        if arg.startswith("--liveness="):
            arg = re.sub(r"0\.0\.0\.0:\d+", f"127.0.0.1:{liveness_port}", arg)
        elif arg == "--all-namespaces":
            arg = f"--namespace={NS}"
        args.append(arg)
    return command + args


class OperatorProcess:
    """One operator pod's container, as a process; its output goes to `log_path`."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            command, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=log_path.parent
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, as the kubelet sends; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()


def _wait_healthy(liveness_port: int) -> None:
    """The chart's livenessProbe: GET /healthz on the liveness port answers 200."""
    url = f"http://127.0.0.1:{liveness_port}/healthz"

    def healthy() -> bool:
        with urllib.request.urlopen(url, timeout=2) as rsp:
            return rsp.status == 200

    _wait("the liveness endpoint", healthy)


def _scrape(port: int) -> str | None:
    """The operator's /metrics once it holds a planned CR (None before)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as rsp:
        text: str = rsp.read().decode()
    return text if "dsv4_operator_planned_full_tokens{" in text else None


def _create_cr(server: FakeApiServer, name: str) -> None:
    cr = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    cr["metadata"].update({"namespace": NS, "name": name})
    server.create(cr)


def _planned(server: FakeApiServer, name: str) -> Callable[[], dict[str, Any] | None]:
    def probe() -> dict[str, Any] | None:
        got = server.get(L.API_VERSION, L.KIND, NS, name) or {}
        conds = (got.get("status") or {}).get("conditions") or []
        ok = any(c["type"] == "PlanValid" and c["status"] == "True" for c in conds)
        return got if ok else None

    return probe


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    api = FakeApiServer([load_crd(CRD_FILE)]).start()
    try:
        yield api
    finally:
        api.stop()


@needs_helm
def test_the_charts_command_line_runs_the_operator(server: FakeApiServer, tmp_path: Path) -> None:
    container = _operator_container()
    liveness_port, metrics_port = free_port(), free_port()
    chart_env = {e["name"]: e.get("value") for e in container["env"]}
    assert chart_env["DSV4_OPERATOR_METRICS_PORT"] == "8090"  # made a free one below
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    env = _environment(container, kubeconfig, tmp_path, metrics_port=metrics_port)
    command = _command_line(container, env, liveness_port)
    assert command[1:4] == ["run", "-m", "dsv4_operator.main"] and "--standalone" in command
    assert env["DSV4_PEERING"] == "" and env["DSV4_PRIORITY"] == "-0"
    op = OperatorProcess(command, env, tmp_path / "operator.log")
    try:
        _wait_healthy(liveness_port)
        _create_cr(server, "tiny")
        got = _wait("status PlanValid=True", _planned(server, "tiny"))
        assert got["metadata"]["finalizers"] == [f"{L.GROUP}/finalizer"]
        statefulsets = server.list("apps/v1", "StatefulSet", NS)
        assert {s["metadata"]["name"] for s in statefulsets} == {"tiny-prefill-0", "tiny-decode-0"}
        # The default worker image comes from the chart's DSV4_WORKER_IMAGE.
        image = statefulsets[0]["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == env["DSV4_WORKER_IMAGE"]
        # The chart's DSV4_METRICS_SCRAPE_NAMESPACE reached the NetworkPolicy.
        policies = server.list("networking.k8s.io/v1", "NetworkPolicy", NS)
        (policy,) = [p for p in policies if p["metadata"]["name"] == "tiny-workers"]
        scrapers = policy["spec"]["ingress"][-1]["from"][0]["namespaceSelector"]
        assert scrapers == {"matchLabels": {L.NAMESPACE_NAME_LABEL: "monitoring"}}
        # ... and DSV4_OPERATOR_NAMESPACE (the downward API's) the operator's own rule.
        operator_rule = policy["spec"]["ingress"][2]["from"][0]
        assert operator_rule["namespaceSelector"] == {
            "matchLabels": {L.NAMESPACE_NAME_LABEL: "dsv4-system"}
        }
        # The operator's own metrics: the reconcile was counted, the plan is exported.
        text = _wait("operator metrics", lambda: _scrape(metrics_port))
        assert 'dsv4_operator_planned_full_tokens{deployment="tiny",namespace="default"' in text
        assert re.search(r'dsv4_operator_reconciles_total\{result="ok"\} [1-9]', text), text
    finally:
        code = op.stop()
    output = op.output()
    assert code == 0, output
    assert "Traceback" not in output, output


@needs_helm
def test_sigterm_stops_the_operator_within_its_grace_mid_api_call(
    server: FakeApiServer, tmp_path: Path
) -> None:
    """The kubelet's SIGTERM while a reconcile waits on an API server that does not answer:
    the process exits (0, no traceback) well within the pod's terminationGracePeriodSeconds,
    without waiting out the API client's timeout."""
    (sts,) = [o for o in render() if o["kind"] == "StatefulSet"]
    grace_s = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    container = _operator_container()
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    env = _environment(container, kubeconfig, tmp_path)
    liveness_port = free_port()
    op = OperatorProcess(_command_line(container, env, liveness_port), env, tmp_path / "op.log")
    held = server.hold("PATCH", "/statefulsets/")  # the reconcile's first StatefulSet apply
    try:
        _wait_healthy(liveness_port)
        _create_cr(server, "tiny")
        assert held.arrived.wait(30), op.output()
        started = time.monotonic()
        code = op.stop(timeout_s=grace_s)
        took_s = time.monotonic() - started
    finally:
        held.release.set()
        op.stop()
    output = op.output()
    assert code == 0, output
    assert took_s < STOP_WITHIN_S < grace_s, (took_s, output)
    assert "Traceback" not in output, output


HA_VALUES = ("--set", "replicaCount=2", "--set", f"watch.namespaces={{{NS}}}")


@needs_helm
def test_two_replicas_peer_and_the_standby_takes_over(tmp_path: Path) -> None:
    """replicaCount=2: pod 0 (priority 0) works, pod 1 (priority -1) pauses; when pod 0 stops,
    pod 1 takes over."""
    objects = render(*HA_VALUES)
    (peering,) = [o for o in objects if o["kind"] == "KopfPeering"]
    assert peering["metadata"]["namespace"] == NS
    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()))
    server = FakeApiServer([load_crd(CRD_FILE), *crds]).start()
    container = _operator_container(*HA_VALUES)
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    ops: list[OperatorProcess] = []
    try:
        server.create(peering)
        for index in (0, 1):
            port = free_port()
            env = _environment(container, kubeconfig, tmp_path, pod_index=index)
            command = _command_line(container, env, port)
            assert f"--priority=-{index}" in command and "--peering=dsv4-operator" in command
            ops.append(OperatorProcess(command, env, tmp_path / f"operator-{index}.log"))
            _wait_healthy(port)
        active, standby = ops

        def peers() -> dict[str, Any] | None:
            got = server.get("zalando.org/v1", "KopfPeering", NS, "dsv4-operator") or {}
            status = got.get("status") or {}
            return status if len(status) == 2 else None

        records = _wait("both replicas in the peering record", peers)
        assert sorted(r["priority"] for r in records.values()) == [-1, 0]

        _create_cr(server, "first")
        _wait("first planned", _planned(server, "first"))
        # (handlers log what they applied after the reconcile, so after its status write)
        _wait(
            "pod 0's log", lambda: "applied StatefulSet first-prefill-0" in active.output() or None
        )
        # kopf starts a peered operator paused; the standby never resumed while pod 0 lived.
        assert "first" not in standby.output() and "Resuming" not in standby.output()

        assert active.stop() == 0
        _wait("the standby to resume", lambda: "Resuming" in standby.output() or None)
        _create_cr(server, "second")
        _wait("second planned by the standby", _planned(server, "second"))
        _wait(
            "pod 1's log",
            lambda: "applied StatefulSet second-prefill-0" in standby.output() or None,
        )
        # On taking over, it resumed "first" and found it as planned: nothing re-applied.
        assert "[default/first] applied" not in standby.output()
    finally:
        codes = [op.stop() for op in ops]
        server.stop()
    for op, code in zip(ops, codes, strict=True):
        assert code == 0, op.output()
        assert "Traceback" not in op.output(), op.output()
