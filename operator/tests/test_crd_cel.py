"""Each CEL rule of the CRD, restated as a Python predicate; both must agree on every sample.

The CEL side runs through the interpreter in support/crd_support.py (our subset, CEL typing);
the Python side is the intent written independently. A new rule without a predicate fails
`test_every_rule_has_a_predicate`. Not checked here: the API server's CEL compiler and cost
estimator (only a real cluster runs those: e2e/).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import crd_support as S

from dsv4_common.api.names import DSV4_TRANSFERS, GPU_RESOURCE, SGLANG_TRANSFERS

SCHEMA: dict[str, Any] = S.crd_schema()


def _tp_ok(role: str) -> Callable[[dict[str, Any]], bool]:
    def check(spec: dict[str, Any]) -> bool:
        per_pod = spec["gpu"]["perPod"]
        return bool(spec[role]["tensorParallel"] == (per_pod if per_pod > 0 else 1))

    return check


_SPLIT = "layerSplit"


def _sglang(spec: dict[str, Any]) -> bool:
    return bool(spec["engine"]["name"] == "sglang")


# (schema path, rule text) -> the same condition in Python, on the defaulted object at that path.
PREDICATES: dict[tuple[str, str], Callable[[Any], bool]] = {
    ("", "self.metadata.name.size() <= 40"): lambda o: len(o["metadata"]["name"]) <= 40,
    ("", "!self.metadata.name.contains('.')"): lambda o: "." not in o["metadata"]["name"],
    ("", "self.metadata.name.matches('^[a-z]')"): lambda o: (
        o["metadata"]["name"][:1].isalpha() and o["metadata"]["name"][:1].islower()
    ),
    (
        "spec",
        "has(self.gpu.type) || self.gpu.memoryGiB > 0.0 || has(self.model.configPath) "
        "|| (has(self.model.preset) && (self.model.preset == 'tiny' || "
        "self.model.preset == 'hybrid-tiny')) || (has(self.model.source) && "
        "!has(self.model.preset) && !has(self.model.configMapRef))",
    ): lambda s: (
        "type" in s["gpu"]
        or s["gpu"]["memoryGiB"] > 0
        or "configPath" in s["model"]
        or s["model"].get("preset") in ("tiny", "hybrid-tiny")
        or ("source" in s["model"] and not {"preset", "configMapRef"} & set(s["model"]))
    ),
    (
        "spec",
        "self.prefill.tensorParallel == (self.gpu.perPod > 0 ? self.gpu.perPod : 1)",
    ): _tp_ok("prefill"),
    (
        "spec",
        "self.decode.tensorParallel == (self.gpu.perPod > 0 ? self.gpu.perPod : 1)",
    ): _tp_ok("decode"),
    (
        "spec.model",
        "has(self.preset) ? !has(self.configPath) && !has(self.configMapRef) : "
        "(has(self.configPath) && has(self.configMapRef) ? false : "
        "has(self.configPath) || has(self.configMapRef) || (has(self.source) && "
        "!self.source.startsWith('pvc://')))",
    ): lambda m: (
        sum(k in m for k in ("preset", "configPath", "configMapRef")) == 1
        or (
            not {"preset", "configPath", "configMapRef"} & set(m)
            and not m.get("source", "pvc://").startswith("pvc://")
        )
    ),
    ("spec.model", "!has(self.source) || !has(self.weights)"): lambda m: (
        not ("source" in m and "weights" in m)
    ),
    **{
        (
            "spec.model",
            f"!has(self.{key}) || (has(self.source) && self.source.startsWith('hf://'))",
        ): (lambda m, key=key: key not in m or m.get("source", "").startswith("hf://"))
        for key in ("hub", "cache")
    },
    (
        "spec.model",
        "!has(self.source) || self.source.startsWith('/') || !self.source.contains('..')",
    ): lambda m: m.get("source", "/").startswith("/") or ".." not in m["source"],
    (
        "spec.model",
        "!has(self.source) || !self.source.startsWith('hf://') || !self.source.contains('--')",
    ): lambda m: not m.get("source", "").startswith("hf://") or "--" not in m["source"],
    (
        "spec.model.cache",
        "!has(self.persistentVolumeClaim) || (!has(self.storageClassName) && !has(self.size))",
    ): lambda c: "persistentVolumeClaim" not in c or not {"storageClassName", "size"} & set(c),
    **{
        (role, f"!has(self.{_SPLIT}) || self.{_SPLIT}.size() == self.pipelineParallel"): (
            lambda r: _SPLIT not in r or len(r[_SPLIT]) == r["pipelineParallel"]
        )
        for role in ("spec.prefill", "spec.decode")
    },
    **{
        (f"{role}.autoscaling", "self.maxReplicas >= self.minReplicas"): (
            lambda a: a["maxReplicas"] >= a["minReplicas"]
        )
        for role in ("spec.prefill", "spec.decode")
    },
    **{
        (
            f"{role}.autoscaling",
            "has(self.queueDepthPerReplica) || has(self.kvUtilization) || has(self.ttftSeconds) "
            "|| has(self.interTokenLatencySeconds)",
        ): (
            lambda a: bool(
                {"queueDepthPerReplica", "kvUtilization", "ttftSeconds", "interTokenLatencySeconds"}
                & set(a)
            )
        )
        for role in ("spec.prefill", "spec.decode")
    },
    ("spec.autoscaling.prefillDecodeRatio", "self.max >= self.min"): lambda b: b["max"] >= b["min"],
    **{
        (f"{role}.rollout", "self.maxSurge > 0 || self.maxUnavailable > 0"): (
            lambda r: r["maxSurge"] > 0 or r["maxUnavailable"] > 0
        )
        for role in ("spec.prefill", "spec.decode")
    },
    ("spec.groupRestarts", "self.maxBackoffSeconds >= self.backoffSeconds"): lambda g: (
        g["maxBackoffSeconds"] >= g["backoffSeconds"]
    ),
    ("spec.gpu", "has(self.type) || self.memoryGiB > 0.0 || self.perPod == 0"): lambda g: (
        "type" in g or g["memoryGiB"] > 0 or g["perPod"] == 0
    ),
    ("spec.gpu", "(!has(self.type) && self.memoryGiB == 0.0) || self.perPod > 0"): lambda g: (
        ("type" not in g and g["memoryGiB"] == 0) or g["perPod"] > 0
    ),
    ("spec.resources", f"!has(self.limits) || !('{GPU_RESOURCE}' in self.limits)"): lambda r: (
        GPU_RESOURCE not in r.get("limits", {})
    ),
    ("spec.resources", f"!has(self.requests) || !('{GPU_RESOURCE}' in self.requests)"): lambda r: (
        GPU_RESOURCE not in r.get("requests", {})
    ),
    ("spec.scheduling", "!has(self.queue) || self.gang == 'volcano'"): lambda s: (
        "queue" not in s or s["gang"] == "volcano"
    ),
    **{
        ("spec", f"self.engine.name == 'sglang' || !has(self.{role}.engineArgs)"): (
            lambda s, role=role: _sglang(s) or "engineArgs" not in s[role]
        )
        for role in ("prefill", "decode")
    },
    ("spec", "self.engine.name != 'sglang' || !has(self.image)"): lambda s: (
        not _sglang(s) or "image" not in s
    ),
    ("spec", "self.engine.name == 'sglang' || self.kv.transfer != 'mooncake'"): lambda s: (
        _sglang(s) or s["kv"]["transfer"] in DSV4_TRANSFERS
    ),
    ("spec", "self.engine.name != 'sglang' || self.kv.transfer != 'zmq'"): lambda s: (
        not _sglang(s) or s["kv"]["transfer"] in SGLANG_TRANSFERS
    ),
    (
        "spec",
        "self.engine.name != 'sglang' || has(self.gpu.type) || self.gpu.memoryGiB > 0.0",
    ): lambda s: not _sglang(s) or "type" in s["gpu"] or s["gpu"]["memoryGiB"] > 0,
    (
        "spec",
        "self.engine.name != 'sglang' || has(self.model.weights) || (has(self.model.source) && "
        "!self.model.source.startsWith('/'))",
    ): lambda s: (
        not _sglang(s)
        or "weights" in s["model"]
        or not s["model"].get("source", "/").startswith("/")
    ),
    (
        "spec",
        "self.engine.name != 'sglang' || !has(self.model.servedModelNames) || "
        "self.model.servedModelNames.size() == 1",
    ): lambda s: not _sglang(s) or len(s["model"].get("servedModelNames", [0])) == 1,
    (
        "spec",
        "self.engine.name != 'sglang' || !has(self.model.dtype) || self.model.dtype == 'auto'",
    ): lambda s: not _sglang(s) or s["model"].get("dtype", "auto") == "auto",
    ("spec", "self.engine.name != 'sglang' || self.speculativeDraftTokens == 0"): lambda s: (
        not _sglang(s) or s["speculativeDraftTokens"] == 0
    ),
    ("spec", "self.engine.name != 'sglang' || !has(self.apiKey)"): lambda s: (
        not _sglang(s) or "apiKey" not in s
    ),
    (
        "spec",
        "self.engine.name != 'sglang' || self.decode.pipelineParallel == 1 || "
        "self.decode.pipelineParallel == self.prefill.pipelineParallel",
    ): lambda s: (
        not _sglang(s) or s["decode"]["pipelineParallel"] in (1, s["prefill"]["pipelineParallel"])
    ),
    **{
        ("spec.engine", f"self.name == 'sglang' || !has(self.{key})"): (
            lambda e, key=key: e["name"] == "sglang" or key not in e
        )
        for key in ("image", "routerImage")
    },
}

# The podTemplates' pod security rules (the same in each role, on containers and init
# containers alike), by the node they sit on and their fieldPath (or message): the standard's
# intent at restricted, where the CRD's copy stands (`pod_security.py` restates it for the
# operator; test_pod_security.py checks the two agree).
_BASELINE_GUARD = "'restricted' == 'privileged' || "
_RESTRICTED_GUARD = "'restricted' != 'restricted' || "


def _unset_or(value: object, *allowed: object) -> bool:
    return value is None or value in allowed


def _typed(profile: Any) -> Any:
    return (profile or {}).get("type")


_SC: dict[tuple[str, str], Callable[[Any], bool]] = {
    ("baseline", ".privileged"): lambda c: c.get("privileged") is not True,
    ("restricted", ".allowPrivilegeEscalation"): lambda c: (
        c.get("allowPrivilegeEscalation") is not True
    ),
    ("restricted", ".runAsNonRoot"): lambda c: c.get("runAsNonRoot") is not False,
    ("restricted", ".runAsUser"): lambda c: c.get("runAsUser") != 0,
    ("baseline", ".procMount"): lambda c: _unset_or(c.get("procMount"), "Default"),
    ("baseline", ".seccompProfile.type"): lambda c: _typed(c.get("seccompProfile")) != "Unconfined",
    ("restricted", ".seccompProfile.type"): lambda c: _unset_or(
        _typed(c.get("seccompProfile")), "RuntimeDefault", "Localhost"
    ),
    ("baseline", ".appArmorProfile.type"): lambda c: (
        _typed(c.get("appArmorProfile")) != "Unconfined"
    ),
    ("baseline", ".seLinuxOptions.type"): lambda c: _unset_or(
        _typed(c.get("seLinuxOptions")),
        "",
        "container_t",
        "container_init_t",
        "container_kvm_t",
        "container_engine_t",
    ),
    ("baseline", ".seLinuxOptions"): lambda c: (
        not (c.get("seLinuxOptions") or {}).get("user")
        and not (c.get("seLinuxOptions") or {}).get("role")
    ),
    ("baseline", ".windowsOptions.hostProcess"): lambda c: (
        (c.get("windowsOptions") or {}).get("hostProcess") is not True
    ),
}
_BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip


def _pod_security_predicates() -> dict[tuple[str, str], Callable[[Any], bool]]:
    out: dict[tuple[str, str], Callable[[Any], bool]] = {}
    for role in ("prefill", "decode", "router"):
        spec = f"spec.{role}.podTemplate.spec"
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            out[(spec, f"!has(self.{field}) || !self.{field}")] = lambda p, field=field: (
                p.get(field) is not True
            )
        volume = f"{spec}.volumes.items"
        for path, rule in S.all_rules(SCHEMA):
            if path == volume and rule.get("fieldPath") == ".hostPath":
                out[(path, rule["rule"])] = lambda v: "hostPath" not in v
            elif path == volume:  # restricted's: none of the other types (hostPath: above)
                out[(path, rule["rule"])] = lambda v: not set(v) & (_OTHER_VOLUMES - {"hostPath"})
        for kind in ("containers", "initContainers"):
            items = f"{spec}.{kind}.items"
            for path, rule in S.all_rules(SCHEMA):
                text = rule["rule"]
                level = "restricted" if text.startswith(_RESTRICTED_GUARD) else "baseline"
                if path == f"{items}.securityContext":
                    out[(path, text)] = _SC[(level, rule["fieldPath"])]
                elif path == f"{items}.ports.items":
                    out[(path, text)] = lambda p: p.get("hostPort") in (None, 0)
                elif path == f"{items}.securityContext.capabilities.add.items":
                    out[(path, text)] = (
                        (lambda c: c == "NET_BIND_SERVICE")
                        if level == "restricted"
                        else (lambda c: c in _BASELINE_CAPABILITIES)
                    )
    return out


_OTHER_VOLUMES = {
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "fc", "flexVolume",
    "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs",
    "photonPersistentDisk", "portworxVolume", "quobyte", "rbd", "scaleIO", "storageos",
    "vsphereVolume",
}  # fmt: skip
PREDICATES.update(_pod_security_predicates())

# Samples whose OpenAPI validation passes (CEL only sees well-typed objects): the valid ones and
# the invalid ones that are invalid through a CEL rule.
CEL_SAMPLES = [
    p
    for p in [*S.valid_samples(), *S.invalid_samples(), *S.pod_security_samples()]
    if not S.schema_errors(SCHEMA, S.apply_defaults(SCHEMA, S.load_yaml(p)))
]


def test_every_rule_has_a_predicate() -> None:
    rules = {(path, rule["rule"].strip()) for path, rule in S.all_rules(SCHEMA)}
    assert rules == set(PREDICATES)


@pytest.mark.parametrize("rule", sorted(r for _, r in PREDICATES), ids=str)
def test_rule_parses_in_the_supported_subset(rule: str) -> None:
    S.parse(rule)


@pytest.mark.parametrize("path", CEL_SAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_cel_and_python_agree_on_sample(path: Path) -> None:
    obj = S.apply_defaults(SCHEMA, S.load_yaml(path))
    checked = 0
    for node, value, where in S.rule_sites(SCHEMA, obj):
        for rule in node["x-kubernetes-validations"]:
            cel = S.evaluate(rule["rule"], S.to_cel(node, value))
            schema_path = re.sub(r"\[\d+\]", ".items", where)  # a list item's rules
            python = PREDICATES[(schema_path, rule["rule"].strip())](value)
            assert cel is python, (where, rule["rule"], cel, python)
            checked += 1
    assert checked >= 8


def test_each_rule_is_broken_by_some_invalid_sample() -> None:
    broken: set[str] = set()
    for path in [*S.invalid_samples(), *S.pod_security_samples()]:
        broken |= {
            e.split(": Invalid value: ", 1)[1]
            for e in S.validate_cr(S.load_yaml(path))
            if ": Invalid value: " in e
        }
    messages = {rule["message"] for _, rule in S.all_rules(SCHEMA)}
    # The requests-side GPU rule mirrors the limits-side one; one sample covers the pair.
    assert messages - broken == {"set GPUs with gpu.perPod, not resources.requests"}


# --- the interpreter itself ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "this", "expected"),
    [
        ("self.a > 0.0 || self.b == 0", {"a": 1.5, "b": 3}, True),
        ("self.a > 0.0 || self.b == 0", {"a": 0.0, "b": 3}, False),
        ("has(self.x) != has(self.y)", {"x": 1}, True),
        ("has(self.x) != has(self.y)", {"x": 1, "y": 2}, False),
        ("self.n == (self.p > 0 ? self.p : 1)", {"n": 1, "p": 0}, True),
        ("!('k' in self.m)", {"m": {"k": 1}}, False),
        ("self.s.size() <= 3 && !self.s.contains('.')", {"s": "abc"}, True),
        ("true || self.missing", {}, True),  # || absorbs an error when the other side is true
        ("self.missing || true", {}, True),
    ],
)
def test_interpreter_semantics(rule: str, this: Any, expected: bool) -> None:
    assert S.evaluate(rule, this) is expected


@pytest.mark.parametrize(
    ("rule", "this"),
    [
        ("self.a > 0", {"a": 1.0}),  # double vs int: no overload in CEL, write 0.0
        ("self.missing == 1", {}),  # no such key
        ("false || self.missing", {}),
    ],
)
def test_interpreter_errors_like_cel(rule: str, this: Any) -> None:
    with pytest.raises(S.CelError):
        S.evaluate(rule, this)


def test_number_fields_are_doubles_in_cel() -> None:
    gpu = SCHEMA["properties"]["spec"]["properties"]["gpu"]
    assert S.to_cel(gpu, {"memoryGiB": 0, "perPod": 0}) == {"memoryGiB": 0.0, "perPod": 0}
    assert isinstance(S.to_cel(gpu, {"memoryGiB": 0})["memoryGiB"], float)


def test_unsupported_syntax_is_refused() -> None:
    with pytest.raises(SyntaxError):
        S.parse("self.items.all(x, x > 0)")
