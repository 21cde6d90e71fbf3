"""Gang scheduling and placement of PP groups (`spec.scheduling`): one PodGroup per group for
Volcano or scheduler-plugins, valid against each project's published CRD (vendored under
data/), pods tied to it; affinity that packs a group into a topology domain and spreads a role's
groups, merged with a podTemplate's; PodGroups applied and pruned like every other child, over
the wire too, and skipped where their CRD is not served; over the wire, a podTemplate field the
operator owns ends in the CR's status (PlanValid=False, InvalidSpec) with nothing applied."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from repo_paths import CRD_FILE
from support import crd_support as S
from support.fake_apiserver import FakeApiServer, load_crd
from support.fake_kube import FakeKube, FakeProbe

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_operator import labels as L
from dsv4_operator.gang import (
    COSCHEDULING_API_VERSION,
    COSCHEDULING_GROUP_LABEL,
    COSCHEDULING_SCHEDULER,
    VOLCANO_API_VERSION,
    VOLCANO_GROUP_ANNOTATION,
)
from dsv4_operator.kube import KubeError
from dsv4_operator.kube_api import ApiKube
from dsv4_operator.objects import DesiredState, build_desired_state
from dsv4_operator.reconcile import reconcile

Body = dict[str, Any]
DATA = Path(__file__).parent / "data"
VOLCANO_CRD = load_crd(DATA / "volcano" / "scheduling.volcano.sh_podgroups.yaml")
COSCHEDULING_CRD = load_crd(DATA / "scheduler-plugins" / "scheduling.x-k8s.io_podgroups.yaml")
CRDS = {VOLCANO_API_VERSION: VOLCANO_CRD, COSCHEDULING_API_VERSION: COSCHEDULING_CRD}
ZONE = "topology.kubernetes.io/zone"


def desired(body: Body) -> DesiredState:
    spec = parse_spec(body)
    return build_desired_state(spec, parse_meta(body), plan_memory(spec))


def of_kind(state: DesiredState, kind: str) -> dict[str, Body]:
    return {o["metadata"]["name"]: o for o in state.objects if o["kind"] == kind}


def pod_spec(state: DesiredState, group: str) -> Body:
    spec: Body = of_kind(state, "StatefulSet")[group]["spec"]["template"]
    return spec


# --- PodGroups -------------------------------------------------------------------------------


def test_no_gang_means_no_pod_group_and_the_default_scheduler(
    make_body: Callable[..., Body],
) -> None:
    state = desired(make_body())
    assert not of_kind(state, "PodGroup")
    for template in (pod_spec(state, "tiny-prefill-0"), pod_spec(state, "tiny-decode-0")):
        assert "schedulerName" not in template["spec"] and "affinity" not in template["spec"]
        assert "annotations" not in template["metadata"] or set(
            template["metadata"]["annotations"]
        ) == {L.TEMPLATE_HASH_ANNOTATION}


@pytest.mark.parametrize(
    ("gang", "api_version", "scheduler"),
    [
        ("volcano", VOLCANO_API_VERSION, "volcano"),
        ("coscheduling", COSCHEDULING_API_VERSION, COSCHEDULING_SCHEDULER),
    ],
)
def test_one_pod_group_per_pp_group_with_the_pp_size_as_min_member(
    make_body: Callable[..., Body], gang: str, api_version: str, scheduler: str
) -> None:
    body = make_body(scheduling={"gang": gang})
    body["spec"]["decode"]["replicas"] = 2
    state = desired(body)
    groups = of_kind(state, "PodGroup")
    assert set(groups) == {"tiny-prefill-0", "tiny-decode-0", "tiny-decode-1"}
    assert {n: g["spec"]["minMember"] for n, g in groups.items()} == {
        "tiny-prefill-0": 2,
        "tiny-decode-0": 1,
        "tiny-decode-1": 1,
    }
    for name, group in groups.items():
        assert group["apiVersion"] == api_version
        assert "minResources" not in group["spec"]  # CPU mode: no GPUs to reserve
        meta = group["metadata"]
        assert meta["labels"][L.GROUP_LABEL] == name and meta["namespace"] == "ns"
        (owner,) = meta["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (L.KIND, "cr-uid-1", True)
        template = pod_spec(state, name)
        assert template["spec"]["schedulerName"] == scheduler
        if gang == "volcano":
            assert template["metadata"]["annotations"][VOLCANO_GROUP_ANNOTATION] == name
        else:
            assert template["metadata"]["labels"][COSCHEDULING_GROUP_LABEL] == name
    # PodGroups come before the StatefulSets whose pods name them.
    kinds = [o["kind"] for o in state.objects]
    assert max(i for i, k in enumerate(kinds) if k == "PodGroup") < kinds.index("StatefulSet")


def test_gpu_pod_groups_reserve_the_groups_gpus_in_a_queue_with_a_priority(
    make_body: Callable[..., Body],
) -> None:
    body = make_body("flash-h200-volcano.yaml")
    groups = of_kind(desired(body), "PodGroup")
    assert set(groups) == {"flash-h200-prefill-0", "flash-h200-prefill-1"} | {
        "flash-h200-decode-0",
        "flash-h200-decode-1",
    }
    prefill = groups["flash-h200-prefill-1"]["spec"]
    assert prefill == {
        "minMember": 2,
        "minResources": {"nvidia.com/gpu": "8"},  # PP 2 x 4 GPUs
        "queue": "inference",
        "priorityClassName": "inference-high",  # from the podTemplate
    }
    assert groups["flash-h200-decode-0"]["spec"]["minMember"] == 1


def test_a_podtemplate_scheduler_name_overrides_the_gangs(make_body: Callable[..., Body]) -> None:
    body = make_body(scheduling={"gang": "coscheduling"})
    body["spec"]["decode"]["podTemplate"] = {"spec": {"schedulerName": "sched-plugins"}}
    state = desired(body)
    assert pod_spec(state, "tiny-decode-0")["spec"]["schedulerName"] == "sched-plugins"
    assert pod_spec(state, "tiny-prefill-0")["spec"]["schedulerName"] == COSCHEDULING_SCHEDULER


@pytest.mark.parametrize("gang", ["volcano", "coscheduling"])
@pytest.mark.parametrize("sample", ["tiny-cpu.yaml", "flash-h200-volcano.yaml"])
def test_pod_groups_validate_against_the_published_crd(
    make_body: Callable[..., Body], gang: str, sample: str
) -> None:
    body = make_body(sample)
    body["spec"]["scheduling"] = {"gang": gang}
    groups = list(of_kind(desired(body), "PodGroup").values())
    assert groups
    for group in groups:
        crd = CRDS[group["apiVersion"]]
        assert group["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
        assert group["kind"] == crd["spec"]["names"]["kind"]
        schema = S.crd_schema(crd)
        assert S.schema_errors(schema, group) == []
        assert S.unknown_fields(schema, group) == []  # nothing the API server would prune


def test_the_schema_check_catches_a_bad_pod_group() -> None:
    bad = {"apiVersion": VOLCANO_API_VERSION, "kind": "PodGroup", "metadata": {"name": "x"}}
    bad["spec"] = {"minMember": "2", "queue": "Not A Queue", "minAvailable": 1}
    schema = S.crd_schema(VOLCANO_CRD)
    assert len(S.schema_errors(schema, bad)) == 2
    assert S.unknown_fields(schema, bad) == ["spec.minAvailable"]


# --- placement -------------------------------------------------------------------------------


def _terms(affinity: Body, kind: str, key: str) -> list[Body]:
    terms: list[Body] = affinity[kind][key]
    return terms


PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def test_a_topology_key_packs_each_group_and_spreads_a_roles_groups(
    make_body: Callable[..., Body],
) -> None:
    body = make_body(scheduling={"topologyKey": ZONE})
    body["spec"]["decode"]["replicas"] = 2
    state = desired(body)
    affinity = pod_spec(state, "tiny-decode-1")["spec"]["affinity"]
    (pack,) = _terms(affinity, "podAffinity", PREFERRED)
    assert pack == {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {
                "matchLabels": {L.DEPLOYMENT_LABEL: "tiny", L.GROUP_LABEL: "tiny-decode-1"}
            },
            "topologyKey": ZONE,
        },
    }
    (spread,) = _terms(affinity, "podAntiAffinity", PREFERRED)
    term = spread["podAffinityTerm"]
    assert spread["weight"] == 50 and term["topologyKey"] == ZONE
    assert term["labelSelector"]["matchLabels"][L.ROLE_LABEL] == "decode"
    assert term["labelSelector"]["matchExpressions"] == [
        {"key": L.GROUP_LABEL, "operator": "NotIn", "values": ["tiny-decode-1"]}
    ]
    # The router is not a PP group: no placement rules.
    assert "affinity" not in of_kind(state, "Deployment")["tiny-router"]["spec"]["template"]["spec"]


def test_required_policy_packs_with_a_required_term(make_body: Callable[..., Body]) -> None:
    body = make_body(scheduling={"topologyKey": ZONE, "topologyPolicy": "required"})
    affinity = pod_spec(desired(body), "tiny-prefill-0")["spec"]["affinity"]
    (pack,) = _terms(affinity, "podAffinity", REQUIRED)
    assert pack["topologyKey"] == ZONE and PREFERRED not in affinity["podAffinity"]
    assert _terms(affinity, "podAntiAffinity", PREFERRED)  # spreading stays a preference


def test_podtemplate_affinity_is_appended_to_the_generated_one(
    make_body: Callable[..., Body],
) -> None:
    mine = {
        "weight": 5,
        "podAffinityTerm": {"labelSelector": {"matchLabels": {"a": "b"}}, "topologyKey": ZONE},
    }
    node = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}
    body = make_body(scheduling={"topologyKey": ZONE})
    body["spec"]["prefill"]["podTemplate"] = {
        "spec": {
            "affinity": {
                "nodeAffinity": {REQUIRED: node},
                "podAntiAffinity": {PREFERRED: [mine]},
                "podAffinity": {REQUIRED: [mine["podAffinityTerm"]]},
            }
        }
    }
    affinity = pod_spec(desired(body), "tiny-prefill-0")["spec"]["affinity"]
    generated = pod_spec(desired(make_body(scheduling={"topologyKey": ZONE})), "tiny-prefill-0")
    ours = generated["spec"]["affinity"]
    assert _terms(affinity, "podAntiAffinity", PREFERRED) == [
        *_terms(ours, "podAntiAffinity", PREFERRED),
        mine,
    ]
    assert _terms(affinity, "podAffinity", PREFERRED) == _terms(ours, "podAffinity", PREFERRED)
    assert _terms(affinity, "podAffinity", REQUIRED) == [mine["podAffinityTerm"]]
    assert affinity["nodeAffinity"] == {REQUIRED: node}


def test_scheduling_changes_roll_the_pods(make_body: Callable[..., Body]) -> None:
    base = desired(make_body()).template_hashes
    for scheduling in ({"gang": "volcano"}, {"topologyKey": ZONE}):
        changed = desired(make_body(scheduling=scheduling)).template_hashes
        assert changed["tiny-prefill-0"] != base["tiny-prefill-0"]
        assert changed["tiny-router"] == base["tiny-router"]


# --- apply and prune -------------------------------------------------------------------------


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def run(kube: FakeKube, body: Body | None = None) -> Any:
    return reconcile(body or kube.cr, kube, FakeProbe(), clock=lambda: T0)


def test_pod_groups_are_applied_then_pruned_when_gang_scheduling_is_turned_off(
    make_cluster: Callable[..., tuple[FakeKube, FakeProbe]],
) -> None:
    kube, _ = make_cluster(scheduling={"gang": "volcano"})
    result = run(kube)
    assert set(kube.of_kind("PodGroup")) == {"tiny-prefill-0", "tiny-decode-0"}
    assert ("scheduling.volcano.sh/v1beta1", "PodGroup", "tiny-decode-0") in result.applied
    kube.cr["spec"]["scheduling"] = {"gang": "coscheduling"}
    result = run(kube)
    assert sorted(k[0] for k in result.pruned) == [VOLCANO_API_VERSION] * 2
    assert {o["apiVersion"] for o in kube.of_kind("PodGroup").values()} == {
        COSCHEDULING_API_VERSION
    }
    del kube.cr["spec"]["scheduling"]
    result = run(kube)
    assert kube.of_kind("PodGroup") == {} and len(result.pruned) == 2


class UnservedKube(FakeKube):
    """A cluster without the listed kinds (e.g. no Volcano): listing them answers 404."""

    def __init__(self, cr: Body, unserved: set[tuple[str, str]]) -> None:
        super().__init__(cr)
        self.unserved = unserved

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Body]:
        if (api_version, kind) in self.unserved:
            raise KubeError(f"{api_version} {kind}: not served", retryable=False, status=404)
        return super().list(api_version, kind, namespace, selector)


def test_a_cluster_without_pod_group_crds_is_reconciled(make_body: Callable[..., Body]) -> None:
    kinds = {(VOLCANO_API_VERSION, "PodGroup"), (COSCHEDULING_API_VERSION, "PodGroup")}
    kube = UnservedKube(make_body(), kinds)
    result = run(kube)
    assert result.problem is None and len(result.applied) == 15  # 14 + the PD Secret
    # A built-in kind that is not served is an error, not something to skip.
    kube = UnservedKube(make_body(), {("apps/v1", "StatefulSet")})
    with pytest.raises(KubeError):
        run(kube)


# --- over the wire: the official client against a server serving Volcano's CRD --------------


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the client's discovery cache
    with FakeApiServer([load_crd(CRD_FILE), VOLCANO_CRD], namespaces=["ns"]) as srv:
        schema = S.crd_schema(VOLCANO_CRD)
        srv.add_admission(VOLCANO_API_VERSION, "PodGroup", lambda obj: S.admit(obj, schema))
        yield srv


def test_pod_groups_go_over_the_wire_and_are_pruned(
    server: FakeApiServer, make_body: Callable[..., Body]
) -> None:
    body = make_body(scheduling={"gang": "volcano"})
    del body["metadata"]["uid"], body["metadata"]["generation"]
    cr = server.create(body, keep_status=False)
    config = kubernetes.client.Configuration()
    config.host = server.url
    with kubernetes.client.ApiClient(config) as client:
        kube = ApiKube(client, request_timeout_s=5.0)
        result = reconcile(cr, kube, FakeProbe())
        assert result.problem is None
        groups = {g["metadata"]["name"]: g for g in server.list(VOLCANO_API_VERSION, "PodGroup")}
        assert set(groups) == {"tiny-prefill-0", "tiny-decode-0"}
        assert groups["tiny-prefill-0"]["spec"] == {"minMember": 2, "queue": "default"}
        assert (
            groups["tiny-prefill-0"]["metadata"]["ownerReferences"][0]["uid"]
            == cr["metadata"]["uid"]
        )
        # scheduler-plugins is not installed: its kind is skipped, and asked about only once.
        discovery = len(server.requests)
        reconcile(cr, kube, FakeProbe())
        assert not [r for r in server.requests[discovery:] if r.path in ("/api", "/apis")]
        off = copy.deepcopy(cr)
        off["spec"]["scheduling"] = {"gang": "none"}
        result = reconcile(off, kube, FakeProbe())
        assert {k[2] for k in result.pruned} == {"tiny-prefill-0", "tiny-decode-0"}
        assert server.list(VOLCANO_API_VERSION, "PodGroup") == []
        coscheduling = copy.deepcopy(cr)
        coscheduling["spec"]["scheduling"] = {"gang": "coscheduling"}
        with pytest.raises(KubeError, match="not served") as err:
            reconcile(coscheduling, kube, FakeProbe())
        assert err.value.status == 404 and not err.value.retryable


def test_an_owned_podtemplate_field_is_reported_in_status_over_the_wire(
    server: FakeApiServer, make_body: Callable[..., Body]
) -> None:
    body = make_body()
    del body["metadata"]["uid"], body["metadata"]["generation"]
    body["spec"]["prefill"]["podTemplate"] = {
        "spec": {"containers": [{"name": "worker", "command": ["sh"]}]}
    }
    cr = server.create(body, keep_status=False)
    config = kubernetes.client.Configuration()
    config.host = server.url
    with kubernetes.client.ApiClient(config) as client:
        result = reconcile(cr, ApiKube(client, request_timeout_s=5.0), FakeProbe())
    assert result.permanent and result.applied == ()
    stored = server.get(L.API_VERSION, L.KIND, "ns", "tiny")
    assert stored is not None
    conditions = {c["type"]: c for c in stored["status"]["conditions"]}
    assert (conditions["PlanValid"]["status"], conditions["PlanValid"]["reason"]) == (
        "False",
        "InvalidSpec",
    )
    assert conditions["PlanValid"]["message"] == (
        "spec.prefill.podTemplate.spec.containers[worker].command: owned by the operator"
    )
    assert server.list("apps/v1", "StatefulSet", "ns") == []
    assert not [r for r in server.requests if r.content_type == "application/apply-patch+yaml"]
