"""The CR cannot escalate: what a podTemplate adds (sidecars, init containers, volumes) is held
to the Pod Security Standard of the operator's configured level, refused naming the field by
the CRD's CEL rules (crds/ holds restricted's; the chart writes another level into its managed
copy) and by the operator (webhook and reconcile alike: `build_desired_state`), and what is
rendered never holds an escalation: every container of every rendered pod, the operator's own
included, meets `restricted` unless the level allows more. Plus what the API server and the
kubelet refuse in the fields a podTemplate hands over (names, images, env names, annotation
sizes, object sizes)."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import CHART
from support import crd_support as S
from support.chart_support import HELM, needs_helm, render

from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.model_source import HfSource
from dsv4_common.api.spec import SpecError, parse_meta, parse_spec
from dsv4_operator import weights as W
from dsv4_operator.config import OperatorConfig
from dsv4_operator.objects import build_desired_state
from dsv4_operator.pod_security import LEVELS, Level, container_errors

SAMPLES = S.pod_security_samples()
APPARMOR = "container.apparmor.security.beta.kubernetes.io/"
ORDER = {"privileged": 0, "baseline": 1, "restricted": 2}
Body = dict[str, Any]


def _desired(body: Body, level: Level = "restricted") -> list[Body]:
    spec = parse_spec(body)
    state = build_desired_state(spec, parse_meta(body), plan_memory(spec), pod_security=level)
    return list(state.objects)


def _refused(body: Body, level: Level = "restricted") -> list[str]:
    try:
        _desired(body, level)
    except SpecError as exc:
        return exc.errors
    return []


def _refused_at(path: Path) -> str:
    return S.expected_path(path, "refused at")


def test_there_is_a_sample_for_each_kind_of_escalation() -> None:
    assert len(SAMPLES) >= 15
    assert {_refused_at(p) for p in SAMPLES} == {"baseline", "restricted", "always"}


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_the_crd_refuses_each_escalation_naming_the_field(path: Path) -> None:
    errors = S.validate_cr(S.load_yaml(path))
    field = S.expected_path(path, "expect-crd")
    assert any(e.startswith(f"{field}: Invalid value: ") for e in errors), errors


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_the_operator_refuses_each_escalation_up_to_its_level(path: Path, level: Level) -> None:
    body = S.load_yaml(path)
    refused_at = _refused_at(path)
    field = S.expected_path(path)
    errors = _refused(body, level)
    if refused_at == "always" or ORDER[level] >= ORDER[refused_at]:
        assert any(e.startswith(f"{field}: ") for e in errors), errors
        if refused_at != "always":
            assert any(f"pod security level {level}" in e for e in errors), errors
    else:  # the level allows it: rendered as written
        assert errors == []


def _chart_crd_schema(level: str) -> dict[str, Any]:
    objects = render("--set", "crds.manage=true", "--set", f"podSecurity.level={level}")
    (crd,) = [
        o
        for o in objects
        if o["kind"] == "CustomResourceDefinition"
        and o["metadata"]["name"] == "dsv4deployments.serving.dsv4.io"
    ]
    return S.crd_schema(crd)


@needs_helm
@pytest.mark.parametrize("level", LEVELS)
def test_the_chart_s_crd_follows_its_level(level: str) -> None:
    schema = _chart_crd_schema(level)
    for path in SAMPLES:
        errors = S.validate_cr(S.load_yaml(path), schema)
        refused_at = _refused_at(path)
        want = refused_at == "always" or ORDER[level] >= ORDER[refused_at]
        assert bool(errors) is want, (path.name, errors)
    for path in S.valid_samples():
        assert S.validate_cr(S.load_yaml(path), schema) == [], path.name


@needs_helm
def test_a_level_other_than_restricted_needs_the_managed_crd() -> None:

    args = [str(HELM), "template", "x", str(CHART), "--set", "podSecurity.level=baseline"]
    done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode != 0 and "needs crds.manage=true" in done.stderr
    args[-1] = "podSecurity.level=root"
    done = subprocess.run([*args, "--set", "crds.manage=true"], capture_output=True, text=True)
    assert done.returncode != 0 and "must be restricted, baseline or privileged" in done.stderr


def test_the_operator_reads_its_level_from_the_chart_s_variable() -> None:
    assert OperatorConfig.from_env({}).pod_security == "restricted"
    assert OperatorConfig.from_env({"DSV4_POD_SECURITY_LEVEL": "baseline"}).pod_security == (
        "baseline"
    )
    with pytest.raises(ValueError, match="DSV4_POD_SECURITY_LEVEL: must be one of"):
        OperatorConfig.from_env({"DSV4_POD_SECURITY_LEVEL": "root"})


# --- what is rendered meets restricted ---------------------------------------------------------


def _restricted_violations(pod: Body) -> Iterator[str]:
    """The standard, read directly against a rendered pod spec (not pod_security.py): every
    container and init container, the pod's own securityContext counted where allowed."""
    pod_sc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            yield key
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral"}
    allowed |= {"persistentVolumeClaim", "projected", "secret"}
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= allowed:
            yield f"volume {volume['name']}"
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            yield f"{name}: privileged"
        if sc.get("allowPrivilegeEscalation") is not False:
            yield f"{name}: allowPrivilegeEscalation not false"
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            yield f"{name}: capabilities not dropped"
        if set((sc.get("capabilities") or {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            yield f"{name}: capabilities added"
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            yield f"{name}: may run as root"
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            yield f"{name}: runs as root"
        seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            yield f"{name}: seccomp {seccomp}"
        if any(p.get("hostPort") for p in c.get("ports", [])):
            yield f"{name}: hostPort"


def _pods(objects: list[Body]) -> Iterator[Body]:
    for obj in objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            yield obj["spec"]["template"]["spec"]


PLAIN_SIDECAR = {"name": "metrics", "image": "ghcr.io/example/metrics:1.0"}


def test_the_weights_download_pod_meets_restricted(make_body: Any) -> None:
    """An hf:// source's shared download Job (built by the operator, not from a podTemplate)
    runs as the workers do: no root, no escalation, no capabilities, RuntimeDefault seccomp,
    only a claim and an emptyDir mounted, no service account token."""
    body = make_body("tiny-cpu.yaml")
    body["spec"]["model"] = {
        "source": "hf://acme/tiny@main",
        "hub": {"tokenSecretRef": {"name": "hf"}},
    }
    spec, meta = parse_spec(body), parse_meta(body)
    resolved = W.Resolved(HfSource("acme/tiny"), "a" * 40, 1 << 30, 5, None)
    decision = W.decide(
        spec,
        meta,
        resolved,
        W.Seen(),
        owners=[W.Owner(meta.name, "uid")],
        previous={},
        now=datetime(2026, 1, 1, tzinfo=UTC),
        image="ghcr.io/dsv4-serve/worker:test",
        endpoint=None,
    )
    (job,) = [o for o in decision.objects if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert list(_restricted_violations(pod)) == []
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("sample", ["tiny-cpu.yaml", "flash-gpu.yaml", "sglang-flash-pd.yaml"])
def test_every_rendered_container_meets_restricted(sample: str, make_body: Any) -> None:
    """The operator's own containers, and a sidecar and init container written without any
    securityContext: the operator fills in what restricted wants said."""
    body = make_body(sample)
    plain = {"spec": {"containers": [PLAIN_SIDECAR], "initContainers": [PLAIN_SIDECAR]}}
    for role in ("prefill", "decode"):
        body["spec"][role]["podTemplate"] = copy.deepcopy(plain)
    pods = list(_pods(_desired(body)))
    assert len(pods) >= 3
    for pod in pods:
        assert list(_restricted_violations(pod)) == []
    sidecars = [c for p in pods for c in p["containers"] if c["name"] == "metrics"]
    assert len(sidecars) >= 2
    for sidecar in sidecars:
        assert sidecar["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }


def test_at_baseline_nothing_is_filled_in_and_baseline_s_escalations_still_are_refused(
    make_body: Any,
) -> None:
    body = make_body(decode={"podTemplate": {"spec": {"containers": [PLAIN_SIDECAR]}}})
    (sidecar,) = [
        c
        for p in _pods(_desired(body, "baseline"))
        for c in p["containers"]
        if c["name"] == "metrics"
    ]
    assert sidecar == PLAIN_SIDECAR


# --- the CRD and the operator agree ------------------------------------------------------------

SECURITY_CONTEXT = st.fixed_dictionaries(
    {},
    optional={
        "privileged": st.booleans(),
        "allowPrivilegeEscalation": st.booleans(),
        "runAsNonRoot": st.booleans(),
        "runAsUser": st.integers(0, 3),
        "procMount": st.sampled_from(["Default", "Unmasked"]),
        "seccompProfile": st.fixed_dictionaries(
            {"type": st.sampled_from(["RuntimeDefault", "Localhost", "Unconfined"])}
        ),
        "appArmorProfile": st.fixed_dictionaries(
            {"type": st.sampled_from(["RuntimeDefault", "Localhost", "Unconfined"])}
        ),
        "seLinuxOptions": st.fixed_dictionaries(
            {},
            optional={
                "type": st.sampled_from(["", "container_t", "spc_t", "container_kvm_t"]),
                "user": st.sampled_from(["", "system_u"]),
                "role": st.sampled_from(["", "system_r"]),
                "level": st.just("s0:c1"),
            },
        ),
        "windowsOptions": st.fixed_dictionaries({"hostProcess": st.booleans()}),
        "capabilities": st.fixed_dictionaries(
            {},
            optional={
                "add": st.lists(
                    st.sampled_from(["NET_BIND_SERVICE", "CHOWN", "SYS_ADMIN", "NET_RAW"]),
                    max_size=3,
                ),
                "drop": st.just(["ALL"]),
            },
        ),
        "readOnlyRootFilesystem": st.booleans(),
    },
)
PORTS = st.lists(
    st.fixed_dictionaries(
        {"containerPort": st.just(9100)}, optional={"hostPort": st.integers(0, 2)}
    ),
    max_size=2,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SECURITY_CONTEXT, PORTS)
def test_the_crd_and_the_operator_refuse_the_same_containers(
    context: Body, ports: list[Body]
) -> None:
    container = {**PLAIN_SIDECAR, "securityContext": context, "ports": ports}
    body = yaml.safe_load((S.SAMPLES / "tiny-minimal.yaml").read_text())
    body["spec"]["decode"] = {"podTemplate": {"spec": {"containers": [container]}}}
    crd = [e for e in S.validate_cr(body) if "podTemplate" in e]
    operator = container_errors(container, "c", "restricted")
    assert bool(crd) is bool(operator), (crd, operator)
    if not operator:  # admitted: rendered without an escalation
        pods = list(_pods(_desired(body)))
        for pod in pods:
            assert list(_restricted_violations(pod)) == []


# --- what the API server and the kubelet refuse -----------------------------------------------


@pytest.mark.parametrize(
    ("template", "field", "why"),
    [
        (
            {"spec": {"containers": [{**PLAIN_SIDECAR, "image": "ghcr.io/x/y:1\nevil"}]}},
            "spec.containers[metrics].image",
            "is not an image reference",
        ),
        (
            {"spec": {"containers": [{**PLAIN_SIDECAR, "image": "Ghcr.io/X/Y"}]}},
            "spec.containers[metrics].image",
            "is not an image reference",
        ),
        (
            {"spec": {"containers": [{**PLAIN_SIDECAR, "name": "Metrics_1"}]}},
            "spec.containers[Metrics_1].name",
            "must be a DNS-1123 label",
        ),
        (
            {"spec": {"volumes": [{"name": "Scratch", "emptyDir": {}}]}},
            "spec.volumes[Scratch].name",
            "must be a DNS-1123 label",
        ),
        (
            {"spec": {"containers": [{"name": "worker", "env": [{"name": "1BAD", "value": "x"}]}]}},
            "spec.containers[worker].env[1BAD]",
            "must be an environment variable name",
        ),
        (
            {"metadata": {"annotations": {"example.com/blob": "x" * (256 * 1024)}}},
            "metadata.annotations",
            "may not be more than 262144 bytes in total",
        ),
        (
            {
                "metadata": {
                    "annotations": {
                        "container.apparmor.security.beta.kubernetes.io/m": "unconfined"
                    }
                }
            },
            "metadata.annotations[container.apparmor.security.beta.kubernetes.io/m]",
            "must be runtime/default or localhost/<profile>",
        ),
        (
            {"metadata": {"labels": {"team": "a b"}}},
            "metadata.labels[team]",
            "must be a label value",
        ),
    ],
)
def test_what_the_api_server_refuses_is_refused_naming_the_field(
    make_body: Any, template: Body, field: str, why: str
) -> None:
    errors = _refused(make_body(decode={"podTemplate": template}))
    assert any(e.startswith(f"spec.decode.podTemplate.{field}: ") and why in e for e in errors), (
        errors
    )


def test_a_pod_template_etcd_would_never_store_is_refused(make_body: Any) -> None:
    env = [{"name": f"V{i}", "value": "x" * 1024} for i in range(1600)]
    template = {"spec": {"containers": [{"name": "worker", "env": env}]}}
    errors = _refused(make_body(decode={"podTemplate": template}))
    assert any(
        e.startswith("spec.decode.podTemplate: the pod template would be ") for e in errors
    ), errors
