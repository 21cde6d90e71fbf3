"""The real operator (kopf, our handlers, `ApiKube`) while a served namespace terminates: every
create there is refused with 403 NamespaceTerminating, as a real API server's NamespaceLifecycle
plugin refuses it; the operator says so in one INFO line per reconcile and carries on, never an
ERROR, a traceback or a Warning Event, and the CR goes with the namespace (kopf still releases
its finalizer: an update is allowed there). The live fixture fails the test on any ERROR record
and on any 401/403 other than NamespaceTerminating's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.live_operator import CLUSTER_WIDE, NS, Live, running_operator

from dsv4_operator import labels as L


@pytest.fixture
def live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Iterator[Live]:
    """Cluster-wide (a ClusterRole): a Role in the terminating namespace would go with it,
    and the operator could not release its finalizer (a real cluster's trap too)."""
    with running_operator(tmp_path, monkeypatch, caplog, CLUSTER_WIDE) as running:
        yield running


def test_a_terminating_namespace_is_handled_quietly(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    live.create_cr("tiny-cpu.yaml")
    sts = live.wait("StatefulSets applied", lambda: live.children("StatefulSet", "apps/v1") or None)
    live.settle()
    live.server.delete("v1", "Namespace", "", NS)  # Terminating: its content goes next
    # A child gone before the CR (the namespace controller's order is arbitrary): the next
    # reconcile (the pod or timer events) would create it again, and is refused.
    live.server.delete("apps/v1", "StatefulSet", NS, sorted(sts)[0])
    refused = live.wait(
        "a create refused with NamespaceTerminating",
        lambda: [r for r in live.server.requests if r.cause == "NamespaceTerminating"],
    )
    assert {r.code for r in refused} == {403}
    live.wait(
        "the operator's one line",
        lambda: any("is being deleted: not reconciling tiny" in m for m in caplog.messages),
    )
    live.wait("the namespace to go, the CR with it", lambda: live.server.finish_namespace(NS))
    assert live.server.get(L.API_VERSION, L.KIND, NS, "tiny") is None
    assert not any("Traceback" in m for m in caplog.messages)
    assert all(r.levelno < logging.WARNING or "tiny" not in r.getMessage() for r in caplog.records)
