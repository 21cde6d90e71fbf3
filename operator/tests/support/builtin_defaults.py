"""What the API server stores for an object of a built-in kind the operator writes: the object
decoded into its Go type and encoded back (quantities canonical, nulls and the zero values of
`omitempty` fields gone), with the kind's defaults applied. Pure, apart from the Service IPs the
caller allocates.

Defaults restated from kubernetes/kubernetes (read at pkg/apis/core/v1/defaults.go and its
zz_generated.defaults.go, pkg/apis/apps/v1/defaults.go, pkg/apis/networking/v1/defaults.go;
Service IPs from pkg/registry/core/service/storage):
  PodSpec      dnsPolicy ClusterFirst, restartPolicy Always, securityContext {},
               terminationGracePeriodSeconds 30, schedulerName default-scheduler
  Container    imagePullPolicy Always for `:latest` or no tag (and no digest), else
               IfNotPresent; terminationMessagePath /dev/termination-log,
               terminationMessagePolicy File; ports' protocol TCP; env fieldRef apiVersion v1;
               requests/limits rounded up to milli; probes timeoutSeconds 1, periodSeconds 10,
               successThreshold 1, failureThreshold 3, httpGet path / and scheme HTTP;
               `resources: {}` (a struct, always encoded)
  Volume       no source: emptyDir {}; secret/configMap/downwardAPI/projected defaultMode 420;
               hostPath type ""; projected token expirationSeconds 3600
  Pod          requests default to limits; enableServiceLinks true (Pods only, not templates)
  StatefulSet  replicas 1, podManagementPolicy OrderedReady, updateStrategy RollingUpdate with
               partition 0, revisionHistoryLimit 10, persistentVolumeClaimRetentionPolicy
               Retain/Retain; claim templates volumeMode Filesystem, status.phase Pending
  Deployment   replicas 1, strategy RollingUpdate 25%/25%, revisionHistoryLimit 10,
               progressDeadlineSeconds 600
  Service      type ClusterIP, sessionAffinity None, ports' protocol TCP and targetPort = port,
               internalTrafficPolicy Cluster, externalTrafficPolicy Cluster when reachable from
               outside; a ClusterIP allocated (kept across updates that omit it), clusterIPs,
               ipFamilies [IPv4], ipFamilyPolicy SingleStack
  NetworkPolicy policyTypes [Ingress] (+ Egress with egress rules); ports' protocol TCP
ConfigMap, ServiceAccount and PodDisruptionBudget get no visible default. Job,
PersistentVolumeClaim and Secret: support/jobs_claims.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Final

from support import field_types as T
from support import jobs_claims as J
from support import quantity_canon as Q

Obj = dict[str, Any]

KINDS: Final = frozenset(T.BUILTIN)  # (apiVersion, kind) decoded and defaulted here
_PROBES: Final = ("livenessProbe", "readinessProbe", "startupProbe")
_CONTAINER_LISTS: Final = ("initContainers", "containers", "ephemeralContainers")


def decode(
    api_version: str,
    kind: str,
    obj: Obj,
    *,
    old: Obj | None = None,
    cluster_ip: Callable[[str, str], str] = lambda namespace, name: "10.96.0.1",
) -> Obj:
    """The object as stored (raises quantity_canon.QuantityError for a bad quantity). `old`:
    the stored object an update replaces; `cluster_ip(namespace, name)`: a Service's IP."""
    if (api_version, kind) not in KINDS:
        return obj
    out: Obj = _encode(obj, T.builtin(api_version, kind))
    if kind in ("ConfigMap", "ServiceAccount", "PodDisruptionBudget"):
        return out
    if (api_version, kind) == J.SECRET:
        J.default_secret(out)
        return out
    if (api_version, kind) == J.CLAIM:
        J.default_claim(out)
        _claim_spec(out["spec"])
        return out
    spec = out.setdefault("spec", {})
    if kind == "Pod":
        _pod(spec)
        _pod_spec(spec)
    elif kind == "StatefulSet":
        _stateful_set(spec)
        _template(spec)
    elif kind == "Deployment":
        _deployment(spec)
        _template(spec)
    elif kind == "Service":
        meta = out.get("metadata") or {}
        ip = functools.partial(cluster_ip, meta.get("namespace", ""), meta.get("name", ""))
        _service(spec, (old or {}).get("spec") or {}, ip)
    elif kind == "NetworkPolicy":
        _network_policy(spec)
    elif (api_version, kind) == J.JOB:
        J.default_job(out)
        _template(spec)
    return out


def _encode(value: Any, t: T.FieldType) -> Any:
    """The JSON the server writes back after decoding `value` into its Go type."""
    if t.quantity:
        return str(Q.from_json(value))
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            child = t.child(key)
            if sub is None:
                continue
            encoded = _encode(sub, child)
            if child.omit_zero and encoded in (False, 0):
                continue
            if encoded == [] or (encoded == {} and child.free_keys and not child.fields):
                continue  # an empty `omitempty` slice or Go map
            out[key] = encoded
        return out
    if isinstance(value, list):
        return [_encode(item, t.item()) for item in value]
    return value


def _empty(d: Obj, key: str) -> bool:
    """A Go string or int field at its zero value."""
    return d.get(key) in (None, "", 0)


# ---------------------------------------------------------------------------------------------
# Pods


def _pod(spec: Obj) -> None:
    for name in ("containers", "initContainers"):
        for container in spec.get(name) or []:
            resources = container.get("resources") or {}
            if "limits" in resources:
                requests = resources.setdefault("requests", {})
                for resource, amount in resources["limits"].items():
                    requests.setdefault(resource, amount)
                container["resources"] = resources
    spec.setdefault("enableServiceLinks", True)


def _template(spec: Obj) -> None:
    template = spec.setdefault("template", {})
    template.setdefault("metadata", {})
    _pod_spec(template.setdefault("spec", {}))


def _pod_spec(spec: Obj) -> None:
    if _empty(spec, "dnsPolicy"):
        spec["dnsPolicy"] = "ClusterFirst"
    if _empty(spec, "restartPolicy"):
        spec["restartPolicy"] = "Always"
    spec.setdefault("securityContext", {})
    spec.setdefault("terminationGracePeriodSeconds", 30)
    if _empty(spec, "schedulerName"):
        spec["schedulerName"] = "default-scheduler"
    for volume in spec.get("volumes") or []:
        _volume(volume)
    for name in _CONTAINER_LISTS:
        for container in spec.get(name) or []:
            _container(container)


def _volume(volume: Obj) -> None:
    if not any(k != "name" for k in volume):
        volume["emptyDir"] = {}
    for source in ("secret", "configMap", "downwardAPI", "projected"):
        if isinstance(volume.get(source), dict):
            volume[source].setdefault("defaultMode", 420)
    if isinstance(volume.get("hostPath"), dict):
        volume["hostPath"].setdefault("type", "")
    for item in (volume.get("downwardAPI") or {}).get("items") or []:
        _field_ref(item)
    for projection in (volume.get("projected") or {}).get("sources") or []:
        for item in (projection.get("downwardAPI") or {}).get("items") or []:
            _field_ref(item)
        if isinstance(projection.get("serviceAccountToken"), dict):
            projection["serviceAccountToken"].setdefault("expirationSeconds", 3600)
    template = (volume.get("ephemeral") or {}).get("volumeClaimTemplate")
    if isinstance(template, dict):
        _claim_spec(template.setdefault("spec", {}))


def _container(container: Obj) -> None:
    if _empty(container, "imagePullPolicy"):
        tag = image_tag(str(container.get("image") or ""))
        container["imagePullPolicy"] = "Always" if tag == "latest" else "IfNotPresent"
    if _empty(container, "terminationMessagePath"):
        container["terminationMessagePath"] = "/dev/termination-log"
    if _empty(container, "terminationMessagePolicy"):
        container["terminationMessagePolicy"] = "File"
    for port in container.get("ports") or []:
        if _empty(port, "protocol"):
            port["protocol"] = "TCP"
    for env in container.get("env") or []:
        _field_ref(env.get("valueFrom") or {})
    resources = container.setdefault("resources", {})
    for name in ("limits", "requests"):
        if isinstance(resources.get(name), dict):
            resources[name] = {k: _milli(v) for k, v in resources[name].items()}
    for probe_name in _PROBES:
        probe = container.get(probe_name)
        if isinstance(probe, dict):
            for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10),
                               ("successThreshold", 1), ("failureThreshold", 3)):  # fmt: skip
                if _empty(probe, key):
                    probe[key] = value
            _http_get(probe)
    for hook in ("postStart", "preStop"):
        handler = (container.get("lifecycle") or {}).get(hook)
        if isinstance(handler, dict):
            _http_get(handler)


def _milli(amount: str) -> str:
    """SetDefaults_ResourceList: a request or limit rounded up to milli precision."""
    return str(Q.round_up_milli(Q.parse_quantity(amount)))


def _field_ref(holder: Obj) -> None:
    ref = holder.get("fieldRef")
    if isinstance(ref, dict) and _empty(ref, "apiVersion"):
        ref["apiVersion"] = "v1"


def _http_get(handler: Obj) -> None:
    action = handler.get("httpGet")
    if isinstance(action, dict):
        if _empty(action, "path"):
            action["path"] = "/"
        if _empty(action, "scheme"):
            action["scheme"] = "HTTP"


def _claim_spec(spec: Obj) -> None:
    spec.setdefault("volumeMode", "Filesystem")
    resources = spec.get("resources") or {}
    for name in ("limits", "requests"):
        if isinstance(resources.get(name), dict):
            resources[name] = {k: _milli(v) for k, v in resources[name].items()}


def image_tag(image: str) -> str:
    """The tag the kubelet pulls (parsers.ParseImageName): `latest` when the reference names
    neither a tag nor a digest."""
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.rpartition(":")[2] if ":" in last else ""
    return tag or ("" if digest or not image else "latest")


# ---------------------------------------------------------------------------------------------
# Workloads, Services, NetworkPolicies


def _stateful_set(spec: Obj) -> None:
    if _empty(spec, "podManagementPolicy"):
        spec["podManagementPolicy"] = "OrderedReady"
    strategy = spec.setdefault("updateStrategy", {})
    if _empty(strategy, "type"):
        strategy["type"] = "RollingUpdate"
        strategy.setdefault("rollingUpdate", {})
    if strategy["type"] == "RollingUpdate" and isinstance(strategy.get("rollingUpdate"), dict):
        strategy["rollingUpdate"].setdefault("partition", 0)
    retention = spec.setdefault("persistentVolumeClaimRetentionPolicy", {})
    for when in ("whenDeleted", "whenScaled"):
        if _empty(retention, when):
            retention[when] = "Retain"
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    for claim in spec.get("volumeClaimTemplates") or []:
        _claim_spec(claim.setdefault("spec", {}))
        status = claim.setdefault("status", {})
        if _empty(status, "phase"):
            status["phase"] = "Pending"


def _deployment(spec: Obj) -> None:
    spec.setdefault("replicas", 1)
    strategy = spec.setdefault("strategy", {})
    if _empty(strategy, "type"):
        strategy["type"] = "RollingUpdate"
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)


def _service(spec: Obj, old: Obj, cluster_ip: Callable[[], str]) -> None:
    if _empty(spec, "sessionAffinity"):
        spec["sessionAffinity"] = "None"
    if spec["sessionAffinity"] == "None":
        spec.pop("sessionAffinityConfig", None)
    if _empty(spec, "type"):
        spec["type"] = "ClusterIP"
    for port in spec.get("ports") or []:
        if _empty(port, "protocol"):
            port["protocol"] = "TCP"
        if port.get("targetPort") in (None, 0, ""):
            port["targetPort"] = port.get("port")
    kind = spec["type"]
    outside = kind in ("NodePort", "LoadBalancer") or (
        kind == "ClusterIP" and spec.get("externalIPs")
    )
    if outside and _empty(spec, "externalTrafficPolicy"):
        spec["externalTrafficPolicy"] = "Cluster"
    if kind in ("ClusterIP", "NodePort", "LoadBalancer"):
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if kind == "LoadBalancer":
        spec.setdefault("allocateLoadBalancerNodePorts", True)
    if kind == "ExternalName":
        return
    for allocated in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
        if _empty(spec, allocated) and allocated in old:
            spec[allocated] = old[allocated]
    if _empty(spec, "clusterIP"):
        spec["clusterIP"] = cluster_ip()
    spec.setdefault("clusterIPs", [spec["clusterIP"]])
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")


def _network_policy(spec: Obj) -> None:
    if not spec.get("policyTypes"):
        spec["policyTypes"] = ["Ingress", *(["Egress"] if spec.get("egress") else [])]
    for direction in ("ingress", "egress"):
        for rule in spec.get(direction) or []:
            for port in rule.get("ports") or []:
                port.setdefault("protocol", "TCP")
