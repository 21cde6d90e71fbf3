"""The real operator (kopf running our handlers and start-up, `ApiKube`, `HttpWorkerProbe`)
in a thread against the loopback fake API server, for the live tests (test_operator_live.py,
test_operator_configmap.py): `running_operator` is the body of their `live` fixture, `Live` what
a test drives. The test plays the StatefulSet controller, the kubelet and the workers.

The operator is installed as helm installs it (support/chart_install.py: the CRD POSTed and
Established, the chart's objects applied) and runs with its ServiceAccount's token, so the
chart's Roles decide what it may do: a request they do not allow is refused with 403, and any
401 or 403 the operator got fails the test on exit. `Install` picks the chart's mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest
import yaml
from repo_paths import CRD_FILE, SAMPLES
from support import chart_install
from support import crd_support as S
from support.chart_support import HELM
from support.fake_apiserver import FakeApiServer, load_crd
from support.status_servers import StatusServers

from dsv4_common.api.rank_config import parse_rank_config
from dsv4_common.api.worker_status import WorkerStatus, build_worker_status
from dsv4_operator import labels as L
from dsv4_operator import main as operator_main
from dsv4_operator import settings as operator_settings
from dsv4_operator.metrics import OperatorMetrics
from dsv4_operator.probe import HttpWorkerProbe

NS = "default"
TIMEOUT_S = 40.0
WORKER_IPS = [f"127.0.0.{i}" for i in range(2, 8)]
SCHEMA: dict[str, Any] = S.crd_schema()


@dataclass(frozen=True)
class Install:
    """A mode of the chart: its `helm template` flags, the namespace the CRs live in, and
    whether kopf watches every namespace (`--all-namespaces`) or that one."""

    values: tuple[str, ...]
    namespace: str
    clusterwide: bool


# Namespaced: one Role and RoleBinding in the served namespace (watch.namespaces).
SERVED_NAMESPACE = Install(("--set", f"watch.namespaces={{{NS}}}"), NS, clusterwide=False)
# rbac.namespaced: serve the release namespace only.
RELEASE_NAMESPACE = Install(
    ("--set", "rbac.namespaced=true"), chart_install.RELEASE_NAMESPACE, clusterwide=False
)
CLUSTER_WIDE = Install((), NS, clusterwide=True)  # the chart's default: a ClusterRole

assert operator_main.handlers and operator_main.settings  # registered in kopf's default registry


# ---------------------------------------------------------------------------------------------
# kopf in a background thread


@dataclass
class OperatorThread:
    settings: kopf.OperatorSettings = field(default_factory=kopf.OperatorSettings)
    stop_flag: threading.Event = field(default_factory=threading.Event)
    ready_flag: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None
    namespaces: tuple[str, ...] = (NS,)
    clusterwide: bool = False

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.ready_flag.wait(0.05):
            if self.error is not None or time.monotonic() > deadline:
                raise RuntimeError("the operator did not start") from self.error

    def _run(self) -> None:
        try:
            asyncio.run(
                kopf.operator(
                    standalone=True,
                    clusterwide=self.clusterwide,
                    namespaces=[] if self.clusterwide else list(self.namespaces),
                    settings=self.settings,
                    ready_flag=self.ready_flag,
                    stop_flag=self.stop_flag,
                )
            )
        except BaseException as exc:
            self.error = exc

    def stop(self) -> float:
        t0 = time.monotonic()
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(30)
            assert not self.thread.is_alive(), "kopf did not stop"
        self.settings.execution.executor.shutdown(wait=True)
        return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# Fixture: fake API server + worker status servers + the operator


@dataclass
class Live:
    server: FakeApiServer
    workers: StatusServers
    metrics: OperatorMetrics  # the operator's (what its start-up put in kopf's memo)
    ips: dict[str, str] = field(default_factory=dict)  # pod name -> IP
    timings: dict[str, float] = field(default_factory=dict)
    namespace: str = NS  # of the CRs and their children
    worker_ips: list[str] = field(default_factory=lambda: list(WORKER_IPS))  # pod IPs to hand out
    operator_user: str = ""  # whom the API server authenticates the operator as

    def cr(self, name: str) -> dict[str, Any] | None:
        return self.server.get(L.API_VERSION, L.KIND, self.namespace, name)

    def create_cr(self, sample: str, **spec: Any) -> dict[str, Any]:
        body = yaml.safe_load((SAMPLES / sample).read_text())
        body["metadata"]["namespace"] = self.namespace
        body["spec"].update(spec)
        return self.server.create(body, keep_status=False)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = TIMEOUT_S) -> Any:
        t0 = time.monotonic()
        while True:
            result = check()
            if result:
                self.timings[what] = round(time.monotonic() - t0, 2)
                return result
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
            time.sleep(0.05)

    def settle(self, quiet: float = 0.3, timeout: float = 10.0) -> None:
        """Wait until the operator has made no API request for `quiet` seconds."""
        deadline = time.monotonic() + timeout
        seen, since = len(self.server.requests), time.monotonic()
        while time.monotonic() - since < quiet and time.monotonic() < deadline:
            time.sleep(0.05)
            if len(self.server.requests) != seen:
                seen, since = len(self.server.requests), time.monotonic()

    def condition(self, name: str, ctype: str) -> dict[str, Any] | None:
        cr = self.cr(name) or {}
        conds = (cr.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c.get("type") == ctype), None)

    def children(self, kind: str, api_version: str) -> dict[str, dict[str, Any]]:
        return {
            o["metadata"]["name"]: o for o in self.server.list(api_version, kind, self.namespace)
        }

    def events(self, name: str, *, reason: str | None = None) -> list[dict[str, Any]]:
        """The Events posted on the CR `name` (those with `reason`, when given)."""
        return [
            e
            for e in self.server.list("v1", "Event", self.namespace)
            if e["involvedObject"]["name"] == name and reason in (None, e["reason"])
        ]

    # --- the StatefulSet controller, the kubelet and the workers -----------------------------
    def create_pods(self) -> list[str]:
        """The StatefulSet controller: every missing pod of every StatefulSet, from its
        template (labels and annotations), with its PP rank label; Pending, no IP yet."""
        created = []
        ns = self.namespace
        for sts in self.server.list("apps/v1", "StatefulSet", ns):
            template = sts["spec"]["template"]["metadata"]
            for index in range(sts["spec"]["replicas"]):
                name = f"{sts['metadata']['name']}-{index}"
                if self.server.get("v1", "Pod", ns, name) is not None:
                    continue
                pod_labels = {
                    **template["labels"],
                    L.POD_INDEX_LABEL: str(index),
                    "statefulset.kubernetes.io/pod-name": name,
                }
                owner = {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": sts["metadata"]["name"],
                    "uid": sts["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
                self.server.create(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": name,
                            "namespace": ns,
                            "labels": pod_labels,
                            "annotations": dict(template.get("annotations") or {}),
                            "ownerReferences": [owner],
                        },
                        "spec": copy.deepcopy(sts["spec"]["template"]["spec"]),
                    },
                    keep_status=False,
                )
                if name not in self.ips:  # a recreated pod keeps its name's IP
                    self.ips[name] = self.worker_ips[len(self.ips)]
                created.append(name)
        return created

    def start_pods(self, names: list[str]) -> None:
        """The kubelet: the containers start (after every pod of a group was created, or the
        operator would see a pod replaced under a running peer), then run Ready."""
        time.sleep(1.05)  # timestamps have one-second resolution
        for name in names:
            self.set_pod(name)

    def set_pod(self, name: str, *, restarts: int = 0) -> None:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.server.set_status(
            "v1",
            "Pod",
            self.namespace,
            name,
            {
                "phase": "Running",
                "podIP": self.ips[name],
                "podIPs": [{"ip": self.ips[name]}],
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": "worker",
                        "ready": True,
                        "restartCount": restarts,
                        "state": {"running": {"startedAt": started}},
                    }
                ],
            },
        )

    def report_planned(self, name: str) -> None:
        """Each running pod's worker reports exactly the capacity its ConfigMap plans."""
        cm = self.server.get("v1", "ConfigMap", self.namespace, L.config_name(name))
        assert cm is not None
        for pod in self.server.list("v1", "Pod", self.namespace, L.worker_selector(name)):
            labels = pod["metadata"]["labels"]
            role, rank = labels[L.ROLE_LABEL], int(labels[L.POD_INDEX_LABEL])
            planned = parse_rank_config(
                yaml.safe_load(cm["data"][f"{role}-rank-{rank}.json"])
            ).planned
            self.workers.docs[self.ips[pod["metadata"]["name"]]] = build_worker_status(
                WorkerStatus(
                    role=role,
                    pp_rank=rank,
                    capacity=planned.capacity,
                    kv_backend="nixl",
                    kv_ready=True,
                    kv_layout_hash="layout-1",
                )
            )


@contextlib.contextmanager
def running_operator(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    install: Install = SERVED_NAMESPACE,
    *,
    worker_ips: list[str] = WORKER_IPS,
    chunk_size: int | None = None,
    progress_port: int | None = None,
) -> Iterator[Live]:
    """The body of a test's `live` fixture: the fake API server with the chart installed
    (`install`'s mode), the workers' status servers on `worker_ips` and the operator (listing
    in chunks of `chunk_size`), started; on exit, stopped, and checked for errors and leaks."""
    if not HELM.exists():
        pytest.skip(f"{HELM} missing: run scripts/tools.sh (CI always does)")
    threads_before = set(threading.enumerate())
    t0 = time.monotonic()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the DynamicClient's cache
    # kopf's login and ApiKube.from_environment() both load the kubeconfig into this global.
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)
    for var in ("DSV4_PEERING", "DSV4_PEERING_CLUSTERWIDE", "DSV4_PRIORITY", "DSV4_WORKER_IMAGE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    server = FakeApiServer(
        namespaces=sorted({NS, install.namespace, chart_install.RELEASE_NAMESPACE}),
        crd_admission=S.crd_admission,
    ).start()
    chart_install.create_crd(server, load_crd(CRD_FILE))
    chart = chart_install.rendered(install.values)
    chart_install.install(server, chart)
    server.clear_requests()  # the log starts with the operator
    # What the chart tells the operator about its mode (kopf's flags are `install`'s).
    monkeypatch.setenv("DSV4_NAMESPACED", chart_install.operator_env(chart)["DSV4_NAMESPACED"])
    account = chart_install.service_account(chart)
    token = server.service_account_token(*account)
    workers = StatusServers(worker_ips)
    kubeconfig = str(
        server.write_kubeconfig(tmp_path / "kubeconfig", install.namespace, token=token)
    )
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    # The client reads $KUBECONFIG once, at import.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    monkeypatch.setattr(
        operator_settings,
        "HttpWorkerProbe",
        lambda: HttpWorkerProbe(
            timeout_s=1.0,
            port=workers.port,
            http_port=workers.port,
            progress_port=progress_port or workers.port,
        ),
    )
    metrics = OperatorMetrics()
    monkeypatch.setattr(operator_settings, "OperatorMetrics", lambda: metrics)
    operator = OperatorThread(namespaces=(install.namespace,), clusterwide=install.clusterwide)
    operator.settings.watching.chunk_size = chunk_size
    user = f"system:serviceaccount:{account[0]}:{account[1]}"
    live = Live(
        server,
        workers,
        metrics,
        namespace=install.namespace,
        worker_ips=list(worker_ips),
        operator_user=user,
    )
    try:
        operator.start()
        live.timings["operator start"] = round(time.monotonic() - t0, 2)
        yield live
    finally:
        try:
            # Stopping kopf in the middle of handling an object can make it wait for its
            # streams (2 s) and even start the object's timer while it shuts down.
            live.settle()
            live.timings["operator stop"] = round(operator.stop(), 2)
        finally:
            server.stop()
            workers.close()
            print(f"timings (s): {live.timings}")
    assert operator.error is None, operator.error
    # The chart's RBAC allowed every request the operator made (a create refused because its
    # namespace terminates is NamespaceLifecycle's 403, not RBAC's).
    refused = [
        (r.method, r.path, r.code)
        for r in server.requests
        if r.code in (401, 403) and r.cause != "NamespaceTerminating"
    ]
    assert not refused, refused
    # Nothing failed inside kopf or a handler (a refused write, a handler exception, ...).
    errors = [
        r.getMessage()
        for when in ("setup", "call", "teardown")
        for r in caplog.get_records(when)
        if r.levelno >= logging.ERROR
    ]
    assert not errors, errors
    # Nothing left behind: no thread, no listening port.
    deadline = time.monotonic() + 5
    while (leaked := set(threading.enumerate()) - threads_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaked, f"threads left running: {leaked}"
    for address in [("127.0.0.1", server.port)] + [(ip, workers.port) for ip in worker_ips]:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=1).close()
