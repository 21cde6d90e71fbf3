"""The fake API server keeps the API server's rules the operator and kopf rely on (so the wire
and live tests cannot pass on a fake that is merely permissive)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from repo_paths import CRD_FILE
from support.fake_apiserver import FakeApiServer, load_crd, selector_matches

CMS = "/api/v1/namespaces/default/configmaps"
CRS = "/apis/serving.dsv4.io/v1alpha1/namespaces/default/dsv4deployments"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer([load_crd(CRD_FILE)]) as srv:
        yield srv


def call(
    server: FakeApiServer,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def watch(server: FakeApiServer, path: str) -> list[tuple[str, str]]:
    """(type, name) of every event until the server ends the stream."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        events = [json.loads(line) for line in resp.read().splitlines() if line]
        return [(e["type"], e["object"]["metadata"]["name"]) for e in events]
    finally:
        conn.close()


def cm(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}}


def test_errors_are_status_objects(server: FakeApiServer) -> None:
    assert call(server, "POST", CMS, cm("a"))[0] == 201
    code, status = call(server, "POST", CMS, cm("a"))
    assert code == 409 and status["kind"] == "Status" and status["reason"] == "AlreadyExists"
    code, status = call(server, "GET", f"{CMS}/missing")
    assert (code, status["reason"], status["code"]) == (404, "NotFound", 404)
    code, status = call(server, "POST", "/api/v1/namespaces/nowhere/configmaps", cm("b"))
    assert code == 404


def test_watch_replays_from_a_resource_version_and_follows_the_selector(
    server: FakeApiServer,
) -> None:
    _, listed = call(server, "GET", f"{CMS}?labelSelector=team%3Dus")
    since = listed["metadata"]["resourceVersion"]
    call(server, "POST", CMS, cm("a", team="us"))
    call(server, "POST", CMS, cm("b", team="them"))
    patch = {"metadata": {"labels": {"team": "them"}}}
    call(server, "PATCH", f"{CMS}/a", patch, "application/merge-patch+json")
    call(
        server,
        "PATCH",
        f"{CMS}/b",
        {"metadata": {"labels": {"team": "us"}}},
        "application/merge-patch+json",
    )
    call(server, "DELETE", f"{CMS}/b")
    events = watch(
        server, f"{CMS}?watch=true&labelSelector=team%3Dus&resourceVersion={since}&timeoutSeconds=1"
    )
    # Leaving the selector reads as DELETED, entering it as ADDED (as the API server does).
    assert events == [("ADDED", "a"), ("DELETED", "a"), ("ADDED", "b"), ("DELETED", "b")]


def test_finalizers_hold_deletion_until_removed(server: FakeApiServer) -> None:
    body = cm("held")
    body["metadata"]["finalizers"] = ["example.com/keep"]
    call(server, "POST", CMS, body)
    code, deleting = call(server, "DELETE", f"{CMS}/held")
    assert code == 200 and deleting["metadata"]["deletionTimestamp"]
    assert call(server, "GET", f"{CMS}/held")[0] == 200
    rv = deleting["metadata"]["resourceVersion"]
    json_patch = "application/json-patch+json"
    remove = [{"op": "remove", "path": "/metadata/finalizers"}]
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}]
    assert call(server, "PATCH", f"{CMS}/held", stale + remove, json_patch)[0] == 422
    fresh = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}]
    assert call(server, "PATCH", f"{CMS}/held", fresh + remove, json_patch)[0] == 200
    assert call(server, "GET", f"{CMS}/held")[0] == 404


class _AuditedLock:
    """The server's lock, noting at each full release any request (but a watch, which streams
    outside it) still logged without its response code: a test thread taking the lock next
    would see what the request did but not the request as done."""

    def __init__(self, server: FakeApiServer) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._server = server
        self.undone: list[tuple[str, str]] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *_: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.undone += [
                (r.method, r.path)
                for r in self._server.requests
                if not r.code and r.query.get("watch") != "true"
            ]
        self._lock.release()


def test_a_request_is_logged_as_done_by_the_time_its_effect_is_visible() -> None:
    # The flake this guards against: a test saw the CR gone (kopf's finalizer release had
    # landed) while the release was still logged with code 0, so filtering the log on 200
    # dropped it and the last JSON patch read was the finalizer's addition.
    server = FakeApiServer()
    audit = _AuditedLock(server)
    server._lock = audit  # type: ignore[assignment]
    with server:
        body = cm("held")
        body["metadata"]["finalizers"] = ["example.com/keep"]
        call(server, "POST", CMS, body)
        call(server, "DELETE", f"{CMS}/held")
        remove = [{"op": "remove", "path": "/metadata/finalizers"}]
        call(server, "PATCH", f"{CMS}/held", remove, "application/json-patch+json")
        call(server, "GET", f"{CMS}/held")
        watch(server, f"{CMS}?watch=true&timeoutSeconds=1")
    assert audit.undone == []
    assert [(r.method, r.code) for r in server.requests] == [
        ("POST", 201),
        ("DELETE", 200),
        ("PATCH", 200),
        ("GET", 404),
        ("GET", 200),
    ]


def test_garbage_collection_of_dependents_also_when_created_late(server: FakeApiServer) -> None:
    _, owner = call(server, "POST", CMS, cm("owner"))
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    early = cm("early")
    early["metadata"]["ownerReferences"] = [ref]
    assert call(server, "POST", CMS, early)[0] == 201
    assert call(server, "DELETE", f"{CMS}/owner")[0] == 200
    assert call(server, "GET", f"{CMS}/early")[0] == 404  # collected with its owner
    late = cm("late")
    late["metadata"]["ownerReferences"] = [ref]
    assert call(server, "POST", CMS, late)[0] == 201  # accepted, then collected: owner is gone
    assert call(server, "GET", f"{CMS}/late")[0] == 404
    alive = cm("alive")
    alive["metadata"]["ownerReferences"] = [ref, {**ref, "name": "other", "uid": "no-such-uid"}]
    call(server, "POST", CMS, cm("keeper"))
    _, keeper = call(server, "GET", f"{CMS}/keeper")
    alive["metadata"]["ownerReferences"][1]["uid"] = keeper["metadata"]["uid"]
    assert call(server, "POST", CMS, alive)[0] == 201
    assert call(server, "GET", f"{CMS}/alive")[0] == 200  # one owner left is enough


def test_status_subresource_and_generation(server: FakeApiServer) -> None:
    cr = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "x"},
        "spec": {"maxContextTokens": 1},
        "status": {"ignored": True},
    }
    _, created = call(server, "POST", CRS, cr)
    assert "status" not in created and created["metadata"]["generation"] == 1
    merge = "application/merge-patch+json"
    _, patched = call(
        server, "PATCH", f"{CRS}/x", {"status": {"a": 1}, "metadata": {"labels": {"l": "v"}}}, merge
    )
    assert "status" not in patched and patched["metadata"]["generation"] == 1
    _, patched = call(
        server,
        "PATCH",
        f"{CRS}/x/status",
        {"status": {"a": 1}, "spec": {"maxContextTokens": 2}},
        merge,
    )
    assert patched["status"] == {"a": 1} and patched["spec"] == {"maxContextTokens": 1}
    assert patched["metadata"]["generation"] == 1
    _, patched = call(server, "PATCH", f"{CRS}/x", {"spec": {"maxContextTokens": 2}}, merge)
    assert patched["metadata"]["generation"] == 2 and patched["status"] == {"a": 1}
    stale = {**patched, "metadata": {**patched["metadata"], "resourceVersion": "1"}}
    assert call(server, "PUT", f"{CRS}/x", stale)[0] == 409
    # A no-op write changes nothing, not even the resourceVersion.
    _, same = call(server, "PATCH", f"{CRS}/x", {"spec": {"maxContextTokens": 2}}, merge)
    assert same["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]
    # Items of custom resources keep their type; built-in kinds' items do not (#3030).
    call(server, "POST", CMS, cm("c"))
    assert call(server, "GET", CRS)[1]["items"][0]["kind"] == "DSV4Deployment"
    assert "kind" not in call(server, "GET", CMS)[1]["items"][0]


def test_server_side_apply(server: FakeApiServer) -> None:
    apply = "application/apply-patch+yaml"
    first = {**cm("s"), "data": {"a": "1", "b": "2"}}
    # No fieldManager: ValidatePatchOptions refuses it as an invalid PatchOptions (422).
    assert call(server, "PATCH", f"{CMS}/s", first, apply)[0] == 422
    code, created = call(server, "PATCH", f"{CMS}/s?fieldManager=m&force=true", first, apply)
    assert code == 201 and created["data"] == {"a": "1", "b": "2"}
    call(server, "PATCH", f"{CMS}/s", {"data": {"other": "x"}}, "application/merge-patch+json")
    _, updated = call(
        server, "PATCH", f"{CMS}/s?fieldManager=m", {**cm("s"), "data": {"a": "3"}}, apply
    )
    # The manager's dropped field goes; another writer's field stays.
    assert updated["data"] == {"a": "3", "other": "x"}
    assert updated["metadata"]["uid"] == created["metadata"]["uid"]


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("a=1,b", {"a": "1", "b": ""}, True),
        ("a==1,!b", {"a": "1", "b": "x"}, False),
        ("a!=1", {}, True),
        ("a in (1, 2),c notin (3)", {"a": "2", "c": "4"}, True),
        ("a in (1,2)", {"a": "3"}, False),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert selector_matches(selector, labels) is matches
