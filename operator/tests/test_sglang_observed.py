"""Engine sglang, observed capacity (issue #13 item 4): the operator reads /server_info from PP
rank 0 of every SGLang group, reports what SGLang realized next to the plan in
`status.plan[].observed`, and says in `CapacityMatchesPlan` when a group realized more than a
page per rank more or less than the operator asked it for (Degraded when a group holds less
context than the spec). The stand-in servers realize exactly what their rendered command line
asks (support/sglang_stand_in.py), unless a test makes one fall short."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from support.fake_kube import FakeKube, FakeProbe, conditions
from support.live_operator import NS, Live
from support.sglang_stand_in import flag, realized

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import parse_spec
from dsv4_operator.metrics import OBSERVED_PREFIX, capacity_series
from dsv4_operator.reconcile import reconcile

SAMPLE = "sglang-flash-pd.yaml"
NOW = datetime(2026, 1, 1, tzinfo=UTC)
Body = dict[str, Any]


def _argv(kube_or_sts: Body) -> list[str]:
    containers = kube_or_sts["spec"]["template"]["spec"]["containers"]
    args: list[str] = next(c for c in containers if c["name"] == "worker")["args"]
    return args


def _serving(make_body: Callable[..., Body]) -> tuple[FakeKube, FakeProbe]:
    """Every group up; rank 0 of each answers what its command line asks."""
    kube, probe = FakeKube(make_body(SAMPLE)), FakeProbe()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    kube.run_controllers()
    for name, sts in kube.of_kind("StatefulSet").items():
        probe.infos[f"{name}-0"] = realized(_argv(sts))
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    return kube, probe


def test_what_sglang_realized_is_reported_next_to_the_plan(
    make_body: Callable[..., Body],
) -> None:
    kube, _ = _serving(make_body)
    cond = conditions(kube)
    assert {t: c["status"] for t, c in cond.items()} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "PlanValid": "True",
        "ContextFits": "True",
        "WeightsReady": "True",  # model.weights: on its claim
        "KVTransferReady": "Unknown",  # SGLang does not report its transfer engine
        "CapacityMatchesPlan": "True",
    }
    assert cond["CapacityMatchesPlan"]["reason"] == "AsPlanned"
    assert "3 worker(s)" in cond["CapacityMatchesPlan"]["message"]
    sts = kube.of_kind("StatefulSet")
    for entry in kube.cr["status"]["plan"]:
        argv = _argv(sts[f"flash-sgl-{entry['role']}-0"])
        full = int(flag(argv, "--max-total-tokens"))
        # Every PP rank holds the group's least pool (SGLang's all-reduce MIN).
        assert entry["observed"]["fullTokens"] == full <= entry["fullTokens"]
        assert entry["observed"]["maxContextTokens"] == min(
            full, int(flag(argv, "--context-length"))
        )
        assert entry["observed"]["maxRunningRequests"] == int(flag(argv, "--max-running-requests"))
        assert 0 < entry["observed"]["swaTokens"] <= entry["swaTokens"]
    assert [(e["role"], e["ppRank"]) for e in kube.cr["status"]["plan"]] == [
        ("prefill", 0),
        ("prefill", 1),
        ("decode", 0),
    ]


def test_a_group_that_realized_less_is_named_with_both_figures(
    make_body: Callable[..., Body],
) -> None:
    kube, probe = _serving(make_body)
    info = probe.infos["flash-sgl-decode-1-0"]
    planned = info["max_total_num_tokens"]
    info["max_total_num_tokens"] = planned - 3 * 256  # SGLang profiled less free memory
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    cond = conditions(kube)["CapacityMatchesPlan"]
    assert (cond["status"], cond["reason"]) == ("False", "CapacityDiffers")
    assert cond["message"] == (
        f"flash-sgl-decode-1-0 (decode, PP rank 0): fullTokens {planned - 768} realized, "
        f"{planned} planned (-3.0 pages) (tolerance: one page of tokens per rank)"
    )
    # The status shows the least over the replicas; serving goes on.
    (decode,) = [e for e in kube.cr["status"]["plan"] if e["role"] == "decode"]
    assert decode["observed"]["fullTokens"] == planned - 768
    assert conditions(kube)["Ready"]["status"] == "True"
    assert conditions(kube)["Degraded"]["status"] == "False"  # the context still fits

    # Within a page: as planned.
    info["max_total_num_tokens"] = planned - 256
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    assert conditions(kube)["CapacityMatchesPlan"]["status"] == "True"


def test_a_group_too_small_for_the_context_is_degraded(make_body: Callable[..., Body]) -> None:
    kube, probe = _serving(make_body)
    probe.infos["flash-sgl-prefill-0-0"]["max_total_num_tokens"] = 65536
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    cond = conditions(kube)
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == (
        "True",
        "CapacityBelowPlan",
    )
    assert "flash-sgl-prefill-0-0" in cond["Degraded"]["message"]
    assert "(prefill, PP ranks 0-1)" in cond["CapacityMatchesPlan"]["message"]
    prefill = [e for e in kube.cr["status"]["plan"] if e["role"] == "prefill"]
    assert [e["observed"]["maxContextTokens"] for e in prefill] == [65536, 65536]


def test_unknown_until_every_role_answers_and_an_unreadable_answer_is_named(
    make_body: Callable[..., Body],
) -> None:
    kube, probe = FakeKube(make_body(SAMPLE)), FakeProbe()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    kube.run_controllers()
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    cond = conditions(kube)["CapacityMatchesPlan"]
    assert (cond["status"], cond["reason"]) == ("Unknown", "NotObserved")
    assert cond["message"] == "no prefill or decode worker has answered /server_info yet"
    assert all("observed" not in e for e in kube.cr["status"]["plan"])

    sts = kube.of_kind("StatefulSet")
    probe.infos["flash-sgl-decode-0-0"] = realized(_argv(sts["flash-sgl-decode-0"]))
    probe.infos["flash-sgl-prefill-0-0"] = {"version": "0.6.0"}  # another SGLang's document
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    cond = conditions(kube)["CapacityMatchesPlan"]
    assert (cond["status"], cond["reason"]) == ("Unknown", "NotObserved")
    assert cond["message"] == (
        "flash-sgl-prefill-0-0: /server_info: max_total_num_tokens: expected a count, got None; "
        "no prefill worker has answered /server_info yet"
    )
    assert conditions(kube)["Ready"]["status"] == "True"  # observation never gates serving


def test_the_observed_gauges_follow_and_skip_what_sglang_does_not_report(
    make_body: Callable[..., Body],
) -> None:
    """The operator's observed_* gauges come from status.plan[].observed: SGLang's too."""
    kube, probe = _serving(make_body)
    for info in probe.infos.values():
        for state in info["internal_states"]:
            state["memory_usage"]["token_capacity_swa"] = None
    reconcile(kube.cr, kube, probe, clock=lambda: NOW)
    memory = plan_memory(parse_spec(kube.cr))
    series = capacity_series(NS, "flash-sgl", memory, kube.cr["status"])
    observed = {(s.name, s.labels[2], s.labels[3]): s.value for s in series}
    decode = next(e for e in kube.cr["status"]["plan"] if e["role"] == "decode")
    assert (
        observed[(f"{OBSERVED_PREFIX}full_tokens", "decode", "0")]
        == (decode["observed"]["fullTokens"])
    )
    assert (f"{OBSERVED_PREFIX}full_tokens", "prefill", "1") in observed
    assert not any(name == f"{OBSERVED_PREFIX}swa_tokens" for name, _, _ in observed)


def test_the_real_operator_reads_server_info_on_rank_0_only(live: Live) -> None:
    """kopf, ApiKube and HttpWorkerProbe against the loopback API server and stand-in SGLang
    servers on the pod IPs."""
    live.create_cr(SAMPLE)
    live.wait("groups applied", lambda: len(live.children("StatefulSet", "apps/v1")) == 3)
    pods = live.create_pods()
    assert len(pods) == 4  # prefill PP 2, two decode groups
    for name, sts in live.children("StatefulSet", "apps/v1").items():
        live.workers.info[live.ips[f"{name}-0"]] = realized(_argv(sts))
    live.start_pods(pods)
    live.server.set_status(
        "apps/v1", "Deployment", NS, "flash-sgl-router", {"replicas": 1, "readyReplicas": 1}
    )
    cond = live.wait(
        "CapacityMatchesPlan",
        lambda: (
            (c := live.condition("flash-sgl", "CapacityMatchesPlan"))
            and c["status"] != "Unknown"
            and c
        ),
    )
    assert (cond["status"], cond["reason"]) == ("True", "AsPlanned"), cond
    status = live.cr("flash-sgl")["status"]  # type: ignore[index]
    assert all("observed" in e for e in status["plan"])
    rank0 = {live.ips[p] for p in pods if p.endswith("-0")}
    assert {h.split("/", 1)[0] for h in live.workers.hits} == rank0
    assert {"/" + h.split("/", 1)[1] for h in live.workers.hits} == {"/server_info"}
    ready = live.condition("flash-sgl", "Ready")
    assert ready is not None and ready["status"] == "True"
