"""Spec parsing: defaults, and every error path names its field (table-driven)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dsv4_common.api.spec import (
    DeploymentSpec,
    EngineSpec,
    GpuSpec,
    KVSpec,
    RoleSpec,
    RouterSpec,
    SchedulingSpec,
    SpecError,
    parse_meta,
    parse_spec,
)

BASE: dict[str, Any] = {
    "apiVersion": "serving.dsv4.io/v1alpha1",
    "kind": "DSV4Deployment",
    "metadata": {"name": "tiny"},
    "spec": {"model": {"preset": "tiny"}, "maxContextTokens": 4096},
}
GPU = {"gpu": {"type": "h100-80gb", "perPod": 8}, "prefill": {"tensorParallel": 8}}
GPU_BOTH = {**GPU, "decode": {"tensorParallel": 8}}


def body_with(spec_patch: dict[str, Any], name: str = "tiny") -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    body["metadata"]["name"] = name
    body["spec"].update(copy.deepcopy(spec_patch))
    return body


def test_minimal_spec_gets_the_crd_defaults() -> None:
    spec = parse_spec(BASE)
    assert spec == DeploymentSpec(
        model=spec.model,
        max_context_tokens=4096,
        gpu=GpuSpec(type=None, memory_gib=0.0, per_pod=0),
        kv=KVSpec(page_size=None, swa_ratio=None, transfer="nixl"),
        prefill=RoleSpec(),
        decode=RoleSpec(),
        router=RouterSpec(replicas=1, port=8000),
    )
    assert spec.gpu.cpu_mode and spec.model.source == "tiny"


def test_full_gpu_spec_round_trips_every_field() -> None:
    spec = parse_spec(
        body_with(
            {
                "model": {
                    "preset": "deepseek-v4-flash",
                    "weights": {"persistentVolumeClaim": "w", "path": "/models/f"},
                },
                **GPU_BOTH,
                "kv": {"pageSize": 256, "swaRatio": "0.25", "transfer": "zmq"},
                "prefill": {"tensorParallel": 8, "pipelineParallel": 2, "chunkedPrefillTokens": 8},
                "decode": {"tensorParallel": 8, "replicas": 3, "maxRunningRequests": 64},
                "router": {"replicas": 2, "port": 9000},
                "speculativeDraftTokens": 2,
                "memFraction": 0.8,
                "image": "registry/worker:1",
                "resources": {"requests": {"cpu": 4, "memory": "64Gi"}},
            }
        )
    )
    assert spec.model.weights is not None and spec.model.weights.path == "/models/f"
    assert spec.kv == KVSpec(page_size=256, swa_ratio=0.25, transfer="zmq")
    assert spec.prefill == RoleSpec(1, 2, 8, 8, None)
    assert spec.decode == RoleSpec(3, 1, 8, None, 64)
    assert spec.router == RouterSpec(2, 9000)
    assert (spec.speculative_draft_tokens, spec.mem_fraction, spec.image) == (
        2,
        0.8,
        "registry/worker:1",
    )
    assert spec.resources.requests == (("cpu", "4"), ("memory", "64Gi"))


@pytest.mark.parametrize(
    ("text", "ratio"), [("auto", None), ("0.25", 0.25), (".5", 0.5), ("1", 1.0), ("1.0", 1.0)]
)
def test_swa_ratio_takes_auto_or_a_decimal_string(text: str, ratio: float | None) -> None:
    assert parse_spec(body_with({"kv": {"swaRatio": text}})).kv.swa_ratio == ratio


# (spec patch, metadata name, the field path the error must name)
ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("no spec", {"__drop_spec__": True}, "spec: required"),
    ("spec not object", {"__spec__": [1]}, "spec: must be an object"),
    ("no model", {"model": None}, "spec.model: required"),
    ("model not object", {"model": "tiny"}, "spec.model: must be an object"),
    ("no model source", {"model": {}}, "spec.model: exactly one"),
    ("two model sources", {"model": {"preset": "tiny", "configPath": "/c.json"}}, "spec.model:"),
    ("unknown preset", {"model": {"preset": "llama"}}, "spec.model.preset"),
    (
        "relative configPath",
        {"model": {"configPath": "c.json"}, **GPU_BOTH},
        "spec.model.configPath",
    ),
    (
        "weights no path",
        {"model": {"preset": "tiny", "weights": {"persistentVolumeClaim": "w"}}},
        "spec.model.weights.path: required",
    ),
    (
        "weights no pvc",
        {"model": {"preset": "tiny", "weights": {"path": "/m"}}},
        "spec.model.weights.persistentVolumeClaim: required",
    ),
    (
        "bad pvc name",
        {"model": {"preset": "tiny", "weights": {"persistentVolumeClaim": "W_", "path": "/m"}}},
        "spec.model.weights.persistentVolumeClaim",
    ),
    (
        "relative weights path",
        {"model": {"preset": "tiny", "weights": {"persistentVolumeClaim": "w", "path": "m"}}},
        "spec.model.weights.path",
    ),
    ("unknown model field", {"model": {"preset": "tiny", "revision": "x"}}, "spec.model.revision"),
    ("no context", {"maxContextTokens": None}, "spec.maxContextTokens: required"),
    ("zero context", {"maxContextTokens": 0}, "spec.maxContextTokens: must be >= 1"),
    ("huge context", {"maxContextTokens": 1 << 30}, "spec.maxContextTokens: must be <="),
    ("string context", {"maxContextTokens": "4k"}, "spec.maxContextTokens: must be an integer"),
    ("bool context", {"maxContextTokens": True}, "spec.maxContextTokens: must be an integer"),
    ("negative memory", {"gpu": {"memoryGiB": -1}}, "spec.gpu.memoryGiB"),
    ("string memory", {"gpu": {"memoryGiB": "80"}}, "spec.gpu.memoryGiB: must be a number"),
    ("cpu with devices", {"gpu": {"memoryGiB": 0, "perPod": 1}}, "spec.gpu.perPod: must be 0"),
    (
        "gpu without devices",
        {"model": {"preset": "deepseek-v4-flash"}, "gpu": {"memoryGiB": 80}},
        "spec.gpu.perPod: must be > 0",
    ),
    ("too many devices", {"gpu": {"memoryGiB": 80, "perPod": 17}}, "spec.gpu.perPod: must be <="),
    (
        "cpu mode big model",
        {"model": {"preset": "deepseek-v4-pro"}},
        "spec.gpu.type: required for this model: CPU mode",
    ),
    ("prefill tp mismatch", {**GPU, "decode": {"tensorParallel": 4}}, "spec.decode.tensorParallel"),
    ("tp on cpu", {"prefill": {"tensorParallel": 2}}, "spec.prefill.tensorParallel"),
    ("page size zero", {"kv": {"pageSize": 0}}, "spec.kv.pageSize"),
    ("swa above one", {"kv": {"swaRatio": "1.5"}}, "spec.kv.swaRatio"),
    ("swa zero", {"kv": {"swaRatio": "0"}}, "spec.kv.swaRatio"),
    ("swa unquoted", {"kv": {"swaRatio": 0.25}}, "spec.kv.swaRatio: must be a string"),
    ("unknown transfer", {"kv": {"transfer": "tcp"}}, "spec.kv.transfer: must be one of"),
    ("kv not object", {"kv": 3}, "spec.kv: must be an object"),
    ("zero decode replicas", {"decode": {"replicas": 0}}, "spec.decode.replicas: must be >= 1"),
    ("too many replicas", {"prefill": {"replicas": 65}}, "spec.prefill.replicas: must be <="),
    ("zero pp", {"decode": {"pipelineParallel": 0}}, "spec.decode.pipelineParallel: must be >= 1"),
    ("pp too big", {"prefill": {"pipelineParallel": 17}}, "spec.prefill.pipelineParallel"),
    ("chunk zero", {"prefill": {"chunkedPrefillTokens": 0}}, "spec.prefill.chunkedPrefillTokens"),
    ("running zero", {"decode": {"maxRunningRequests": 0}}, "spec.decode.maxRunningRequests"),
    ("misspelled role field", {"prefill": {"pipelineParalel": 2}}, "spec.prefill.pipelineParalel"),
    ("router port privileged", {"router": {"port": 80}}, "spec.router.port: must be >= 1024"),
    ("router replicas zero", {"router": {"replicas": 0}}, "spec.router.replicas"),
    ("router unknown", {"router": {"host": "x"}}, "spec.router.host"),
    ("draft negative", {"speculativeDraftTokens": -1}, "spec.speculativeDraftTokens"),
    ("mem fraction high", {"memFraction": 1.5}, "spec.memFraction"),
    ("mem fraction low", {"memFraction": 0.01}, "spec.memFraction"),
    ("empty image", {"image": ""}, "spec.image: length"),
    (
        "gpu in resources",
        {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "spec.resources.limits.nvidia.com/gpu",
    ),
    (
        "bad quantity",
        {"resources": {"requests": {"memory": "lots"}}},
        "spec.resources.requests.memory",
    ),
    ("unknown resources key", {"resources": {"claims": []}}, "spec.resources.claims"),
    ("unknown top-level", {"replicas": 3}, "spec.replicas: unknown field"),
    ("unknown gang", {"scheduling": {"gang": "kueue"}}, "spec.scheduling.gang: must be one of"),
    (
        "bad topology key",
        {"scheduling": {"topologyKey": "not a key"}},
        "spec.scheduling.topologyKey: must be a node label key",
    ),
    (
        "unknown topology policy",
        {"scheduling": {"topologyPolicy": "strict"}},
        "spec.scheduling.topologyPolicy: must be one of",
    ),
    (
        "queue without volcano",
        {"scheduling": {"queue": "q"}},
        "spec.scheduling.queue: is a Volcano queue",
    ),
    ("bad queue", {"scheduling": {"gang": "volcano", "queue": "Q_1"}}, "spec.scheduling.queue"),
    ("unknown scheduling field", {"scheduling": {"gangs": "none"}}, "spec.scheduling.gangs"),
    ("podTemplate not object", {"decode": {"podTemplate": []}}, "spec.decode.podTemplate: must be"),
    (
        "podTemplate unknown key",
        {"prefill": {"podTemplate": {"kind": "Pod"}}},
        "spec.prefill.podTemplate.kind: unknown field",
    ),
    (
        "podTemplate metadata name",
        {"router": {"podTemplate": {"metadata": {"name": "x"}}}},
        "spec.router.podTemplate.metadata.name: unknown field",
    ),
    (
        "podTemplate label not a string",
        {"decode": {"podTemplate": {"metadata": {"labels": {"gpus": 8}}}}},
        "spec.decode.podTemplate.metadata.labels.gpus: must be a string",
    ),
    (
        "podTemplate spec not object",
        {"decode": {"podTemplate": {"spec": "x"}}},
        "spec.decode.podTemplate.spec: must be an object",
    ),
]


@pytest.mark.parametrize(("case", "patch", "field"), ERRORS, ids=[e[0] for e in ERRORS])
def test_every_error_names_its_field(case: str, patch: dict[str, Any], field: str) -> None:
    body = body_with({k: v for k, v in patch.items() if not k.startswith("__")})
    if "__drop_spec__" in patch:
        del body["spec"]
    if "__spec__" in patch:
        body["spec"] = patch["__spec__"]
    with pytest.raises(SpecError) as info:
        parse_spec(body)
    assert any(e.startswith(field) or field in e for e in info.value.errors), info.value.errors


def test_scheduling_and_pod_templates_are_read() -> None:
    template = {"metadata": {"labels": {"team": "a"}}, "spec": {"nodeSelector": {"x": "y"}}}
    body = body_with(
        {
            "scheduling": {
                "gang": "volcano",
                "queue": "inference",
                "topologyKey": "topology.kubernetes.io/zone",
                "topologyPolicy": "required",
            },
            "decode": {"podTemplate": template},
            "router": {"podTemplate": {"spec": {}}},
        }
    )
    spec = parse_spec(body)
    assert spec.scheduling == SchedulingSpec(
        "volcano", "topology.kubernetes.io/zone", "required", "inference"
    )
    assert spec.decode.pod_template == template and spec.prefill.pod_template is None
    assert spec.router.pod_template == {"spec": {}}
    body["spec"]["decode"]["podTemplate"]["metadata"]["labels"]["team"] = "b"
    assert spec.decode.pod_template["metadata"]["labels"]["team"] == "a"  # a copy
    assert parse_spec(BASE).scheduling == SchedulingSpec("none", None, "preferred", None)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("tiny", True),
        ("a" * 40, True),
        ("a" * 41, False),
        ("tiny.v2", False),
        ("1tiny", False),
        ("Tiny", False),
        ("tiny-", False),
    ],
)
def test_metadata_name_rule(name: str, ok: bool) -> None:
    body = body_with({}, name=name)
    if ok:
        parse_spec(body)
        assert parse_meta(body).name == name
    else:
        with pytest.raises(SpecError, match=r"metadata\.name"):
            parse_spec(body)
        with pytest.raises(SpecError, match=r"metadata\.name"):
            parse_meta(body)


def test_all_errors_are_collected_not_just_the_first() -> None:
    body = body_with(
        {"maxContextTokens": 0, "decode": {"pipelineParallel": 0}, "kv": {"transfer": "tcp"}},
        name="Bad.Name",
    )
    with pytest.raises(SpecError) as info:
        parse_spec(body)
    fields = {e.split(":")[0] for e in info.value.errors}
    assert fields == {
        "metadata.name",
        "spec.maxContextTokens",
        "spec.decode.pipelineParallel",
        "spec.kv.transfer",
    }
    assert str(info.value).count(";") == 3


def test_meta_defaults_namespace_and_reads_uid_and_generation() -> None:
    body = body_with({})
    assert parse_meta(body, "dev").namespace == "dev"
    body["metadata"].update({"namespace": "prod", "uid": "u1", "generation": 7})
    meta = parse_meta(body, "dev")
    assert (meta.namespace, meta.uid, meta.generation) == ("prod", "u1", 7)


# --- spec.<role>.layerSplit --------------------------------------------------------------------


def test_layer_split_is_read_per_role() -> None:
    spec = parse_spec(
        body_with(
            {
                **GPU_BOTH,
                "model": {"preset": "deepseek-v4-pro"},
                "decode": {
                    "tensorParallel": 8,
                    "pipelineParallel": 4,
                    "layerSplit": [16, 15, 15, 15],
                },
            }
        )
    )
    assert spec.decode.layer_split == (16, 15, 15, 15)
    assert spec.prefill.layer_split is None  # the planner balances it
    assert parse_spec(BASE).decode.layer_split is None


@pytest.mark.parametrize(
    ("role", "patch", "needle"),
    [
        ("decode", {"layerSplit": "3,3"}, "spec.decode.layerSplit: must be a list"),
        ("prefill", {"layerSplit": {"0": 6}}, "spec.prefill.layerSplit: must be a list"),
        ("decode", {"pipelineParallel": 2, "layerSplit": [6, 0]}, "spec.decode.layerSplit[1]:"),
        ("decode", {"pipelineParallel": 2, "layerSplit": [3, "3"]}, "spec.decode.layerSplit[1]:"),
        ("decode", {"pipelineParallel": 2, "layerSplit": [True, 5]}, "spec.decode.layerSplit[0]:"),
        ("prefill", {"pipelineParallel": 2, "layerSplit": [3, 2000]}, "spec.prefill.layerSplit[1]"),
        (
            "prefill",
            {"pipelineParallel": 2, "layerSplit": [6]},
            "spec.prefill.layerSplit: has 1 entries, pipelineParallel is 2",
        ),
        ("decode", {"layerSplit": [3, 3]}, "spec.decode.layerSplit: has 2 entries"),
    ],
)
def test_bad_layer_split_names_the_field(role: str, patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(body_with({role: patch}))
    assert any(e.startswith(needle) for e in info.value.errors), info.value.errors


# --- spec.engine and spec.<role>.engineArgs ---------------------------------------------------

SGLANG: dict[str, Any] = {
    "engine": {"name": "sglang"},
    "model": {
        "preset": "deepseek-v4-flash",
        "weights": {"persistentVolumeClaim": "w", "path": "/models/flash"},
    },
    "gpu": {"type": "h200", "perPod": 4},
    "prefill": {"tensorParallel": 4},
    "decode": {"tensorParallel": 4},
}


def sglang_with(**patch: Any) -> dict[str, Any]:
    """The SGLang spec with each patched section merged into (not replacing) its own."""
    spec = copy.deepcopy(SGLANG)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return body_with(spec)


def test_the_engine_defaults_to_ours() -> None:
    spec = parse_spec(BASE)
    assert spec.engine == EngineSpec(name="dsv4", image=None, router_image=None)
    assert not spec.engine.sglang and spec.prefill.engine_args == ()


def test_an_sglang_spec_reads_engine_images_and_engine_args() -> None:
    spec = parse_spec(
        sglang_with(
            engine={"image": "lmsysorg/sglang:v0.5.23", "routerImage": "r:1"},
            decode={"engineArgs": ["--log-level", "debug", "--decode-log-interval=10"]},
        )
    )
    assert spec.engine == EngineSpec("sglang", "lmsysorg/sglang:v0.5.23", "r:1")
    assert spec.engine.sglang
    assert spec.decode.engine_args == ("--log-level", "debug", "--decode-log-interval=10")
    assert spec.prefill.engine_args == ()


ENGINE_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown engine", body_with({"engine": {"name": "vllm"}}), "spec.engine.name: must be one of"),
    ("engine field", body_with({"engine": {"version": "1"}}), "spec.engine.version: unknown"),
    (
        "engine image with dsv4",
        body_with({"engine": {"image": "lmsysorg/sglang:v0.5.23"}}),
        "spec.engine.image: is an SGLang image",
    ),
    (
        "router image with dsv4",
        body_with({"engine": {"name": "dsv4", "routerImage": "r:1"}}),
        "spec.engine.routerImage: is an SGLang image",
    ),
    (
        "engine args with dsv4",
        body_with({"prefill": {"engineArgs": ["--log-level", "debug"]}}),
        "spec.prefill.engineArgs: are SGLang flags",
    ),
    (
        "engine args not a list",
        sglang_with(decode={"engineArgs": "--log-level debug"}),
        "spec.decode.engineArgs: must be a list",
    ),
    (
        "engine arg not a string",
        sglang_with(decode={"engineArgs": ["--decode-log-interval", 10]}),
        "spec.decode.engineArgs[1]: must be a string",
    ),
    (
        "engine arg empty",
        sglang_with(prefill={"engineArgs": [""]}),
        "spec.prefill.engineArgs[0]: must be a string of 1 to",
    ),
    (
        "too many engine args",
        sglang_with(prefill={"engineArgs": ["--enable-metrics"] * 65}),
        "spec.prefill.engineArgs: at most 64 entries",
    ),
    (
        "worker image with sglang",
        sglang_with(image="ghcr.io/dsv4-serve/worker:0.1.0"),
        "spec.image: is our worker's image",
    ),
    ("zmq with sglang", sglang_with(kv={"transfer": "zmq"}), "spec.kv.transfer: must be one of"),
    (
        "sglang in cpu mode",
        body_with(
            {
                "engine": {"name": "sglang"},
                "model": {"preset": "tiny", "weights": SGLANG["model"]["weights"]},
            }
        ),
        "spec.gpu.type: required with engine.name sglang",
    ),
    (
        "sglang without weights",
        body_with({**SGLANG, "model": {"preset": "deepseek-v4-flash"}}),
        "spec.model.weights: required with engine.name sglang",
    ),
    (
        "sglang speculating",
        sglang_with(speculativeDraftTokens=1),
        "spec.speculativeDraftTokens: must be 0 with engine.name sglang",
    ),
    (
        "sglang compute dtype",
        sglang_with(model={"dtype": "float32"}),
        "spec.model.dtype: must be auto with engine.name sglang",
    ),
    (
        "unknown compute dtype",
        body_with({"model": {"preset": "tiny", "dtype": "float16"}}),
        "spec.model.dtype: must be one of",
    ),
]


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32", "float64"])
def test_the_compute_dtype_is_read_and_defaults_to_auto(dtype: str) -> None:
    assert parse_spec(BASE).model.dtype == "auto"
    assert parse_spec(body_with({"model": {"preset": "tiny", "dtype": dtype}})).model.dtype == dtype


@pytest.mark.parametrize(
    ("case", "body", "needle"), ENGINE_ERRORS, ids=[e[0] for e in ENGINE_ERRORS]
)
def test_engine_errors_name_their_field(case: str, body: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(body)
    assert any(e.startswith(needle) for e in info.value.errors), info.value.errors
