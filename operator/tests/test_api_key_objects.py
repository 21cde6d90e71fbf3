"""`spec.apiKey.secretRef`: the kubelet mounts the Secret's key into the router and worker pods
(the operator never reads it), the rank and router configs name the file, a change of the
reference rolls the pods, and what a podTemplate could do to it is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
from test_manifests import KUBERNETES_VERSIONS, by_kind, desired

from dsv4_common.api.rank_config import (
    API_KEY_FILE,
    ROUTER_CONFIG_KEY,
    parse_rank_config,
    parse_router_config,
)
from dsv4_common.api.spec import SpecError

Body = dict[str, Any]
REF = {"secretRef": {"name": "tiny-api-key", "key": "token"}}


def _pods(kinds: dict[str, dict[str, Body]]) -> list[Body]:
    workloads = [*kinds["StatefulSet"].values(), *kinds["Deployment"].values()]
    return [w["spec"]["template"]["spec"] for w in workloads]


def test_every_pod_mounts_the_key_and_every_config_names_it(
    make_body: Callable[..., Body],
) -> None:
    kinds = by_kind(desired(make_body(apiKey=REF)))
    pods = _pods(kinds)
    assert len(pods) == 3  # prefill, decode, router
    for pod in pods:
        (volume,) = [v for v in pod["volumes"] if v["name"] == "api-key"]
        assert volume["secret"] == {
            "secretName": "tiny-api-key",
            "items": [{"key": "token", "path": "api-key"}],
            "defaultMode": 0o440,
        }
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-key"]
        assert mount == {"name": "api-key", "mountPath": "/etc/dsv4-api-key", "readOnly": True}
        assert f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}" == API_KEY_FILE
    (config_map,) = kinds["ConfigMap"].values()
    for key, text in config_map["data"].items():
        if key == ROUTER_CONFIG_KEY:
            assert parse_router_config(json.loads(text)).api_key_file == API_KEY_FILE
        elif key.endswith(".json") and "-rank-" in key:
            assert parse_rank_config(json.loads(text)).api_key_file == API_KEY_FILE
    # No Secret is rendered (the user's own), and nothing reads one.
    assert "Secret" not in kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_objects_with_a_key_pass_strict_schema_validation(
    make_body: Callable[..., Body], version: str
) -> None:
    for obj in desired(make_body(apiKey=REF)).objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_without_a_key_nothing_is_mounted_and_the_configs_name_no_file(
    make_body: Callable[..., Body],
) -> None:
    kinds = by_kind(desired(make_body()))
    for pod in _pods(kinds):
        assert all(v["name"] != "api-key" for v in pod["volumes"])
    (config_map,) = kinds["ConfigMap"].values()
    assert json.loads(config_map["data"][ROUTER_CONFIG_KEY]).get("api_key_file") is None


def test_naming_a_key_rolls_every_group_and_the_router(make_body: Callable[..., Body]) -> None:
    before = desired(make_body()).template_hashes
    after = desired(make_body(apiKey=REF)).template_hashes
    other = desired(make_body(apiKey={"secretRef": {"name": "other"}})).template_hashes
    assert set(before) == set(after)
    assert all(before[k] != after[k] != other[k] for k in before)


def test_a_pod_template_cannot_take_the_key_s_volume_mount_or_flags(
    make_body: Callable[..., Body],
) -> None:
    template = {
        "spec": {
            "volumes": [{"name": "api-key", "emptyDir": {}}],
            "containers": [
                {
                    "name": "worker",
                    "args": ["--api-key=guess", "--api-key-file", "/x", "--open-status"],
                    "volumeMounts": [{"name": "dshm", "mountPath": "/etc/dsv4-api-key"}],
                }
            ],
        }
    }
    with pytest.raises(SpecError) as info:
        desired(make_body(apiKey=REF, decode={"podTemplate": template}))
    errors = "\n".join(info.value.errors)
    where = "spec.decode.podTemplate.spec"
    assert f"{where}.volumes[api-key]: name clash" in errors
    assert f"{where}.containers[worker].args[0]: --api-key is computed by the operator" in errors
    assert f"{where}.containers[worker].args[1]: --api-key-file is computed" in errors
    assert f"{where}.containers[worker].args[3]: --open-status is computed" in errors
    assert f"{where}.containers[worker].volumeMounts[/etc/dsv4-api-key]: mount path clash" in errors
