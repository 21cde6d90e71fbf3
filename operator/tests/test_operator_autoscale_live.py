"""The real operator (kopf, our handlers, the chart's RBAC) scales decode from its workers'
/status: the test plays the StatefulSet controller, the kubelet and the workers (a queue of 12
on the one decode group); the operator applies two more decode groups, writes
status.autoscaling and posts a Normal Event ScaledUp naming the figure."""

from __future__ import annotations

from support.live_operator import Live

from dsv4_common.api.worker_status import (
    Load,
    WorkerStatus,
    build_worker_status,
    parse_worker_status,
)
from dsv4_operator import labels as L


def test_a_queue_on_decode_scales_it_up_with_an_event(live: Live) -> None:
    live.create_cr("tiny-autoscale.yaml")
    name = "tiny-autoscale"
    live.wait("StatefulSets applied", lambda: len(live.children("StatefulSet", "apps/v1")) == 2)
    pods = live.create_pods()
    live.report_planned(name)
    for pod in pods:
        if pod.startswith(f"{name}-decode"):
            ip = live.ips[pod]
            doc = live.workers.docs[ip]
            status = WorkerStatus(
                role="decode",
                pp_rank=0,
                capacity=parse_worker_status(doc).capacity,
                kv_backend="nixl",
                kv_ready=True,
                kv_layout_hash="layout-1",
                load=Load(waiting=12, accepting=True),
            )
            live.workers.docs[ip] = build_worker_status(status)
    live.start_pods(pods)  # pod events: the operator reconciles and reads the queue
    live.wait(
        "decode scaled to 3 groups",
        lambda: len(live.children("StatefulSet", "apps/v1")) == 4,
    )
    sets = sorted(live.children("StatefulSet", "apps/v1"))
    assert sets == [f"{name}-decode-{i}" for i in range(3)] + [f"{name}-prefill-0"]
    (event,) = live.wait("ScaledUp event", lambda: live.events(name, reason="ScaledUp"))
    assert event["type"] == "Normal"
    assert "decode 1 -> 3 group(s): queue depth 12 against 4 per group" in event["message"]
    entry = live.wait(
        "status.autoscaling written",
        lambda: ((live.cr(name) or {}).get("status") or {}).get("autoscaling", {}).get("decode"),
    )
    # The entry is the latest decision: ScaledUp, or Steady once a later reconcile sees the
    # queue spread over the three groups (4 per group is on target); the change is recorded.
    assert entry["replicas"] == 3 and entry["reason"] in ("ScaledUp", "Steady")
    assert "lastScaleUpTime" in entry
    assert entry["figures"]["queueDepth"] == 12
    roles = live.cr(name)["status"]["roles"]  # type: ignore[index]
    assert roles["decode"]["replicas"] == 3 and roles["prefill"]["replicas"] == 1
    assert (
        live.children("StatefulSet", "apps/v1")[f"{name}-decode-2"]["metadata"]["labels"][
            L.ROLE_LABEL
        ]
        == "decode"
    )
