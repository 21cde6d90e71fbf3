"""Issue #23's demonstration: the chart and CRD install into the strict fake API server as helm
sends them, the operator runs with the chart's ServiceAccount (so the chart's RBAC decides what
it may do), every CPU sample reconciles to Ready, and after that nothing is written over
two timer periods, in both the cluster-wide and the namespaced mode. Then: with its watch
history compacted, the operator relists (in pages) and keeps reconciling.

The fake checks what a real API server checks on the way (docs/operator.md has the table):
RBAC on every request, OwnerReferencesPermissionEnforcement on every child, the CRD's schema,
CEL rules and list keys on every CR and status write. The test plays the StatefulSet
controller, the kubelet and the workers (support/live_operator.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import SAMPLES
from support import chart_install
from support.expected import SERVING_CONDITIONS
from support.live_operator import (
    CLUSTER_WIDE,
    RELEASE_NAMESPACE,
    SERVED_NAMESPACE,
    Install,
    Live,
    running_operator,
)

from dsv4_operator import labels as L
from dsv4_operator.handlers import RECONCILE_INTERVAL_S

WORKER_IPS = [f"127.0.0.{i}" for i in range(2, 16)]
# Timer periods with no write after convergence: the first shows a converged reconcile writes
# nothing, the second that the state it leaves is still converged (a reconcile that wrote every
# time, or every other time, is caught); each further one is another 15 s of CI.
QUIET_TICKS = 2
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def _samples() -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(SAMPLES.glob("*.yaml"))}


def _cpu_samples() -> dict[str, dict[str, Any]]:
    """The samples that run without GPUs (no gpu.type: CPU mode, model tiny)."""
    return {n: s for n, s in _samples().items() if not (s["spec"].get("gpu") or {}).get("type")}


def _apply(live: Live, body: dict[str, Any], dry_run: bool = False) -> tuple[int, Any]:
    """`kubectl apply --server-side` of a sample, as the cluster admin."""
    path = chart_install.object_path(live.server, body, live.namespace)
    query = "?fieldManager=kubectl&force=true" + ("&dryRun=All" if dry_run else "")
    return chart_install.request(
        live.server, "PATCH", path + query, body, "application/apply-patch+yaml"
    )


def _ready(live: Live, name: str) -> bool:
    cond = live.condition(name, "Ready")
    return bool(cond and cond["status"] == "True")


def _cr_reads(live: Live, name: str, since: int) -> int:
    """GETs of the CR by the operator since request `since`: each reconcile starts with one."""
    path = f"/namespaces/{live.namespace}/{L.PLURAL}/{name}"
    return sum(
        1
        for r in live.server.requests[since:]
        if r.method == "GET" and r.path.endswith(path) and r.user == live.operator_user
    )


@pytest.mark.parametrize(
    "install", [CLUSTER_WIDE, RELEASE_NAMESPACE], ids=["cluster", "namespaced"]
)
def test_every_cpu_sample_converges_and_then_nothing_is_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    install: Install,
) -> None:
    samples = _cpu_samples()
    assert set(samples) >= {"tiny-cpu.yaml", "tiny-minimal.yaml", "tiny-pd.yaml", "tiny-pp.yaml"}
    with running_operator(tmp_path, monkeypatch, caplog, install, worker_ips=WORKER_IPS) as live:
        # Every sample is admitted by the CRD as installed (a server-side dry run: nothing is
        # stored); only the CPU ones are created.
        for name, body in _samples().items():
            code, answer = _apply(live, body, dry_run=True)
            assert code == 201, (name, answer)
        names = []
        for body in samples.values():
            code, answer = _apply(live, body)
            assert code == 201, answer
            names.append(body["metadata"]["name"])

        # The StatefulSet controller, the kubelet and the workers.
        live.wait(
            "every StatefulSet and router applied",
            lambda: (
                all(f"{n}-router" in live.children("Deployment", "apps/v1") for n in names)
                and len(live.children("StatefulSet", "apps/v1")) >= 2 * len(names)
            ),
            timeout=90,
        )
        pods = live.create_pods()
        for name in names:
            live.report_planned(name)
        live.start_pods(pods)
        for name in names:
            live.server.set_status(
                "apps/v1",
                "Deployment",
                live.namespace,
                f"{name}-router",
                {"replicas": 1, "readyReplicas": 1},
            )
        live.wait("every sample Ready", lambda: all(_ready(live, n) for n in names), timeout=120)
        for name in names:
            conds = {c["type"]: c["status"] for c in live.cr(name)["status"]["conditions"]}  # type: ignore[index]
            assert conds == SERVING_CONDITIONS, name

        # Converged: over the next timer periods every CR is reconciled and nothing written.
        live.settle(quiet=1.0, timeout=30)
        mark = len(live.server.requests)
        t0 = time.monotonic()
        live.wait(
            f"{QUIET_TICKS} timer reconciles of every CR",
            lambda: all(_cr_reads(live, n, mark) >= QUIET_TICKS for n in names),
            timeout=(QUIET_TICKS + 2) * RECONCILE_INTERVAL_S + 30,
        )
        quiet_s = time.monotonic() - t0
        writes = [
            (r.method, r.path, r.code)
            for r in live.server.requests[mark:]
            if r.method in WRITES and r.user == live.operator_user
        ]
        assert writes == [], writes
        live.timings["quiet period"] = round(quiet_s, 1)

        # Everything the operator asked, it asked as the chart's ServiceAccount.
        users = {r.user for r in live.server.requests}
        assert users == {live.operator_user, "system:admin"}, users
        # Cluster-wide it watches its CRs everywhere; namespaced only in its namespace.
        crd_watches = {
            r.path
            for r in live.server.requests
            if r.path.endswith(f"/{L.PLURAL}") and r.method == "GET"
        }
        everywhere = f"/apis/{L.API_VERSION}/{L.PLURAL}"
        assert crd_watches == (
            {everywhere}
            if install.clusterwide
            else {f"/apis/{L.API_VERSION}/namespaces/{live.namespace}/{L.PLURAL}"}
        )


def test_after_its_watch_history_is_compacted_the_operator_relists_and_keeps_reconciling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with running_operator(tmp_path, monkeypatch, caplog, SERVED_NAMESPACE, chunk_size=1) as live:
        for sample in ("tiny-cpu.yaml", "tiny-pd.yaml"):
            live.create_cr(sample)
        live.wait("both planned", lambda: all(_observed(live, n) == 1 for n in ("tiny", "tiny-pd")))
        live.settle(quiet=0.5)
        # A write the operator does not watch, then the history goes: every watch the
        # operator holds would resume from before the compaction.
        live.server.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "elsewhere", "namespace": chart_install.RELEASE_NAMESPACE},
            }
        )
        mark = len(live.server.requests)
        compacted = live.server.compact()
        live.server.close_watches()  # as the server does when a watch's timeout is up
        crs = f"/apis/{L.API_VERSION}/namespaces/{live.namespace}/{L.PLURAL}"

        def relisted() -> bool:
            after = live.server.requests[mark:]
            return any(
                r.path == crs and "watch" not in r.query and "continue" in r.query for r in after
            )

        live.wait("the operator relists its CRs, in pages", relisted)
        resumed = [
            int(r.query["resourceVersion"])
            for r in live.server.requests[mark:]
            if r.path == crs and r.query.get("watch") == "true" and "resourceVersion" in r.query
        ]
        assert resumed and min(resumed) < compacted  # the watch that got 410 Gone
        # It still reconciles: a spec change is planned.
        code, answer = chart_install.request(
            live.server,
            "PATCH",
            f"{crs}/tiny-pd",
            {"spec": {"maxContextTokens": 1024}},
            "application/merge-patch+json",
        )
        assert code == 200, answer
        live.wait("the change reconciled", lambda: _observed(live, "tiny-pd") == 2)


def _observed(live: Live, name: str) -> int | None:
    cond = live.condition(name, "PlanValid")
    status = (live.cr(name) or {}).get("status") or {}
    if not cond or cond["status"] != "True":
        return None
    generation: int | None = status.get("observedGeneration")
    return generation
