"""Pod customization (`spec.<role>.podTemplate`), through the pure object builder and `dsv4
render`: every supported field is merged into the generated pods (table-driven), every field
the operator owns is refused naming the field, GPU pods get a memory request sized for their
weights, and the merged objects pass strict schema validation (Kubernetes 1.30 and 1.37)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import SAMPLES

from dsv4_cli.main import main
from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.names import GPU_RESOURCE
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_common.core.units import GIB
from dsv4_operator import labels as L
from dsv4_operator.objects import DesiredState, build_desired_state
from dsv4_operator.podtemplate import default_memory_limit
from dsv4_operator.quantities import quantity
from dsv4_operator.render import render

Body = dict[str, Any]
KUBERNETES_VERSIONS = ("1.30", "1.37")


def desired(body: Body) -> DesiredState:
    spec = parse_spec(body)
    return build_desired_state(spec, parse_meta(body), plan_memory(spec))


def with_template(body: Body, role: str, template: Body) -> Body:
    body = copy.deepcopy(body)
    body["spec"][role] = {**body["spec"].get(role, {}), "podTemplate": template}
    return body


def pod_template(state: DesiredState, name: str) -> Body:
    obj = next(
        o
        for o in state.objects
        if o["metadata"]["name"] == name and "template" in o.get("spec", {})
    )
    template: Body = obj["spec"]["template"]
    return template


def container(template: Body, name: str = "worker") -> Body:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


def refused(body: Body) -> list[str]:
    with pytest.raises(SpecError) as info:
        desired(body)
    return list(info.value.errors)


def spec_of(*containers: Body, **pod: Any) -> Body:
    return {"spec": {**pod, **({"containers": list(containers)} if containers else {})}}


def worker(**fields: Any) -> Body:
    return {"name": "worker", **fields}


# --- merged ----------------------------------------------------------------------------------

RDMA = "rdma/rdma_shared_device_a"
# (case, podTemplate of decode, what the merged decode pod template holds)
MERGED: list[tuple[str, Body, Callable[[Body], Any], Any]] = [
    (
        "labels",
        {"metadata": {"labels": {"team": "infer", "kueue.x-k8s.io/queue-name": "q"}}},
        lambda t: {k: t["metadata"]["labels"][k] for k in ("team", L.ROLE_LABEL)},
        {"team": "infer", L.ROLE_LABEL: "decode"},
    ),
    (
        "annotations",
        {"metadata": {"annotations": {"example.com/owner": "ml-platform"}}},
        lambda t: t["metadata"]["annotations"]["example.com/owner"],
        "ml-platform",
    ),
    (
        "nodeSelector",
        spec_of(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"}),
        lambda t: t["spec"]["nodeSelector"],
        {"nvidia.com/gpu.product": "NVIDIA-H200"},
    ),
    (
        "affinity.nodeAffinity",
        spec_of(
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "pool", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            }
        ),
        lambda t: t["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"],
        ["a"],
    ),
    (
        "tolerations",
        spec_of(tolerations=[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]),
        lambda t: t["spec"]["tolerations"],
        [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    ),
    (
        "topologySpreadConstraints",
        spec_of(
            topologySpreadConstraints=[
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"team": "infer"}},
                }
            ]
        ),
        lambda t: t["spec"]["topologySpreadConstraints"][0]["maxSkew"],
        1,
    ),
    (
        "priorityClassName",
        spec_of(priorityClassName="inference-high"),
        lambda t: t["spec"]["priorityClassName"],
        "inference-high",
    ),
    (
        "schedulerName",
        spec_of(schedulerName="my-scheduler"),
        lambda t: t["spec"]["schedulerName"],
        "my-scheduler",
    ),
    (
        "runtimeClassName",
        spec_of(runtimeClassName="nvidia"),
        lambda t: t["spec"]["runtimeClassName"],
        "nvidia",
    ),
    (
        "imagePullSecrets",
        spec_of(imagePullSecrets=[{"name": "registry"}]),
        lambda t: t["spec"]["imagePullSecrets"],
        [{"name": "registry"}],
    ),
    (
        "env",
        spec_of(worker(env=[{"name": "NCCL_IB_HCA", "value": "mlx5"}])),
        lambda t: [e["name"] for e in container(t)["env"]][-2:],
        ["DSV4_POD_IP", "NCCL_IB_HCA"],  # after the operator's own
    ),
    (
        "envFrom",
        spec_of(worker(envFrom=[{"configMapRef": {"name": "nccl-tuning"}}])),
        lambda t: container(t)["envFrom"],
        [{"configMapRef": {"name": "nccl-tuning"}}],
    ),
    (
        "volumes and volumeMounts",
        spec_of(
            worker(volumeMounts=[{"name": "cache", "mountPath": "/cache"}]),
            volumes=[{"name": "cache", "emptyDir": {}}],
        ),
        lambda t: (
            t["spec"]["volumes"][-1]["name"],
            container(t)["volumeMounts"][-1],
            [v["name"] for v in t["spec"]["volumes"]][:3],
        ),
        ("cache", {"name": "cache", "mountPath": "/cache"}, ["config", "pd-secret", "tmp"]),
    ),
    (
        "a mount of an operator volume at a new path",
        spec_of(
            worker(volumeMounts=[{"name": "config", "mountPath": "/config", "readOnly": True}])
        ),
        lambda t: container(t)["volumeMounts"][-1]["mountPath"],
        "/config",
    ),
    (
        "resources: cpu, memory, hugepages, a device",
        spec_of(
            worker(
                resources={
                    "requests": {"cpu": 2, "memory": "1Gi"},
                    "limits": {"hugepages-2Mi": "512Mi", RDMA: 1, "memory": "2Gi"},
                }
            )
        ),
        lambda t: container(t)["resources"],
        {
            "requests": {"cpu": "2", "memory": "1Gi"},
            "limits": {"memory": "2Gi", "hugepages-2Mi": "512Mi", RDMA: "1"},
        },
    ),
    (
        "extra worker args",
        spec_of(worker(args=["--seed", "7", "--transfer-timeout-s=30"])),
        lambda t: container(t)["args"],
        ["--role", "decode", "--config-dir", "/etc/dsv4", "--seed", "7", "--transfer-timeout-s=30"],
    ),
    (
        "a sidecar container",
        spec_of(worker(), {"name": "log-shipper", "image": "fluent/fluent-bit:3"}),
        lambda t: [c["name"] for c in t["spec"]["containers"]],
        ["worker", "log-shipper"],
    ),
]


@pytest.mark.parametrize(
    ("case", "template", "get", "expected"), MERGED, ids=[m[0] for m in MERGED]
)
def test_podtemplate_field_is_merged(
    make_body: Callable[..., Body],
    case: str,
    template: Body,
    get: Callable[[Body], Any],
    expected: Any,
) -> None:
    state = desired(with_template(make_body(), "decode", template))
    assert get(pod_template(state, "tiny-decode-0")) == expected
    # Only the decode role changed.
    assert pod_template(state, "tiny-prefill-0") == pod_template(
        desired(make_body()), "tiny-prefill-0"
    )


def test_merged_fields_keep_every_operator_field(make_body: Callable[..., Body]) -> None:
    base = pod_template(desired(make_body()), "tiny-decode-0")
    merged = pod_template(
        desired(with_template(make_body(), "decode", KITCHEN_SINK)), "tiny-decode-0"
    )
    for key, value in base["spec"].items():
        if key == "containers":
            assert [c["name"] for c in merged["spec"][key]] == ["worker", "sidecar"]
        elif key == "volumes":
            assert merged["spec"][key][: len(value)] == value
        else:
            assert merged["spec"][key] == value, key
    ours, theirs = container(base), container(merged)
    for key in ("image", "command", "ports", "startupProbe", "livenessProbe", "readinessProbe"):
        assert theirs[key] == ours[key]
    assert theirs["securityContext"] == ours["securityContext"]
    assert theirs["args"][: len(ours["args"])] == ours["args"]
    assert base["metadata"]["labels"].items() <= merged["metadata"]["labels"].items()


def test_podtemplate_change_rolls_only_its_role(make_body: Callable[..., Body]) -> None:
    before = desired(make_body()).template_hashes
    after = desired(
        with_template(make_body(), "decode", spec_of(priorityClassName="x"))
    ).template_hashes
    assert after["tiny-decode-0"] != before["tiny-decode-0"]
    assert after["tiny-prefill-0"] == before["tiny-prefill-0"]
    assert after["tiny-router"] == before["tiny-router"]


def test_gpu_toleration_given_again_is_kept_once(make_body: Callable[..., Body]) -> None:
    gpu = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    extra = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    body = with_template(make_body("flash-gpu.yaml"), "decode", spec_of(tolerations=[gpu, extra]))
    assert pod_template(desired(body), "flash-decode-0")["spec"]["tolerations"] == [gpu, extra]


def test_router_takes_its_own_template(make_body: Callable[..., Body]) -> None:
    body = with_template(
        make_body(),
        "router",
        {
            "metadata": {"labels": {"team": "edge"}},
            "spec": {
                "nodeSelector": {"pool": "cpu"},
                "containers": [{"name": "router", "env": [{"name": "LOG", "value": "debug"}]}],
            },
        },
    )
    state = desired(body)
    router = pod_template(state, "tiny-router")
    assert router["metadata"]["labels"]["team"] == "edge"
    assert router["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert container(router, "router")["env"][-1] == {"name": "LOG", "value": "debug"}
    assert "nodeSelector" not in pod_template(state, "tiny-decode-0")["spec"]


def test_kueue_labels_reach_the_workload_objects(make_body: Callable[..., Body]) -> None:
    labels = {
        "kueue.x-k8s.io/queue-name": "team-a",
        "kueue.x-k8s.io/priority-class": "high",
        "x": "y",
    }
    body = with_template(make_body(), "prefill", {"metadata": {"labels": labels}})
    body = with_template(
        body, "router", {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "edge"}}}
    )
    objects = {(o["kind"], o["metadata"]["name"]): o for o in desired(body).objects}
    sts = objects[("StatefulSet", "tiny-prefill-0")]["metadata"]["labels"]
    assert (
        sts["kueue.x-k8s.io/queue-name"] == "team-a"
        and sts["kueue.x-k8s.io/priority-class"] == "high"
    )
    assert "x" not in sts  # other pod labels stay on the pods
    assert (
        "kueue.x-k8s.io/queue-name"
        not in objects[("StatefulSet", "tiny-decode-0")]["metadata"]["labels"]
    )
    assert (
        objects[("Deployment", "tiny-router")]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
        == "edge"
    )


# --- refused ---------------------------------------------------------------------------------

P = "spec.decode.podTemplate"
W = f"{P}.spec.containers[worker]"
# (case, podTemplate of decode, the error it gives: field path, then the start of the message)
REFUSED: list[tuple[str, Body, str]] = [
    ("command", spec_of(worker(command=["sh"])), f"{W}.command: owned by the operator"),
    ("ports", spec_of(worker(ports=[{"containerPort": 1}])), f"{W}.ports: owned by the operator"),
    ("startupProbe", spec_of(worker(startupProbe={})), f"{W}.startupProbe: owned by the operator"),
    (
        "livenessProbe",
        spec_of(worker(livenessProbe={})),
        f"{W}.livenessProbe: owned by the operator",
    ),
    (
        "readinessProbe",
        spec_of(worker(readinessProbe={})),
        f"{W}.readinessProbe: owned by the operator",
    ),
    (
        "container securityContext",
        spec_of(worker(securityContext={"privileged": True})),
        f"{W}.securityContext: owned by the operator",
    ),
    (
        "image",
        spec_of(worker(image="evil")),
        f"{W}.image: owned by the operator (set spec.image; spec.engine.image with engine sglang)",
    ),
    (
        "pod securityContext",
        spec_of(securityContext={}),
        f"{P}.spec.securityContext: owned by the operator",
    ),
    (
        "serviceAccountName",
        spec_of(serviceAccountName="admin"),
        f"{P}.spec.serviceAccountName: owned",
    ),
    (
        "automountServiceAccountToken",
        spec_of(automountServiceAccountToken=True),
        f"{P}.spec.automountServiceAccountToken: owned",
    ),
    (
        "terminationGracePeriodSeconds",
        spec_of(terminationGracePeriodSeconds=1),
        f"{P}.spec.terminationGracePeriodSeconds: owned",
    ),
    (
        "GPU limit",
        spec_of(worker(resources={"limits": {GPU_RESOURCE: 8}})),
        f"{W}.resources.limits.{GPU_RESOURCE}: owned by the operator (set spec.gpu.perPod)",
    ),
    (
        "GPU request",
        spec_of(worker(resources={"requests": {GPU_RESOURCE: 8}})),
        f"{W}.resources.requests.{GPU_RESOURCE}: owned by the operator",
    ),
    (
        "selector label",
        {"metadata": {"labels": {L.DEPLOYMENT_LABEL: "other"}}},
        f"{P}.metadata.labels[{L.DEPLOYMENT_LABEL}]: owned by the operator",
    ),
    (
        "role label",
        {"metadata": {"labels": {L.ROLE_LABEL: "prefill"}}},
        f"{P}.metadata.labels[{L.ROLE_LABEL}]: owned by the operator",
    ),
    (
        "app label",
        {"metadata": {"labels": {L.APP_NAME: "x"}}},
        f"{P}.metadata.labels[{L.APP_NAME}]: owned by the operator",
    ),
    (
        "pod-index label",
        {"metadata": {"labels": {L.POD_INDEX_LABEL: "0"}}},
        f"{P}.metadata.labels[{L.POD_INDEX_LABEL}]: owned by the operator",
    ),
    (
        "any serving.dsv4.io label",
        {"metadata": {"labels": {"serving.dsv4.io/anything": "x"}}},
        f"{P}.metadata.labels[serving.dsv4.io/anything]: owned by the operator",
    ),
    (
        "coscheduling label",
        {"metadata": {"labels": {"scheduling.x-k8s.io/pod-group": "g"}}},
        f"{P}.metadata.labels[scheduling.x-k8s.io/pod-group]: owned by the operator",
    ),
    (
        "template-hash annotation",
        {"metadata": {"annotations": {L.TEMPLATE_HASH_ANNOTATION: "0"}}},
        f"{P}.metadata.annotations[{L.TEMPLATE_HASH_ANNOTATION}]: owned by the operator",
    ),
    (
        "volcano group annotation",
        {"metadata": {"annotations": {"scheduling.k8s.io/group-name": "g"}}},
        f"{P}.metadata.annotations[scheduling.k8s.io/group-name]: owned by the operator",
    ),
    ("bad label value", {"metadata": {"labels": {"a": "b c"}}}, f"{P}.metadata.labels[a]: must be"),
    (
        "env set by the operator",
        spec_of(worker(env=[{"name": "HOME", "value": "/"}])),
        f"{W}.env[HOME]: set by",
    ),
    (
        "env of the rank",
        spec_of(worker(env=[{"name": "DSV4_PP_RANK", "value": "3"}])),
        f"{W}.env[DSV4_PP_RANK]: set by the operator",
    ),
    (
        "volume named like the config",
        spec_of(volumes=[{"name": "config", "emptyDir": {}}]),
        f"{P}.spec.volumes[config]: name clash with a volume the operator generates",
    ),
    (
        "volume named like shared memory",
        spec_of(volumes=[{"name": "dshm", "emptyDir": {}}]),
        f"{P}.spec.volumes[dshm]: name clash",
    ),
    (
        "mount over the config dir",
        spec_of(worker(volumeMounts=[{"name": "tmp", "mountPath": "/etc/dsv4"}])),
        f"{W}.volumeMounts[/etc/dsv4]: mount path clash",
    ),
    (
        "mount of a missing volume",
        spec_of(worker(volumeMounts=[{"name": "nope", "mountPath": "/nope"}])),
        f"{W}.volumeMounts[/nope].name: no volume 'nope' in the pod",
    ),
    (
        "--config-dir",
        spec_of(worker(args=["--config-dir", "/x"])),
        f"{W}.args[0]: --config-dir is computed by the operator",
    ),
    (
        "--port=",
        spec_of(worker(args=["--port=9000"])),
        f"{W}.args[0]: --port is computed by the operator",
    ),
    (
        "--page-size",
        spec_of(worker(args=["--seed", "1", "--page-size", "64"])),
        f"{W}.args[2]: --page-size is computed by the operator (spec.kv.pageSize)",
    ),
    ("--role", spec_of(worker(args=["--role", "prefill"])), f"{W}.args[0]: --role is computed"),
    ("args not strings", spec_of(worker(args=[1])), f"{W}.args[0]: must be a string"),
    ("unsupported pod field", spec_of(hostNetwork=True), f"{P}.spec.hostNetwork: not supported"),
    ("unsupported container field", spec_of(worker(lifecycle={})), f"{W}.lifecycle: not supported"),
    (
        "request above the limit",
        spec_of(worker(resources={"requests": {"memory": "4Gi"}})),  # CPU mode limits 2Gi
        f"{W}.resources.requests.memory: 4Gi is above the limit 2Gi",
    ),
    (
        "bad quantity",
        spec_of(worker(resources={"limits": {"memory": "lots"}})),
        f"{W}.resources.limits.memory: must be",
    ),
    (
        "resource claims",
        spec_of(worker(resources={"claims": [{"name": "gpu"}]})),
        f"{W}.resources.claims: not supported",
    ),
    (
        "sidecar without image",
        spec_of({"name": "helper"}),
        f"{P}.spec.containers[helper].image: must be a non-empty string",
    ),
    ("container without name", spec_of({"image": "x"}), f"{P}.spec.containers[0].name: required"),
    (
        "duplicate containers",
        spec_of(worker(), worker()),
        f"{P}.spec.containers[worker]: duplicate",
    ),
    (
        "tolerations not a list",
        spec_of(tolerations={"key": "x"}),
        f"{P}.spec.tolerations: must be a list",
    ),
    (
        "unknown affinity kind",
        spec_of(affinity={"nodeAntiAffinity": {}}),
        f"{P}.spec.affinity.nodeAntiAffinity: not supported",
    ),
]


@pytest.mark.parametrize(("case", "template", "error"), REFUSED, ids=[r[0] for r in REFUSED])
def test_podtemplate_field_is_refused_naming_it(
    make_body: Callable[..., Body], case: str, template: Body, error: str
) -> None:
    errors = refused(with_template(make_body(), "decode", template))
    assert any(e.startswith(error) for e in errors), errors


def test_router_owned_fields_name_the_router_container(make_body: Callable[..., Body]) -> None:
    body = with_template(make_body(), "router", spec_of({"name": "router", "ports": []}))
    assert refused(body) == [
        "spec.router.podTemplate.spec.containers[router].ports: owned by the operator"
    ]


def test_every_refusal_of_every_role_is_reported_once(make_body: Callable[..., Body]) -> None:
    body = with_template(make_body(), "prefill", spec_of(worker(command=["x"])))  # PP 2: 1 group
    body["spec"]["prefill"]["replicas"] = 3
    body = with_template(body, "router", spec_of(securityContext={}))
    assert refused(body) == [
        "spec.prefill.podTemplate.spec.containers[worker].command: owned by the operator",
        "spec.router.podTemplate.spec.securityContext: owned by the operator",
    ]


def test_render_prints_merged_objects_and_refuses_owned_fields(
    make_body: Callable[..., Body], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = with_template(make_body(), "decode", spec_of(worker(args=["--seed", "5"])))
    docs = list(yaml.safe_load_all(render(body)))
    sts = next(
        d for d in docs if d["metadata"]["name"] == "tiny-decode-0" and d["kind"] == "StatefulSet"
    )
    assert container(sts["spec"]["template"])["args"][-2:] == ["--seed", "5"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_template(make_body(), "decode", spec_of(worker(ports=[])))))
    assert main(["render", str(bad)]) == 2
    assert f"{W}.ports: owned by the operator" in capsys.readouterr().err


# --- the default requests and the memory limit ----------------------------------------------


def _expected_memory(body: Body, role: str) -> str:
    spec = parse_spec(body)
    weights = max(r.weight_bytes for r in plan_memory(spec).role(role).ranks) * spec.gpu.per_pod
    return f"{math.ceil((weights * 1.1 + 8 * GIB) / GIB)}Gi"


def _plus_shm(memory: str) -> str:
    """`memory` plus the GPU pods' 32 GiB /dev/shm (written tmpfs pages count against the
    container's memory)."""
    total = quantity(memory)
    assert total is not None
    return f"{int((total + 32 * GIB) / GIB)}Gi"


def _gpu_body(make_body: Callable[..., Body]) -> Body:
    body = make_body("flash-gpu.yaml")
    del body["spec"]["resources"]
    return body


def test_gpu_pods_request_memory_for_their_weights(make_body: Callable[..., Body]) -> None:
    body = _gpu_body(make_body)
    state = desired(body)
    for role, name in (("prefill", "flash-prefill-0"), ("decode", "flash-decode-1")):
        resources = container(pod_template(state, name))["resources"]
        memory = _expected_memory(body, role)
        assert resources["requests"] == {"cpu": "8", "memory": memory}  # 2 CPUs per GPU
        assert resources["limits"] == {GPU_RESOURCE: "4", "memory": _plus_shm(memory)}
        weights = quantity(resources["requests"]["memory"])
        assert weights is not None and weights > 8 * GIB  # the model's shard, not only the margin


@pytest.mark.parametrize(
    ("resources", "requests", "memory_limit"),
    [
        ({"requests": {"memory": "300Gi"}}, {"cpu": "8", "memory": "300Gi"}, "332Gi"),
        # The API server sets the request to the limit.
        ({"limits": {"memory": "500Gi"}}, {"cpu": "8"}, "500Gi"),
        ({"requests": {"cpu": "24"}}, {"cpu": "24", "memory": "default"}, "default"),
        ({"limits": {"cpu": "32"}}, {"memory": "default"}, "default"),
        (
            {"requests": {"memory": "100Gi"}, "limits": {"memory": "120Gi"}},
            {"cpu": "8", "memory": "100Gi"},
            "120Gi",
        ),
    ],
)
def test_a_user_setting_replaces_the_default(
    make_body: Callable[..., Body], resources: Body, requests: Body, memory_limit: str
) -> None:
    body = with_template(_gpu_body(make_body), "decode", spec_of(worker(resources=resources)))
    got = container(pod_template(desired(body), "flash-decode-0"))["resources"]
    default = _expected_memory(body, "decode")
    if requests.get("memory") == "default":
        requests = {**requests, "memory": default}
    assert got.get("requests", {}) == requests
    assert got["limits"]["memory"] == (
        _plus_shm(default) if memory_limit == "default" else memory_limit
    )


def test_spec_resources_also_replace_the_default(make_body: Callable[..., Body]) -> None:
    state = desired(make_body("flash-gpu.yaml"))  # resources.requests: cpu 16, memory 200Gi
    resources = container(pod_template(state, "flash-decode-0"))["resources"]
    assert resources["requests"] == {"cpu": "16", "memory": "200Gi"}
    assert resources["limits"]["memory"] == "232Gi"


def test_cpu_pods_keep_their_cpu_mode_resources(make_body: Callable[..., Body]) -> None:
    resources = container(pod_template(desired(make_body()), "tiny-decode-0"))["resources"]
    assert resources == {
        "requests": {"cpu": "500m", "memory": "1536Mi"},
        "limits": {"memory": "2Gi"},
    }


@pytest.mark.parametrize(
    ("request_", "volumes", "limit"),
    [
        ("244Gi", [], "244Gi"),
        ("244Gi", [{"medium": "Memory", "sizeLimit": "32Gi"}], "276Gi"),
        ("1Gi", [{"sizeLimit": "10Gi"}], "1Gi"),  # on disk: not memory
        ("1Gi", [{"medium": "Memory", "sizeLimit": "512Mi"}, {"medium": "Memory"}], "1536Mi"),
        ("200G", [], "195312500Ki"),
        ("1500m", [], "2"),  # milli-bytes, rounded up
        ("0", [], None),
        (None, [{"medium": "Memory", "sizeLimit": "1Gi"}], None),
    ],
)
def test_default_memory_limit(request_: str | None, volumes: list[Body], limit: str | None) -> None:
    pod = {"volumes": [{"name": f"v{i}", "emptyDir": v} for i, v in enumerate(volumes)]}
    assert default_memory_limit(request_, pod) == limit
    if limit is not None:
        total = sum(quantity(v.get("sizeLimit")) or 0 for v in volumes if v.get("medium"))
        assert quantity(limit) == math.ceil(quantity(request_) + total)  # type: ignore[operator]


def test_a_memory_emptydir_of_the_user_raises_the_default_limit(
    make_body: Callable[..., Body],
) -> None:
    volume = {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    body = with_template(_gpu_body(make_body), "decode", spec_of(volumes=[volume]))
    got = container(pod_template(desired(body), "flash-decode-0"))["resources"]
    default = quantity(_plus_shm(_expected_memory(body, "decode")))
    assert default is not None and quantity(got["limits"]["memory"]) == default + 8 * GIB


_GPU_BODY: Body = yaml.safe_load((SAMPLES / "flash-gpu.yaml").read_text())
del _GPU_BODY["spec"]["resources"]
_QUANTITIES = {
    "cpu": st.sampled_from(["500m", "4", "16", "64"]),
    "memory": st.sampled_from(["64Gi", "150Gi", "200Gi", "300G", "250000Mi", "512Gi"]),
}
_SOME = st.fixed_dictionaries({}, optional=_QUANTITIES)


@settings(max_examples=60, deadline=None)
@given(requests=_SOME, limits=_SOME)
def test_user_resources_are_kept_and_every_resource_is_bounded(
    requests: dict[str, str], limits: dict[str, str]
) -> None:
    """Whatever cpu and memory a role's podTemplate sets: the user's values are kept as
    written; a request above its limit is refused; each resource ends with a request or a
    limit (the API server copies a lone limit into the request); memory always has a limit,
    the effective request plus /dev/shm when the user set none."""
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    body = with_template(_GPU_BODY, "decode", spec_of(worker(resources=resources)))
    over = [
        n
        for n in requests
        if n in limits and quantity(requests[n]) > quantity(limits[n])  # type: ignore[operator]
    ]
    if over:
        assert {e.split(": ")[0] for e in refused(body)} == {
            f"{W}.resources.requests.{n}" for n in over
        }
        return
    got = container(pod_template(desired(body), "flash-decode-0"))["resources"]
    assert requests.items() <= got.get("requests", {}).items()
    assert limits.items() <= got["limits"].items()
    for name in ("cpu", "memory"):
        assert name in got.get("requests", {}) or name in got["limits"]
    if "memory" not in limits:  # the effective request, plus the 32 GiB /dev/shm
        effective = quantity(got["requests"]["memory"])
        assert effective is not None
        assert quantity(got["limits"]["memory"]) == math.ceil(effective + 32 * GIB)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", 2),
        ("500m", 0.5),
        ("4Gi", 4 * GIB),
        ("1.5k", 1500),
        ("1e3", 1000),
        (3, 3),
        (0.5, 0.5),
        ("x", None),
        ("1Gb", None),
        (True, None),
    ],
)
def test_quantity(text: Any, value: float | None) -> None:
    got = quantity(text)
    assert (got if got is None else float(got)) == value


# --- strict schema validation of what a podTemplate produces ---------------------------------

KITCHEN_SINK: Body = {
    "metadata": {
        "labels": {"team": "infer", "kueue.x-k8s.io/queue-name": "q"},
        "annotations": {"example.com/owner": "ml"},
    },
    "spec": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                    ]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 10,
                        "preference": {
                            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]
                        },
                    }
                ],
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 5,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": {"app": "noisy"}},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            },
        },
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
        ],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"team": "infer"}},
            }
        ],
        "priorityClassName": "inference-high",
        "schedulerName": "my-scheduler",
        "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}],
        "containers": [
            {
                "name": "worker",
                "args": ["--seed", "1"],
                "env": [
                    {"name": "NCCL_IB_HCA", "value": "mlx5"},
                    {"name": "UCX_TLS", "value": "rc,cuda_copy"},
                    {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                ],
                "envFrom": [{"configMapRef": {"name": "nccl"}}],
                "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                "resources": {
                    "requests": {"cpu": "1"},
                    "limits": {"hugepages-2Mi": "256Mi", RDMA: "1"},
                },
            },
            {"name": "sidecar", "image": "busybox:1.36", "args": ["sleep", "infinity"]},
        ],
    },
}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("sample", ["tiny-cpu.yaml", "flash-gpu.yaml"])
def test_objects_with_every_podtemplate_field_pass_strict_validation(
    make_body: Callable[..., Body], sample: str, version: str
) -> None:
    body = make_body(sample, scheduling={"topologyKey": "topology.kubernetes.io/zone"})
    for role in ("prefill", "decode"):
        body = with_template(body, role, KITCHEN_SINK)
    router = copy.deepcopy(KITCHEN_SINK)
    router["spec"]["containers"][0] = {"name": "router", "env": [{"name": "X", "value": "1"}]}
    body = with_template(body, "router", router)
    state = desired(body)
    assert any("sidecar" in str(o) for o in state.objects)
    for obj in state.objects:
        kubernetes_validate.validate(obj, version, strict=True)
