"""The fake API server's Job, PersistentVolumeClaim and Secret (support/jobs_claims.py), over
HTTP as the operator writes them: defaults and the generated selector, a no-op re-apply, and
the real server's refusals of a changed Job template or claim spec."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from typing import Any

import pytest
from support.fake_apiserver import FakeApiServer
from test_fake_builtin_defaults import APPLY, call, ok

from dsv4_operator import labels as L

NS = "team-a"
JOB: dict[str, Any] = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "fetch", "namespace": NS, "labels": {"a": "b"}},
    "spec": {
        "backoffLimit": 2,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": "c", "operator": "In", "values": [3]},
                }
            ]
        },
        "template": {
            "metadata": {"labels": {"a": "b"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "c", "image": "img:1", "command": ["dsv4", "fetch"]}],
            },
        },
    },
}
CLAIM: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "cache", "namespace": NS},
    "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}},
}


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    s = FakeApiServer(namespaces=[NS]).start()
    try:
        yield s
    finally:
        s.stop()


def _url(plural: str, name: str, group: str = "") -> str:
    base = f"/apis/{group}" if group else "/api/v1"
    return f"{base}/namespaces/{NS}/{plural}/{name}?fieldManager={L.FIELD_MANAGER}&force=true"


def test_a_job_is_defaulted_with_its_selector_and_reapplies_without_a_write(
    server: FakeApiServer,
) -> None:
    url = _url("jobs", "fetch", "batch/v1")
    stored = ok(call(server, "PATCH", url, JOB, APPLY))
    spec, uid = stored["spec"], stored["metadata"]["uid"]
    assert spec["selector"] == {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    labels = spec["template"]["metadata"]["labels"]
    assert labels["job-name"] == "fetch" and labels["batch.kubernetes.io/controller-uid"] == uid
    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (
        1,
        1,
        "NonIndexed",
    )
    assert spec["podReplacementPolicy"] == "Failed"  # with a podFailurePolicy
    assert spec["template"]["spec"]["dnsPolicy"] == "ClusterFirst"
    assert ok(call(server, "PATCH", url, JOB, APPLY)) == stored


def test_a_jobs_template_is_immutable(server: FakeApiServer) -> None:
    url = _url("jobs", "fetch", "batch/v1")
    ok(call(server, "PATCH", url, JOB, APPLY))
    changed = copy.deepcopy(JOB)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "img:2"
    code, body = call(server, "PATCH", url, changed, APPLY)
    assert (
        code == 422
        and "spec.template" in body["message"]
        and "field is immutable" in body["message"]
    )
    relabeled = copy.deepcopy(JOB)
    relabeled["metadata"]["labels"]["c"] = "d"  # metadata may change
    ok(call(server, "PATCH", url, relabeled, APPLY))


def test_a_claims_spec_is_immutable_but_may_grow(server: FakeApiServer) -> None:
    url = _url("persistentvolumeclaims", "cache")
    stored = ok(call(server, "PATCH", url, CLAIM, APPLY))
    assert stored["spec"]["volumeMode"] == "Filesystem" and stored["status"]["phase"] == "Pending"
    grown = copy.deepcopy(CLAIM)
    grown["spec"]["resources"]["requests"]["storage"] = "20Gi"
    ok(call(server, "PATCH", url, grown, APPLY))
    other = copy.deepcopy(grown)
    other["spec"]["accessModes"] = ["ReadWriteOnce"]
    code, body = call(server, "PATCH", url, other, APPLY)
    assert code == 422 and "spec is immutable after creation" in body["message"]


def test_a_secrets_string_data_is_stored_as_data(server: FakeApiServer) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hf", "namespace": NS},
        "stringData": {"HF_TOKEN": "hf_abc"},
    }
    stored = server.create(secret)
    assert stored["type"] == "Opaque" and "stringData" not in stored
    assert base64.b64decode(stored["data"]["HF_TOKEN"]) == b"hf_abc"
