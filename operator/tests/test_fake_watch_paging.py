"""Watches answer 410 Gone once their history is compacted, and lists paginate, as the real
API server does (support/watch_cache.py cites the upstream code: watch_cache_history.go,
continue.go, etcd3 store and errors)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import watch_cache
from support.chart_install import request
from support.fake_apiserver import FakeApiServer

CMS = "/api/v1/namespaces/default/configmaps"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer(namespaces=("default", "other")) as srv:
        yield srv


def cm(name: str, ns: str = "default", **labels: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": ns, "labels": labels}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


def rv_of(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


def watch_events(server: FakeApiServer, query: str) -> list[dict[str, Any]]:
    """Every event of a watch until the server ends it (timeoutSeconds=1 or an error)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", f"{CMS}?watch=true&timeoutSeconds=1&{query}")
        resp = conn.getresponse()
        assert resp.status == 200
        return [json.loads(line) for line in resp.read().splitlines() if line]
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# Watches


def test_a_watch_from_before_the_compaction_gets_a_410_error_event(
    server: FakeApiServer,
) -> None:
    first = server.create(cm("a"))
    server.create(cm("b"))
    # Before compaction the whole history is there.
    assert [e["object"]["metadata"]["name"] for e in watch_events(server, "resourceVersion=0")]
    resumed = watch_events(server, f"resourceVersion={rv_of(first)}")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in resumed] == [("ADDED", "b")]
    compacted = server.compact()
    (error,) = watch_events(server, f"resourceVersion={rv_of(first)}")
    assert error == {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {rv_of(first)} ({compacted})",
            "reason": "Expired",
            "code": 410,
        },
    }
    # From the compaction's version on, a watch resumes: nothing is lost after it.
    server.create(cm("c"))
    resumed = watch_events(server, f"resourceVersion={compacted}")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in resumed] == [("ADDED", "c")]


def test_the_history_window_keeps_the_newest_events_only() -> None:
    with FakeApiServer(history_window=3) as server:
        created = [server.create(cm(f"n{i}")) for i in range(5)]
        (error,) = watch_events(server, f"resourceVersion={rv_of(created[0])}")
        assert error["object"]["code"] == 410
        resumed = watch_events(server, f"resourceVersion={rv_of(created[2])}")
        assert [e["object"]["metadata"]["name"] for e in resumed] == ["n3", "n4"]


def test_close_watches_ends_open_streams(server: FakeApiServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", f"{CMS}?watch=true&timeoutSeconds=60")
        resp = conn.getresponse()
        server.close_watches()
        assert resp.read() == b""  # ended long before its 60 s
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# Lists


def test_a_list_in_pages_is_one_consistent_list(server: FakeApiServer) -> None:
    for name in "abcde":
        server.create(cm(name))
    server.create(cm("z", ns="other"))
    code, first = request(server, "GET", f"{CMS}?limit=2")
    assert code == 200
    names = [o["metadata"]["name"] for o in first["items"]]
    assert names == ["a", "b"]
    assert first["metadata"]["remainingItemCount"] == 3
    list_rv = first["metadata"]["resourceVersion"]
    # Writes between pages do not show: every page is read at the first page's version.
    server.delete("v1", "ConfigMap", "default", "d")
    server.create(cm("c2"))
    token = first["metadata"]["continue"]
    _, second = request(server, "GET", f"{CMS}?limit=2&continue={token}")
    assert [o["metadata"]["name"] for o in second["items"]] == ["c", "d"]
    assert second["metadata"]["resourceVersion"] == list_rv
    assert second["metadata"]["remainingItemCount"] == 1
    _, last = request(server, "GET", f"{CMS}?limit=2&continue={second['metadata']['continue']}")
    assert [o["metadata"]["name"] for o in last["items"]] == ["e"]
    assert "continue" not in last["metadata"] and "remainingItemCount" not in last["metadata"]
    # Items of built-in kinds carry no apiVersion/kind, as in an unpaged list.
    assert "kind" not in last["items"][0]


def test_a_selector_filters_pages_and_hides_the_remaining_count(server: FakeApiServer) -> None:
    for i in range(6):
        server.create(cm(f"n{i}", tier="x" if i % 2 else "y"))
    code, page = request(server, "GET", f"{CMS}?limit=2&labelSelector=tier%3Dx")
    assert code == 200
    assert [o["metadata"]["name"] for o in page["items"]] == ["n1", "n3"]
    assert "remainingItemCount" not in page["metadata"]
    _, rest = request(
        server,
        "GET",
        f"{CMS}?limit=2&labelSelector=tier%3Dx&continue={page['metadata']['continue']}",
    )
    assert [o["metadata"]["name"] for o in rest["items"]] == ["n5"]


def test_a_continue_token_from_before_the_compaction_is_expired(server: FakeApiServer) -> None:
    for name in "abc":
        server.create(cm(name))
    _, first = request(server, "GET", f"{CMS}?limit=1")
    server.create(cm("d"))
    server.compact()
    code, status = request(server, "GET", f"{CMS}?limit=1&continue={first['metadata']['continue']}")
    assert (code, status["reason"], status["code"]) == (410, "Expired", 410)
    assert status["message"] == watch_cache.EXPIRED_CONTINUE
    # The Status's token continues after the same key, at the latest version (d shows).
    inconsistent = status["metadata"]["continue"]
    assert watch_cache.decode_continue(inconsistent) == (-1, "default/a\x00")
    names = []
    token = inconsistent
    while token:
        code, page = request(server, "GET", f"{CMS}?limit=1&continue={token}")
        assert code == 200
        names += [o["metadata"]["name"] for o in page["items"]]
        token = page["metadata"].get("continue", "")
    assert names == ["b", "c", "d"]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("continue=%21%21", "invalid continue token"),
        ("continue=eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MCwic3RhcnQiOiJhIn0", "resourceVersion"),
        (
            f"continue={watch_cache.encode_continue(5, 'a')}&resourceVersion=3",
            "specifying resource version is not allowed when using continue",
        ),
        (f"continue={watch_cache.encode_continue(5, '../x')}", "continue key is not valid"),
    ],
)
def test_bad_continue_requests_are_refused(server: FakeApiServer, query: str, message: str) -> None:
    code, status = request(server, "GET", f"{CMS}?limit=1&{query}")
    assert code == 400
    assert message in status["message"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    names=st.lists(
        st.from_regex(r"[a-z]([a-z0-9-]{0,5}[a-z0-9])?", fullmatch=True), unique=True, max_size=12
    ),
    limit=st.integers(min_value=1, max_value=5),
)
def test_paging_through_any_list_yields_it_exactly_once(
    server: FakeApiServer, names: list[str], limit: int
) -> None:
    for obj in server.list("v1", "ConfigMap", "default"):
        server.delete("v1", "ConfigMap", "default", obj["metadata"]["name"])
    for name in names:
        server.create(cm(name))
    seen: list[str] = []
    token, pages = "", 0
    while True:
        suffix = f"&continue={token}" if token else ""
        code, page = request(server, "GET", f"{CMS}?limit={limit}{suffix}")
        assert code == 200
        pages += 1
        seen += [o["metadata"]["name"] for o in page["items"]]
        token = page["metadata"].get("continue", "")
        if not token:
            break
        assert page["metadata"]["remainingItemCount"] == len(names) - len(seen)
    assert seen == sorted(names)
    assert pages == max(1, -(-len(names) // limit))
