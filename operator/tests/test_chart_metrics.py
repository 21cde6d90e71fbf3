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
SGLANG_SAMPLE = "sglang-flash-pd.yaml"
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
    (service,) = _metrics_services(objects)
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
    assert not _metrics_services(objects)
    container = operator_container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSV4_OPERATOR_METRICS_PORT"] == "0"
    assert env["DSV4_METRICS_SCRAPE_NAMESPACE"] == ""
    assert [p["name"] for p in container["ports"]] == ["healthz"]
    args = ["template", "dsv4", str(CHART), "--set", "metrics.port=0"]
    with pytest.raises(AssertionError, match=r"needs metrics\.port > 0"):
        helm(*args, "--set", "metrics.serviceMonitor.enabled=true")


def _pod_templates(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Workload name -> the pod template the operator plans for it."""
    spec = parse_spec(body)
    state = build_desired_state(spec, parse_meta(body), plan_memory(spec))
    kinds = ("StatefulSet", "Deployment")
    return {
        o["metadata"]["name"]: o["spec"]["template"] for o in state.objects if o["kind"] in kinds
    }


def _prometheus_label(label: str) -> str:
    """The `__meta_kubernetes_pod_label_*` name Prometheus gives a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _port_numbers(template: dict[str, Any]) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]
    }


LABEL_COPIES = {
    "deployment": [_prometheus_label(L.DEPLOYMENT_LABEL)],
    "component": [_prometheus_label(L.APP_COMPONENT)],
    "role": [_prometheus_label(L.ROLE_LABEL)],
    "pp_rank": [_prometheus_label(L.POD_INDEX_LABEL)],
    "group": [_prometheus_label(L.GROUP_LABEL)],
}


@needs_helm
def test_pod_monitor_scrapes_the_operators_workers_and_routers(
    make_body: Callable[..., dict[str, Any]],
) -> None:
    (monitor,) = by_kind(render(*ON), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    status, http = spec["podMetricsEndpoints"]
    (component,) = spec["selector"]["matchExpressions"]
    assert component == {"key": L.APP_COMPONENT, "operator": "In", "values": ["worker", "router"]}
    # Every worker and router pod the operator plans (either engine) matches; our engine's serve
    # /metrics on `status` (8081), SGLang's server on `http` (8080).
    templates = {**_pod_templates(make_body()), **_pod_templates(make_body(SGLANG_SAMPLE))}
    assert {t["metadata"]["labels"][L.APP_COMPONENT] for t in templates.values()} == {
        "worker",
        "router",
    }
    for template in templates.values():
        labels = template["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        ports = _port_numbers(template)
        assert ports[status["port"]] == 8081
        if labels[L.APP_COMPONENT] == "worker":
            assert ports[http["port"]] == 8080
    assert status["path"] == http["path"] == "/metrics"
    # The pod labels that place a series on a rank of a deployment become target labels, on both.
    for endpoint in (status, http):
        relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"][1:]}
        assert relabel == LABEL_COPIES
    # The first relabeling picks the engine's pods, by the meta-label names of the operator's keys.
    engine_component = [_prometheus_label(k) for k in (L.ENGINE_LABEL, L.APP_COMPONENT)]
    assert status["relabelings"][0] == {
        "sourceLabels": engine_component,
        "separator": ";",
        "regex": "sglang;worker",
        "action": "drop",
    }
    assert http["relabelings"][0] == {
        "sourceLabels": [*engine_component, _prometheus_label(L.POD_INDEX_LABEL)],
        "separator": ";",
        "regex": "sglang;worker;0",
        "action": "keep",
    }
    watched = by_kind(render(*VALUE_SETS["monitors-watch-list"]), "PodMonitor")[0]
    assert watched["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    namespaced = by_kind(render(*VALUE_SETS["monitors-namespaced"]), "PodMonitor")[0]
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["dsv4-system"]}


# --- which pods each PodMonitor endpoint scrapes: a tiny model of prometheus-operator ----------


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector of matchLabels and `In` matchExpressions."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return selector["matchLabels"].items() <= labels.items() and all(
        labels.get(e["key"]) in e["values"] for e in expressions
    )


def _relabel_keeps(relabelings: list[dict[str, Any]], meta: dict[str, str]) -> bool:
    """Prometheus' keep and drop: the source labels' values (an absent label is "") joined by
    the separator (default ";") must match the whole regex (Prometheus anchors it)."""
    for rule in relabelings:
        action = rule.get("action", "replace").lower()
        if action not in ("keep", "drop"):
            continue  # a label copy never drops a target
        value = rule.get("separator", ";").join(meta.get(s, "") for s in rule["sourceLabels"])
        if (re.fullmatch(rule.get("regex", "(.*)"), value) is not None) != (action == "keep"):
            return False
    return True


def _scrapes(monitor: dict[str, Any], endpoint: dict[str, Any], pod: dict[str, Any]) -> bool:
    """A pod is a target of an endpoint iff the monitor selects it, it has a container port of
    the endpoint's name, and the endpoint's relabelings keep it."""
    labels = pod["metadata"]["labels"]
    meta = {_prometheus_label(k): v for k, v in labels.items()}
    return (
        _selected(monitor["spec"]["selector"], labels)
        and endpoint["port"] in _port_numbers(pod)
        and _relabel_keeps(endpoint["relabelings"], meta)
    )


def _as_pod(template: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    """A pod of `template`; a StatefulSet's carries its ordinal (the PP rank) as pod-index."""
    labels = dict(template["metadata"]["labels"])
    if rank is not None:
        labels[L.POD_INDEX_LABEL] = str(rank)
    return {**template, "metadata": {**template["metadata"], "labels": labels}}


def test_relabel_model_follows_prometheus() -> None:
    rule = {"sourceLabels": ["a", "b"], "separator": ";", "regex": "x;y", "action": "keep"}
    assert _relabel_keeps([rule], {"a": "x", "b": "y"})
    assert not _relabel_keeps([rule], {"a": "x", "b": "yy"})  # anchored: the whole value
    assert not _relabel_keeps([rule], {"a": "x"})  # absent: ""
    assert not _relabel_keeps([{**rule, "action": "drop"}], {"a": "x", "b": "y"})
    assert _relabel_keeps([{"sourceLabels": ["a"], "targetLabel": "t"}], {})


@needs_helm
def test_each_endpoint_scrapes_the_pods_that_serve_metrics_on_its_port(
    make_body: Callable[..., dict[str, Any]],
) -> None:
    """`status`: our workers (every rank) and both routers; `http`: PP rank 0 of SGLang's workers
    only (its ranks > 0 serve no HTTP, and nothing of SGLang's is on `status`)."""
    (monitor,) = by_kind(render(*ON), "PodMonitor")
    ours, sglang = _pod_templates(make_body()), _pod_templates(make_body(SGLANG_SAMPLE))
    pods = {
        "dsv4 worker 0": _as_pod(ours["tiny-prefill-0"], 0),
        "dsv4 worker 1": _as_pod(ours["tiny-prefill-0"], 1),
        "dsv4 router": _as_pod(ours["tiny-router"]),
        "sglang worker 0": _as_pod(sglang["flash-sgl-prefill-0"], 0),
        "sglang worker 1": _as_pod(sglang["flash-sgl-prefill-0"], 1),
        "sglang router": _as_pod(sglang["flash-sgl-router"]),
    }
    assert L.ENGINE_LABEL not in pods["sglang router"]["metadata"]["labels"]
    status, http = monitor["spec"]["podMetricsEndpoints"]
    assert {n for n, pod in pods.items() if _scrapes(monitor, status, pod)} == {
        "dsv4 worker 0",
        "dsv4 worker 1",
        "dsv4 router",
        "sglang router",
    }
    assert {n for n, pod in pods.items() if _scrapes(monitor, http, pod)} == {"sglang worker 0"}


@needs_helm
def test_service_monitor_scrapes_the_operators_metrics_service() -> None:
    objects = render(*ON)
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = _metrics_services(objects)
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
    from dsv4_router.liveness import LivenessRule
    from dsv4_router.metrics import RouterMetrics
    from dsv4_worker.mem.usage import PoolUsage
    from dsv4_worker.server.metrics import Metrics
    from dsv4_worker.server.runner import Snapshot

    worker = Metrics(lambda: Snapshot(usage=(PoolUsage("full", 0, 1),)))
    router = RouterMetrics(lambda: ([], 0.0), LivenessRule(misses=3, grace_s=10.0))
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


def _metrics_services(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's metrics Service (the chart also renders the StatefulSet's headless one)."""
    return [
        s
        for s in by_kind(objects, "Service")
        if s["metadata"]["labels"].get("app.kubernetes.io/component") == "metrics"
    ]
