"""The fake API server authorizes as a real one with RBAC does (support/rbac.py) and enforces
OwnerReferencesPermissionEnforcement (support/owner_refs_admission.py); the chart's Roles allow
the operator what it needs and nothing the tests show it does not. Upstream sources are cited
in those modules; each test below names the rule it shows.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from repo_paths import CRD_FILE
from support import chart_install, rbac
from support.chart_support import needs_helm
from support.fake_apiserver import FakeApiServer, load_crd
from support.rbac import Attributes, Policy, User, authorize, request_attributes, rule_allows

from dsv4_operator import labels as L

SA = rbac.service_account_user("ops", "bot")
PODS = "/api/v1/namespaces/default/pods"
CRS = f"/apis/{L.API_VERSION}/namespaces/default/{L.PLURAL}"


# ---------------------------------------------------------------------------------------------
# Request attributes (requestinfo.go NewRequestInfo)


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", PODS, {}, ("list", "", "default", "pods", "", "")),
        ("GET", PODS, {"watch": "true"}, ("watch", "", "default", "pods", "", "")),
        ("GET", PODS, {"watch": "1"}, ("watch", "", "default", "pods", "", "")),
        ("GET", PODS, {"watch": "false"}, ("list", "", "default", "pods", "", "")),
        ("GET", f"{PODS}/p", {}, ("get", "", "default", "pods", "", "p")),
        # A list or watch pinned to one name is authorized for that name.
        (
            "GET",
            PODS,
            {"watch": "true", "fieldSelector": "metadata.name=p"},
            ("watch", "", "default", "pods", "", "p"),
        ),
        ("GET", f"{PODS}/p/status", {}, ("get", "", "default", "pods", "status", "p")),
        ("PUT", f"{PODS}/p", {}, ("update", "", "default", "pods", "", "p")),
        ("PATCH", f"{PODS}/p", {}, ("patch", "", "default", "pods", "", "p")),
        ("POST", PODS, {}, ("create", "", "default", "pods", "", "")),
        ("DELETE", f"{PODS}/p", {}, ("delete", "", "default", "pods", "", "p")),
        ("DELETE", PODS, {}, ("deletecollection", "", "default", "pods", "", "")),
        ("GET", "/api/v1/namespaces", {}, ("list", "", "", "namespaces", "", "")),
        # A namespace's own path: the namespace is both the name and the namespace.
        ("GET", "/api/v1/namespaces/a", {}, ("get", "", "a", "namespaces", "", "a")),
        (
            "PUT",
            "/api/v1/namespaces/a/finalize",
            {},
            ("update", "", "a", "namespaces", "finalize", "a"),
        ),
        (
            "GET",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            {},
            ("list", "apiextensions.k8s.io", "", "customresourcedefinitions", "", ""),
        ),
        (
            "PATCH",
            f"{CRS}/x/status",
            {},
            ("patch", L.GROUP, "default", L.PLURAL, "status", "x"),
        ),
        # The deprecated /watch/ path prefix.
        (
            "GET",
            "/api/v1/watch/namespaces/default/pods",
            {},
            ("watch", "", "default", "pods", "", ""),
        ),
    ],
)
def test_request_attributes_as_requestinfo_parses_them(
    method: str, path: str, query: dict[str, str], expected: tuple[str, ...]
) -> None:
    attrs = request_attributes(method, path, query)
    assert attrs.resource_request
    got = (attrs.verb, attrs.api_group, attrs.namespace, attrs.resource, attrs.subresource)
    assert (*got, attrs.name) == expected


@pytest.mark.parametrize("path", ["/api", "/apis", "/api/v1", "/apis/apps/v1", "/version"])
def test_discovery_paths_are_non_resource_requests(path: str) -> None:
    attrs = request_attributes("GET", path, {})
    assert (attrs.resource_request, attrs.verb, attrs.path) == (False, "get", path)


# ---------------------------------------------------------------------------------------------
# Rules (RuleAllows and the evaluation helpers)


def _attrs(verb: str, resource: str, sub: str = "", name: str = "", group: str = "") -> Attributes:
    return Attributes(verb, "", True, group, "v1", "default", resource, sub, name)


@pytest.mark.parametrize(
    ("rule", "attrs", "allowed"),
    [
        ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}, _attrs("get", "pods"), True),
        # list, watch and get are three verbs
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
            _attrs("list", "pods"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
            _attrs("watch", "pods"),
            False,
        ),
        # patch does not grant update, nor delete deletecollection
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
            _attrs("update", "pods"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]},
            _attrs("deletecollection", "pods"),
            False,
        ),
        ({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, _attrs("patch", "pods"), True),
        # the resource does not grant its subresources, and the other way round
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
            _attrs("patch", "pods", "status"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
            _attrs("patch", "pods"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
            _attrs("patch", "pods", "status"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["*/status"], "verbs": ["patch"]},
            _attrs("patch", "services", "status"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["*/status"], "verbs": ["patch"]},
            _attrs("patch", "services", "finalizers"),
            False,
        ),
        # the API group must match
        (
            {"apiGroups": ["apps"], "resources": ["pods"], "verbs": ["get"]},
            _attrs("get", "pods"),
            False,
        ),
        # resourceNames: only those names (a list has no name)
        (
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": ["a"], "verbs": ["get"]},
            _attrs("get", "pods", name="a"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": ["a"], "verbs": ["get"]},
            _attrs("get", "pods", name="b"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": ["a"], "verbs": ["list"]},
            _attrs("list", "pods"),
            False,
        ),
        # a resource rule says nothing of non-resource URLs, and the other way round
        (
            {"nonResourceURLs": ["/apis/*"], "verbs": ["get"]},
            Attributes("get", "/apis/apps/v1", False),
            True,
        ),
        (
            {"nonResourceURLs": ["/apis"], "verbs": ["get"]},
            Attributes("get", "/apis/apps/v1", False),
            False,
        ),
        ({"nonResourceURLs": ["*"], "verbs": ["get"]}, _attrs("get", "pods"), False),
    ],
)
def test_a_rule_grants_exactly_its_verbs_groups_resources_and_names(
    rule: dict[str, Any], attrs: Attributes, allowed: bool
) -> None:
    assert rule_allows(rule, attrs) is allowed


VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


@given(granted=st.sets(st.sampled_from((*VERBS, "*"))), verb=st.sampled_from(VERBS))
def test_a_verb_is_granted_only_by_itself_or_the_wildcard(granted: set[str], verb: str) -> None:
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": sorted(granted)}
    assert rule_allows(rule, _attrs(verb, "pods")) is (verb in granted or "*" in granted)


# ---------------------------------------------------------------------------------------------
# Bindings (VisitRulesFor, appliesToUser)


def _role(kind: str, name: str, rules: list[dict[str, Any]], ns: str = "") -> dict[str, Any]:
    meta = {"name": name, **({"namespace": ns} if ns else {})}
    return {"kind": kind, "metadata": meta, "rules": rules}


def _binding(
    kind: str, name: str, role_kind: str, role: str, subject: dict[str, Any], ns: str = ""
) -> dict[str, Any]:
    meta = {"name": name, **({"namespace": ns} if ns else {})}
    ref = {"apiGroup": rbac.RBAC_GROUP, "kind": role_kind, "name": role}
    return {"kind": kind, "metadata": meta, "roleRef": ref, "subjects": [subject]}


ACCOUNT = {"kind": "ServiceAccount", "name": "bot", "namespace": "ops"}
READ_PODS = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
READ_CRDS = [
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list"],
    }
]


def _crds() -> Attributes:
    return Attributes(
        "list", "", True, "apiextensions.k8s.io", "v1", "", "customresourcedefinitions"
    )


def test_a_role_binding_to_a_cluster_role_grants_only_in_its_namespace() -> None:
    policy = Policy.from_objects(
        [
            _role("ClusterRole", "reader", READ_PODS + READ_CRDS),
            _binding("RoleBinding", "b", "ClusterRole", "reader", ACCOUNT, ns="default"),
        ]
    )
    here = _attrs("list", "pods")
    there = Attributes("list", "", True, "", "v1", "other", "pods")
    assert authorize(policy, SA, here) == (True, "")
    assert authorize(policy, SA, there) == (False, "")
    # A cluster-scoped resource: only a ClusterRoleBinding can grant it.
    assert authorize(policy, SA, _crds())[0] is False
    bound = Policy.from_objects(
        [
            _role("ClusterRole", "reader", READ_PODS + READ_CRDS),
            _binding("ClusterRoleBinding", "b", "ClusterRole", "reader", ACCOUNT),
        ]
    )
    assert authorize(bound, SA, _crds())[0] is True
    assert authorize(bound, SA, there)[0] is True


def test_a_role_grants_only_in_its_own_namespace_and_subjects_must_match() -> None:
    policy = Policy.from_objects(
        [
            _role("Role", "reader", READ_PODS, ns="default"),
            _binding("RoleBinding", "b", "Role", "reader", ACCOUNT, ns="default"),
            _role("Role", "reader", READ_PODS, ns="other"),  # same name, not bound there
        ]
    )
    assert authorize(policy, SA, _attrs("get", "pods"))[0] is True
    other = Attributes("get", "", True, "", "v1", "other", "pods")
    assert authorize(policy, SA, other)[0] is False
    stranger = rbac.service_account_user("ops", "someone-else")
    assert authorize(policy, stranger, _attrs("get", "pods"))[0] is False
    same_name_elsewhere = rbac.service_account_user("default", "bot")
    assert authorize(policy, same_name_elsewhere, _attrs("get", "pods"))[0] is False


def test_groups_users_masters_and_the_discovery_roles() -> None:
    by_group = Policy.from_objects(
        [
            _role("ClusterRole", "reader", READ_PODS),
            _binding(
                "ClusterRoleBinding",
                "b",
                "ClusterRole",
                "reader",
                {"kind": "Group", "name": "system:serviceaccounts:ops"},
            ),
        ]
    )
    assert authorize(by_group, SA, _attrs("list", "pods"))[0] is True
    assert authorize(by_group, User("alice"), _attrs("list", "pods"))[0] is False
    assert authorize(Policy.from_objects([]), rbac.ADMIN, _attrs("delete", "pods"))[0] is True
    # Every authenticated user may read discovery, and nothing else by default.
    nobody = Policy.from_objects([])
    assert authorize(nobody, SA, Attributes("get", "/apis/apps/v1", False))[0] is True
    assert authorize(nobody, SA, Attributes("get", "/version", False))[0] is True
    assert authorize(nobody, SA, Attributes("get", "/metrics", False))[0] is False
    assert authorize(nobody, SA, _attrs("get", "pods"))[0] is False


def test_a_binding_to_a_missing_role_grants_nothing_and_says_why() -> None:
    policy = Policy.from_objects(
        [_binding("ClusterRoleBinding", "b", "ClusterRole", "gone", ACCOUNT)]
    )
    allowed, reason = authorize(policy, SA, _attrs("get", "pods"))
    assert not allowed
    assert reason == f'RBAC: clusterrole.{rbac.RBAC_GROUP} "gone" not found'


# ---------------------------------------------------------------------------------------------
# Over HTTP: credentials, 401 and 403 as the real server words them


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer([load_crd(CRD_FILE)], namespaces=("default", "ops")) as srv:
        yield srv


def test_a_denied_request_is_a_forbidden_status_naming_user_verb_resource_and_namespace(
    server: FakeApiServer,
) -> None:
    token = server.service_account_token("ops", "bot")
    user = "system:serviceaccount:ops:bot"
    code, status = chart_install.request(server, "GET", f"{PODS}/p", token=token)
    assert code == 403
    assert status == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'pods "p" is forbidden: User "{user}" cannot get resource "pods" in API '
        'group "" in the namespace "default"',
        "reason": "Forbidden",
        "details": {"name": "p", "group": "", "kind": "pods"},
        "code": 403,
    }
    code, status = chart_install.request(
        server, "GET", f"{CRS}?watch=true&timeoutSeconds=0", token=token
    )
    assert (code, status["message"]) == (
        403,
        f'{L.PLURAL}.{L.GROUP} is forbidden: User "{user}" cannot watch resource '
        f'"{L.PLURAL}" in API group "{L.GROUP}" in the namespace "default"',
    )
    code, status = chart_install.request(server, "GET", "/api/v1/namespaces", token=token)
    assert (code, status["message"]) == (
        403,
        f'namespaces is forbidden: User "{user}" cannot list resource "namespaces" in API '
        'group "" at the cluster scope',
    )
    # Discovery is open to every authenticated user; a wrong token is 401.
    assert chart_install.request(server, "GET", "/apis", token=token)[0] == 200
    assert chart_install.request(server, "GET", PODS, token="nope")[:1] == (401,)
    # Without credentials: the cluster admin (the tests' own requests).
    assert chart_install.request(server, "GET", PODS)[0] == 200
    assert {r.user for r in server.requests} == {user, "", "system:admin"}  # "": the 401


def _install_rbac(server: FakeApiServer, *values: str) -> str:
    chart = [
        o
        for o in chart_install.rendered(values)
        if o["kind"]
        in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    ]
    chart_install.install(server, chart)
    return server.service_account_token(
        *chart_install.service_account(chart_install.rendered(values))
    )


def _can(server: FakeApiServer, token: str, method: str, path: str, body: Any = None) -> bool:
    ctype = "application/merge-patch+json" if method == "PATCH" else "application/json"
    code, status = chart_install.request(server, method, path, body, ctype, token=token)
    assert code != 401, status
    return code != 403


@needs_helm
def test_the_chart_cluster_wide_grants_what_the_operator_does_and_no_more() -> None:
    with FakeApiServer(
        [load_crd(CRD_FILE)], namespaces=("default", "dsv4-system", "team-a")
    ) as server:
        token = _install_rbac(server)
        anywhere = f"/apis/{L.API_VERSION}/{L.PLURAL}"
        assert _can(server, token, "GET", anywhere)
        assert _can(server, token, "GET", f"{anywhere}?watch=true&timeoutSeconds=0")
        assert _can(server, token, "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        team = "/api/v1/namespaces/team-a"
        assert _can(server, token, "GET", f"{team}/pods?watch=true&timeoutSeconds=0")
        assert _can(server, token, "DELETE", f"{team}/pods?labelSelector=a%3Db")
        assert _can(server, token, "POST", f"{team}/events", {"metadata": {"name": "e"}})
        # What it never does: create pods, update (PUT) its CRs, read namespaces.
        assert not _can(server, token, "POST", f"{team}/pods", {"metadata": {"name": "p"}})
        assert not _can(
            server, token, "PUT", f"/apis/{L.API_VERSION}/namespaces/team-a/{L.PLURAL}/x"
        )
        # Secrets: it creates a deployment's PD secret and reads one Secret by name (an hf://
        # source's tokenSecretRef); it never lists or watches them, changes or deletes one.
        assert _can(server, token, "POST", f"{team}/secrets", {"metadata": {"name": "s"}})
        assert _can(server, token, "GET", f"{team}/secrets/hf-token")
        assert not _can(server, token, "GET", f"{team}/secrets")
        assert not _can(server, token, "GET", f"{team}/secrets?watch=true&timeoutSeconds=0")
        assert not _can(server, token, "PATCH", f"{team}/secrets/s", {"data": {}})
        assert not _can(server, token, "DELETE", f"{team}/secrets/s")
        assert not _can(server, token, "GET", "/api/v1/namespaces")
        assert not _can(
            server, token, "DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x"
        )


@needs_helm
def test_the_chart_namespaced_grants_only_in_the_release_namespace() -> None:
    with FakeApiServer([load_crd(CRD_FILE)], namespaces=("default", "dsv4-system")) as server:
        token = _install_rbac(server, "--set", "rbac.namespaced=true")
        served = f"/apis/{L.API_VERSION}/namespaces/dsv4-system/{L.PLURAL}"
        assert _can(server, token, "GET", f"{served}?watch=true&timeoutSeconds=0")
        assert _can(server, token, "GET", "/api/v1/namespaces/dsv4-system/pods")
        assert not _can(
            server, token, "GET", f"/apis/{L.API_VERSION}/namespaces/default/{L.PLURAL}"
        )
        assert not _can(server, token, "GET", f"/apis/{L.API_VERSION}/{L.PLURAL}")  # cluster-wide
        assert not _can(server, token, "GET", "/api/v1/namespaces?watch=true&timeoutSeconds=0")
        # observeCRDs (default true) still grants the cluster-wide CRD read.
        assert _can(server, token, "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")


# ---------------------------------------------------------------------------------------------
# OwnerReferencesPermissionEnforcement (gc_admission.go)


def _owned_cm(name: str, owner: dict[str, Any], *, block: bool) -> dict[str, Any]:
    ref = {
        "apiVersion": L.API_VERSION,
        "kind": L.KIND,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": block,
    }
    meta = {"name": name, "namespace": "default", "ownerReferences": [ref]}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


def _apply(server: FakeApiServer, token: str, obj: dict[str, Any]) -> tuple[int, Any]:
    path = f"{chart_install.object_path(server, obj)}?fieldManager={L.FIELD_MANAGER}&force=true"
    return chart_install.request(server, "PATCH", path, obj, "application/apply-patch+yaml", token)


def _workload_role(finalizers: bool, delete: bool = False) -> list[dict[str, Any]]:
    verbs = ["create", "patch", "get", *(["delete"] if delete else [])]
    rules = [{"apiGroups": [""], "resources": ["configmaps"], "verbs": verbs}]
    if finalizers:
        rules.append(
            {"apiGroups": [L.GROUP], "resources": [f"{L.PLURAL}/finalizers"], "verbs": ["update"]}
        )
    return rules


def _owner(server: FakeApiServer) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": L.API_VERSION,
        "kind": L.KIND,
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {"model": {"preset": "tiny"}, "maxContextTokens": 2048},
    }
    return server.create(body)


def test_block_owner_deletion_needs_update_on_the_owners_finalizers(
    server: FakeApiServer,
) -> None:
    owner = _owner(server)
    token = server.service_account_token("ops", "bot")
    server.create(_role_obj("plain", _workload_role(finalizers=False)))
    server.create(_binding_obj("plain"))
    code, status = _apply(server, token, _owned_cm("a", owner, block=True))
    assert code == 403
    assert status["message"] == (
        'configmaps "a" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers '
        "to a resource you can't set finalizers on: , <nil>"
    )
    assert server.get("v1", "ConfigMap", "default", "a") is None
    # Without blockOwnerDeletion the same owner reference is fine.
    assert _apply(server, token, _owned_cm("b", owner, block=False))[0] == 201
    # With the grant the chart has (dsv4deployments/finalizers: update), it is allowed.
    server.create(_role_obj("finalizers", _workload_role(finalizers=True)))
    server.create(_binding_obj("finalizers"))
    assert _apply(server, token, _owned_cm("a", owner, block=True))[0] == 201
    # Turning blocking on for an existing reference changes the references (delete on the
    # object, which the chart grants on children) and blocks anew (finalizers).
    server.create(_role_obj("delete", _workload_role(finalizers=False, delete=True)))
    server.create(_binding_obj("delete"))
    assert _apply(server, token, _owned_cm("b", owner, block=True))[0] == 200


def test_changing_owner_references_on_update_needs_delete_on_the_object(
    server: FakeApiServer,
) -> None:
    owner = _owner(server)
    token = server.service_account_token("ops", "bot")
    server.create(_role_obj("writer", _workload_role(finalizers=True)))
    server.create(_binding_obj("writer"))
    plain = _owned_cm("c", owner, block=False)
    plain["metadata"].pop("ownerReferences")
    assert _apply(server, token, plain)[0] == 201  # a create may set anything it likes
    code, status = _apply(server, token, _owned_cm("c", owner, block=False))
    assert code == 403
    assert status["message"].startswith(
        'configmaps "c" is forbidden: cannot set an ownerRef on a resource you can\'t delete'
    )
    # The admin (system:masters) is never refused.
    assert _apply_admin(server, _owned_cm("c", owner, block=True)) == 200


def _role_obj(name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    role = _role("Role", name, rules, ns="default")
    return {"apiVersion": f"{rbac.RBAC_GROUP}/v1", **role}


def _binding_obj(name: str) -> dict[str, Any]:
    binding = _binding("RoleBinding", name, "Role", name, ACCOUNT, ns="default")
    return {"apiVersion": f"{rbac.RBAC_GROUP}/v1", **binding}


def _apply_admin(server: FakeApiServer, obj: dict[str, Any]) -> int:
    path = f"{chart_install.object_path(server, obj)}?fieldManager=admin&force=true"
    return chart_install.request(
        server, "PATCH", path, copy.deepcopy(obj), "application/apply-patch+yaml"
    )[0]


@needs_helm
def test_the_charts_finalizers_grant_is_what_lets_the_operator_own_its_children() -> None:
    """The chart grants update on dsv4deployments/finalizers (#23 item 3): without that rule
    the operator's first child apply (blockOwnerDeletion: true) is refused."""
    values = ("--set", "watch.namespaces={default}")
    for granted in (True, False):
        chart = [copy.deepcopy(dict(o)) for o in chart_install.rendered(values)]
        if not granted:
            for obj in chart:
                obj["rules"] = [
                    r
                    for r in obj.get("rules") or []
                    if f"{L.PLURAL}/finalizers" not in r.get("resources", [])
                ]
        with FakeApiServer([load_crd(CRD_FILE)], namespaces=("default", "dsv4-system")) as server:
            rbac_kinds = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole")
            chart_install.install(server, [o for o in chart if o["kind"] in rbac_kinds])
            token = server.service_account_token(*chart_install.service_account(chart))
            code, answer = _apply(
                server, token, _owned_cm("tiny-config", _owner(server), block=True)
            )
            assert (code == 201) is granted, answer


def test_a_blocking_reference_to_a_kind_not_served_is_refused(server: FakeApiServer) -> None:
    token = server.service_account_token("ops", "bot")
    server.create(_role_obj("all", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]))
    server.create(_binding_obj("all"))
    owner = {"metadata": {"name": "pg", "uid": "u-1"}}
    obj = _owned_cm("d", owner, block=True)
    obj["metadata"]["ownerReferences"][0].update(apiVersion="example.com/v1", kind="Widget")
    code, status = _apply(server, token, obj)
    assert code == 403
    assert "cannot find RESTMapping for APIVersion example.com/v1 Kind Widget" in status["message"]
