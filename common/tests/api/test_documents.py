"""The versioned documents of the contract: rank config, router config, worker /status. One
builder and one parser each; round trips are exact, every bad field is named, and the wire
format does not depend on `dsv4 plan --json`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import yaml
from contract_samples import DECODE_STATUS
from repo_paths import SAMPLES

from dsv4_common.api import rank_config as rc
from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.documents import DocumentError
from dsv4_common.api.names import WORKER_ROLES
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_common.api.worker_status import (
    Threads,
    WeightsHeld,
    build_worker_status,
    parse_worker_status,
)
from dsv4_common.core.presets import load_model_config
from dsv4_common.plan import report
from dsv4_common.plan.planner import plan


def tiny_configs() -> list[rc.RankConfig]:
    body = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    spec, meta = parse_spec(body), parse_meta(body, "ns")
    memory = plan_memory(spec)
    return [
        rc.build_rank_config(
            spec,
            meta,
            memory,
            role,
            rank,
            peers_host_template="{group}-{rank}.local",
            role_services={r: f"{r}.local" for r in WORKER_ROLES},
        )
        for role in WORKER_ROLES
        for rank in range(spec.role(role).pipeline_parallel)
    ]


def wire(doc: Any) -> Any:
    return json.loads(json.dumps(doc))


def test_rank_config_round_trips_through_json() -> None:
    configs = tiny_configs()
    assert [(c.role, c.pp_rank) for c in configs] == [("prefill", 0), ("prefill", 1), ("decode", 0)]
    for config in configs:
        assert rc.parse_rank_config(wire(rc.rank_config_to_dict(config))) == config


def test_a_worker_replans_exactly_what_the_operator_planned() -> None:
    """The rank config carries every planner input: re-solving gives the same rank plan."""
    for config in tiny_configs():
        model = load_model_config(config.model.source)
        replanned = plan(config.plan_inputs(model)).ranks[config.pp_rank]
        assert rc.planned_rank(replanned) == config.planned


def test_wire_format_does_not_follow_the_plan_report(monkeypatch: pytest.MonkeyPatch) -> None:
    before = [wire(rc.rank_config_to_dict(c)) for c in tiny_configs()]
    monkeypatch.setattr(report, "rank_to_dict", lambda r: {"changed": True})
    monkeypatch.setattr(report, "plan_to_dict", lambda p: {"changed": True})
    assert [wire(rc.rank_config_to_dict(c)) for c in tiny_configs()] == before


def test_rank_config_wire_keys_are_the_v1_schema() -> None:
    doc = rc.rank_config_to_dict(tiny_configs()[0])
    assert set(doc) == {
        "version", "deployment", "namespace", "role", "pp_rank", "pp_size", "tp_size",
        "serving_rank", "model", "max_context_tokens", "kv", "plan", "planned", "ports",
        "peers", "role_services", "torch_threads", "max_queue_requests", "queue_timeout_s",
        "api_key_file", "pd_secret_file",
    }  # fmt: skip
    assert doc["version"] == 1 and doc["plan"]["layer_split"] == [3, 3]
    assert doc["ports"] == {"http": 8080, "status": 8081, "pp": 8082, "kv": 8083}


def _with(doc: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    out = wire(doc)
    *parents, last = path.split(".")
    target = out
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("version", 2, "rank_config.version: this reader understands version 1, got 2"),
        ("version", KeyError, "rank_config.version: this reader understands version 1"),
        ("plan.layer_split", KeyError, "rank_config.plan.layer_split: required"),
        ("plan.layer_split", [3], "rank_config.plan.layer_split: has 1 entries, pp_size is 2"),
        ("pp_rank", 2, "rank_config.pp_rank: must be in [0, 2), got 2"),
        ("pp_rank", "0", "rank_config.pp_rank: must be an integer, got '0'"),
        ("role", "router", "rank_config.role: must be one of"),
        ("kv.transfer", "tcp", "rank_config.kv.transfer: must be one of"),
        ("kv.swa_ratio", "auto", "rank_config.kv.swa_ratio"),
        ("serving_rank", True, "rank_config.serving_rank: only PP rank 0 serves"),
        ("serving_rank", 1, "rank_config.serving_rank: must be true or false"),
        ("planned.layers", [0], "rank_config.planned.layers: must have 2 items"),
        ("model.config_path", "/m/config.json", "rank_config.model: exactly one of preset"),
        ("role_services", {"prefill": "p"}, "rank_config.role_services: missing decode"),
        ("plan.mem_fraction", float("nan"), "rank_config.plan.mem_fraction: must be finite"),
        ("torch_threads", 0, "rank_config.torch_threads: must be >= 1, got 0"),
        ("torch_threads", 1.5, "rank_config.torch_threads: must be an integer"),
        ("max_queue_requests", 0, "rank_config.max_queue_requests: must be >= 1, got 0"),
        ("queue_timeout_s", 0, "rank_config.queue_timeout_s: must be > 0, got 0"),
        ("model.served_model_names", ["a", "a"], "rank_config.model.served_model_names: must"),
        ("model.served_model_names", [" "], "rank_config.model.served_model_names: must"),
        ("model.served_model_names", "a", "rank_config.model.served_model_names"),
        ("model.dtype", "float16", "rank_config.model.dtype: must be one of"),
    ],
)
def test_rank_config_errors_name_the_field(path: str, value: object, needle: str) -> None:
    doc = rc.rank_config_to_dict(tiny_configs()[1])  # prefill PP rank 1
    with pytest.raises(DocumentError) as info:
        rc.parse_rank_config(_with(doc, path, value))
    assert needle in str(info.value)


def test_rank_config_torch_threads_is_optional_and_round_trips() -> None:
    config = tiny_configs()[0]
    assert config.torch_threads is None  # the builder's default: the worker decides
    doc = _with(rc.rank_config_to_dict(config), "torch_threads", KeyError)  # an older operator
    assert rc.parse_rank_config(doc).torch_threads is None
    doc = _with(rc.rank_config_to_dict(config), "torch_threads", 7)
    assert rc.parse_rank_config(doc).torch_threads == 7


def test_rank_config_queue_settings_are_optional_and_round_trip() -> None:
    config = tiny_configs()[0]
    assert (config.max_queue_requests, config.queue_timeout_s) == (None, None)  # derived
    doc = rc.rank_config_to_dict(config)
    for key in ("max_queue_requests", "queue_timeout_s"):
        doc = _with(doc, key, KeyError)  # an older operator's
    parsed = rc.parse_rank_config(doc)
    assert (parsed.max_queue_requests, parsed.queue_timeout_s) == (None, None)
    doc = _with(_with(doc, "max_queue_requests", 12), "queue_timeout_s", 2.5)
    parsed = rc.parse_rank_config(doc)
    assert (parsed.max_queue_requests, parsed.queue_timeout_s) == (12, 2.5)


def test_rank_config_carries_the_specs_served_model_names() -> None:
    body = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    body["spec"]["model"]["servedModelNames"] = ["tiny-chat", "tiny"]
    spec, meta = parse_spec(body), parse_meta(body)
    memory, services = plan_memory(spec), {r: f"{r}.local" for r in WORKER_ROLES}
    config = rc.build_rank_config(
        spec, meta, memory, "decode", 0, peers_host_template="h", role_services=services
    )
    assert config.model.served_model_names == ("tiny-chat", "tiny")
    assert rc.parse_rank_config(wire(rc.rank_config_to_dict(config))) == config
    doc = _with(rc.rank_config_to_dict(config), "model.served_model_names", KeyError)
    assert rc.parse_rank_config(doc).model.served_model_names == ()  # an older operator's


def test_rank_config_carries_the_specs_compute_dtype() -> None:
    body = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    body["spec"]["model"]["dtype"] = "float32"
    spec, meta = parse_spec(body), parse_meta(body)
    memory, services = plan_memory(spec), {r: f"{r}.local" for r in WORKER_ROLES}
    config = rc.build_rank_config(
        spec, meta, memory, "prefill", 0, peers_host_template="h", role_services=services
    )
    assert config.model.dtype == "float32"
    assert rc.parse_rank_config(wire(rc.rank_config_to_dict(config))) == config
    doc = _with(rc.rank_config_to_dict(config), "model.dtype", KeyError)
    assert rc.parse_rank_config(doc).model.dtype == "auto"  # an older operator's


def test_router_config_round_trips_and_needs_both_roles() -> None:
    body = yaml.safe_load((SAMPLES / "tiny-cpu.yaml").read_text())
    spec, meta = parse_spec(body), parse_meta(body)
    endpoints = {r: rc.RoleEndpoint(f"{r}.svc", 8080, 8083) for r in WORKER_ROLES}
    config = rc.build_router_config(spec, meta, endpoints)
    doc = wire(rc.router_config_to_dict(config))
    assert rc.parse_router_config(doc) == config
    del doc["roles"]["decode"]
    with pytest.raises(DocumentError, match=r"router_config.roles: missing decode"):
        rc.parse_router_config(doc)


STATUS = DECODE_STATUS


def test_worker_status_round_trips() -> None:
    doc = wire(build_worker_status(STATUS))
    assert doc["version"] == 1 and doc["capacity"]["full_tokens"] == 8192
    assert parse_worker_status(doc) == STATUS


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("version", 0, "status.version: this reader understands version 1, got 0"),
        ("capacity.full_tokens", -1, "status.capacity.full_tokens: must be >= 0, got -1"),
        ("capacity.swa_tokens", 1.5, "status.capacity.swa_tokens: must be an integer"),
        ("kv_transfer.backend", "tcp", "status.kv_transfer.backend"),
        ("pp_rank", KeyError, "status.pp_rank: required"),
        ("capacity", None, "status.capacity: must be an object, got null"),
        ("threads.intra_op", -1, "status.threads.intra_op: must be >= 0, got -1"),
        ("threads.source", "guess", "status.threads.source: must be one of"),
    ],
)
def test_worker_status_errors_name_the_field(path: str, value: object, needle: str) -> None:
    with pytest.raises(DocumentError) as info:
        parse_worker_status(_with(build_worker_status(STATUS), path, value))
    assert needle in str(info.value)


def test_worker_status_without_kv_transfer_means_not_ready() -> None:
    doc = _with(build_worker_status(STATUS), "kv_transfer", KeyError)
    parsed = parse_worker_status(doc)
    assert (parsed.kv_backend, parsed.kv_ready, parsed.kv_layout_hash) == (None, False, None)


def test_worker_status_reports_torch_threads_and_older_workers_report_none() -> None:
    status = dataclasses.replace(STATUS, threads=Threads(3, 1, "rank_config", 3.5))
    doc = wire(build_worker_status(status))
    assert doc["threads"] == {"intra_op": 3, "inter_op": 1, "source": "rank_config", "cpus": 3.5}
    assert parse_worker_status(doc) == status
    del doc["threads"]
    assert parse_worker_status(doc).threads == Threads()  # zeros and "unknown"


def test_worker_status_reports_its_weights_and_older_workers_report_none() -> None:
    status = dataclasses.replace(STATUS, weights=WeightsHeld(1529612, 1529612, "float32"))
    doc = wire(build_worker_status(status))
    assert doc["weights"] == {
        "held_bytes": 1529612,
        "planned_bytes": 1529612,
        "compute_dtype": "float32",
    }
    assert parse_worker_status(doc) == status
    with pytest.raises(DocumentError, match=r"status\.weights\.held_bytes: must be >= 0"):
        parse_worker_status(_with(doc, "weights.held_bytes", -1))
    del doc["weights"]
    assert parse_worker_status(doc).weights == WeightsHeld()  # zeros and "unknown"
