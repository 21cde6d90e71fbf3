"""The fake API server does server-side apply as the real one does (support/ssa.py, restating
structured-merge-diff's merge/update.go and apimachinery's managedfields): managedFields per
manager, conflicts with every field and manager named, `force`, removal of what an applier no
longer applies, per-item merge of keyed lists, ownership taken by plain updates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import CRD_FILE
from support import field_sets as F
from support import field_types as T
from support.fake_apiserver import FakeApiServer, load_crd
from support.fake_http import APPLY, MERGE, call, ok, owned

DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
CMS = "/api/v1/namespaces/default/configmaps"
CRS = "/apis/serving.dsv4.io/v1alpha1/namespaces/default/dsv4deployments"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer([load_crd(CRD_FILE)]) as srv:
        yield srv


def deployment(containers: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": containers or [{"name": "app", "image": "app:1"}]},
            },
            **spec,
        },
    }


def apply(
    server: FakeApiServer, body: dict[str, Any], manager: str, *, force: bool = False
) -> tuple[int, Any]:
    query = f"fieldManager={manager}" + ("&force=true" if force else "")
    return call(server, "PATCH", f"{DEPLOYMENTS}/web?{query}", body, APPLY)


def containers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


# ---------------------------------------------------------------------------------------------
# managedFields


def test_each_applier_owns_exactly_what_it_applied(server: FakeApiServer) -> None:
    created = ok(apply(server, deployment(replicas=2), "a"))
    # The server set defaults (strategy, imagePullPolicy...) that nobody owns; the applier owns
    # its fields, keyed list items by key (`.` marks an owned node holding owned fields), an
    # atomic selector as one field, and none of the metadata the server sets.
    assert owned(created, "a") == {
        "f:metadata": {"f:labels": {"f:app": {}}},
        "f:spec": {
            "f:replicas": {},
            "f:selector": {},
            "f:template": {
                "f:metadata": {"f:labels": {"f:app": {}}},
                "f:spec": {
                    "f:containers": {'k:{"name":"app"}': {".": {}, "f:image": {}, "f:name": {}}}
                },
            },
        },
    }
    assert created["spec"]["strategy"]["type"] == "RollingUpdate"
    labelled = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "labels": {"team": "x"}},
    }
    after = ok(apply(server, labelled, "b"))
    assert owned(after, "b") == {"f:metadata": {"f:labels": {"f:team": {}}}}
    assert owned(after, "a") == owned(created, "a")
    assert after["metadata"]["labels"] == {"app": "web", "team": "x"}
    entry = after["metadata"]["managedFields"][0]
    assert set(entry) == {"manager", "operation", "apiVersion", "time", "fieldsType", "fieldsV1"}
    assert (entry["apiVersion"], entry["fieldsType"]) == ("apps/v1", "FieldsV1")


def test_a_conflict_is_409_naming_every_field_and_its_manager(server: FakeApiServer) -> None:
    before = ok(apply(server, deployment(replicas=2), "a"))
    code, status = apply(server, deployment([{"name": "app", "image": "app:2"}], replicas=5), "b")
    assert (code, status["reason"], status["kind"]) == (409, "Conflict", "Status")
    assert status["details"]["causes"] == [
        {
            "type": "FieldManagerConflict",
            "message": 'conflict with "a"',
            "field": ".spec.replicas",
        },
        {
            "type": "FieldManagerConflict",
            "message": 'conflict with "a"',
            "field": '.spec.template.spec.containers[name="app"].image',
        },
    ]
    assert status["message"] == (
        'Apply failed with 2 conflicts: conflicts with "a":\n- .spec.replicas\n'
        '- .spec.template.spec.containers[name="app"].image'
    )
    assert ok(call(server, "GET", f"{DEPLOYMENTS}/web")) == before  # nothing written
    # Applying the value another manager owns is no conflict: both own it.
    shared = ok(apply(server, deployment(replicas=2), "b"))
    assert "f:replicas" in owned(shared, "a")["f:spec"]
    assert "f:replicas" in owned(shared, "b")["f:spec"]


def test_force_takes_the_fields_from_their_owner(server: FakeApiServer) -> None:
    ok(apply(server, deployment(replicas=2), "a"))
    taken = ok(apply(server, deployment(replicas=5), "b", force=True))
    assert taken["spec"]["replicas"] == 5
    assert "f:replicas" not in owned(taken, "a")["f:spec"]
    assert "f:replicas" in owned(taken, "b")["f:spec"]
    code, status = apply(server, deployment(replicas=2), "a")
    assert code == 409 and status["details"]["causes"][0]["message"] == 'conflict with "b"'


def test_an_update_takes_the_fields_it_changes(server: FakeApiServer) -> None:
    ok(apply(server, deployment(), "a"))
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "app", "image": "app:9"}]}}}}
    edited = ok(
        call(server, "PATCH", f"{DEPLOYMENTS}/web", patch, MERGE, user_agent="kubectl-edit/v1.31")
    )
    image = owned(edited, "kubectl-edit", "Update")["f:spec"]["f:template"]["f:spec"]
    assert image == {"f:containers": {'k:{"name":"app"}': {"f:image": {}}}}
    mine = owned(edited, "a")["f:spec"]["f:template"]["f:spec"]["f:containers"]
    assert mine == {'k:{"name":"app"}': {".": {}, "f:name": {}}}
    code, status = apply(server, deployment(), "a")  # a's config still says app:1
    assert code == 409
    assert status["details"]["causes"][0]["message"] == 'conflict with "kubectl-edit" using apps/v1'
    back = ok(apply(server, deployment(), "a", force=True))
    assert containers(back)["app"]["image"] == "app:1"
    assert owned(back, "kubectl-edit", "Update") == {}  # left with nothing: the entry goes


def test_what_an_applier_stops_applying_goes_unless_someone_else_owns_it(
    server: FakeApiServer,
) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    url = f"{CMS}/c?fieldManager="
    ok(call(server, "PATCH", url + "a", {**cm, "data": {"x": "1", "y": "2", "z": "3"}}, APPLY))
    ok(call(server, "PATCH", url + "b", {**cm, "data": {"z": "3"}}, APPLY))  # shares z
    ok(call(server, "PATCH", f"{CMS}/c", {"data": {"w": "0"}}, MERGE))  # an Update adds w
    after = ok(call(server, "PATCH", url + "a", {**cm, "data": {"x": "1"}}, APPLY))
    # y was a's alone: removed; z is b's too and w the updater's: kept.
    assert after["data"] == {"x": "1", "z": "3", "w": "0"}


def test_keyed_lists_merge_item_by_item_and_keep_other_managers_items(
    server: FakeApiServer,
) -> None:
    app = {"name": "app", "image": "app:1", "env": [{"name": "X", "value": "1"}]}
    ok(apply(server, deployment([app]), "a"))
    sidecar = {"name": "proxy", "image": "proxy:1", "ports": [{"containerPort": 9000}]}
    both = ok(apply(server, deployment([sidecar]), "injector"))
    assert list(containers(both)) == ["app", "proxy"]
    again = ok(apply(server, deployment([{**app, "env": [{"name": "Y", "value": "2"}]}]), "a"))
    assert list(containers(again)) == ["app", "proxy"]  # the injector's item is kept
    assert containers(again)["app"]["env"] == [{"name": "Y", "value": "2"}]  # X was a's: gone
    # Ports are keyed by containerPort and protocol (TCP when omitted): UDP 9000 is another.
    udp = {"name": "proxy", "ports": [{"containerPort": 9000, "protocol": "UDP"}]}
    ports = containers(ok(apply(server, deployment([udp]), "udp")))["proxy"]["ports"]
    assert ports == [
        {"containerPort": 9000, "protocol": "TCP"},
        {"containerPort": 9000, "protocol": "UDP"},
    ]


def test_atomic_lists_are_one_field(server: FakeApiServer) -> None:
    ok(apply(server, deployment([{"name": "app", "image": "i", "args": ["--a"]}]), "a"))
    code, status = apply(server, deployment([{"name": "app", "args": ["--b"]}]), "b")
    assert code == 409
    assert [c["field"] for c in status["details"]["causes"]] == [
        '.spec.template.spec.containers[name="app"].args'
    ]
    forced = ok(apply(server, deployment([{"name": "app", "args": ["--b"]}]), "b", force=True))
    assert containers(forced)["app"]["args"] == ["--b"]  # replaced whole, not merged


def test_an_apply_that_changes_nothing_writes_nothing(server: FakeApiServer) -> None:
    resources = {"requests": {"cpu": "500m"}}
    body = deployment([{"name": "app", "image": "app:1", "resources": resources}])
    first = ok(apply(server, body, "a"))
    assert ok(apply(server, body, "a")) == first
    # 0.5 is stored as 500m: no write either (the server keeps the old managedFields times).
    half = deployment([{"name": "app", "image": "app:1", "resources": {"requests": {"cpu": 0.5}}}])
    assert (
        ok(apply(server, half, "a"))["metadata"]["resourceVersion"]
        == (first["metadata"]["resourceVersion"])
    )


def test_existing_fields_get_an_owner_at_the_first_apply(server: FakeApiServer) -> None:
    """skipnonapplied.go: an object stored without managedFields (here: created by the test,
    untracked) first has its fields attributed to `before-first-apply`."""
    server.create({**deployment(replicas=3), "metadata": {"name": "web", "namespace": "default"}})
    applied = ok(apply(server, deployment(), "a"))
    managers = {(m["manager"], m["operation"]) for m in applied["metadata"]["managedFields"]}
    assert managers == {("before-first-apply", "Update"), ("a", "Apply")}
    assert "f:replicas" in owned(applied, "before-first-apply", "Update")["f:spec"]


def test_a_write_that_sends_empty_managed_fields_clears_them(server: FakeApiServer) -> None:
    created = ok(apply(server, deployment(), "a"))
    assert created["metadata"]["managedFields"]
    patch: dict[str, Any] = {"metadata": {"managedFields": []}}
    cleared = ok(call(server, "PATCH", f"{DEPLOYMENTS}/web", patch, MERGE))
    assert "managedFields" not in cleared["metadata"]


def test_apply_options_the_server_refuses(server: FakeApiServer) -> None:
    body = deployment()
    code, status = call(server, "PATCH", f"{DEPLOYMENTS}/web", body, APPLY)
    assert (code, status["reason"]) == (422, "Invalid")
    assert "fieldManager: Required value" in status["message"]
    ok(apply(server, body, "a"))
    code, status = call(server, "PATCH", f"{DEPLOYMENTS}/web?force=true", {}, MERGE)
    assert code == 422 and "force: Forbidden" in status["message"]
    with_fields = {**body, "metadata": {**body["metadata"], "managedFields": [{}]}}
    code, status = apply(server, with_fields, "a")
    assert (code, status["message"]) == (400, "metadata.managedFields must be nil")
    twice = deployment([{"name": "app", "image": "x"}, {"name": "app", "image": "y"}])
    code, status = apply(server, twice, "a")
    assert code == 500 and 'duplicate entries for key [name="app"]' in status["message"]


def test_custom_resources_merge_the_lists_their_crd_keys(server: FakeApiServer) -> None:
    """The CRD's status.conditions is `x-kubernetes-list-type: map` keyed by type: two
    managers' conditions are kept side by side, each owned by its manager."""
    body = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {"model": {"preset": "tiny"}},
    }
    server.create(body)
    url = f"{CRS}/tiny/status?fieldManager="

    def condition(kind: str) -> dict[str, Any]:
        return {**body, "status": {"conditions": [{"type": kind, "status": "True"}]}}

    ok(call(server, "PATCH", url + "a", condition("Ready"), APPLY))
    both = ok(call(server, "PATCH", url + "b", condition("Degraded"), APPLY))
    assert [c["type"] for c in both["status"]["conditions"]] == ["Ready", "Degraded"]
    entry = next(m for m in both["metadata"]["managedFields"] if m["manager"] == "b")
    assert entry["subresource"] == "status"
    assert list(entry["fieldsV1"]["f:status"]["f:conditions"]) == ['k:{"type":"Degraded"}']


# ---------------------------------------------------------------------------------------------
# The typed operations (support/field_sets.py), on arbitrary JSON

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text("ab", max_size=2))
_KEYS = st.sampled_from(["a", "b", "c"])
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=12,
)
_OBJECTS = st.dictionaries(_KEYS, _JSON, max_size=3)


@settings(max_examples=200, deadline=None)
@given(_OBJECTS)
def test_field_sets_survive_the_managed_fields_encoding(obj: dict[str, Any]) -> None:
    paths = F.field_set(obj, T.DEDUCED, unique=False)
    encoded = json.loads(json.dumps(F.to_fields_v1(paths)))
    assert F.from_fields_v1(encoded) == paths


@settings(max_examples=200, deadline=None)
@given(_OBJECTS, _OBJECTS)
def test_merge_keeps_everything_applied_and_compare_is_consistent(
    live: dict[str, Any], applied: dict[str, Any]
) -> None:
    merged = F.merge(live, applied, T.DEDUCED)
    assert F.field_set(applied, T.DEDUCED) <= F.field_set(merged, T.DEDUCED)
    added, removed, modified = F.compare(live, merged, T.DEDUCED)
    assert not (added & removed) and not (added & modified)
    assert F.compare(merged, merged, T.DEDUCED) == (frozenset(), frozenset(), frozenset())
    assert F.merge(merged, applied, T.DEDUCED) == merged  # applying again changes nothing


def test_keyed_list_merge_keeps_live_only_items_in_place() -> None:
    keyed = T.FieldType(keys=("k",))
    live = [{"k": 1}, {"k": 2}, {"k": 3}]
    applied = [{"k": 3, "x": 1}, {"k": 1}, {"k": 4}]
    merged = F.merge(live, applied, keyed)
    assert [i["k"] for i in merged] == [2, 3, 1, 4]
    assert merged[1] == {"k": 3, "x": 1}


def test_a_write_its_schema_cannot_type_keeps_the_old_managed_fields(server: FakeApiServer) -> None:
    """fieldmanager.go UpdateNoErrors: an update whose object the merge schema refuses (a keyed
    list item without its keys) is still stored, with the managedFields it had."""
    body = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny"},
        "spec": {"model": {"preset": "tiny"}},
    }
    created = ok(call(server, "POST", CRS, body))
    keyless = {"status": {"conditions": [{"status": "True"}]}}
    stored = ok(call(server, "PATCH", f"{CRS}/tiny/status", keyless, MERGE))
    assert stored["status"] == keyless["status"]
    assert stored["metadata"]["managedFields"] == created["metadata"]["managedFields"]
