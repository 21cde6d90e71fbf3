"""Rendered children: valid Kubernetes objects (strict schemas, 1.30 and 1.37), owned, labelled,
hardened, one StatefulSet per PP group, routing only to the serving rank, hashes that roll
exactly what changed."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.names import GPU_RESOURCE, NAME_PATTERN
from dsv4_common.api.rank_config import parse_rank_config, planned_rank
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.objects import DesiredState, build_desired_state

KUBERNETES_VERSIONS = ("1.30", "1.37")
SAMPLES = ("tiny-cpu.yaml", "tiny-minimal.yaml", "flash-gpu.yaml", "flash-h200-volcano.yaml")
Body = dict[str, Any]


def desired(body: Body) -> DesiredState:
    spec = parse_spec(body)
    return build_desired_state(spec, parse_meta(body), plan_memory(spec))


def by_kind(state: DesiredState) -> dict[str, dict[str, Body]]:
    out: dict[str, dict[str, Body]] = {}
    for obj in state.objects:
        out.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    return out


def test_validator_knows_both_versions() -> None:
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "datum": {}}
    for version in KUBERNETES_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, version, strict=True)


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_strict_schema_validation(
    make_body: Callable[..., Body], sample: str, version: str
) -> None:
    for obj in desired(make_body(sample)).objects:
        if obj["kind"] == "PodGroup":
            continue  # a custom resource: test_gang.py validates it against its CRD
        kubernetes_validate.validate(obj, version, strict=True)


def test_object_set_for_pp2_prefill_and_one_decode(make_body: Callable[..., Body]) -> None:
    kinds = by_kind(desired(make_body()))
    assert set(kinds["StatefulSet"]) == {"tiny-prefill-0", "tiny-decode-0"}
    assert set(kinds["Service"]) == {
        "tiny-prefill",
        "tiny-decode",
        "tiny-prefill-0",
        "tiny-decode-0",
        "tiny-router",
    }
    assert set(kinds["PodDisruptionBudget"]) == {"tiny-prefill", "tiny-decode"}
    assert set(kinds["Deployment"]) == {"tiny-router"}
    assert set(kinds["ConfigMap"]) == {"tiny-config"}
    assert set(kinds["NetworkPolicy"]) == {"tiny-workers", "tiny-router"}
    assert set(kinds["ServiceAccount"]) == {"tiny-workload"}


def test_every_object_is_owned_labelled_and_namespaced(make_body: Callable[..., Body]) -> None:
    for obj in desired(make_body()).objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "serving.dsv4.io/v1alpha1",
                "kind": "DSV4Deployment",
                "name": "tiny",
                "uid": "cr-uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert L.prune_selector("tiny") == L.selector_string(
            {k: meta["labels"][k] for k in (L.APP_MANAGED_BY, L.DEPLOYMENT_LABEL)}
        )


def test_pp_group_statefulset_shape(make_body: Callable[..., Body]) -> None:
    sts = by_kind(desired(make_body()))["StatefulSet"]["tiny-prefill-0"]["spec"]
    assert sts["replicas"] == 2  # one pod per PP rank
    assert sts["podManagementPolicy"] == "Parallel"
    assert sts["updateStrategy"] == {"type": "OnDelete"}
    assert sts["serviceName"] == "tiny-prefill-0"
    assert sts["selector"]["matchLabels"] == {
        L.DEPLOYMENT_LABEL: "tiny",
        L.GROUP_LABEL: "tiny-prefill-0",
    }
    labels = sts["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in sts["selector"]["matchLabels"].items())
    env = {e["name"]: e for e in sts["template"]["spec"]["containers"][0]["env"]}
    assert env["DSV4_PP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{L.POD_INDEX_LABEL}']"
    )
    assert env["DSV4_ROLE"]["value"] == "prefill"


def test_group_service_is_headless_and_publishes_unready_peers(
    make_body: Callable[..., Body],
) -> None:
    svc = by_kind(desired(make_body()))["Service"]["tiny-prefill-0"]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"] == {L.DEPLOYMENT_LABEL: "tiny", L.GROUP_LABEL: "tiny-prefill-0"}


def test_only_the_serving_rank_is_routed_to(make_body: Callable[..., Body]) -> None:
    services = by_kind(desired(make_body()))["Service"]
    for role in ("prefill", "decode"):
        spec = services[f"tiny-{role}"]["spec"]
        assert spec["selector"][L.POD_INDEX_LABEL] == "0"
        assert spec["selector"][L.ROLE_LABEL] == role
        assert not spec.get("publishNotReadyAddresses")  # readiness gates routing
    router = services["tiny-router"]["spec"]
    assert router["ports"][0]["port"] == 8000
    assert router["selector"] == {L.DEPLOYMENT_LABEL: "tiny", L.APP_COMPONENT: "router"}


def _containers(state: DesiredState) -> list[tuple[Body, Body]]:
    out = []
    for obj in state.objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            pod = obj["spec"]["template"]["spec"]
            out.extend((pod, c) for c in pod["containers"])
    return out


@pytest.mark.parametrize("sample", SAMPLES)
def test_pods_are_hardened_and_carry_no_api_token(
    make_body: Callable[..., Body], sample: str
) -> None:
    for pod, container in _containers(desired(make_body(sample))):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == f"{make_body(sample)['metadata']['name']}-workload"
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}


def test_gpu_requests_come_from_gpu_per_pod(make_body: Callable[..., Body]) -> None:
    gpu = desired(make_body("flash-gpu.yaml"))
    cpu = desired(make_body("tiny-cpu.yaml"))
    for pod, c in _containers(gpu):
        if c["name"] == "worker":
            assert c["resources"]["limits"][GPU_RESOURCE] == "4"
            assert c["resources"]["requests"] == {"cpu": "16", "memory": "200Gi"}
            toleration = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
            assert toleration in pod["tolerations"]
        else:
            assert GPU_RESOURCE not in json.dumps(c["resources"])
    for pod, c in _containers(cpu):
        assert GPU_RESOURCE not in json.dumps(c["resources"]) and "tolerations" not in pod


def test_weights_volume_is_mounted_read_only(make_body: Callable[..., Body]) -> None:
    state = desired(make_body("flash-gpu.yaml"))
    sts = by_kind(state)["StatefulSet"]["flash-decode-1"]["spec"]["template"]["spec"]
    volume = next(v for v in sts["volumes"] if v["name"] == "weights")
    assert volume["persistentVolumeClaim"] == {"claimName": "dsv4-flash-weights", "readOnly": True}
    mount = next(m for m in sts["containers"][0]["volumeMounts"] if m["name"] == "weights")
    assert mount == {"name": "weights", "mountPath": "/models/DeepSeek-V4-Flash", "readOnly": True}


def test_pdb_allows_one_unavailable_worker_per_role(make_body: Callable[..., Body]) -> None:
    pdbs = by_kind(desired(make_body()))["PodDisruptionBudget"]
    for role in ("prefill", "decode"):
        spec = pdbs[f"tiny-{role}"]["spec"]
        assert spec["maxUnavailable"] == 1
        assert spec["selector"]["matchLabels"][L.ROLE_LABEL] == role


def test_router_network_policy_admits_clients_on_http_and_the_operator_on_status(
    make_body: Callable[..., Body],
) -> None:
    """Every pod the operator creates has a NetworkPolicy (checkov CKV2_K8S_6): the router
    takes clients from anywhere on its serving port, the operator on `status`, nothing else."""
    policy = by_kind(desired(make_body()))["NetworkPolicy"]["tiny-router"]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"] == {
        L.DEPLOYMENT_LABEL: "tiny",
        L.APP_COMPONENT: "router",
    }
    clients, operator = policy["ingress"]
    assert "from" not in clients and clients["ports"] == [{"protocol": "TCP", "port": "http"}]
    assert operator["from"][0]["podSelector"]["matchLabels"] == dict(L.OPERATOR_POD_LABELS)
    assert operator["ports"] == [{"protocol": "TCP", "port": "status"}]


def test_network_policy_admits_only_peers_router_and_operator(
    make_body: Callable[..., Body],
) -> None:
    policy = by_kind(desired(make_body()))["NetworkPolicy"]["tiny-workers"]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"] == {
        L.DEPLOYMENT_LABEL: "tiny",
        L.APP_COMPONENT: "worker",
    }
    peers, router, operator = policy["ingress"]
    assert peers["from"] == [{"podSelector": policy["podSelector"]}] and "ports" not in peers
    assert router["from"][0]["podSelector"]["matchLabels"][L.APP_COMPONENT] == "router"
    assert {p["port"] for p in router["ports"]} == {8080, 8081}
    assert operator["from"][0]["podSelector"]["matchLabels"] == L.OPERATOR_POD_LABELS
    assert [p["port"] for p in operator["ports"]] == [8081]


def test_the_operator_is_admitted_from_its_own_namespace_only(
    make_body: Callable[..., Body],
) -> None:
    """The operator's pod label alone would admit any pod that carries it, in any namespace;
    with its namespace (the chart's DSV4_OPERATOR_NAMESPACE) only a cluster admin's pods."""
    body = make_body()
    spec = parse_spec(body)
    for namespace in ("dsv4-system", "ops"):
        state = build_desired_state(
            spec, parse_meta(body), plan_memory(spec), operator_namespace=namespace
        )
        for policy in by_kind(state)["NetworkPolicy"].values():
            rules = [r for r in policy["spec"]["ingress"] if "from" in r]
            operator = [
                r
                for r in rules
                if "podSelector" in r["from"][0]
                and r["from"][0]["podSelector"]["matchLabels"] == L.OPERATOR_POD_LABELS
            ]
            assert len(operator) == 1, policy["metadata"]["name"]
            (peer,) = operator[0]["from"]
            assert peer["namespaceSelector"] == {
                "matchLabels": {"kubernetes.io/metadata.name": namespace}
            }
            # Nowhere an empty namespaceSelector (every namespace).
            assert all(p.get("namespaceSelector") != {} for r in rules for p in r["from"])


def test_network_policy_admits_the_metrics_scrapers_on_the_status_port(
    make_body: Callable[..., Body],
) -> None:
    body = make_body()
    spec = parse_spec(body)
    state = build_desired_state(
        spec, parse_meta(body), plan_memory(spec), metrics_scrape_namespace="monitoring"
    )
    *_, operator, scrapers = by_kind(state)["NetworkPolicy"]["tiny-workers"]["spec"]["ingress"]
    assert operator["ports"] == [{"protocol": "TCP", "port": 8081}]
    assert scrapers == {
        "from": [{"namespaceSelector": {"matchLabels": {L.NAMESPACE_NAME_LABEL: "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": "status"}],
    }


@pytest.mark.parametrize("sample", SAMPLES)
def test_our_engines_pods_carry_no_engine_label(
    make_body: Callable[..., Body], sample: str
) -> None:
    """Only SGLang's worker pods carry it: on ours it would change every template hash and roll
    every existing deployment on an operator upgrade."""
    for obj in desired(make_body(sample)).objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            assert L.ENGINE_LABEL not in obj["spec"]["template"]["metadata"]["labels"]


def test_service_account_has_no_token(make_body: Callable[..., Body]) -> None:
    sa = by_kind(desired(make_body()))["ServiceAccount"]["tiny-workload"]
    assert sa["automountServiceAccountToken"] is False


def test_config_map_holds_each_ranks_config_and_plan(make_body: Callable[..., Body]) -> None:
    body = make_body()
    spec = parse_spec(body)
    memory = plan_memory(spec)
    data = by_kind(desired(body))["ConfigMap"]["tiny-config"]["data"]
    assert set(data) == {
        "prefill-rank-0.json",
        "prefill-rank-1.json",
        "decode-rank-0.json",
        "router.json",
        "plan.json",
    }
    for role, rank in (("prefill", 0), ("prefill", 1), ("decode", 0)):
        doc = json.loads(data[f"{role}-rank-{rank}.json"])
        assert (doc["role"], doc["pp_rank"], doc["serving_rank"]) == (role, rank, rank == 0)
        config = parse_rank_config(doc)
        assert config.planned == planned_rank(memory.role(role).ranks[rank])
        assert config.kv.page_size == 32 and config.kv.transfer == "nixl"
        assert config.plan.max_running_requests == memory.role(role).max_running_requests
    assert json.loads(data["plan.json"])["decode"]["max_context_tokens"] == 4096
    router = json.loads(data["router.json"])
    assert router["roles"]["prefill"]["service"] == "tiny-prefill.ns.svc"


def _hashes(body: Body) -> dict[str, str]:
    return desired(body).template_hashes


def test_template_hash_rolls_exactly_the_pods_whose_template_or_config_changed(
    make_body: Callable[..., Body],
) -> None:
    base = _hashes(make_body())
    prefill = make_body()
    prefill["spec"]["prefill"] = {**prefill["spec"]["prefill"], "chunkedPrefillTokens": 512}
    changed = _hashes(prefill)
    assert changed["tiny-prefill-0"] != base["tiny-prefill-0"]
    assert changed["tiny-decode-0"] == base["tiny-decode-0"]
    router = make_body()
    router["spec"]["router"] = {"replicas": 3, "port": 8000}
    assert _hashes(router) == base  # scaling the router rolls nothing
    image = make_body(image="registry/other:2")
    assert all(_hashes(image)[k] != v for k, v in base.items())


def test_pod_templates_carry_their_hash(make_body: Callable[..., Body]) -> None:
    state = desired(make_body())
    for obj in state.objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            name = obj["metadata"]["name"]
            assert annotations[L.TEMPLATE_HASH_ANNOTATION] == state.template_hashes[name]


def test_rendering_is_deterministic(make_body: Callable[..., Body]) -> None:
    assert desired(make_body()) == desired(copy.deepcopy(make_body()))


def test_longest_name_at_most_replicas_gives_legal_child_names(
    make_body: Callable[..., Body],
) -> None:
    body = make_body()
    body["metadata"]["name"] = "a" * L.MAX_NAME_LENGTH
    body["spec"]["decode"] = {**body["spec"]["decode"], "replicas": L.MAX_ROLE_REPLICAS}
    for obj in desired(body).objects:
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and NAME_PATTERN.match(name)
        if obj["kind"] == "StatefulSet":
            assert len(name) + 11 <= 63  # controller-revision-hash label
            for value in obj["spec"]["template"]["metadata"]["labels"].values():
                assert len(value) <= 63
