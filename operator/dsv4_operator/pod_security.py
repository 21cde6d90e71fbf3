"""The Pod Security Standards a role's `podTemplate` is held to: the containers and volumes it
adds must meet the level the operator is configured with (`OperatorConfig.pod_security`, the
chart's `podSecurity.level`; default `restricted`, which the operator's own containers meet).
Pure; each refusal names its field. The CRD's CEL rules refuse the same at `restricted` (the
chart writes the level into them when it manages the CRD), the webhook and the reconcile at
the configured level. Restated from the Pod Security Standards (kubernetes.io/docs/concepts/
security/pod-security-standards, policy version 1.30+):

| field (container or volume)  | baseline refuses              | restricted also refuses        |
| ---------------------------- | ----------------------------- | ------------------------------ |
| securityContext.privileged   | true                          |                                |
| capabilities.add             | past BASELINE_CAPABILITIES    | all but NET_BIND_SERVICE       |
| ports[].hostPort             | non-zero                      |                                |
| a volume's source            | hostPath                      | one not in RESTRICTED_VOLUMES  |
| procMount                    | all but Default               |                                |
| seccompProfile.type          | Unconfined                    | all but RuntimeDefault, Localhost |
| appArmorProfile.type, and the beta annotation | Unconfined   |                                |
| seLinuxOptions               | a type not in SELINUX_TYPES, a user, a role |                  |
| windowsOptions.hostProcess   | true                          |                                |
| allowPrivilegeEscalation     |                               | true                           |
| runAsNonRoot / runAsUser     |                               | false / 0                      |

The pod's own securityContext and host namespaces are the operator's (a podTemplate cannot set
them at any level). At `restricted`, what the standard wants said explicitly and a container
leaves unset is filled in (`harden`): allowPrivilegeEscalation false and capabilities.drop ALL;
runAsNonRoot and the seccomp profile come from the pod's securityContext.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final, Literal

Level = Literal["restricted", "baseline", "privileged"]
LEVELS: Final[tuple[Level, ...]] = ("restricted", "baseline", "privileged")
DEFAULT_LEVEL: Final[Level] = "restricted"

BASELINE_CAPABILITIES: Final = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
RESTRICTED_CAPABILITIES: Final = frozenset({"NET_BIND_SERVICE"})
RESTRICTED_VOLUMES: Final = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
# Every other volume source of the v1 API (what `restricted` refuses; hostPath also `baseline`).
OTHER_VOLUMES: Final = (
    "awsElasticBlockStore",
    "azureDisk",
    "azureFile",
    "cephfs",
    "cinder",
    "fc",
    "flexVolume",
    "flocker",
    "gcePersistentDisk",
    "gitRepo",
    "glusterfs",
    "hostPath",
    "image",
    "iscsi",
    "nfs",
    "photonPersistentDisk",
    "portworxVolume",
    "quobyte",
    "rbd",
    "scaleIO",
    "storageos",
    "vsphereVolume",
)
SELINUX_TYPES: Final = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
APPARMOR_ANNOTATION_PREFIX: Final = "container.apparmor.security.beta.kubernetes.io/"
LEVEL_HINT: Final = "the operator's podSecurity.level, set by a cluster admin"

Obj = dict[str, Any]


def parse_level(text: str, where: str) -> Level:
    for level in LEVELS:
        if level == text:
            return level
    raise ValueError(f"{where}: must be one of {', '.join(LEVELS)}, got {text!r}")


class _Check:
    """Errors of one object at one level, each "<field>: <why> (<level>: <hint>)"."""

    def __init__(self, level: Level) -> None:
        self.level = level
        self.errors: list[str] = []

    def refuse(self, where: str, why: str, *, at: Level) -> None:
        """`at`: the lowest level that refuses it (baseline also refuses at restricted)."""
        if self.level == "privileged" or (at == "restricted" and self.level == "baseline"):
            return
        self.errors.append(f"{where}: {why} (pod security level {self.level}: {LEVEL_HINT})")


def container_errors(container: Mapping[str, Any], where: str, level: Level) -> list[str]:
    """What a sidecar or init container (`where`: its path) may not do at `level`."""
    check = _Check(level)
    ports = container.get("ports")
    for i, port in enumerate(ports if isinstance(ports, list) else []):
        if isinstance(port, Mapping) and port.get("hostPort") not in (None, 0):
            check.refuse(
                f"{where}.ports[{i}].hostPort", "host ports are not allowed", at="baseline"
            )
    context = container.get("securityContext")
    if isinstance(context, Mapping):
        _security_context(check, context, f"{where}.securityContext")
    return check.errors


def _security_context(check: _Check, sc: Mapping[str, Any], where: str) -> None:
    if sc.get("privileged") is True:
        check.refuse(f"{where}.privileged", "privileged containers are not allowed", at="baseline")
    if sc.get("allowPrivilegeEscalation") is True:
        check.refuse(
            f"{where}.allowPrivilegeEscalation",
            "privilege escalation is not allowed",
            at="restricted",
        )
    if sc.get("runAsNonRoot") is False:
        check.refuse(f"{where}.runAsNonRoot", "must not be false: no root", at="restricted")
    if sc.get("runAsUser") == 0:
        check.refuse(f"{where}.runAsUser", "must not be 0 (root)", at="restricted")
    if sc.get("procMount") not in (None, "Default"):
        check.refuse(f"{where}.procMount", "must be Default", at="baseline")
    capabilities = sc.get("capabilities")
    added = capabilities.get("add") if isinstance(capabilities, Mapping) else None
    for i, name in enumerate(added if isinstance(added, list) else []):
        at = f"{where}.capabilities.add[{i}]"
        if name not in BASELINE_CAPABILITIES:
            check.refuse(at, f"adding {name} is not allowed", at="baseline")
        elif name not in RESTRICTED_CAPABILITIES:
            check.refuse(
                at, f"adding {name} is not allowed (only NET_BIND_SERVICE)", at="restricted"
            )
    seccomp = _type(sc.get("seccompProfile"))
    if seccomp == "Unconfined":
        check.refuse(f"{where}.seccompProfile.type", "must not be Unconfined", at="baseline")
    elif seccomp is not None and seccomp not in ("RuntimeDefault", "Localhost"):
        check.refuse(
            f"{where}.seccompProfile.type", "must be RuntimeDefault or Localhost", at="restricted"
        )
    if _type(sc.get("appArmorProfile")) == "Unconfined":
        check.refuse(f"{where}.appArmorProfile.type", "must not be Unconfined", at="baseline")
    selinux = sc.get("seLinuxOptions")
    if isinstance(selinux, Mapping):
        if selinux.get("type", "") not in SELINUX_TYPES:
            allowed = ", ".join(sorted(t for t in SELINUX_TYPES if t))
            check.refuse(f"{where}.seLinuxOptions.type", f"must be one of {allowed}", at="baseline")
        for key in ("user", "role"):
            if selinux.get(key, "") != "":
                check.refuse(f"{where}.seLinuxOptions.{key}", "must not be set", at="baseline")
    windows = sc.get("windowsOptions")
    if isinstance(windows, Mapping) and windows.get("hostProcess") is True:
        check.refuse(
            f"{where}.windowsOptions.hostProcess", "host processes are not allowed", at="baseline"
        )


def _type(profile: object) -> object:
    return profile.get("type") if isinstance(profile, Mapping) else None


def volume_errors(volume: Mapping[str, Any], where: str, level: Level) -> list[str]:
    """What a volume the podTemplate adds (`where`: its path) may not be at `level`."""
    check = _Check(level)
    for source in OTHER_VOLUMES:
        if source not in volume:
            continue
        if source == "hostPath":
            check.refuse(f"{where}.hostPath", "hostPath volumes are not allowed", at="baseline")
        else:
            allowed = ", ".join(sorted(RESTRICTED_VOLUMES))
            why = f"{source} volumes are not allowed (only {allowed})"
            check.refuse(f"{where}.{source}", why, at="restricted")
    return check.errors


def annotation_errors(annotations: Mapping[str, str], where: str, level: Level) -> list[str]:
    """The AppArmor beta annotation names a profile per container: never `unconfined`."""
    check = _Check(level)
    for key, value in annotations.items():
        if key.startswith(APPARMOR_ANNOTATION_PREFIX) and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            why = "must be runtime/default or localhost/<profile>"
            check.refuse(f"{where}[{key}]", why, at="baseline")
    return check.errors


def harden(container: Obj, level: Level) -> Obj:
    """`container` with what `restricted` wants said explicitly and it leaves unset
    (allowPrivilegeEscalation false, capabilities.drop ALL); as it is at other levels."""
    if level != "restricted":
        return container
    out = copy.deepcopy(container)
    sc = out.setdefault("securityContext", {})
    if not isinstance(sc, dict):
        return out  # not an object: the API server refuses it
    sc.setdefault("allowPrivilegeEscalation", False)
    capabilities = sc.setdefault("capabilities", {})
    if not isinstance(capabilities, dict):
        return out
    drop = capabilities.setdefault("drop", [])
    if isinstance(drop, list) and "ALL" not in drop:
        drop.append("ALL")
    return out
