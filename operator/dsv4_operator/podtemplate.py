"""A role's `podTemplate` (a partial PodTemplateSpec) merged into the pod template the operator
generates. Pure; every refusal is a `SpecError` naming the field, all collected at once.

Merge rules:
- `metadata.labels` / `annotations`: added. Keys the operator sets (its selector and group
  labels, the pod-index label, the gang keys, anything under `serving.dsv4.io/`) are refused.
- `spec.nodeSelector`: added. `priorityClassName`, `runtimeClassName`: set. `schedulerName`:
  set, over the gang scheduler's name.
- `spec.tolerations`, `topologySpreadConstraints`, `imagePullSecrets`, `volumes`: appended
  after the operator's entries (a toleration equal to one of the operator's is kept once; a
  volume named like one of the operator's is refused).
- `spec.affinity`: per kind (`nodeAffinity`, `podAffinity`, `podAntiAffinity`), each list of
  terms is appended to the operator's; the operator sets no `nodeAffinity`, so its required
  `nodeSelectorTerms` (which Kubernetes ORs) are the user's as written.
- `spec.containers`: matched by name. The main container (`worker`, or `router` for the router)
  takes `args` (appended after the operator's; flags the operator computes are refused; with
  engine sglang none at all: SGLang flags go through the checked `engineArgs`), `env`,
  `envFrom`, `volumeMounts` (appended; an env name or mount path the operator uses is refused,
  and a mount must name a volume of the pod) and `resources` (merged per resource; the GPU count
  is refused). Containers of other names are sidecars, appended as written.
- The main container's resources, after the merge: each default request applies to a resource
  the user sets neither a request nor a limit for; a memory request without a memory limit
  gets one, the request plus the sizeLimits of the pod's memory-backed emptyDirs (tmpfs pages
  count against the memory of the container that writes them, so /dev/shm must fit in it).
- Fields the operator owns (its command, image, ports, probes, the hardened security contexts,
  the service account, ...) are refused with "owned by the operator"; any other field with "not
  supported".
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from dsv4_common.api.errors import SpecError
from dsv4_common.api.names import GPU_RESOURCE
from dsv4_common.api.object_rules import (
    annotations_error,
    dns1123_label_error,
    env_name_error,
    image_error,
)
from dsv4_common.api.serve_flags import operator_owned
from dsv4_common.api.spec import PodTemplate
from dsv4_operator import labels as L
from dsv4_operator.gang import COSCHEDULING_GROUP_LABEL, VOLCANO_GROUP_ANNOTATION
from dsv4_operator.manifests import Obj
from dsv4_operator.pod_security import (
    DEFAULT_LEVEL,
    Level,
    annotation_errors,
    container_errors,
    harden,
    volume_errors,
)
from dsv4_operator.quantities import quantity

# Pod fields the operator sets: refused. The others it knows how to merge are below.
OWNED_POD_FIELDS: Final = frozenset(
    {
        "serviceAccountName",
        "serviceAccount",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "securityContext",
        "terminationGracePeriodSeconds",
        "restartPolicy",
        "hostname",
        "subdomain",
    }
)
OWNED_CONTAINER_FIELDS: Final = {
    "image": " (set spec.image; spec.engine.image with engine sglang)",
    "imagePullPolicy": "",
    "command": "",
    "ports": "",
    "startupProbe": "",
    "livenessProbe": "",
    "readinessProbe": "",
    "securityContext": "",
}
MAIN_CONTAINER_FIELDS: Final = ("args", "env", "envFrom", "volumeMounts", "resources")
# `dsv4 serve` flags the operator computes, with where to set them instead (the flag table's).
OWNED_FLAGS: Final = operator_owned()
_RESERVED_PREFIX: Final = f"{L.GROUP}/"
_OWNED_LABELS: Final = frozenset({L.POD_INDEX_LABEL, COSCHEDULING_GROUP_LABEL})
_OWNED_ANNOTATIONS: Final = frozenset({VOLCANO_GROUP_ANNOTATION})
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_KEY: Final = re.compile(
    rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME}$"
)
_LABEL_VALUE: Final = re.compile(rf"^({_NAME})?$")


def merge_pod_template(
    base: Obj,
    user: PodTemplate | None,
    *,
    path: str,
    main: str,
    default_requests: Mapping[str, str] | None = None,
    args_refused: str | None = None,
    pod_security: Level = DEFAULT_LEVEL,
) -> Obj:
    """`base` (generated; left unchanged) with `user` merged in. `default_requests` go to the
    main container for each resource the user sets neither a request nor a limit for; its
    memory limit defaults to `default_memory_limit`.
    `args_refused`: why the main container takes no `args` (engine sglang), if it takes none.
    `pod_security`: the level the containers and volumes `user` adds are held to."""
    out = copy.deepcopy(base)
    merger = _Merger(path, args_refused, pod_security)
    if user:
        merger.metadata(out["metadata"], user.get("metadata") or {})
        merger.pod_spec(out["spec"], user.get("spec") or {}, main)
    container = _named(out["spec"]["containers"], main)
    had_resources = "resources" in container
    resources = container.setdefault("resources", {})
    for name, value in (default_requests or {}).items():
        if name not in resources.get("requests", {}) and name not in resources.get("limits", {}):
            resources.setdefault("requests", {})[name] = value
    if "memory" not in resources.get("limits", {}):
        limit = default_memory_limit(resources.get("requests", {}).get("memory"), out["spec"])
        if limit is not None:
            resources.setdefault("limits", {})["memory"] = limit
    merger.requests_within_limits(resources, f"{path}.spec.containers[{main}].resources")
    if not resources and not had_resources:
        del container["resources"]
    if merger.errors:
        raise SpecError(list(dict.fromkeys(merger.errors)))
    return out


def default_memory_limit(request: object, pod: Obj) -> str | None:
    """The memory limit of a container that sets none: its `request` plus the sizeLimits of
    the memory-backed emptyDirs of `pod` (None without a request, or for 0: a zero limit
    would not mean "as requested")."""
    amount = quantity(request)
    if amount is None:
        return None
    for volume in pod.get("volumes", []):
        empty_dir = volume.get("emptyDir")
        if isinstance(empty_dir, Mapping) and empty_dir.get("medium") == "Memory":
            amount += quantity(empty_dir.get("sizeLimit")) or 0
    return _byte_quantity(math.ceil(amount)) if amount > 0 else None


def _byte_quantity(num_bytes: int) -> str:
    """`num_bytes` in the largest binary unit that holds it exactly (Gi, Mi, Ki), else bytes."""
    for suffix, unit in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)


def _qualified_name(key: object) -> bool:
    """A label or annotation key: an optional DNS-subdomain prefix and a name of <= 63."""
    if not isinstance(key, str) or not _KEY.match(key):
        return False
    prefix, _, name = key.rpartition("/")
    return len(prefix) <= 253 and len(name) <= 63


def _named(items: list[Obj], name: str) -> Obj:
    return next(i for i in items if i.get("name") == name)


class _Merger:
    """Merges one user template section by section, recording an error per refused field."""

    def __init__(
        self, path: str, args_refused: str | None = None, level: Level = DEFAULT_LEVEL
    ) -> None:
        self.path = path
        self.args_refused = args_refused
        self.level = level
        self.errors: list[str] = []

    def fail(self, where: str, message: str) -> None:
        self.errors.append(f"{where}: {message}")

    # --- shape checks ------------------------------------------------------------------------
    def _object(self, value: object, where: str) -> Mapping[str, Any] | None:
        if isinstance(value, Mapping):
            return value
        self.fail(where, f"must be an object, got {type(value).__name__}")
        return None

    def _objects(self, value: object, where: str, *, named: bool = False) -> list[Obj]:
        """A list of objects (each with a string `name` when `named`); bad items are left out."""
        if not isinstance(value, list):
            self.fail(where, f"must be a list, got {type(value).__name__}")
            return []
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, Mapping):
                self.fail(f"{where}[{i}]", f"must be an object, got {type(item).__name__}")
            elif named and not (isinstance(item.get("name"), str) and item["name"]):
                self.fail(f"{where}[{i}].name", "required string")
            else:
                out.append(copy.deepcopy(dict(item)))
        return out

    def _string(self, value: object, where: str) -> str | None:
        if isinstance(value, str) and value:
            return value
        self.fail(where, f"must be a non-empty string, got {value!r}")
        return None

    def _string_map(self, value: object, where: str, *, label_values: bool) -> dict[str, str]:
        m = self._object(value, where) or {}
        out = {}
        for key, item in m.items():
            at = f"{where}[{key}]"
            if not _qualified_name(key):
                self.fail(at, "must be a qualified name such as example.com/name")
            elif not isinstance(item, str):
                self.fail(at, f"must be a string, got {item!r}")
            elif label_values and not (len(item) <= 63 and _LABEL_VALUE.match(item)):
                self.fail(at, f"must be a label value (at most 63 characters), got {item!r}")
            else:
                out[key] = item
        return out

    # --- metadata ----------------------------------------------------------------------------
    def metadata(self, out: Obj, user: Mapping[str, Any]) -> None:
        for key, owned in (("labels", _OWNED_LABELS), ("annotations", _OWNED_ANNOTATIONS)):
            if key not in user:
                continue
            where = f"{self.path}.metadata.{key}"
            mine = out.get(key, {})
            for k, v in self._string_map(user[key], where, label_values=key == "labels").items():
                if k in mine or k in owned or k.startswith(_RESERVED_PREFIX):
                    self.fail(f"{where}[{k}]", "owned by the operator")
                else:
                    out.setdefault(key, {})[k] = v
            if key == "annotations":
                self.errors.extend(annotation_errors(out.get(key, {}), where, self.level))
                if (why := annotations_error(out.get(key, {}))) is not None:
                    self.fail(where, f"the pod's annotations (the operator's and these) {why}")

    # --- pod spec ----------------------------------------------------------------------------
    def pod_spec(self, out: Obj, user: Mapping[str, Any], main: str) -> None:
        where = f"{self.path}.spec"
        mergers: dict[str, Callable[[Obj, Any, str], None]] = {
            "nodeSelector": self._node_selector,
            "affinity": self._affinity,
            "tolerations": self._tolerations,
            "topologySpreadConstraints": self._appended,
            "priorityClassName": self._scalar,
            "runtimeClassName": self._scalar,
            "schedulerName": self._scalar,
            "imagePullSecrets": self._pull_secrets,
            "volumes": self._volumes,  # before containers: mounts must name a volume
            "initContainers": self._init_containers,
            "containers": lambda o, v, w: self._containers(o, v, w, main),
        }
        for key in sorted(set(user) - set(mergers)):
            if key in OWNED_POD_FIELDS:
                self.fail(f"{where}.{key}", "owned by the operator")
            else:
                self.fail(f"{where}.{key}", f"not supported (supported: {', '.join(mergers)})")
        for key, merge in mergers.items():
            if key in user:
                merge(out, user[key], f"{where}.{key}")

    def _scalar(self, out: Obj, value: object, where: str) -> None:
        if (text := self._string(value, where)) is not None:
            out[where.rsplit(".", 1)[1]] = text

    def _node_selector(self, out: Obj, value: object, where: str) -> None:
        mine = out.setdefault("nodeSelector", {})
        for key, item in self._string_map(value, where, label_values=True).items():
            if key in mine:
                self.fail(f"{where}[{key}]", "owned by the operator")
            mine[key] = item
        if not mine:
            del out["nodeSelector"]

    def _appended(self, out: Obj, value: object, where: str) -> None:
        if items := self._objects(value, where):
            out[where.rsplit(".", 1)[1]] = out.get(where.rsplit(".", 1)[1], []) + items

    def _tolerations(self, out: Obj, value: object, where: str) -> None:
        mine = out.setdefault("tolerations", [])
        mine.extend(t for t in self._objects(value, where) if t not in mine)
        if not mine:
            del out["tolerations"]

    def _pull_secrets(self, out: Obj, value: object, where: str) -> None:
        mine = out.setdefault("imagePullSecrets", [])
        names = {s["name"] for s in mine}
        mine.extend(s for s in self._objects(value, where, named=True) if s["name"] not in names)
        if not mine:
            del out["imagePullSecrets"]

    def _affinity(self, out: Obj, value: object, where: str) -> None:
        kinds = ("nodeAffinity", "podAffinity", "podAntiAffinity")
        terms = (
            "requiredDuringSchedulingIgnoredDuringExecution",
            "preferredDuringSchedulingIgnoredDuringExecution",
        )
        user = self._object(value, where) or {}
        mine = out.setdefault("affinity", {})
        for kind in sorted(set(user) - set(kinds)):
            self.fail(f"{where}.{kind}", f"not supported (supported: {', '.join(kinds)})")
        for kind in kinds:
            given = self._object(user[kind], f"{where}.{kind}") if kind in user else None
            for key in sorted(set(given or {}) - set(terms)):
                self.fail(f"{where}.{kind}.{key}", f"not supported (supported: {', '.join(terms)})")
            for key in terms:
                if given is None or key not in given:
                    continue
                at = f"{where}.{kind}.{key}"
                target = mine.setdefault(kind, {})
                if kind == "nodeAffinity" and key == terms[0]:  # a NodeSelector, not a list
                    if key in target:
                        self.fail(at, "owned by the operator")
                    elif (selector := self._object(given[key], at)) is not None:
                        target[key] = copy.deepcopy(dict(selector))
                else:
                    target[key] = target.get(key, []) + self._objects(given[key], at)
        if not any(mine.values()):
            del out["affinity"]

    def _volumes(self, out: Obj, value: object, where: str) -> None:
        mine = out.setdefault("volumes", [])
        generated = {v["name"] for v in mine}
        for volume in self._objects(value, where, named=True):
            name = volume["name"]
            if name in generated:
                self.fail(f"{where}[{name}]", "name clash with a volume the operator generates")
            elif any(v["name"] == name for v in mine):
                self.fail(f"{where}[{name}]", "duplicate volume name")
            elif (why := dns1123_label_error(name)) is not None:
                self.fail(f"{where}[{name}].name", why)
            elif refused := volume_errors(volume, f"{where}[{name}]", self.level):
                self.errors.extend(refused)
            else:
                mine.append(volume)

    # --- containers --------------------------------------------------------------------------
    def _containers(self, out: Obj, value: object, where: str, main: str) -> None:
        seen: set[str] = set()
        for container in self._objects(value, where, named=True):
            name = container["name"]
            if name in seen:
                self.fail(f"{where}[{name}]", "duplicate container name")
                continue
            seen.add(name)
            if name == main:
                self._main(_named(out["containers"], main), container, f"{where}[{name}]", out)
            elif any(c["name"] == name for c in out["containers"]):
                self.fail(f"{where}[{name}]", "owned by the operator")
            elif (added := self._added(container, f"{where}[{name}]")) is not None:
                out["containers"].append(added)  # a sidecar

    def _init_containers(self, out: Obj, value: object, where: str) -> None:
        """Appended (the operator runs none); native sidecars (restartPolicy Always) too."""
        names = {c["name"] for c in out["containers"]}
        for container in self._objects(value, where, named=True):
            name = container["name"]
            if name in names:
                self.fail(f"{where}[{name}]", "duplicate container name")
                continue
            names.add(name)
            if (added := self._added(container, f"{where}[{name}]")) is not None:
                out.setdefault("initContainers", []).append(added)

    def _added(self, container: Obj, where: str) -> Obj | None:
        """A container the user adds, as written but held to the pod security level (and
        hardened where `restricted` wants it explicit); None when refused."""
        before = len(self.errors)
        if (why := dns1123_label_error(container["name"])) is not None:
            self.fail(f"{where}.name", why)
        image = self._string(container.get("image"), f"{where}.image")
        if image is not None and (why := image_error(image)) is not None:
            self.fail(f"{where}.image", why)
        self._env_names(container.get("env"), f"{where}.env")
        self.errors.extend(container_errors(container, where, self.level))
        return harden(container, self.level) if len(self.errors) == before else None

    def _env_names(self, env: object, where: str) -> None:
        for item in env if isinstance(env, list) else []:
            name = item.get("name") if isinstance(item, Mapping) else None
            if isinstance(name, str) and (why := env_name_error(name)) is not None:
                self.fail(f"{where}[{name}]", why)

    def _main(self, out: Obj, user: Obj, where: str, pod: Obj) -> None:
        for key in sorted(set(user) - {"name", *MAIN_CONTAINER_FIELDS}):
            if key in OWNED_CONTAINER_FIELDS:
                self.fail(f"{where}.{key}", f"owned by the operator{OWNED_CONTAINER_FIELDS[key]}")
            else:
                supported = ", ".join(MAIN_CONTAINER_FIELDS)
                self.fail(f"{where}.{key}", f"not supported (supported: {supported})")
        if "args" in user and self.args_refused is not None:
            self.fail(f"{where}.args", self.args_refused)
        elif "args" in user:
            self._args(out, user["args"], f"{where}.args")
        if "env" in user:
            names = {e["name"] for e in out.get("env", [])}
            self._env_names(user["env"], f"{where}.env")
            for env in self._objects(user["env"], f"{where}.env", named=True):
                if env["name"] in names:
                    self.fail(f"{where}.env[{env['name']}]", "set by the operator")
                else:
                    names.add(env["name"])
                    out.setdefault("env", []).append(env)
        if "envFrom" in user:
            out["envFrom"] = out.get("envFrom", []) + self._objects(
                user["envFrom"], f"{where}.envFrom"
            )
        if "volumeMounts" in user:
            self._mounts(out, user["volumeMounts"], f"{where}.volumeMounts", pod)
        if "resources" in user:
            self._resources(out, user["resources"], f"{where}.resources")

    def _args(self, out: Obj, value: object, where: str) -> None:
        if not isinstance(value, list):
            self.fail(where, f"must be a list of strings, got {type(value).__name__}")
            return
        for i, arg in enumerate(value):
            flag = arg.split("=", 1)[0] if isinstance(arg, str) else None
            if flag is None:
                self.fail(f"{where}[{i}]", f"must be a string, got {arg!r}")
            elif flag in OWNED_FLAGS:
                self.fail(
                    f"{where}[{i}]", f"{flag} is computed by the operator ({OWNED_FLAGS[flag]})"
                )
            else:
                out["args"].append(arg)

    def _mounts(self, out: Obj, value: object, where: str, pod: Obj) -> None:
        paths = {m["mountPath"] for m in out.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for i, mount in enumerate(self._objects(value, where, named=True)):
            path = mount.get("mountPath")
            if not isinstance(path, str) or not path.startswith("/"):
                self.fail(f"{where}[{i}].mountPath", f"must be an absolute path, got {path!r}")
            elif path in paths:
                self.fail(
                    f"{where}[{path}]", "mount path clash: the operator or another mount uses it"
                )
            elif mount["name"] not in volumes:
                self.fail(f"{where}[{path}].name", f"no volume {mount['name']!r} in the pod")
            else:
                paths.add(path)
                out.setdefault("volumeMounts", []).append(mount)

    def _resources(self, out: Obj, value: object, where: str) -> None:
        user = self._object(value, where) or {}
        for key in sorted(set(user) - {"requests", "limits"}):
            self.fail(f"{where}.{key}", "not supported (supported: requests, limits)")
        mine = out.setdefault("resources", {})
        for key in ("requests", "limits"):
            given = self._object(user[key], f"{where}.{key}") if key in user else None
            for name, amount in (given or {}).items():
                at = f"{where}.{key}.{name}"
                number = quantity(amount)
                if name == GPU_RESOURCE:
                    self.fail(at, "owned by the operator (set spec.gpu.perPod)")
                elif number is None or not number.is_finite() or number < 0:
                    self.fail(at, f"must be a quantity such as 2, 500m or 4Gi, got {amount!r}")
                else:
                    mine.setdefault(key, {})[name] = str(amount)

    def requests_within_limits(self, resources: Obj, where: str) -> None:
        limits = resources.get("limits", {})
        for name, amount in resources.get("requests", {}).items():
            request, limit = quantity(amount), quantity(limits.get(name))
            if request is not None and limit is not None and request > limit:
                self.fail(
                    f"{where}.requests.{name}",
                    f"{amount} is above the limit {limits[name]}: set limits.{name} as well",
                )
