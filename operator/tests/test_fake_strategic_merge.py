"""The fake API server applies strategic merge patches to built-in kinds as the real one does
(support/strategic_merge.py, restating apimachinery pkg/util/strategicpatch): lists merged by
their patchMergeKey, the `$patch`, `$retainKeys`, `$deleteFromPrimitiveList` and
`$setElementOrder` directives, the server's error codes; and refuses them for custom resources
with 415, as a real server does (it knows no patch strategies for them). The content types the
operator and kopf send (merge patch, JSON patch, apply) are accepted for both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import CRD_FILE
from support import field_types as T
from support import strategic_merge as S
from support.fake_apiserver import FakeApiServer, load_crd, merge_patch
from support.fake_http import APPLY, JSON_PATCH, MERGE, STRATEGIC, call, ok, owned

DEPLOYMENT = "/apis/apps/v1/namespaces/default/deployments/web"
CRS = "/apis/serving.dsv4.io/v1alpha1/namespaces/default/dsv4deployments"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer([load_crd(CRD_FILE)]) as srv:
        app = {
            "name": "app",
            "image": "app:1",
            "args": ["--a", "--b"],
            "env": [{"name": "A", "value": "1"}],
            "ports": [{"containerPort": 8000}],
        }
        body = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web", "x": "1"}},
            "spec": {
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "containers": [app, {"name": "proxy", "image": "proxy:1"}],
                        "volumes": [{"name": "data", "emptyDir": {}}],
                        "tolerations": [{"key": "a", "operator": "Exists"}],
                    },
                },
            },
        }
        srv.create(body)
        yield srv


def patch(server: FakeApiServer, body: Any, media: str = STRATEGIC) -> tuple[int, Any]:
    return call(server, "PATCH", DEPLOYMENT, body, media, user_agent="kubectl-patch/v1.31")


def pod_spec(changes: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"template": {"spec": changes}}}


def containers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def test_lists_merge_by_their_merge_key(server: FakeApiServer) -> None:
    changed = ok(
        patch(
            server,
            pod_spec(
                {
                    "containers": [
                        {
                            "name": "app",
                            "image": "app:2",
                            "env": [{"name": "B", "value": "2"}],
                            "ports": [{"containerPort": 8000, "name": "http"}],
                        }
                    ]
                }
            ),
        )
    )
    app = containers(changed)["app"]
    assert list(containers(changed)) == ["app", "proxy"]  # the proxy is kept
    assert app["image"] == "app:2" and app["args"] == ["--a", "--b"]
    # Merged by name; an item the live list lacks goes first (mergeSortedSlice places a live
    # item before a patch item only when both are in the live list).
    assert [e["name"] for e in app["env"]] == ["B", "A"]
    assert app["ports"] == [{"containerPort": 8000, "protocol": "TCP", "name": "http"}]


def test_lists_without_a_merge_strategy_are_replaced(server: FakeApiServer) -> None:
    changed = ok(
        patch(
            server,
            pod_spec(
                {
                    "containers": [{"name": "app", "args": ["--c"]}],
                    "tolerations": [{"key": "b", "operator": "Exists"}],
                }
            ),
        )
    )
    assert containers(changed)["app"]["args"] == ["--c"]
    assert changed["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "b", "operator": "Exists"}
    ]


def test_item_directives_delete_and_replace(server: FakeApiServer) -> None:
    gone = ok(patch(server, pod_spec({"containers": [{"name": "proxy", "$patch": "delete"}]})))
    assert list(containers(gone)) == ["app"]
    only = {"name": "solo", "image": "solo:1"}
    replaced = ok(patch(server, pod_spec({"containers": [{"$patch": "replace"}, only]})))
    assert list(containers(replaced)) == ["solo"]


def test_retain_keys_drops_the_volume_source_it_does_not_list(server: FakeApiServer) -> None:
    volume = {"name": "data", "hostPath": {"path": "/x"}, "$retainKeys": ["hostPath", "name"]}
    changed = ok(patch(server, pod_spec({"volumes": [volume]})))
    assert changed["spec"]["template"]["spec"]["volumes"] == [
        {"name": "data", "hostPath": {"path": "/x", "type": ""}}
    ]
    bad = {"name": "data", "emptyDir": {}, "$retainKeys": ["name"]}  # emptyDir not retained
    code, status = patch(server, pod_spec({"volumes": [bad]}))
    assert (code, status["message"]) == (400, "invalid patch format of retainKeys")


def test_set_element_order_orders_the_merged_list(server: FakeApiServer) -> None:
    order = [{"name": "proxy"}, {"name": "app"}]
    changed = ok(patch(server, pod_spec({"$setElementOrder/containers": order})))
    assert list(containers(changed)) == ["proxy", "app"]


def test_primitive_merge_lists_are_unioned_and_items_deleted_in_parallel(
    server: FakeApiServer,
) -> None:
    added = ok(patch(server, {"metadata": {"finalizers": ["a", "b"]}}))
    assert ok(patch(server, {"metadata": {"finalizers": ["b", "c"]}}))["metadata"][
        "finalizers"
    ] == [
        "a",
        "b",
        "c",
    ]
    assert added["metadata"]["finalizers"] == ["a", "b"]
    deleted = ok(patch(server, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a", "c"]}}))
    assert deleted["metadata"]["finalizers"] == ["b"]


def test_null_deletes_and_the_writer_owns_what_it_changed(server: FakeApiServer) -> None:
    changed = ok(patch(server, {"metadata": {"labels": {"x": None, "y": "2"}}}))
    assert changed["metadata"]["labels"] == {"app": "web", "y": "2"}
    assert "managedFields" not in changed["metadata"]  # created untracked: stays untracked
    tracked = ok(call(server, "PATCH", f"{DEPLOYMENT}?fieldManager=a", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
    }, APPLY))  # fmt: skip
    assert tracked["metadata"]["managedFields"]
    again = ok(patch(server, {"metadata": {"labels": {"z": "3"}}}))
    assert owned(again, "kubectl-patch", "Update") == {"f:metadata": {"f:labels": {"f:z": {}}}}


def test_malformed_patches_get_the_servers_codes(server: FakeApiServer) -> None:
    code, status = patch(server, pod_spec({"containers": [{"image": "nameless"}]}))
    assert code == 500 and "does not contain declared merge key: name" in status["message"]
    code, status = patch(server, pod_spec({"containers": [{"name": "app", "$patch": "merge"}]}))
    assert code == 500 and "merging lists cannot yet be specified" in status["message"]
    assert patch(server, [{"op": "add"}])[0] == 400  # not an object


def test_custom_resources_refuse_strategic_merge_with_415(server: FakeApiServer) -> None:
    cr = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {"model": {"preset": "tiny"}},
    }
    server.create(cr)
    body = {"metadata": {"labels": {"a": "b"}}}
    code, status = call(server, "PATCH", f"{CRS}/tiny", body, STRATEGIC)
    assert (code, status["reason"]) == (415, "UnsupportedMediaType")
    assert status["message"] == (
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
    )
    # What kopf and the operator send is accepted: merge patches (metadata, status), JSON patches.
    assert ok(call(server, "PATCH", f"{CRS}/tiny", body, MERGE))["metadata"]["labels"] == {"a": "b"}
    ops = [{"op": "add", "path": "/metadata/finalizers", "value": ["f"]}]
    assert ok(call(server, "PATCH", f"{CRS}/tiny", ops, JSON_PATCH))["metadata"]["finalizers"] == [
        "f"
    ]
    status_patch = {"status": {"observedGeneration": 1}}
    stored = ok(call(server, "PATCH", f"{CRS}/tiny/status", status_patch, MERGE))
    assert stored["status"] == {"observedGeneration": 1}
    code, status = call(server, "PATCH", DEPLOYMENT, body, "application/xml")
    assert code == 415 and "application/strategic-merge-patch+json" in status["message"]


_KEYS = st.sampled_from(["a", "b", "c"])
_MAPS = st.recursive(
    st.one_of(st.none(), st.integers(0, 3), st.text("xy", max_size=2)),
    lambda inner: st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _MAPS, max_size=3), st.dictionaries(_KEYS, _MAPS, max_size=3))
def test_without_lists_or_directives_it_is_a_json_merge_patch(
    original: dict[str, Any], change: dict[str, Any]
) -> None:
    """On maps alone a strategic merge patch is RFC 7386 (nulls delete, maps merge)."""
    original = merge_patch({}, original)  # a stored object holds no nulls
    assert S.apply_patch(original, change, T.LOOSE) == merge_patch(original, change)
