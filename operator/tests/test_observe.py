"""What the operator observes: pod records, worker status documents, and the HTTP probe against
real loopback servers (one per pod IP, as in a cluster)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from contract_samples import DECODE_STATUS
from support.pods import running_pod
from support.sglang_stand_in import server_info_doc
from support.status_servers import HANG, StatusServers

from dsv4_common.api.worker_status import build_worker_status
from dsv4_operator import labels as L
from dsv4_operator.observe import PodState, parse_report, parse_reports, pod_state
from dsv4_operator.probe import HttpWorkerProbe

GOOD: dict[str, Any] = build_worker_status(DECODE_STATUS)


def _without(path: tuple[str, ...]) -> dict[str, Any]:
    doc = json.loads(json.dumps(GOOD))
    target = doc
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return doc


def test_a_complete_report_parses() -> None:
    r = parse_report(GOOD)
    assert r is not None
    assert (r.role, r.pp_rank, r.capacity.full_tokens, r.capacity.swa_tokens) == (
        "decode",
        1,
        8192,
        1024,
    )
    assert (r.capacity.max_running_requests, r.capacity.max_context_tokens) == (16, 4096)
    assert (r.kv_backend, r.kv_ready, r.kv_layout_hash) == ("nixl", True, "abc123")


def test_kv_transfer_is_optional_and_means_not_ready() -> None:
    r = parse_report(_without(("kv_transfer",)))
    assert r is not None and (r.kv_backend, r.kv_ready, r.kv_layout_hash) == (None, False, None)


@pytest.mark.parametrize(
    "doc",
    [
        _without(("role",)),
        _without(("pp_rank",)),
        _without(("capacity",)),
        _without(("capacity", "full_tokens")),
        _without(("capacity", "max_context_tokens")),
        {**GOOD, "pp_rank": "one"},
        {**GOOD, "capacity": None},
        {**GOOD, "capacity": {**GOOD["capacity"], "swa_tokens": [1]}},
    ],
    ids=["no-role", "no-rank", "no-capacity", "no-full", "no-context", "bad-rank", "null", "list"],
)
def test_a_malformed_report_counts_as_not_reporting(doc: dict[str, Any]) -> None:
    assert parse_report(doc) is None
    assert parse_reports({"p": doc, "q": GOOD}).keys() == {"q"}


def _pod(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "tiny-decode-0-1",
            "uid": "u1",
            "labels": {
                L.ROLE_LABEL: "decode",
                L.GROUP_LABEL: "tiny-decode-0",
                L.POD_INDEX_LABEL: "1",
            },
            "annotations": {L.TEMPLATE_HASH_ANNOTATION: "h1"},
            "creationTimestamp": "2026-11-21T10:00:00Z",
        },
        "status": status,
    }


def test_pod_state_reads_rank_readiness_restarts_and_start_time() -> None:
    p = pod_state(
        _pod(
            phase="Running",
            podIP="10.0.0.7",
            conditions=[{"type": "Ready", "status": "True"}],
            containerStatuses=[
                {"restartCount": 1, "state": {"running": {"startedAt": "2026-11-21T10:00:09Z"}}},
                {"restartCount": 2, "state": {"running": {"startedAt": "2026-11-21T10:00:05Z"}}},
            ],
        )
    )
    assert (p.role, p.group, p.pp_rank, p.phase, p.ready) == (
        "decode",
        "tiny-decode-0",
        1,
        "Running",
        True,
    )
    assert (p.restart_count, p.template_hash, p.ip, p.deleting) == (3, "h1", "10.0.0.7", False)
    assert p.started_at == datetime(2026, 11, 21, 10, 0, 5, tzinfo=UTC)
    assert p.created_at == datetime(2026, 11, 21, 10, 0, 0, tzinfo=UTC)


def test_a_pending_pod_has_defaults() -> None:
    p = pod_state(_pod())
    assert (p.phase, p.ready, p.restart_count, p.started_at, p.ip) == (
        "Pending",
        False,
        0,
        None,
        None,
    )


# --- HttpWorkerProbe against loopback servers ------------------------------------------------


@pytest.fixture
def workers() -> Iterator[StatusServers]:
    """127.0.0.2 answers, .3 fails with 500, .4 answers non-JSON, .5 hangs; nothing on .6."""
    servers = StatusServers([f"127.0.0.{n}" for n in (2, 3, 4, 5)])
    servers.docs.update(
        {"127.0.0.2": GOOD, "127.0.0.3": 500, "127.0.0.4": b"<html>", "127.0.0.5": HANG}
    )
    yield servers
    servers.close()


def _state(
    name: str,
    ip: str | None,
    phase: str = "Running",
    deleting: bool = False,
    pp_rank: int | None = 0,
) -> PodState:
    return running_pod(name, group="g", pp_rank=pp_rank, phase=phase, deleting=deleting, ip=ip)


def test_probe_keeps_answers_and_drops_failures(workers: StatusServers) -> None:
    pods = [
        _state("good", "127.0.0.2"),
        _state("error", "127.0.0.3"),
        _state("garbage", "127.0.0.4"),
        _state("slow", "127.0.0.5"),
        _state("closed", "127.0.0.6"),  # nothing listens there
        _state("pending", "127.0.0.2", phase="Pending"),
        _state("leaving", "127.0.0.2", deleting=True),
        _state("no-ip", None),
    ]
    raw = HttpWorkerProbe(timeout_s=2.0, port=workers.port).fetch(pods)
    assert raw == {"good": GOOD}  # the slow one never answers in time: cut off by the timeout
    # Only running, live pods with an IP are asked, each once, on /status.
    assert sorted(workers.hits) == [f"127.0.0.{n}/status" for n in (2, 3, 4, 5)], "wrong pods"


def test_probe_with_no_running_pods_sends_nothing(workers: StatusServers) -> None:
    pending = [_state("p", "127.0.0.2", phase="Pending")]
    assert HttpWorkerProbe(port=workers.port).fetch(pending) == {}
    assert workers.hits == []


def test_server_info_asks_pp_rank_0_of_running_pods_on_the_http_port(
    workers: StatusServers,
) -> None:
    info = server_info_doc(full_tokens=8192, context_tokens=4096)
    workers.info.update({"127.0.0.2": info, "127.0.0.3": 503, "127.0.0.4": b"{", "127.0.0.5": HANG})
    pods = [
        _state("sgl-0", "127.0.0.2"),
        _state("sgl-1", "127.0.0.2", pp_rank=1),  # runs no HTTP server
        _state("unhealthy-0", "127.0.0.3"),
        _state("garbage-0", "127.0.0.4"),
        _state("slow-0", "127.0.0.5"),
        _state("pending-0", "127.0.0.2", phase="Pending"),
        _state("unlabelled", "127.0.0.2", pp_rank=None),
    ]
    probe = HttpWorkerProbe(timeout_s=2.0, port=1, http_port=workers.port)  # not the status port
    assert probe.server_info(pods) == {"sgl-0": info}
    assert sorted(workers.hits) == [f"127.0.0.{n}/server_info" for n in (2, 3, 4, 5)]
