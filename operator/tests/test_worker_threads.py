"""The operator sets each role's torch threads in the rank config from the worker container's
CPU request (`workloads.worker_torch_threads`): the role's podTemplate first, then
spec.resources, then the default (CPU mode's, or CPU_PER_GPU per GPU), a limit standing in for
an unset request; the ConfigMap's rank configs carry it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from repo_paths import SAMPLES

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.rank_config import parse_rank_config
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_operator.objects import build_desired_state
from dsv4_operator.workloads import CPU_PER_GPU, worker_cpu_request, worker_torch_threads


def _body(name: str = "tiny-cpu.yaml") -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return body


def _worker_resources(body: dict[str, Any], role: str, resources: dict[str, Any]) -> None:
    container = {"name": "worker", "resources": resources}
    body["spec"].setdefault(role, {})["podTemplate"] = {"spec": {"containers": [container]}}


def test_cpu_mode_workers_get_one_thread_from_the_default_request() -> None:
    spec = parse_spec(_body())
    assert worker_cpu_request(spec, "prefill") == 0.5
    assert worker_torch_threads(spec)["prefill"] == worker_torch_threads(spec)["decode"] == 1


@pytest.mark.parametrize(
    ("resources", "prefill", "decode"),
    [
        ({"requests": {"cpu": "4"}}, 3, 3),  # spec.resources: every role
        ({"limits": {"cpu": "2500m"}}, 1, 1),  # a limit alone is the request
        ({"requests": {"cpu": "16"}, "limits": {"cpu": "32"}}, 15, 15),
    ],
)
def test_spec_resources_set_every_role(
    resources: dict[str, Any], prefill: int, decode: int
) -> None:
    body = _body()
    body["spec"]["resources"] = resources
    spec = parse_spec(body)
    assert (worker_torch_threads(spec)["prefill"], worker_torch_threads(spec)["decode"]) == (
        prefill,
        decode,
    )


def test_a_role_pod_template_wins_for_its_role_only() -> None:
    body = _body()
    body["spec"]["resources"] = {"requests": {"cpu": "4"}}
    _worker_resources(body, "decode", {"requests": {"cpu": "8"}})
    spec = parse_spec(body)
    assert (worker_torch_threads(spec)["prefill"], worker_torch_threads(spec)["decode"]) == (3, 7)


def test_gpu_workers_default_to_their_cpus_per_gpu() -> None:
    body = _body("flash-gpu.yaml")
    assert worker_torch_threads(parse_spec(body))["decode"] == 15  # its 16-CPU request
    del body["spec"]["resources"]
    spec = parse_spec(body)
    assert worker_cpu_request(spec, "decode") == CPU_PER_GPU * spec.gpu.per_pod


def test_the_rank_configs_in_the_config_map_carry_it() -> None:
    body = copy.deepcopy(_body())
    _worker_resources(body, "prefill", {"requests": {"cpu": "3"}})
    spec, meta = parse_spec(body), parse_meta(body, "ns")
    state = build_desired_state(spec, meta, plan_memory(spec))
    (config_map,) = [o for o in state.objects if o["kind"] == "ConfigMap"]
    threads = {
        key: parse_rank_config(json.loads(doc)).torch_threads
        for key, doc in config_map["data"].items()
        if "-rank-" in key
    }
    assert threads and all(
        v == (2 if key.startswith("prefill") else 1) for key, v in threads.items()
    )
