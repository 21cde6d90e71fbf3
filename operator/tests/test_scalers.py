"""Autoscaling by an HPA or KEDA (`spec.autoscaling.engine: hpa|keda`, `scalers.py`): per role
a DSV4RoleScaler with the scale subresource those need, aimed at by an HorizontalPodAutoscaler
(validated against Kubernetes' own schema) or a KEDA ScaledObject; the replicas an HPA writes
through /scale are the role's PP groups, clamped to its range, and the operator echoes them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
from repo_paths import ROOT
from support import crd_support as S
from support.fake_apiserver import load_crd
from support.fake_kube import FakeKube, FakeProbe
from test_manifests import KUBERNETES_VERSIONS

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.handlers import Deps, run_reconcile
from dsv4_operator.objects import build_desired_state
from dsv4_operator.scalers import SCALER_API_VERSION, SCALER_KIND

Body = dict[str, Any]
LOG = logging.getLogger("test")
SCALER_CRD = load_crd(ROOT / "crds" / "dsv4rolescaler.yaml")
AUTO = {"minReplicas": 1, "maxReplicas": 4, "queueDepthPerReplica": 4, "kvUtilization": 0.75}


def body_with(make_body: Callable[..., Body], engine: str, **extra: Any) -> Body:
    body = make_body(autoscaling={"engine": engine, **extra})
    body["spec"]["decode"]["autoscaling"] = dict(AUTO)
    return body


def objects(body: Body) -> dict[tuple[str, str], Body]:
    spec = parse_spec(body)
    state = build_desired_state(spec, parse_meta(body), plan_memory(spec))
    return {(o["kind"], o["metadata"]["name"]): o for o in state.objects}


def test_the_scale_subresource_points_at_replicas_and_the_selector() -> None:
    (version,) = SCALER_CRD["spec"]["versions"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


@pytest.mark.parametrize("k8s", KUBERNETES_VERSIONS)
def test_engine_hpa_renders_a_scaler_and_a_valid_hpa_per_autoscaled_role(
    make_body: Callable[..., Body], k8s: str
) -> None:
    got = objects(body_with(make_body, "hpa"))
    scaler = got[(SCALER_KIND, "tiny-decode")]
    assert scaler["spec"] == {
        "deployment": "tiny",
        "role": "decode",
        "replicas": 1,
        "minReplicas": 1,
        "maxReplicas": 4,
    }
    assert scaler["status"]["selector"] == L.selector_string(L.serving_selector("tiny", "decode"))
    schema = S.crd_schema(SCALER_CRD)
    assert S.validate_cr(scaler, schema) == []
    hpa = got[("HorizontalPodAutoscaler", "tiny-decode")]
    kubernetes_validate.validate(hpa, k8s, strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": SCALER_API_VERSION,
        "kind": SCALER_KIND,
        "name": "tiny-decode",
    }
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
        "dsv4_queue_depth_requests",
        "vllm_kv_cache_usage_perc",
    ]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 60
    assert not any(k == (SCALER_KIND, "tiny-prefill") for k in got)  # prefill is not autoscaled


def test_engine_keda_renders_a_scaled_object_on_prometheus(make_body: Callable[..., Body]) -> None:
    address = "http://prometheus.monitoring.svc:9090"
    got = objects(body_with(make_body, "keda", prometheusAddress=address))
    scaled = got[("ScaledObject", "tiny-decode")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["kind"] == SCALER_KIND
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 4)
    queue, kv = scaled["spec"]["triggers"]
    assert queue["type"] == "prometheus" and queue["metricType"] == "AverageValue"
    assert queue["metadata"] == {
        "serverAddress": address,
        "query": 'sum(dsv4_queue_depth_requests{namespace="ns",deployment="tiny",role="decode"})',
        "threshold": "4",
    }
    assert "vllm:kv_cache_usage_perc" in kv["metadata"]["query"]
    assert kv["metadata"]["threshold"] == "0.75"


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"engine": "keda"}, "spec.autoscaling.prometheusAddress: required with engine keda"),
        (
            {"engine": "hpa", "prometheusAddress": "http://p:9090"},
            "spec.autoscaling.prometheusAddress",
        ),
        ({"engine": "keda", "prometheusAddress": "p:9090"}, "spec.autoscaling.prometheusAddress"),
    ],
)
def test_engine_settings_name_their_field(
    make_body: Callable[..., Body], autoscaling: Body, message: str
) -> None:
    body = make_body(autoscaling=autoscaling)
    body["spec"]["decode"]["autoscaling"] = dict(AUTO)
    with pytest.raises(SpecError) as err:
        parse_spec(body)
    assert any(e.startswith(message) for e in err.value.errors), err.value.errors


def test_what_the_hpa_writes_through_scale_is_the_groups_the_operator_runs(
    make_body: Callable[..., Body],
) -> None:
    kube = FakeKube(body_with(make_body, "hpa"))
    deps = Deps(kube, FakeProbe(), OperatorConfig(), ReconcileGate())

    def decode_groups() -> int:
        sets = kube.list("apps/v1", "StatefulSet", "ns", f"{L.ROLE_LABEL}=decode")
        return len(sets)

    def hpa_writes(replicas: int) -> None:  # PUT .../dsv4rolescalers/tiny-decode/scale
        kube.objects[(SCALER_API_VERSION, SCALER_KIND, "ns", "tiny-decode")]["spec"]["replicas"] = (
            replicas
        )

    run_reconcile(kube.cr, deps, LOG)
    assert decode_groups() == 1
    hpa_writes(3)
    run_reconcile(kube.cr, deps, LOG)
    assert decode_groups() == 3
    scaler = kube.get(SCALER_API_VERSION, SCALER_KIND, "ns", "tiny-decode")
    assert scaler is not None and scaler["spec"]["replicas"] == 3  # echoed, not fought
    assert kube.cr["status"]["roles"]["decode"]["replicas"] == 3
    hpa_writes(9)  # past maxReplicas 4: clamped
    run_reconcile(kube.cr, deps, LOG)
    assert decode_groups() == 4
    hpa_writes(1)
    kube.run_controllers()  # its groups ready: a group past the replicas is no roll's surge
    run_reconcile(kube.cr, deps, LOG)
    assert decode_groups() == 1
    # Back to engine operator: the scaler and the HPA are pruned.
    kube.cr["spec"]["autoscaling"] = {"engine": "operator"}
    run_reconcile(kube.cr, deps, LOG)
    assert kube.of_kind(SCALER_KIND) == {} and kube.of_kind("HorizontalPodAutoscaler") == {}
