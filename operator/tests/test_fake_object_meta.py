"""The fake API server refuses what a real one refuses in ObjectMeta and around namespaces
(support/object_meta.py, restated from apimachinery's objectmeta.go and the NamespaceLifecycle
plugin): names by each kind's rule, label keys and values, annotations over 256 KiB in total,
bodies over 3 MiB, and new content in a terminating namespace (403, cause NamespaceTerminating),
while updates there still go through and the namespace goes once emptied."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import CRD_FILE
from support.fake_apiserver import FakeApiServer, load_crd
from support.fake_http import APPLY, MERGE, call, ok

from dsv4_common.api.object_rules import (
    TOTAL_ANNOTATION_BYTES,
    dns1123_label_error,
    dns1123_subdomain_error,
)
from dsv4_operator import labels as L

NS = "/api/v1/namespaces/default"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer([load_crd(CRD_FILE)], namespaces=("default", "doomed")) as srv:
        yield srv


def cm(name: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}}


def svc(name: str) -> dict[str, Any]:
    spec = {"ports": [{"port": 80}], "selector": {"app": "x"}}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


@pytest.mark.parametrize(
    ("path", "body", "code", "needle"),
    [
        (f"{NS}/configmaps", cm("ok.name-1"), 201, ""),
        (f"{NS}/configmaps", cm("Bad_Name"), 422, "a lowercase RFC 1123 subdomain"),
        (f"{NS}/configmaps", cm("a" * 254), 422, "must be no more than 253 characters"),
        (f"{NS}/services", svc("web-1"), 201, ""),
        (f"{NS}/services", svc("1web"), 422, "a DNS-1035 label"),
        (f"{NS}/services", svc("web.a"), 422, "a DNS-1035 label"),
        (
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a.b"}},
            422,
            "a lowercase RFC 1123 label",
        ),
        (f"{NS}/configmaps", cm("l", labels={"team": "a b"}), 422, "a valid label must be"),
        (f"{NS}/configmaps", cm("k", labels={"-bad": "x"}), 422, "name part must consist"),
        (
            f"{NS}/configmaps",
            cm("big", annotations={"example.com/blob": "x" * TOTAL_ANNOTATION_BYTES}),
            422,
            "metadata.annotations: Too long: may not be more than 262144 bytes",
        ),
        (
            f"{NS}/configmaps",
            cm("fits", annotations={"a": "x" * (TOTAL_ANNOTATION_BYTES - 1)}),
            201,
            "",
        ),
    ],
)
def test_object_meta_is_validated_as_the_real_server_does(
    server: FakeApiServer, path: str, body: dict[str, Any], code: int, needle: str
) -> None:
    got, status = call(server, "POST", path, body)
    assert got == code, status
    if code == 422:
        assert status["reason"] == "Invalid" and needle in status["message"], status
        assert status["message"].startswith(f'{body["kind"]} "{body["metadata"]["name"]}"')


def test_an_update_past_the_annotation_limit_is_refused_too(server: FakeApiServer) -> None:
    ok(call(server, "POST", f"{NS}/configmaps", cm("grow")))
    patch = {"metadata": {"annotations": {"example.com/blob": "x" * TOTAL_ANNOTATION_BYTES}}}
    got, status = call(server, "PATCH", f"{NS}/configmaps/grow", patch, MERGE)
    assert got == 422 and "Too long" in status["message"]
    cr = {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": {"name": "Tiny"}}
    got, status = call(server, "POST", f"/apis/{L.API_VERSION}/namespaces/default/{L.PLURAL}", cr)
    assert got == 422 and "RFC 1123 subdomain" in status["message"]


def test_a_body_past_3_mib_is_413(server: FakeApiServer) -> None:
    body = cm("huge")
    body["data"] = {"blob": "x" * (3 * 1024 * 1024)}
    got, status = call(server, "POST", f"{NS}/configmaps", body)
    assert got == 413 and status["message"] == "Request entity too large: limit is 3145728"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcz019-.A_", min_size=1, max_size=70))
def test_the_fake_and_the_operator_agree_on_names(name: str) -> None:
    """Two independent restatements of IsDNS1123Subdomain / IsDNS1123Label."""
    from support.object_meta import meta_errors

    as_configmap = meta_errors("", "configmaps", {"name": name})
    as_namespace = meta_errors("", "namespaces", {"name": name})
    assert bool(as_configmap) is (dns1123_subdomain_error(name) is not None)
    assert bool(as_namespace) is (dns1123_label_error(name) is not None)


def test_a_terminating_namespace_refuses_new_content_and_keeps_updates(
    server: FakeApiServer,
) -> None:
    doomed = "/api/v1/namespaces/doomed"
    ok(call(server, "POST", f"{doomed}/configmaps", cm("kept")))
    deleted = ok(call(server, "DELETE", doomed))
    assert deleted["status"]["phase"] == "Terminating" and deleted["metadata"]["deletionTimestamp"]
    got, status = call(server, "POST", f"{doomed}/configmaps", cm("new"))
    assert got == 403 and status["reason"] == "Forbidden", status
    assert status["message"] == (
        'configmaps "new" is forbidden: unable to create new content in namespace doomed '
        "because it is being terminated"
    )
    assert status["details"]["causes"] == [
        {
            "reason": "NamespaceTerminating",
            "message": "namespace doomed is being terminated",
            "field": "metadata.namespace",
        }
    ]
    # A server-side apply that would create is a create too; one that updates is not.
    url = f"{doomed}/configmaps/%s?fieldManager=t&force=true"
    got, status = call(server, "PATCH", url % "applied", cm("applied"), APPLY)
    assert got == 403 and status["details"]["causes"][0]["reason"] == "NamespaceTerminating"
    ok(call(server, "PATCH", url % "kept", {**cm("kept"), "data": {"a": "b"}}, APPLY))
    assert server.finish_namespace("doomed")
    assert call(server, "GET", doomed)[0] == 404
    assert call(server, "GET", f"{doomed}/configmaps/kept")[0] == 404


def test_a_namespace_waits_for_the_finalizers_of_what_it_holds(server: FakeApiServer) -> None:
    ok(call(server, "POST", "/api/v1/namespaces/doomed/configmaps", cm("held", finalizers=["x/y"])))
    ok(call(server, "DELETE", "/api/v1/namespaces/doomed"))
    assert not server.finish_namespace("doomed")  # the ConfigMap is being deleted, held
    held = server.get("v1", "ConfigMap", "doomed", "held")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    patch = {"metadata": {"finalizers": None}}
    ok(call(server, "PATCH", "/api/v1/namespaces/doomed/configmaps/held", patch, MERGE))
    assert server.finish_namespace("doomed")
