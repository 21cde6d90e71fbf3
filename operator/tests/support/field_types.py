"""How the API server's structured merge (server-side apply, managedFields) and strategic merge
patch treat each field of an object: the schema facts they read, for the built-in kinds the
operator writes (a table) and for custom resources (from the CRD's openAPIV3Schema).

Upstream: kube-openapi pkg/schemaconv (OpenAPI -> structured-merge-diff schema: a list is
atomic unless `x-kubernetes-list-type` says set or map, or its patch strategy is merge; a map
with `additionalProperties` has map keys, one with `properties` struct fields;
`x-kubernetes-map-type: atomic` makes a map one leaf); k8s.io/api types.go tags for the
strategic merge keys (`patchStrategy:"merge" patchMergeKey:"name"`); pkg/api/resource for which
fields are quantities. test_fake_field_types.py checks the table against the v1.37 OpenAPI
schema that kubernetes-validate ships, for every field of every rendered sample.

The built-in table (fields not listed are struct fields; lists not listed are atomic):

  field                                 SSA list type        SMP merge key   other
  metadata.labels, .annotations         -                    -               map keys
  metadata.finalizers                   set                  (merge)
  metadata.ownerReferences              map [uid]            uid
  pod containers, initContainers       map [name]           name
  container ports                       map [containerPort,  containerPort   protocol
                                        protocol]                            defaults TCP
  container env                         map [name]           name
  container volumeMounts                map [mountPath]      mountPath
  container volumeDevices               map [devicePath]     devicePath
  container resources.requests/limits   -                    -               quantities
  pod volumes                           map [name]           name            emptyDir.sizeLimit
                                                                             is a quantity
  pod imagePullSecrets, schedulingGates map [name]           name
  pod hostAliases                       map [ip]             ip
  pod topologySpreadConstraints         map [topologyKey,    topologyKey
                                        whenUnsatisfiable]
  pod tolerations, args, command, ...   atomic               -
  pod nodeSelector, label selectors,    atomic maps          -
  env valueFrom.*Ref
  Service spec.ports                    map [port, protocol] port            protocol
                                                                             defaults TCP
  ServiceAccount secrets                map [name]           name
  ConfigMap data, binaryData            -                    -               map keys
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

_NO_FIELDS: Final[Mapping[str, FieldType]] = MappingProxyType({})
_NO_DEFAULTS: Final[Mapping[str, Any]] = MappingProxyType({})


@dataclass(frozen=True)
class FieldType:
    """A node of an object's schema. Maps: `fields` are declared struct fields; other keys take
    `elements` and are struct fields too unless `free_keys` (a Go map: labels, data; or a CRD's
    `additionalProperties` / unknown fields). Lists: `keys` is None for an atomic list, () for a
    set of scalars, the key fields for a keyed list (`elements` types its items)."""

    fields: Mapping[str, FieldType] = field(default_factory=lambda: _NO_FIELDS)
    elements: FieldType | None = None  # None: LOOSE (DEDUCED under free_keys)
    free_keys: bool = False
    atomic: bool = False  # a map or list owned and replaced as one value
    keys: tuple[str, ...] | None = None
    key_defaults: Mapping[str, Any] = field(default_factory=lambda: _NO_DEFAULTS)
    merge_key: str | None = None  # strategic merge: patchMergeKey of a list of maps
    merge_list: bool = False  # strategic merge: patchStrategy merge (lists)
    quantity: bool = False  # a resource quantity (built-in kinds)
    omit_zero: bool = False  # a Go non-pointer `omitempty` bool/int: false and 0 are not stored

    def child(self, name: str) -> FieldType:
        if name in self.fields:
            return self.fields[name]
        if self.elements is not None:
            return self.elements
        return DEDUCED if self.free_keys else LOOSE

    def item(self) -> FieldType:
        return self.child("")

    def is_field(self, name: str) -> bool:
        """A declared (named) struct field, not a map key."""
        return name in self.fields or not self.free_keys

    @property
    def granular_list(self) -> bool:
        return self.keys is not None and not self.atomic


LOOSE: Final = FieldType()  # structs all the way down, lists atomic (an unlisted built-in field)
DEDUCED: Final = FieldType(free_keys=True)  # schemaless: every key a map key, lists atomic


def _struct(**fields: FieldType) -> FieldType:
    return FieldType(fields=MappingProxyType(fields))


def _map_of(values: FieldType = LOOSE, *, atomic: bool = False) -> FieldType:
    return FieldType(elements=values, free_keys=True, atomic=atomic)


def _keyed(*keys: str, item: FieldType = LOOSE, smp: bool = True, **key_defaults: Any) -> FieldType:
    """A keyed list; `smp`: strategic merge merges it by its first key (else replaces it)."""
    return FieldType(
        elements=item,
        keys=keys,
        key_defaults=MappingProxyType(key_defaults),
        merge_key=keys[0] if smp else None,
        merge_list=smp,
    )


_ATOMIC: Final = FieldType(atomic=True)
_QUANTITY: Final = FieldType(quantity=True)
_OMIT_ZERO: Final = FieldType(omit_zero=True)
_QUANTITIES: Final = _map_of(_QUANTITY)
_STRINGS: Final = _map_of()

META: Final = _struct(
    labels=_STRINGS,
    annotations=_STRINGS,
    finalizers=FieldType(keys=(), merge_list=True),
    ownerReferences=_keyed("uid", item=_ATOMIC),
)
_SELECTOR: Final = FieldType(atomic=True, fields=MappingProxyType({"matchLabels": _STRINGS}))
_RESOURCES: Final = _struct(
    requests=_QUANTITIES, limits=_QUANTITIES, claims=_keyed("name", smp=False)
)
_PROBE: Final = _struct(initialDelaySeconds=_OMIT_ZERO)
_CONTAINER: Final = _struct(
    ports=_keyed("containerPort", "protocol", protocol="TCP"),
    env=_keyed(
        "name",
        item=_struct(
            valueFrom=_struct(
                fieldRef=_ATOMIC,
                resourceFieldRef=_ATOMIC,
                configMapKeyRef=_ATOMIC,
                secretKeyRef=_ATOMIC,
            )
        ),
    ),
    volumeMounts=_keyed("mountPath", item=_struct(readOnly=_OMIT_ZERO)),
    volumeDevices=_keyed("devicePath"),
    resources=_RESOURCES,
    livenessProbe=_PROBE,
    readinessProbe=_PROBE,
    startupProbe=_PROBE,
    stdin=_OMIT_ZERO,
    stdinOnce=_OMIT_ZERO,
    tty=_OMIT_ZERO,
)
_VOLUME: Final = _struct(
    emptyDir=_struct(sizeLimit=_QUANTITY),
    ephemeral=_struct(
        volumeClaimTemplate=_struct(metadata=META, spec=_struct(resources=_RESOURCES))
    ),
)
POD_SPEC: Final = _struct(
    containers=_keyed("name", item=_CONTAINER),
    initContainers=_keyed("name", item=_CONTAINER),
    ephemeralContainers=_keyed("name", item=_CONTAINER),
    volumes=_keyed("name", item=_VOLUME),
    imagePullSecrets=_keyed("name", item=_ATOMIC),
    schedulingGates=_keyed("name"),
    hostAliases=_keyed("ip"),
    topologySpreadConstraints=_keyed(
        "topologyKey", "whenUnsatisfiable", item=_struct(labelSelector=_SELECTOR)
    ),
    nodeSelector=_map_of(atomic=True),
    overhead=_QUANTITIES,
    resources=_RESOURCES,
    hostNetwork=_OMIT_ZERO,
    hostPID=_OMIT_ZERO,
    hostIPC=_OMIT_ZERO,
)
_TEMPLATE: Final = _struct(metadata=META, spec=POD_SPEC)
_PVC: Final = _struct(metadata=META, spec=_struct(resources=_RESOURCES, selector=_SELECTOR))

BUILTIN: Final[Mapping[tuple[str, str], FieldType]] = MappingProxyType({
    ("v1", "Pod"): _struct(metadata=META, spec=POD_SPEC),
    ("v1", "Service"): _struct(metadata=META, spec=_struct(
        ports=_keyed("port", "protocol", protocol="TCP"),
        selector=_map_of(atomic=True),
        publishNotReadyAddresses=_OMIT_ZERO,
    )),
    ("v1", "ConfigMap"): _struct(metadata=META, data=_STRINGS, binaryData=_STRINGS),
    ("v1", "ServiceAccount"): _struct(metadata=META, secrets=_keyed("name", item=_ATOMIC)),
    ("apps/v1", "StatefulSet"): _struct(metadata=META, spec=_struct(
        selector=_SELECTOR,
        template=_TEMPLATE,
        volumeClaimTemplates=FieldType(elements=_PVC),
        minReadySeconds=_OMIT_ZERO,
    )),
    ("apps/v1", "Deployment"): _struct(metadata=META, spec=_struct(
        selector=_SELECTOR, template=_TEMPLATE, minReadySeconds=_OMIT_ZERO, paused=_OMIT_ZERO,
    )),
    ("policy/v1", "PodDisruptionBudget"): _struct(metadata=META, spec=_struct(
        selector=_SELECTOR,
    )),
    ("networking.k8s.io/v1", "NetworkPolicy"): _struct(metadata=META, spec=_struct(
        podSelector=_SELECTOR,
    )),
    ("batch/v1", "Job"): _struct(metadata=META, spec=_struct(
        selector=_SELECTOR, template=_TEMPLATE, suspend=_OMIT_ZERO,
    )),
    ("v1", "PersistentVolumeClaim"): _PVC,
    ("v1", "Secret"): _struct(metadata=META, data=_STRINGS, stringData=_STRINGS),
})  # fmt: skip


def builtin(api_version: str, kind: str) -> FieldType:
    """A built-in kind's type (kinds outside the table: struct fields, atomic lists)."""
    return BUILTIN.get((api_version, kind), _struct(metadata=META))


def from_openapi(schema: Mapping[str, Any]) -> FieldType:
    """The type of a CRD's structural schema node (apiextensions: lists are atomic unless
    `x-kubernetes-list-type` says otherwise; unknown fields are schemaless)."""
    kind = schema.get("type")
    atomic = schema.get("x-kubernetes-map-type") == "atomic"
    if kind == "array":
        items = schema.get("items") or {}
        list_type = schema.get("x-kubernetes-list-type", "atomic")
        if list_type == "map":
            keys = tuple(schema.get("x-kubernetes-list-map-keys") or ())
            props = items.get("properties") or {}
            defaults = {k: props[k]["default"] for k in keys if "default" in props.get(k, {})}
            return FieldType(
                elements=from_openapi(items), keys=keys, key_defaults=MappingProxyType(defaults)
            )
        if list_type == "set":
            return FieldType(elements=from_openapi(items), keys=())
        return FieldType(elements=from_openapi(items))
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        return FieldType(elements=from_openapi(extra), free_keys=True, atomic=atomic)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        fields = {k: from_openapi(v) for k, v in props.items()}
        return FieldType(fields=MappingProxyType(fields), free_keys=True, atomic=atomic)
    if props or kind == "object":
        fields = {k: from_openapi(v) for k, v in props.items()}
        return FieldType(fields=MappingProxyType(fields), atomic=atomic)
    return LOOSE


def custom_resource(crd: Mapping[str, Any], version: str) -> FieldType:
    """A custom resource's type: its version's schema, with the API server's ObjectMeta."""
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            schema = (served.get("schema") or {}).get("openAPIV3Schema") or {}
            root = from_openapi(schema)
            return FieldType(
                fields=MappingProxyType({**root.fields, "metadata": META}),
                elements=root.elements,
                free_keys=root.free_keys,
            )
    return _struct(metadata=META)
