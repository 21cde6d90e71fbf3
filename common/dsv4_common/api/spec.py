"""The DSV4Deployment spec as frozen dataclasses, and its parser (`SpecError` re-exported).

`parse_spec(body)` applies the CRD's defaults and checks every bound, enum, pattern and
cross-field rule of crds/dsv4deployment.yaml (so `dsv4 render`/`dsv4 up` reject what the API
server would), collecting all errors, each prefixed with its field path. Pure: no kopf, no
Kubernetes client, no torch. Memory fit is not checked here (see `deployment.py`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from dsv4_common.api.autoscaling_spec import (
    AutoscalingSpec,
    RoleAutoscaling,
    parse_autoscaling,
    parse_role_autoscaling,
)
from dsv4_common.api.errors import SpecError
from dsv4_common.api.fields import FieldReader
from dsv4_common.api.gateway_spec import GatewaySpec, parse_gateway
from dsv4_common.api.model_source import (
    PVC_MOUNT_PATH,
    SOURCE_PATTERN,
    HfSource,
    LocalSource,
    ModelSource,
    PvcSource,
    SourceError,
    parse_model_source,
)
from dsv4_common.api.names import (
    COMPUTE_DTYPES,
    CPU_PRESETS,
    DEFAULT_COMPUTE_DTYPE,
    DEFAULT_ENGINE,
    DEFAULT_TRANSFER,
    DSV4_TRANSFERS,
    ENGINES,
    GANG_SCHEDULERS,
    GPU_RESOURCE,
    MAX_ENGINE_ARG_LENGTH,
    MAX_ENGINE_ARGS,
    MAX_LAYERS_PER_RANK,
    MAX_PIPELINE_PARALLEL,
    MAX_ROLE_REPLICAS,
    MAX_SERVED_MODEL_NAME_LENGTH,
    MAX_SERVED_MODEL_NAMES,
    MAX_SURGE,
    MAX_TENSOR_PARALLEL,
    MODEL_PRESETS,
    SGLANG_TRANSFERS,
    TOPOLOGY_POLICIES,
    TRANSFERS,
    WORKER_ROLES,
    ComputeDtype,
    Engine,
    GangScheduler,
    TopologyPolicy,
    Transfer,
    WorkerRole,
    name_error,
)
from dsv4_common.api.object_rules import MAX_IMAGE_CHARS, image_error
from dsv4_common.core.gpus import GPU_TYPE_NAMES, gpu_type
from dsv4_common.core.units import GIB

__all__ = [
    "CacheSpec",
    "DeploymentMeta",
    "DeploymentSpec",
    "HubSpec",
    "SecretKeyRef",
    "SpecError",
    "parse_meta",
    "parse_spec",
]

_ABS_PATH = re.compile(r"^/")
_PVC_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SWA_RATIO = re.compile(r"^(auto|0?\.[0-9]*[1-9][0-9]*|1(\.0+)?)$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([munkMGTPE]|[KMGTPE]i)?$")
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_LABEL_KEY = re.compile(rf"^({_DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_QUEUE = re.compile(rf"^{_DNS_SUBDOMAIN}$")
_CONFIG_MAP_NAME = re.compile(rf"^{_DNS_SUBDOMAIN}$")
_CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_SERVED_NAME = re.compile(r"^\S+$")
DEFAULT_CONFIG_MAP_KEY = "config.json"
DEFAULT_API_KEY_KEY = "api-key"

# A partial PodTemplateSpec (`metadata.labels/annotations`, `spec`), a plain mapping: its shape
# is checked here as the CRD checks it; what it may set, and how it merges into the pods the
# operator generates, is the operator's (dsv4_operator.podtemplate).
PodTemplate = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class WeightsSpec:
    """A claim mounted read-only at `path` in worker pods: `model.weights` as written, a pvc://
    source (its PATH as the mount's `sub_path`), or an hf:// source's cache claim once the
    operator resolved it (`directory`: its snapshot, below the mount)."""

    persistent_volume_claim: str
    path: str  # the mount path
    sub_path: str = ""  # inside the claim ("": its root)
    directory: str | None = None  # the checkpoint directory below the mount; None: `path`

    @property
    def model_dir(self) -> str:
        return self.directory if self.directory is not None else self.path


@dataclass(frozen=True, slots=True)
class ConfigMapRef:
    """A ConfigMap in the CR's own namespace whose `key` holds the model's config.json."""

    name: str
    key: str = DEFAULT_CONFIG_MAP_KEY


@dataclass(frozen=True, slots=True)
class SecretKeyRef:
    """A key of a Secret in the CR's own namespace: an API key (the kubelet mounts it; the
    operator never reads it) or an hf:// source's token (the operator reads it, `get` only,
    and the kubelet gives it to the download Job)."""

    name: str
    key: str = DEFAULT_API_KEY_KEY


@dataclass(frozen=True, slots=True)
class HubSpec:
    """How an hf:// source is reached: an endpoint override (a mirror, an air-gapped proxy;
    None: the operator's default, else the hub) and the Secret key holding HF_TOKEN."""

    endpoint: str | None = None
    token_secret: SecretKeyRef | None = None


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Where an hf:// source is downloaded: a claim the user names (never created, changed or
    deleted by the operator), else an RWX claim the operator creates per model revision
    (`storage_class_name`, `size`: None = the cluster's default class, the files' size)."""

    persistent_volume_claim: str | None = None
    storage_class_name: str | None = None
    size: str | None = None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    # NOTE: at most one of preset, config_path and config_map is set; none only when `origin`
    # is an hf:// or local source (its config.json is the model's).
    preset: str | None
    config_path: str | None
    # As written, or filled from a pvc:// origin (never both written); an hf:// origin's is
    # filled by the operator once resolved (`model_files.with_hf_weights`).
    weights: WeightsSpec | None = None
    config_map: ConfigMapRef | None = None
    # The names requests may give as `model` (unique; the first is what answers carry by
    # default); empty: the model's own name.
    served_model_names: tuple[str, ...] = ()
    # The workers' compute dtype (engine dsv4): auto is bfloat16 on a GPU, float32 on CPU.
    dtype: ComputeDtype = DEFAULT_COMPUTE_DTYPE
    origin: ModelSource | None = None  # spec.model.source
    hub: HubSpec = HubSpec()  # hf:// only
    cache: CacheSpec = CacheSpec()  # hf:// only

    @property
    def hf(self) -> HfSource | None:
        return self.origin if isinstance(self.origin, HfSource) else None

    @property
    def config_from_origin(self) -> bool:
        """No preset, configPath or configMapRef: config.json comes with the files."""
        return self.preset is None and self.config_path is None and self.config_map is None

    @property
    def source(self) -> str:
        """What `load_model_config` takes: the preset name or the config path (a configMapRef
        has none: only the operator reads it, from the cluster)."""
        source = self.preset if self.preset is not None else self.config_path
        assert source is not None, "model.configMapRef is read from the cluster, not loaded"
        return source


@dataclass(frozen=True, slots=True)
class GpuSpec:
    type: str | None = None  # a named GPU type (its memory as the device reports it)
    memory_gib: float = 0.0  # explicit memory per device; overrides the type's; 0 = unset
    per_pod: int = 0

    @property
    def cpu_mode(self) -> bool:
        """No device: neither a type nor a memory size."""
        return self.type is None and self.memory_gib == 0

    @property
    def memory_bytes(self) -> int | None:
        """Memory per device (None in CPU mode): memoryGiB when set, else the type's."""
        if self.memory_gib > 0:
            return int(self.memory_gib * GIB)
        return gpu_type(self.type).memory_bytes if self.type is not None else None


@dataclass(frozen=True, slots=True)
class KVSpec:
    page_size: int | None = None  # None = the model's default
    swa_ratio: float | None = None  # None = auto
    transfer: Transfer = DEFAULT_TRANSFER


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Which engine the workers run. `dsv4`: our worker (`spec.image`). `sglang`: SGLang's
    server, launched with the flags the operator computes from the memory plan (`image`, and
    `router_image` for sglang-router; None = the operator's defaults)."""

    name: Engine = DEFAULT_ENGINE
    image: str | None = None
    router_image: str | None = None

    @property
    def sglang(self) -> bool:
        return self.name == "sglang"


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """How a role's PP groups move to a new template: up to `max_surge` extra groups at the new
    template, and up to `max_unavailable` ready groups taken down at once (never both 0)."""

    max_surge: int = 1
    max_unavailable: int = 0


@dataclass(frozen=True, slots=True)
class GroupRestartSpec:
    """Restarts of a broken PP group back off exponentially (`backoff_seconds`, doubling up to
    `max_backoff_seconds`); after `budget` restarts the group is left failed. A group Ready for
    `reset_after_seconds` since its last restart starts a fresh budget, as does a new template."""

    budget: int = 5
    backoff_seconds: int = 10
    max_backoff_seconds: int = 300
    reset_after_seconds: int = 600


@dataclass(frozen=True, slots=True)
class RoleSpec:
    replicas: int = 1
    pipeline_parallel: int = 1
    tensor_parallel: int = 1
    chunked_prefill_tokens: int | None = None  # None = 32 pages
    max_running_requests: int | None = None  # None = sized from the memory plan
    pod_template: PodTemplate | None = None
    layer_split: tuple[int, ...] | None = None  # target layers per PP rank; None = balanced
    rollout: RolloutSpec = RolloutSpec()
    # Extra engine flags (engine sglang only), appended after the operator's; the operator
    # checks them against SGLang's flags (dsv4_operator.flavors.sglang.engine_args).
    engine_args: tuple[str, ...] = ()
    # None: `replicas` groups, always; else between its min and max (`autoscaling_spec`).
    autoscaling: RoleAutoscaling | None = None


@dataclass(frozen=True, slots=True)
class RouterSpec:
    replicas: int = 1
    port: int = 8000
    pod_template: PodTemplate | None = None


@dataclass(frozen=True, slots=True)
class SchedulingSpec:
    """How PP groups are scheduled: as gangs (a PodGroup per group) and packed into one
    topology domain."""

    gang: GangScheduler = "none"
    topology_key: str | None = None  # None = no placement rules
    topology_policy: TopologyPolicy = "preferred"
    queue: str | None = None  # the Volcano queue of the PodGroups; None = Volcano's default


@dataclass(frozen=True, slots=True)
class ResourcesSpec:
    """CPU/memory for worker containers, quantities as strings; sorted (name, quantity) pairs."""

    requests: tuple[tuple[str, str], ...] = ()
    limits: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    model: ModelSpec
    max_context_tokens: int
    gpu: GpuSpec = GpuSpec()
    kv: KVSpec = KVSpec()
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    router: RouterSpec = RouterSpec()
    speculative_draft_tokens: int = 0
    mem_fraction: float | None = None  # None = the planner's default
    image: str | None = None  # None = the operator's configured worker image
    resources: ResourcesSpec = ResourcesSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    group_restarts: GroupRestartSpec = GroupRestartSpec()
    engine: EngineSpec = EngineSpec()
    # The API key clients (and the router, to the workers) must send; None: no key.
    api_key: SecretKeyRef | None = None
    # What couples the roles' autoscaling.
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    # The Gateway API Inference Extension's objects (None: none rendered).
    gateway: GatewaySpec | None = None

    def role(self, role: WorkerRole) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True, slots=True)
class DeploymentMeta:
    name: str
    namespace: str
    uid: str | None = None  # None when rendering a file that was never applied
    generation: int = 0


def parse_meta(body: Mapping[str, Any], default_namespace: str = "default") -> DeploymentMeta:
    meta = body.get("metadata")
    if not isinstance(meta, Mapping):
        raise SpecError(["metadata: must be an object with a name"])
    name = meta.get("name")
    if not isinstance(name, str):
        raise SpecError(["metadata.name: required string"])
    if (why := name_error(name)) is not None:
        raise SpecError([f"metadata.name: {why}"])
    namespace = meta.get("namespace") or default_namespace
    uid = meta.get("uid")
    generation = meta.get("generation")
    return DeploymentMeta(
        name=name,
        namespace=str(namespace),
        uid=str(uid) if uid else None,
        generation=generation if isinstance(generation, int) else 0,
    )


def parse_spec(body: Mapping[str, Any]) -> DeploymentSpec:
    """Defaults + validation of `body["spec"]` (and `metadata.name` when present)."""
    r = FieldReader()
    meta = body.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if isinstance(name, str) and (why := name_error(name)) is not None:
        r.fail("metadata.name", why)
    spec = r.obj(body.get("spec"), "spec", required=True)
    r.keys(
        spec,
        "spec",
        {"model", "maxContextTokens", "gpu", "kv", "prefill", "decode", "router"}
        | {"speculativeDraftTokens", "memFraction", "image", "resources", "scheduling"}
        | {"groupRestarts", "engine", "apiKey", "autoscaling", "gateway"},
    )
    model = _model(r, spec.get("model"))
    max_context = r.integer(spec, "maxContextTokens", "spec", None, 1, 16_777_216, required=True)
    gpu = _gpu(r, spec.get("gpu"))
    kv = _kv(r, spec.get("kv"))
    roles = {role: _role(r, spec.get(role), f"spec.{role}") for role in WORKER_ROLES}
    router_raw = r.obj(spec.get("router"), "spec.router")
    r.keys(router_raw, "spec.router", {"replicas", "port", "podTemplate"})
    router = RouterSpec(
        replicas=r.integer(router_raw, "replicas", "spec.router", 1, 1, 16) or 1,
        port=r.integer(router_raw, "port", "spec.router", 8000, 1024, 65535) or 8000,
        pod_template=_pod_template(r, router_raw.get("podTemplate"), "spec.router.podTemplate"),
    )
    draft = r.integer(spec, "speculativeDraftTokens", "spec", 0, 0, 16) or 0
    mem_fraction = r.number(spec, "memFraction", "spec", 0.05, 1.0)
    image = _image(r, spec, "image", "spec")
    resources = _resources(r, spec.get("resources"))
    scheduling = _scheduling(r, spec.get("scheduling"))
    group_restarts = _group_restarts(r, spec.get("groupRestarts"))
    engine = _engine(r, spec.get("engine"))
    api_key = _api_key(r, spec.get("apiKey"))
    gateway = parse_gateway(r, spec.get("gateway"))
    autoscaling = parse_autoscaling(
        r, spec.get("autoscaling"), {k: (v.replicas, v.autoscaling) for k, v in roles.items()}
    )

    # Cross-field rules (the CRD's CEL rules say the same).
    cpu_model = model is not None and (
        model.preset in CPU_PRESETS
        or (model.preset is None and model.config_path is not None)
        or (model.origin is not None and model.preset is None and model.config_map is None)
    )
    if model is not None and gpu.cpu_mode and not cpu_model:
        r.fail(
            "spec.gpu.type",
            f"required for this model: CPU mode (no gpu.type, gpu.memoryGiB 0) runs only "
            f"model.preset {sorted(CPU_PRESETS)}, a model.configPath or a model.source's own "
            "config.json (a small model): set gpu.type (or gpu.memoryGiB) and gpu.perPod for "
            "this model",
        )
    expected_tp = gpu.per_pod if gpu.per_pod > 0 else 1
    for role, role_spec in roles.items():
        if role_spec.tensor_parallel != expected_tp:
            r.fail(
                f"spec.{role}.tensorParallel",
                f"must equal gpu.perPod ({expected_tp}; 1 in CPU mode): one pod holds one "
                f"tensor-parallel group, got {role_spec.tensor_parallel}",
            )
    _engine_rules(r, engine, gpu, kv, roles, image, model, draft)
    if engine.sglang and api_key is not None:
        r.fail("spec.apiKey", "not supported with engine.name sglang (only our engine checks it)")
    for role, role_spec in roles.items():
        if engine.sglang and role_spec.autoscaling is not None:
            r.fail(
                f"spec.{role}.autoscaling",
                "not supported with engine.name sglang (it decides from our workers' /status)",
            )
    r.raise_if_any()
    assert model is not None and max_context is not None
    return DeploymentSpec(
        model=model,
        max_context_tokens=max_context,
        gpu=gpu,
        kv=kv,
        prefill=roles["prefill"],
        decode=roles["decode"],
        router=router,
        speculative_draft_tokens=draft,
        mem_fraction=mem_fraction,
        image=image,
        resources=resources,
        scheduling=scheduling,
        group_restarts=group_restarts,
        engine=engine,
        api_key=api_key,
        autoscaling=autoscaling,
        gateway=gateway,
    )


def _image(r: FieldReader, m: Mapping[str, Any], key: str, path: str) -> str | None:
    """An image reference the kubelet can pull (`object_rules.image_error`)."""
    image = r.string(m, key, path, min_length=1, max_length=MAX_IMAGE_CHARS)
    if image is not None and (why := image_error(image)) is not None:
        r.fail(f"{path}.{key}", why)
        return None
    return image


def _api_key(r: FieldReader, raw: object) -> SecretKeyRef | None:
    """`{secretRef: {name, key}}`: a Secret in the CR's own namespace."""
    if raw is None:
        return None
    path = "spec.apiKey"
    m = r.obj(raw, path)
    r.keys(m, path, {"secretRef"})
    if m.get("secretRef") is None:
        r.fail(f"{path}.secretRef", "required")
        return None
    ref = r.obj(m["secretRef"], f"{path}.secretRef")
    r.keys(ref, f"{path}.secretRef", {"name", "key"})
    if ref.get("name") is None:
        r.fail(f"{path}.secretRef.name", "required")
    name = r.string(
        ref,
        "name",
        f"{path}.secretRef",
        max_length=253,
        pattern=_CONFIG_MAP_NAME,
        pattern_hint="must be a Secret name (a DNS subdomain)",
    )
    key = r.string(
        ref,
        "key",
        f"{path}.secretRef",
        max_length=253,
        pattern=_CONFIG_MAP_KEY,
        pattern_hint="must be a Secret data key (letters, digits, '-', '_', '.')",
    )
    if name is None:
        return None
    return SecretKeyRef(name=name, key=key or DEFAULT_API_KEY_KEY)


def _engine(r: FieldReader, raw: object) -> EngineSpec:
    path = "spec.engine"
    m = r.obj(raw, path)
    r.keys(m, path, {"name", "image", "routerImage"})
    name = r.string(m, "name", path, enum=ENGINES) or DEFAULT_ENGINE
    engine = EngineSpec(
        name=cast(Engine, name),
        image=_image(r, m, "image", path),
        router_image=_image(r, m, "routerImage", path),
    )
    if not engine.sglang:
        for key in ("image", "routerImage"):
            if m.get(key) is not None:
                r.fail(f"{path}.{key}", "is an SGLang image: it needs engine.name sglang")
    return engine


def _engine_rules(
    r: FieldReader,
    engine: EngineSpec,
    gpu: GpuSpec,
    kv: KVSpec,
    roles: Mapping[WorkerRole, RoleSpec],
    image: str | None,
    model: ModelSpec | None,
    draft: int,
) -> None:
    """What each engine accepts (the CRD's CEL rules say the same)."""
    if not engine.sglang:
        for role, role_spec in roles.items():
            if role_spec.engine_args:
                r.fail(
                    f"spec.{role}.engineArgs",
                    "are SGLang flags: they need engine.name sglang (our worker takes none)",
                )
        if kv.transfer not in DSV4_TRANSFERS:
            r.fail(
                "spec.kv.transfer",
                f"must be one of {list(DSV4_TRANSFERS)} with engine.name dsv4 (our worker has "
                f"no {kv.transfer} backend; {kv.transfer} needs engine.name sglang)",
            )
        return
    why = "with engine.name sglang"
    if image is not None:
        r.fail("spec.image", f"is our worker's image; {why} set engine.image")
    if kv.transfer not in SGLANG_TRANSFERS:
        r.fail(
            "spec.kv.transfer",
            f"must be one of {list(SGLANG_TRANSFERS)} {why} (SGLang has no {kv.transfer} backend)",
        )
    if gpu.cpu_mode:
        r.fail("spec.gpu.type", f"required {why}: SGLang runs on GPUs only")
    if (
        model is not None
        and model.weights is None
        and not isinstance(model.origin, HfSource | PvcSource)
    ):
        r.fail(
            "spec.model.weights",
            f"required {why}: SGLang loads the model from it (or a model.source hf:// or pvc://)",
        )
    if model is not None and model.dtype != DEFAULT_COMPUTE_DTYPE:
        r.fail(
            "spec.model.dtype",
            f"must be {DEFAULT_COMPUTE_DTYPE} {why}: it is our worker's compute dtype (give "
            "SGLang its --dtype in engineArgs)",
        )
    if model is not None and len(model.served_model_names) > 1:
        r.fail(
            "spec.model.servedModelNames",
            f"holds one name {why} (SGLang's --served-model-name takes one), got "
            f"{len(model.served_model_names)}",
        )
    if draft:
        r.fail(
            "spec.speculativeDraftTokens",
            f"must be 0 {why}: the operator does not plan SGLang's speculative decoding",
        )
    prefill_pp, decode_pp = roles["prefill"].pipeline_parallel, roles["decode"].pipeline_parallel
    if decode_pp not in (1, prefill_pp):
        r.fail(
            "spec.decode.pipelineParallel",
            f"must be 1 or prefill.pipelineParallel ({prefill_pp}) {why}: SGLang's decode takes "
            "each prefill stage's KV on the stage of the same rank, or all on one, got "
            f"{decode_pp}",
        )


def _model(r: FieldReader, raw: object) -> ModelSpec | None:
    path = "spec.model"
    m = r.obj(raw, path, required=True)
    r.keys(
        m,
        path,
        {"preset", "configPath", "configMapRef", "weights", "servedModelNames", "dtype"}
        | {"source", "hub", "cache"},
    )
    preset = r.string(m, "preset", path, enum=MODEL_PRESETS)
    config_path = r.string(m, "configPath", path, min_length=2, max_length=1024, pattern=_ABS_PATH)
    config_map = _config_map_ref(r, m.get("configMapRef"), f"{path}.configMapRef")
    origin = _origin(r, m)
    # A key holding null counts as unset (as the API server prunes nulls).
    sources = [k for k in ("preset", "configPath", "configMapRef") if m.get(k) is not None]
    from_origin = isinstance(origin, HfSource | LocalSource)
    if isinstance(raw, Mapping) and (len(sources) > 1 or (not sources and not from_origin)):
        r.fail(
            path,
            "exactly one of model.preset, model.configPath and model.configMapRef must be set"
            + (f" (got {', '.join(sources)})" if sources else "")
            + " (none with an hf:// or local model.source: its config.json is the model's)",
        )
    weights: WeightsSpec | None = None
    if "weights" in m:
        wp = f"{path}.weights"
        w = r.obj(m["weights"], wp)
        r.keys(w, wp, {"persistentVolumeClaim", "path"})
        for key in ("persistentVolumeClaim", "path"):
            if key not in w:
                r.fail(f"{wp}.{key}", "required")
        pvc = r.string(w, "persistentVolumeClaim", wp, max_length=253, pattern=_PVC_NAME)
        wpath = r.string(w, "path", wp, min_length=2, max_length=1024, pattern=_ABS_PATH)
        if pvc is not None and wpath is not None:
            weights = WeightsSpec(persistent_volume_claim=pvc, path=wpath)
    served = _served_names(r, m.get("servedModelNames"), f"{path}.servedModelNames")
    dtype = r.string(m, "dtype", path, enum=COMPUTE_DTYPES) or DEFAULT_COMPUTE_DTYPE
    hub, cache = _hub(r, m), _cache(r, m)
    if isinstance(origin, PvcSource):  # the alias: a claim mounted where the workers read it
        weights = WeightsSpec(origin.claim, PVC_MOUNT_PATH, sub_path=origin.path)
    if preset is None and config_path is None and config_map is None and not from_origin:
        return None
    return ModelSpec(
        preset=preset,
        config_path=config_path,
        weights=weights,
        config_map=config_map,
        served_model_names=served,
        dtype=dtype,  # type: ignore[arg-type]  # one of COMPUTE_DTYPES (the enum above)
        origin=origin,
        hub=hub,
        cache=cache,
    )


def _served_names(r: FieldReader, raw: object, path: str) -> tuple[str, ...]:
    """The CRD's set of names: 1 to MAX_SERVED_MODEL_NAMES unique strings without spaces."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_SERVED_MODEL_NAMES:
        r.fail(path, f"must be a list of 1 to {MAX_SERVED_MODEL_NAMES} names, got {raw!r}")
        return ()
    names: list[str] = []
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_SERVED_MODEL_NAME_LENGTH:
            r.fail(
                f"{path}[{i}]",
                f"must be a string of 1 to {MAX_SERVED_MODEL_NAME_LENGTH} characters",
            )
        elif not _SERVED_NAME.match(name):
            r.fail(f"{path}[{i}]", f"must not contain whitespace, got {name!r}")
        elif name in names:
            r.fail(f"{path}[{i}]", f"duplicate name {name!r}")
        else:
            names.append(name)
    return tuple(names)


def _config_map_ref(r: FieldReader, raw: object, path: str) -> ConfigMapRef | None:
    """`{name, key}`: no namespace (the ConfigMap is in the CR's own)."""
    if raw is None:
        return None
    m = r.obj(raw, path)
    r.keys(m, path, {"name", "key"})
    if m.get("name") is None:
        r.fail(f"{path}.name", "required")
    name = r.string(
        m,
        "name",
        path,
        max_length=253,
        pattern=_CONFIG_MAP_NAME,
        pattern_hint="must be a ConfigMap name (a DNS subdomain)",
    )
    key = r.string(
        m,
        "key",
        path,
        max_length=253,
        pattern=_CONFIG_MAP_KEY,
        pattern_hint="must be a ConfigMap data key (letters, digits, '-', '_', '.')",
    )
    if name is None:
        return None
    return ConfigMapRef(name=name, key=key or DEFAULT_CONFIG_MAP_KEY)


def _gpu(r: FieldReader, raw: object) -> GpuSpec:
    g = r.obj(raw, "spec.gpu")
    r.keys(g, "spec.gpu", {"type", "memoryGiB", "perPod"})
    kind = r.string(g, "type", "spec.gpu", enum=GPU_TYPE_NAMES)
    memory = r.number(g, "memoryGiB", "spec.gpu", 0.0, 1024.0)
    per_pod = r.integer(g, "perPod", "spec.gpu", 0, 0, 16)
    memory = 0.0 if memory is None else memory
    per_pod = 0 if per_pod is None else per_pod
    gpu = GpuSpec(type=kind, memory_gib=memory, per_pod=per_pod)
    if gpu.cpu_mode and per_pod != 0:
        r.fail(
            "spec.gpu.perPod",
            f"must be 0 in CPU mode (no gpu.type and gpu.memoryGiB 0), got {per_pod}",
        )
    if not gpu.cpu_mode and per_pod == 0:
        r.fail("spec.gpu.perPod", "must be > 0 when gpu.type or gpu.memoryGiB is set")
    return gpu


def _kv(r: FieldReader, raw: object) -> KVSpec:
    k = r.obj(raw, "spec.kv")
    r.keys(k, "spec.kv", {"pageSize", "swaRatio", "transfer"})
    page_size = r.integer(k, "pageSize", "spec.kv", None, 1, 4096)
    raw_swa = k.get("swaRatio")
    if isinstance(raw_swa, int | float) and not isinstance(raw_swa, bool):
        r.fail("spec.kv.swaRatio", f'must be a string: "auto" or a quoted decimal ("{raw_swa}")')
        swa_text: str | None = None
    else:
        swa_text = r.string(
            k,
            "swaRatio",
            "spec.kv",
            max_length=32,
            pattern=_SWA_RATIO,
            pattern_hint='must be "auto" or a decimal in (0, 1] such as "0.25"',
        )
    swa = None if swa_text in (None, "auto") else float(swa_text)
    transfer = r.string(k, "transfer", "spec.kv", enum=TRANSFERS) or DEFAULT_TRANSFER
    return KVSpec(page_size=page_size, swa_ratio=swa, transfer=cast(Transfer, transfer))


def _role(r: FieldReader, raw: object, path: str) -> RoleSpec:
    m = r.obj(raw, path)
    r.keys(
        m,
        path,
        {"replicas", "pipelineParallel", "tensorParallel"}
        | {"chunkedPrefillTokens", "maxRunningRequests", "podTemplate", "layerSplit"}
        | {"rollout", "engineArgs", "autoscaling"},
    )
    pipeline_parallel = r.integer(m, "pipelineParallel", path, 1, 1, MAX_PIPELINE_PARALLEL) or 1
    return RoleSpec(
        replicas=r.integer(m, "replicas", path, 1, 1, MAX_ROLE_REPLICAS) or 1,
        pipeline_parallel=pipeline_parallel,
        tensor_parallel=r.integer(m, "tensorParallel", path, 1, 1, MAX_TENSOR_PARALLEL) or 1,
        chunked_prefill_tokens=r.integer(m, "chunkedPrefillTokens", path, None, 1, 1_048_576),
        max_running_requests=r.integer(m, "maxRunningRequests", path, None, 1, 65_536),
        pod_template=_pod_template(r, m.get("podTemplate"), f"{path}.podTemplate"),
        layer_split=_layer_split(r, m.get("layerSplit"), f"{path}.layerSplit", pipeline_parallel),
        rollout=_rollout(r, m.get("rollout"), f"{path}.rollout"),
        engine_args=_engine_args(r, m.get("engineArgs"), f"{path}.engineArgs"),
        autoscaling=parse_role_autoscaling(
            r, m.get("autoscaling"), f"{path}.autoscaling", cast(WorkerRole, path.split(".")[-1])
        ),
    )


def _engine_args(r: FieldReader, raw: object, path: str) -> tuple[str, ...]:
    """The CRD's shape only (strings, bounded); which flags are allowed is the operator's."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        r.fail(path, f"must be a list of strings such as [--log-level, debug], got {raw!r}")
        return ()
    if len(raw) > MAX_ENGINE_ARGS:
        r.fail(path, f"at most {MAX_ENGINE_ARGS} entries, got {len(raw)}")
    for i, arg in enumerate(raw):
        if not isinstance(arg, str) or not 1 <= len(arg) <= MAX_ENGINE_ARG_LENGTH:
            r.fail(f"{path}[{i}]", f"must be a string of 1 to {MAX_ENGINE_ARG_LENGTH} characters")
    return tuple(a for a in raw if isinstance(a, str))


def _rollout(r: FieldReader, raw: object, path: str) -> RolloutSpec:
    m = r.obj(raw, path)
    r.keys(m, path, {"maxSurge", "maxUnavailable"})
    surge = r.integer(m, "maxSurge", path, 1, 0, MAX_SURGE)
    unavailable = r.integer(m, "maxUnavailable", path, 0, 0, MAX_ROLE_REPLICAS)
    if surge == 0 and unavailable == 0:
        r.fail(path, "maxSurge and maxUnavailable cannot both be 0: no group could ever roll")
    return RolloutSpec(max_surge=surge or 0, max_unavailable=unavailable or 0)


def _group_restarts(r: FieldReader, raw: object) -> GroupRestartSpec:
    path = "spec.groupRestarts"
    m = r.obj(raw, path)
    r.keys(m, path, {"budget", "backoffSeconds", "maxBackoffSeconds", "resetAfterSeconds"})
    d = GroupRestartSpec()
    backoff = r.integer(m, "backoffSeconds", path, d.backoff_seconds, 0, 3600)
    most = r.integer(m, "maxBackoffSeconds", path, d.max_backoff_seconds, 0, 86_400)
    if backoff is not None and most is not None and most < backoff:
        r.fail(f"{path}.maxBackoffSeconds", f"must be >= backoffSeconds ({backoff}), got {most}")
    reset = r.integer(m, "resetAfterSeconds", path, d.reset_after_seconds, 0, 86_400)
    return GroupRestartSpec(
        budget=r.integer(m, "budget", path, d.budget, 0, 1000) or 0,
        backoff_seconds=backoff or 0,
        max_backoff_seconds=most or 0,
        reset_after_seconds=reset or 0,
    )


def _layer_split(
    r: FieldReader, raw: object, path: str, pipeline_parallel: int
) -> tuple[int, ...] | None:
    """Layers per PP rank: one integer >= 1 per rank (the CRD's CEL rule checks the count; the
    planner checks the sum against the model's layers)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        r.fail(path, f"must be a list of layer counts such as [16, 15, 15, 15], got {raw!r}")
        return None
    bad = False
    for i, n in enumerate(raw):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LAYERS_PER_RANK:
            r.fail(f"{path}[{i}]", f"must be an integer in [1, {MAX_LAYERS_PER_RANK}], got {n!r}")
            bad = True
    if len(raw) != pipeline_parallel:
        r.fail(
            path,
            f"has {len(raw)} entries, pipelineParallel is {pipeline_parallel}: one layer count "
            "per PP rank",
        )
        bad = True
    return None if bad else tuple(raw)


def _pod_template(r: FieldReader, raw: object, path: str) -> PodTemplate | None:
    """The CRD's shape only: string labels/annotations and an object `spec` (a copy)."""
    if raw is None:
        return None
    m = r.obj(raw, path)
    r.keys(m, path, {"metadata", "spec"})
    meta = r.obj(m.get("metadata"), f"{path}.metadata")
    r.keys(meta, f"{path}.metadata", {"labels", "annotations"})
    for key in ("labels", "annotations"):
        where = f"{path}.metadata.{key}"
        for name, value in r.obj(meta.get(key), where).items():
            if not isinstance(value, str):
                r.fail(f"{where}.{name}", f"must be a string, got {value!r}")
    r.obj(m.get("spec"), f"{path}.spec")
    return copy.deepcopy(dict(m)) if m else None


def _scheduling(r: FieldReader, raw: object) -> SchedulingSpec:
    path = "spec.scheduling"
    m = r.obj(raw, path)
    r.keys(m, path, {"gang", "topologyKey", "topologyPolicy", "queue"})
    gang = r.string(m, "gang", path, enum=GANG_SCHEDULERS) or "none"
    key = r.string(
        m,
        "topologyKey",
        path,
        max_length=317,
        pattern=_LABEL_KEY,
        pattern_hint="must be a node label key such as topology.kubernetes.io/zone",
    )
    policy = r.string(m, "topologyPolicy", path, enum=TOPOLOGY_POLICIES) or "preferred"
    queue = r.string(
        m, "queue", path, max_length=253, pattern=_QUEUE, pattern_hint="must be a DNS subdomain"
    )
    if m.get("queue") is not None and gang != "volcano":
        r.fail(f"{path}.queue", f"is a Volcano queue: it needs scheduling.gang volcano, not {gang}")
    return SchedulingSpec(
        gang=cast(GangScheduler, gang),
        topology_key=key,
        topology_policy=cast(TopologyPolicy, policy),
        queue=queue,
    )


def _resources(r: FieldReader, raw: object) -> ResourcesSpec:
    path = "spec.resources"
    m = r.obj(raw, path)
    r.keys(m, path, {"requests", "limits"})
    parts: dict[str, tuple[tuple[str, str], ...]] = {}
    for key in ("requests", "limits"):
        sub = r.obj(m.get(key), f"{path}.{key}")
        if len(sub) > 8:
            r.fail(f"{path}.{key}", f"at most 8 entries, got {len(sub)}")
        pairs: list[tuple[str, str]] = []
        for res_name, quantity in sorted(sub.items()):
            where = f"{path}.{key}.{res_name}"
            if res_name == GPU_RESOURCE:
                r.fail(where, "set GPUs with gpu.perPod, not resources")
            elif isinstance(quantity, int) and not isinstance(quantity, bool) and quantity >= 0:
                pairs.append((str(res_name), str(quantity)))
            elif isinstance(quantity, str) and _QUANTITY.match(quantity):
                pairs.append((str(res_name), quantity))
            else:
                r.fail(where, f"must be a quantity such as 2, 500m or 4Gi, got {quantity!r}")
        parts[key] = tuple(pairs)
    return ResourcesSpec(requests=parts["requests"], limits=parts["limits"])


# --- spec.model.source, .hub, .cache (the weights' origin; docs/operator.md "Weights") -------

_SOURCE = re.compile(SOURCE_PATTERN)
_ENDPOINT = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
DEFAULT_TOKEN_KEY = "HF_TOKEN"


def _origin(r: FieldReader, m: Mapping[str, Any]) -> ModelSource | None:
    """spec.model.source (the CRD's pattern, then the parser's own rules); never with the
    weights alias."""
    path = "spec.model"
    text = r.string(
        m,
        "source",
        path,
        max_length=1024,
        pattern=_SOURCE,
        pattern_hint="must be hf://ORG/NAME[@REVISION], pvc://CLAIM[/PATH] or an absolute path",
    )
    if text is None:
        return None
    if m.get("weights") is not None:
        r.fail(
            f"{path}.weights",
            "is the older form of model.source pvc://CLAIM: set one of them, not both",
        )
    try:
        return parse_model_source(text)
    except SourceError as exc:
        r.fail(f"{path}.source", str(exc))
        return None


def _hub(r: FieldReader, m: Mapping[str, Any]) -> HubSpec:
    path = "spec.model.hub"
    h = r.obj(m.get("hub"), path)
    r.keys(h, path, {"endpoint", "tokenSecretRef"})
    if h and not str(m.get("source") or "").startswith("hf://"):
        r.fail(path, "applies to an hf:// model.source only")
    endpoint = r.string(
        h,
        "endpoint",
        path,
        max_length=1024,
        pattern=_ENDPOINT,
        pattern_hint="must be an http(s) URL such as https://hf-mirror.example.com",
    )
    token: SecretKeyRef | None = None
    if h.get("tokenSecretRef") is not None:
        tp = f"{path}.tokenSecretRef"
        t = r.obj(h["tokenSecretRef"], tp)
        r.keys(t, tp, {"name", "key"})
        if t.get("name") is None:
            r.fail(f"{tp}.name", "required")
        name = r.string(
            t, "name", tp, max_length=253, pattern=_CONFIG_MAP_NAME,
            pattern_hint="must be a Secret name (a DNS subdomain)",
        )  # fmt: skip
        key = r.string(
            t, "key", tp, max_length=253, pattern=_SECRET_KEY,
            pattern_hint="must be a Secret data key (letters, digits, '-', '_', '.')",
        )  # fmt: skip
        if name is not None:
            token = SecretKeyRef(name, key or DEFAULT_TOKEN_KEY)
    return HubSpec(endpoint=endpoint, token_secret=token)


def _cache(r: FieldReader, m: Mapping[str, Any]) -> CacheSpec:
    path = "spec.model.cache"
    c = r.obj(m.get("cache"), path)
    r.keys(c, path, {"persistentVolumeClaim", "storageClassName", "size"})
    if c and not str(m.get("source") or "").startswith("hf://"):
        r.fail(path, "applies to an hf:// model.source only")
    claim = r.string(c, "persistentVolumeClaim", path, max_length=253, pattern=_PVC_NAME)
    storage_class = r.string(c, "storageClassName", path, max_length=253, pattern=_PVC_NAME)
    size = r.string(
        c, "size", path, max_length=64, pattern=_QUANTITY,
        pattern_hint="must be a quantity such as 500Gi",
    )  # fmt: skip
    if claim is not None and (c.get("storageClassName") is not None or c.get("size") is not None):
        r.fail(
            path,
            "persistentVolumeClaim names your own claim; storageClassName and size are for the "
            "claim the operator creates: set one or the other",
        )
    return CacheSpec(persistent_volume_claim=claim, storage_class_name=storage_class, size=size)
