"""The operator's metrics: the NetworkPolicy's scrape rule, the pure capacity mapping, and what
the registry holds after reconciles through the kopf glue (ok, rejected, failed, deleted)."""

from __future__ import annotations

import logging
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

import kopf
import pytest
from support.fake_kube import FakeKube, FakeProbe

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator import settings
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.handlers import Deps, forget_deployment, on_deployment_event, run_reconcile
from dsv4_operator.kube import KubeError
from dsv4_operator.manifests import build_network_policy, metrics_ingress
from dsv4_operator.metrics import (
    CAPACITY_GAUGES,
    OperatorMetrics,
    capacity_series,
    failure_reason,
)

LOG = logging.getLogger("test")
Cluster = tuple[FakeKube, FakeProbe]


def deps(kube: Any, probe: Any, metrics: OperatorMetrics, **config: Any) -> Deps:
    return Deps(kube, probe, OperatorConfig(**config), ReconcileGate(), metrics)


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    value: float | None = metrics.registry.get_sample_value(name, labels)
    return value


def rank(role: str, pp_rank: int, name: str = "tiny") -> dict[str, str]:
    return {"namespace": "ns", "deployment": name, "role": role, "pp_rank": str(pp_rank)}


# --- the NetworkPolicy -----------------------------------------------------------------------


def test_scrape_rule_admits_one_namespace_on_the_status_port_by_name() -> None:
    assert metrics_ingress("monitoring") == [
        {
            "from": [
                {"namespaceSelector": {"matchLabels": {L.NAMESPACE_NAME_LABEL: "monitoring"}}}
            ],
            "ports": [{"protocol": "TCP", "port": "status"}],
        }
    ]
    assert metrics_ingress("") == []


def test_network_policy_has_the_scrape_rule_only_when_configured(
    make_body: Callable[..., dict[str, Any]],
) -> None:
    meta = parse_meta(make_body())
    without = build_network_policy(meta)["spec"]["ingress"]
    with_rule = build_network_policy(meta, "monitoring")["spec"]["ingress"]
    assert with_rule == [*without, *metrics_ingress("monitoring")]
    assert len(without) == 3  # peers, router, operator


def test_reconcile_applies_the_configured_scrape_rule(cluster: Cluster) -> None:
    kube, probe = cluster
    run_reconcile(
        kube.cr, deps(kube, probe, OperatorMetrics(), metrics_scrape_namespace="mon"), LOG
    )
    policies = kube.of_kind("NetworkPolicy")
    workers = next(p for p in policies.values() if p["metadata"]["name"] == "tiny-workers")
    assert workers["spec"]["ingress"][-1] == metrics_ingress("mon")[0]
    router = next(p for p in policies.values() if p["metadata"]["name"] == "tiny-router")
    scrapers = router["spec"]["ingress"][-1]
    assert scrapers["from"] == metrics_ingress("mon")[0]["from"]
    assert scrapers["ports"] == [{"protocol": "TCP", "port": "status"}]


def test_configuration_from_the_environment() -> None:
    env = {"DSV4_METRICS_SCRAPE_NAMESPACE": "monitoring"}
    assert OperatorConfig.from_env(env).metrics_scrape_namespace == "monitoring"
    assert OperatorConfig.from_env({}).metrics_scrape_namespace == ""
    assert settings.metrics_address({}) is None
    assert settings.metrics_address({"DSV4_OPERATOR_METRICS_PORT": "0"}) is None
    assert settings.metrics_address({"DSV4_OPERATOR_METRICS_PORT": "8090"}) == ("0.0.0.0", 8090)
    env = {"DSV4_OPERATOR_METRICS_PORT": "9", "DSV4_OPERATOR_METRICS_HOST": "127.0.0.1"}
    assert settings.metrics_address(env) == ("127.0.0.1", 9)


# --- the pure mapping ------------------------------------------------------------------------


def test_capacity_series_are_the_plan_per_rank(make_body: Callable[..., dict[str, Any]]) -> None:
    body = make_body()
    spec = parse_spec(body)
    memory = plan_memory(spec)
    series = capacity_series("ns", "tiny", memory, {})
    got = {(s.name, s.labels): s.value for s in series}
    assert len(got) == len(series)  # one value per (gauge, labels)
    for role in L.WORKER_ROLES:
        for r in memory.role(role).ranks:
            key = ("ns", "tiny", role, str(r.pp_rank))
            assert got["dsv4_operator_planned_full_tokens", key] == r.capacity.full_tokens
            assert got["dsv4_operator_planned_swa_tokens", key] == r.capacity.swa_tokens
            assert (
                got["dsv4_operator_planned_max_running_requests", key]
                == r.capacity.max_running_requests
            )
            assert (
                got["dsv4_operator_planned_max_context_tokens", key]
                == r.capacity.max_context_tokens
            )
            pages = "dsv4_operator_planned_kv_pages"
            assert got[pages, (*key, "full")] == r.pools.full_pages
            assert got[pages, (*key, "swa")] == r.pools.swa_pages
            assert got[pages, (*key, "req_slots")] == r.pools.request_slots
    assert not any(s.name.startswith("dsv4_operator_observed_") for s in series)
    for s in series:
        assert len(s.labels) == len(CAPACITY_GAUGES[s.name][1])
    assert capacity_series("ns", "tiny", None, {}) == ()


def test_failure_reasons_are_bounded() -> None:
    assert failure_reason(KubeError("409", retryable=True)) == "KubeRetryable"
    assert failure_reason(KubeError("403", retryable=False)) == "KubeError"
    assert failure_reason(ValueError("bug")) == "ValueError"


# --- through the kopf glue -------------------------------------------------------------------


def test_a_reconcile_is_counted_and_exports_planned_then_observed_capacity(
    cluster: Cluster,
) -> None:
    kube, probe = cluster
    metrics = OperatorMetrics()
    result = run_reconcile(kube.cr, deps(kube, probe, metrics), LOG)
    assert sample(metrics, "dsv4_operator_reconciles_total", result="ok") == 1
    assert sample(metrics, "dsv4_operator_reconciles_total", result="error") == 0
    assert sample(metrics, "dsv4_operator_reconcile_duration_seconds_count") == 1
    for entry in result.status["plan"]:
        labels = rank(entry["role"], entry["ppRank"])
        assert sample(metrics, "dsv4_operator_planned_full_tokens", **labels) == entry["fullTokens"]
        assert sample(metrics, "dsv4_operator_observed_full_tokens", **labels) is None
    # The workers come up and report 90 % of the plan: observed series appear, planned stay.
    kube.run_controllers()
    probe.report_planned(kube, scale=0.9)
    result = run_reconcile(kube.cr, deps(kube, probe, metrics), LOG)
    assert sample(metrics, "dsv4_operator_reconciles_total", result="ok") == 2
    for entry in result.status["plan"]:
        labels = rank(entry["role"], entry["ppRank"])
        observed = entry["observed"]["fullTokens"]
        assert sample(metrics, "dsv4_operator_observed_full_tokens", **labels) == observed
        assert observed < entry["fullTokens"]
        assert sample(metrics, "dsv4_operator_planned_full_tokens", **labels) == entry["fullTokens"]
    text = metrics.render().decode()
    assert 'dsv4_operator_planned_kv_pages{deployment="tiny",namespace="ns",pool="swa"' in text


def test_a_rejected_spec_is_an_error_by_reason_and_drops_the_plan(
    make_cluster: Callable[..., Cluster],
) -> None:
    kube, probe = make_cluster()
    metrics = OperatorMetrics()
    run_reconcile(kube.cr, deps(kube, probe, metrics), LOG)
    assert sample(metrics, "dsv4_operator_planned_full_tokens", **rank("decode", 0)) is not None
    kube.cr["spec"]["maxContextTokens"] = 0  # an edit the CRD would refuse; parse_spec does too
    with pytest.raises(kopf.PermanentError):
        run_reconcile(kube.cr, deps(kube, probe, metrics), LOG)
    assert sample(metrics, "dsv4_operator_reconciles_total", result="error") == 1
    assert sample(metrics, "dsv4_operator_reconcile_errors_total", reason="InvalidSpec") == 1
    assert sample(metrics, "dsv4_operator_planned_full_tokens", **rank("decode", 0)) is None


def test_a_context_that_does_not_fit_keeps_the_planned_capacity(
    make_cluster: Callable[..., Cluster],
) -> None:
    kube, probe = make_cluster(maxContextTokens=8192)
    metrics = OperatorMetrics()
    result = run_reconcile(kube.cr, deps(kube, probe, metrics), LOG)
    assert sample(metrics, "dsv4_operator_reconcile_errors_total", reason="ContextTooLong") == 1
    largest = result.status["maxContextTokens"]
    planned = [
        sample(metrics, "dsv4_operator_planned_max_context_tokens", **rank(e["role"], e["ppRank"]))
        for e in result.status["plan"]
    ]
    assert min(p for p in planned if p is not None) == largest < 8192


class FailingKube:
    def __getattr__(self, name: str) -> Any:
        def fail(*_: Any, **__: Any) -> Any:
            raise KubeError("list: 409 Conflict", retryable=True, status=409)

        return fail


def test_an_api_error_is_counted_and_leaves_the_series(cluster: Cluster) -> None:
    kube, probe = cluster
    metrics = OperatorMetrics()
    run_reconcile(kube.cr, deps(kube, probe, metrics), LOG)
    with pytest.raises(kopf.TemporaryError):
        run_reconcile(kube.cr, deps(FailingKube(), probe, metrics), LOG)
    assert sample(metrics, "dsv4_operator_reconciles_total", result="error") == 1
    assert sample(metrics, "dsv4_operator_reconcile_errors_total", reason="KubeRetryable") == 1
    assert sample(metrics, "dsv4_operator_reconcile_duration_seconds_count") == 2
    assert sample(metrics, "dsv4_operator_planned_full_tokens", **rank("decode", 0)) is not None


def test_a_deleted_cr_loses_its_series_and_only_its_own(
    make_body: Callable[..., dict[str, Any]],
) -> None:
    metrics = OperatorMetrics()
    gate = ReconcileGate()
    for name in ("tiny", "other"):
        body = make_body()
        body["metadata"]["name"] = name
        kube, probe = FakeKube(body), FakeProbe()
        run_reconcile(body, Deps(kube, probe, OperatorConfig(), gate, metrics), LOG)
    memo = kopf.Memo(kube=None, probe=None, config=None, gate=gate, metrics=metrics)
    on_deployment_event(event={"type": "MODIFIED"}, namespace="ns", name="tiny", memo=memo)
    assert sample(metrics, "dsv4_operator_planned_full_tokens", **rank("decode", 0)) is not None
    on_deployment_event(event={"type": "DELETED"}, namespace="ns", name="tiny", memo=memo)
    assert sample(metrics, "dsv4_operator_planned_full_tokens", **rank("decode", 0)) is None
    assert 'deployment="tiny"' not in metrics.render().decode()
    other = rank("decode", 0, name="other")
    assert sample(metrics, "dsv4_operator_planned_full_tokens", **other) is not None
    # Counters are per operator, not per CR: they stay.
    assert sample(metrics, "dsv4_operator_reconciles_total", result="ok") == 2
    forget_deployment("ns", "never-seen", Deps(None, None, OperatorConfig(), gate, metrics))


def test_startup_serves_the_registry_and_cleanup_stops_it(
    monkeypatch: pytest.MonkeyPatch, make_body: Callable[..., dict[str, Any]]
) -> None:
    monkeypatch.setattr(settings.ApiKube, "from_environment", lambda _timeout: object())
    monkeypatch.setenv("DSV4_OPERATOR_METRICS_HOST", "127.0.0.1")
    monkeypatch.setenv("DSV4_OPERATOR_METRICS_PORT", "0")
    memo = kopf.Memo()
    settings.on_startup(settings=kopf.OperatorSettings(), memo=memo)
    assert "metrics_server" not in memo and isinstance(memo["metrics"], OperatorMetrics)
    # A real port: what the chart's DSV4_OPERATOR_METRICS_PORT asks for.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DSV4_OPERATOR_METRICS_PORT", str(port))
    memo = kopf.Memo()
    settings.on_startup(settings=kopf.OperatorSettings(), memo=memo)
    try:
        kube, probe = FakeKube(make_body()), FakeProbe()
        run_reconcile(kube.cr, deps(kube, probe, memo["metrics"]), LOG)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
            text = rsp.read().decode()
        assert 'dsv4_operator_reconciles_total{result="ok"} 1.0' in text
        assert "dsv4_operator_planned_max_context_tokens{" in text
    finally:
        settings.on_cleanup(memo=memo)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)
