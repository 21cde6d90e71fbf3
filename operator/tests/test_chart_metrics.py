"""The chart's metrics: the operator's metrics port, env and Service; the optional PodMonitor and
ServiceMonitor (validated against prometheus-operator's CRDs, vendored in data/); the Grafana
dashboard, whose every PromQL expression names only metrics the code exports."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from prometheus_client import CollectorRegistry
from support import crd_support as S
from support.chart_support import CHART, K8S_VERSIONS, helm, needs_helm, render

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.metrics import CAPACITY_GAUGES, OperatorMetrics
from dsv4_operator.objects import build_desired_state

MONITORING_CRDS = Path(__file__).parent / "data" / "prometheus-operator"
DASHBOARD = CHART / "dashboards" / "dsv4.json"
ON = [
    *("--set", "metrics.podMonitor.enabled=true"),
    *("--set", "metrics.serviceMonitor.enabled=true"),
    *("--set", "metrics.dashboard.enabled=true"),
    *("--set", "metrics.podMonitor.labels.release=prom"),
    *("--set", "metrics.serviceMonitor.labels.release=prom"),
]
VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    "monitors": ON,
    "monitors-watch-list": [*ON, "--set", "watch.namespaces={team-a,team-b}"],
    "monitors-namespaced": [*ON, "--set", "rbac.namespaced=true"],
    "operator-metrics-off": ["--set", "metrics.port=0", "--set", "metrics.scrapeNamespace="],
}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = by_kind(objects, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def monitoring_schema(kind: str) -> dict[str, Any]:
    crd = S.load_yaml(MONITORING_CRDS / f"monitoring.coreos.com_{kind.lower()}s.yaml")
    assert crd["spec"]["names"]["kind"] == kind
    return S.crd_schema(crd)


@needs_helm
@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name: str) -> None:
    helm("lint", "--strict", str(CHART), *VALUE_SETS[name])


@needs_helm
@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_are_valid(name: str) -> None:
    """Built-in kinds pass kubernetes-validate; the monitors pass their CRD's schema."""
    objects = render(*VALUE_SETS[name])
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            assert S.validate_cr(obj, monitoring_schema(obj["kind"])) == [], obj
            continue
        for k8s in K8S_VERSIONS:
            kubernetes_validate.validate(obj, k8s, strict=True)


def test_the_vendored_schemas_refuse_a_misspelled_field() -> None:
    schema = monitoring_schema("PodMonitor")
    bad = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "x"},
        "spec": {"selector": {}, "podMetricsEndpoints": [{"prot": "status"}]},
    }
    assert S.validate_cr(bad, schema) == ["spec.podMetricsEndpoints[0].prot: unknown field"]


@needs_helm
def test_default_install_serves_operator_metrics_without_monitors() -> None:
    objects = render()
    assert not [o for o in objects if o["apiVersion"] == "monitoring.coreos.com/v1"]
    assert not [
        c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    container = operator_container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSV4_OPERATOR_METRICS_PORT"] == "8090"
    assert env["DSV4_METRICS_SCRAPE_NAMESPACE"] == "monitoring"
    assert {"name": "metrics", "containerPort": 8090, "protocol": "TCP"} in container["ports"]
    (service,) = by_kind(objects, "Service")
    assert service["metadata"]["name"] == "dsv4-dsv4-operator-metrics"
    (sts,) = by_kind(objects, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    # The NetworkPolicy lets the operator's pods reach the workers by these labels.
    assert L.OPERATOR_POD_LABELS.items() <= pod_labels.items()


@needs_helm
def test_operator_metrics_can_be_turned_off() -> None:
    objects = render(*VALUE_SETS["operator-metrics-off"])
    assert not by_kind(objects, "Service")
    container = operator_container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSV4_OPERATOR_METRICS_PORT"] == "0"
    assert env["DSV4_METRICS_SCRAPE_NAMESPACE"] == ""
    assert [p["name"] for p in container["ports"]] == ["healthz"]
    args = ["template", "dsv4", str(CHART), "--set", "metrics.port=0"]
    with pytest.raises(AssertionError, match=r"needs metrics\.port > 0"):
        helm(*args, "--set", "metrics.serviceMonitor.enabled=true")


def _pod_templates(make_body: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    body = make_body()
    spec = parse_spec(body)
    state = build_desired_state(spec, parse_meta(body), plan_memory(spec))
    return [
        o["spec"]["template"] for o in state.objects if o["kind"] in ("StatefulSet", "Deployment")
    ]


def _prometheus_label(label: str) -> str:
    """The `__meta_kubernetes_pod_label_*` name Prometheus gives a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


@needs_helm
def test_pod_monitor_scrapes_the_operators_workers_and_routers(
    make_body: Callable[..., dict[str, Any]],
) -> None:
    (monitor,) = by_kind(render(*ON), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["podMetricsEndpoints"]
    (component,) = spec["selector"]["matchExpressions"]
    assert component == {"key": L.APP_COMPONENT, "operator": "In", "values": ["worker", "router"]}
    # Every worker and router pod the operator plans matches, and serves /metrics on that port.
    templates = _pod_templates(make_body)
    assert {t["metadata"]["labels"][L.APP_COMPONENT] for t in templates} == {"worker", "router"}
    for template in templates:
        labels = template["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        ports = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c["ports"]
        }
        assert ports[endpoint["port"]] == 8081
    assert endpoint["path"] == "/metrics"
    # The pod labels that place a series on a rank of a deployment become target labels.
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel == {
        "deployment": [_prometheus_label(L.DEPLOYMENT_LABEL)],
        "component": [_prometheus_label(L.APP_COMPONENT)],
        "role": [_prometheus_label(L.ROLE_LABEL)],
        "pp_rank": [_prometheus_label(L.POD_INDEX_LABEL)],
        "group": [_prometheus_label(L.GROUP_LABEL)],
    }
    watched = by_kind(render(*VALUE_SETS["monitors-watch-list"]), "PodMonitor")[0]
    assert watched["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    namespaced = by_kind(render(*VALUE_SETS["monitors-namespaced"]), "PodMonitor")[0]
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["dsv4-system"]}


@needs_helm
def test_service_monitor_scrapes_the_operators_metrics_service() -> None:
    objects = render(*ON)
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = by_kind(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["dsv4-system"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["honorLabels"] is True  # the CR's `namespace` label wins


@needs_helm
def test_dashboard_config_map_carries_the_json() -> None:
    (cm,) = [
        c for c in by_kind(render(*ON), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "dsv4-system"
    assert json.loads(cm["data"]["dsv4.json"]) == json.loads(DASHBOARD.read_text())
    moved = render(*ON, "--set", "metrics.dashboard.namespace=grafana")
    (cm,) = [c for c in by_kind(moved, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["namespace"] == "grafana"


# --- the dashboard ---------------------------------------------------------------------------

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exposed(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry exposes (families with no sample yet included)."""
    return {f.name + s for f in registry.collect() for s in SUFFIXES[f.type]}


def exported_metric_names() -> set[str]:
    """What the worker, the router and the operator export, from their own registries."""
    from dsv4_router.metrics import RouterMetrics
    from dsv4_worker.mem.usage import PoolUsage
    from dsv4_worker.server.metrics import Metrics
    from dsv4_worker.server.runner import Snapshot

    worker = Metrics(lambda: Snapshot(usage=(PoolUsage("full", 0, 1),)))
    router = RouterMetrics(lambda: ([], 0.0), stale_after_s=10.0)
    names = set()
    for registry in (worker.registry, router.registry, OperatorMetrics().registry):
        names |= _exposed(registry)
    return names


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_queries_name_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_metric_names()
    assert set(CAPACITY_GAUGES) <= exported and "dsv4_kv_total_pages" in exported
    used: set[str] = set()
    for expr in _expressions(dashboard):
        names = set(re.findall(r"\bdsv4_\w+", expr))
        assert names, expr
        assert names <= exported, (expr, names - exported)
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        used |= names
    # What the dashboard is for: planned vs realized per rank, load, requests, TTFT.
    assert {
        "dsv4_operator_planned_kv_pages",
        "dsv4_kv_total_pages",
        "dsv4_operator_planned_full_tokens",
        "dsv4_operator_observed_full_tokens",
        "dsv4_kv_used_pages",
        "dsv4_requests_running",
        "dsv4_requests_waiting",
        "dsv4_router_requests_total",
        "dsv4_time_to_first_token_seconds_bucket",
    } <= used


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "deployment", "pool"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        text = json.dumps(panel)
        for var in re.findall(r"\$(\w+)", text):
            assert var in variables or var.startswith("__"), (panel["title"], var)
