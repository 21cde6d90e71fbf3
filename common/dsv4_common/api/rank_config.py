"""What each worker rank and the router are told: the rank-config and router-config documents,
version 1. One builder each (the operator and `dsv4 up`) and one parser each (`dsv4 serve`).

Where they live: in Kubernetes, the deployment's ConfigMap is mounted at CONFIG_DIR; a worker
reads `rank_config_key(role, pp_rank)`, the router reads ROUTER_CONFIG_KEY; a model given by
`spec.model.configMapRef` is the file `model_config_path(name)` (the rank's `config_path`). The
schema is the dataclasses below (snake_case JSON); it is independent of `dsv4 plan --json`, so
the human report can change without changing the wire format. Network addresses are inputs of
the builders: Kubernetes DNS names for the operator, loopback ports for `dsv4 up`. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.documents import (
    INLINE,
    DocumentError,
    check_version,
    from_document,
    to_document,
)
from dsv4_common.api.model_files import ModelFiles, spec_model_files
from dsv4_common.api.names import WORKER_ROLES, ComputeDtype, Transfer, WorkerRole
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.core.capacity import RankCapacity
from dsv4_common.core.model import ModelConfig
from dsv4_common.plan.inputs import PlanInputs, Role
from dsv4_common.plan.planner import RankPlan

RANK_CONFIG_VERSION: Final = 1
ROUTER_CONFIG_VERSION: Final = 1
CONFIG_DIR: Final = "/etc/dsv4"
ROUTER_CONFIG_KEY: Final = "router.json"
# Where worker pods mount a `spec.model.configMapRef` (its key as `<name>/config.json`, so the
# worker names the model after the ConfigMap, as the operator's plan does); beside CONFIG_DIR,
# not inside it: a mount point cannot be made in a read-only ConfigMap volume.
MODEL_CONFIG_DIR: Final = "/etc/dsv4-model"
# Where pods mount the API key of `spec.apiKey.secretRef` (the Secret's key as API_KEY_FILE): the
# rank and router configs' `api_key_file`.
API_KEY_DIR: Final = "/etc/dsv4-api-key"
API_KEY_FILE: Final = f"{API_KEY_DIR}/api-key"
# Where worker and router pods mount the deployment's PD Secret (its key PD_SECRET_KEY).
PD_SECRET_DIR: Final = "/etc/dsv4-pd"
PD_SECRET_KEY: Final = "secret"
PD_SECRET_PATH: Final = f"{PD_SECRET_DIR}/{PD_SECRET_KEY}"
# Only this PP rank of a group takes requests; its /ready means "the whole group is up".
SERVING_RANK: Final = 0


def rank_config_key(role: WorkerRole, pp_rank: int) -> str:
    return f"{role}-rank-{pp_rank}.json"


def model_config_path(config_map_name: str) -> str:
    """Where a worker reads the config.json of `spec.model.configMapRef` (a ConfigMap name is a
    DNS subdomain: a safe path segment)."""
    return f"{MODEL_CONFIG_DIR}/{config_map_name}/config.json"


@dataclass(frozen=True, slots=True)
class WorkerPorts:
    http: int = 8080  # serving API (the serving rank answers the router)
    status: int = 8081  # /live, /ready, /status (realized capacity), /metrics
    pp: int = 8082  # pipeline-parallel activations between the ranks of one group
    kv: int = 8083  # KV-transfer bootstrap (the data path may use other ports)

    def by_name(self) -> dict[str, int]:
        return {"http": self.http, "status": self.status, "pp": self.pp, "kv": self.kv}


DEFAULT_PORTS: Final = WorkerPorts()


@dataclass(frozen=True, slots=True)
class ModelRef:
    preset: str | None
    config_path: str | None
    weights_path: str | None = None
    # The names the API answers to (spec.model.servedModelNames; `dsv4 serve
    # --served-model-name` overrides them); empty: the model's own name.
    served_model_names: tuple[str, ...] = ()
    # The compute dtype (spec.model.dtype; `dsv4 serve --dtype` overrides it): auto is bfloat16
    # on a GPU, float32 on CPU.
    dtype: ComputeDtype = "auto"

    @property
    def source(self) -> str:
        """What `load_model_config` takes."""
        source = self.preset if self.preset is not None else self.config_path
        assert source is not None, "a model reference names a preset or a config path"
        return source


@dataclass(frozen=True, slots=True)
class KVSettings:
    page_size: int
    swa_ratio: float | None  # None: auto (sized from what the role needs)
    transfer: Transfer


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """The planner inputs a worker re-solves with, from the memory it measures."""

    device_memory_bytes: int
    cpu_mode: bool
    mem_fraction: float
    chunked_prefill_tokens: int
    max_running_requests: int
    speculative_draft_tokens: int
    context_len: int
    layer_split: tuple[int, ...]  # target layers per PP rank of the group


@dataclass(frozen=True, slots=True)
class PlannedRank:
    """What the planner expects this rank to realize (the operator compares it in status)."""

    layers: tuple[int, int]  # target layers [start, end)
    draft_layers: tuple[int, ...]
    # On the wire its four fields sit in `planned` itself, as before RankCapacity existed.
    capacity: RankCapacity = field(metadata=INLINE)
    weight_bytes: int
    kv_bytes: int


@dataclass(frozen=True, slots=True)
class Peers:
    # `{group}` and `{rank}` are filled by the worker (group from its environment).
    host_template: str
    pp_size: int


@dataclass(frozen=True, slots=True)
class RankConfig:
    version: int
    deployment: str
    namespace: str
    role: Role  # prefill | decode (| colocated, for a worker run without a peer role)
    pp_rank: int
    pp_size: int
    tp_size: int
    serving_rank: bool
    model: ModelRef
    max_context_tokens: int
    kv: KVSettings
    plan: PlanSettings
    planned: PlannedRank
    ports: WorkerPorts
    peers: Peers
    role_services: dict[str, str]  # role -> host of its routing Service
    # Torch intra-op threads (the operator's, from the pod's CPU request); None: the worker
    # decides from the CPUs it may use. `dsv4 serve --torch-threads` overrides it.
    torch_threads: int | None = None
    # Admission (`dsv4_worker.server.admission`): the queue's bound and deadline; None: the
    # worker derives them. `dsv4 serve --max-queue-requests/--queue-timeout-s` override them.
    max_queue_requests: int | None = None
    queue_timeout_s: float | None = None
    # The file holding the API key clients (the router) must send (`dsv4_common.api.api_key`);
    # None: no key. `dsv4 serve --api-key/--api-key-file` override it.
    api_key_file: str | None = None
    # The deployment's PD secret, a file (the operator mounts its Secret at PD_SECRET_PATH;
    # `dsv4 up` writes one per run); None: `--pd-secret-file` or DSV4_PD_SECRET must give it.
    pd_secret_file: str | None = None

    def plan_inputs(self, model: ModelConfig, device_memory_bytes: int | None = None) -> PlanInputs:
        """The planner inputs of this rank's group; `device_memory_bytes` replaces the planned
        device size with the one the worker measured."""
        p = self.plan
        return PlanInputs(
            model=model,
            role=self.role,
            gpu_memory_bytes=device_memory_bytes or p.device_memory_bytes,
            pp_size=self.pp_size,
            layer_split=p.layer_split,
            tp_size=self.tp_size,
            page_size=self.kv.page_size,
            chunked_prefill_tokens=p.chunked_prefill_tokens,
            max_running_requests=p.max_running_requests,
            swa_ratio=self.kv.swa_ratio,
            mem_fraction=p.mem_fraction,
            speculative_draft_tokens=p.speculative_draft_tokens,
            context_len=p.context_len,
        )


@dataclass(frozen=True, slots=True)
class Instance:
    """One serving rank the router may pick, by address (`dsv4 up`: loopback ports)."""

    host: str
    http_port: int
    status_port: int
    kv_port: int


@dataclass(frozen=True, slots=True)
class RoleEndpoint:
    service: str  # host whose endpoints are the ready serving ranks of the role
    port: int
    bootstrap_port: int
    # Fixed instances; empty: every address `service` resolves to is one (a headless Service
    # lists the ready serving ranks), at `port`, the router config's `status_port`, and
    # `bootstrap_port`.
    instances: tuple[Instance, ...] = ()


@dataclass(frozen=True, slots=True)
class RouterConfig:
    version: int
    deployment: str
    port: int
    status_port: int
    max_context_tokens: int
    transfer: Transfer
    roles: dict[str, RoleEndpoint]
    # The file holding the API key: clients must send it, and the router sends it to the
    # workers; None: no key.
    api_key_file: str | None = None
    pd_secret_file: str | None = None  # as RankConfig's: the router signs its prefill choice


def planned_rank(rank: RankPlan) -> PlannedRank:
    return PlannedRank(
        layers=rank.layers,
        draft_layers=rank.layout.draft_layer_ids,
        capacity=rank.capacity,
        weight_bytes=rank.weight_bytes,
        kv_bytes=rank.pools.kv_bytes,
    )


def build_rank_config(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    memory: MemoryPlan,
    role: WorkerRole,
    pp_rank: int,
    *,
    peers_host_template: str,
    role_services: Mapping[WorkerRole, str],
    ports: WorkerPorts = DEFAULT_PORTS,
    torch_threads: int | None = None,
    api_key_file: str | None = None,
    pd_secret_file: str | None = None,
    files: ModelFiles | None = None,
) -> RankConfig:
    """`files`: where the worker finds the model's files (None: the spec's weights mount, or
    random weights)."""
    plan = memory.role(role)
    inputs = plan.inputs
    return RankConfig(
        version=RANK_CONFIG_VERSION,
        deployment=meta.name,
        namespace=meta.namespace,
        role=role,
        pp_rank=pp_rank,
        pp_size=inputs.pp_size,
        tp_size=inputs.tp_size,
        serving_rank=pp_rank == SERVING_RANK,
        model=_model_ref(spec, files),
        max_context_tokens=spec.max_context_tokens,
        kv=KVSettings(
            page_size=inputs.resolved_page_size,
            swa_ratio=inputs.swa_ratio,
            transfer=spec.kv.transfer,
        ),
        plan=PlanSettings(
            device_memory_bytes=inputs.gpu_memory_bytes,
            cpu_mode=spec.gpu.cpu_mode,
            mem_fraction=inputs.mem_fraction,
            chunked_prefill_tokens=inputs.resolved_chunk_tokens,
            max_running_requests=plan.max_running_requests,
            speculative_draft_tokens=inputs.speculative_draft_tokens,
            context_len=inputs.resolved_context_len,
            layer_split=tuple(r.layers[1] - r.layers[0] for r in plan.ranks),
        ),
        planned=planned_rank(plan.ranks[pp_rank]),
        ports=ports,
        peers=Peers(host_template=peers_host_template, pp_size=inputs.pp_size),
        role_services={r: role_services[r] for r in WORKER_ROLES},
        torch_threads=torch_threads,
        api_key_file=api_key_file,
        pd_secret_file=pd_secret_file,
    )


def _model_ref(spec: DeploymentSpec, files: ModelFiles | None) -> ModelRef:
    files = files if files is not None else spec_model_files(spec)
    config_path = spec.model.config_path
    if spec.model.config_map is not None:
        config_path = model_config_path(spec.model.config_map.name)
    elif files is not None and files.config_from_dir:
        config_path = files.model_dir
    served = spec.model.served_model_names
    if not served and files is not None and files.served_name is not None:
        served = (files.served_name,)
    return ModelRef(
        preset=spec.model.preset,
        config_path=config_path,
        weights_path=files.model_dir if files is not None else None,
        served_model_names=served,
        dtype=spec.model.dtype,
    )


def build_router_config(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    endpoints: Mapping[WorkerRole, RoleEndpoint],
    *,
    status_port: int = DEFAULT_PORTS.status,
    api_key_file: str | None = None,
    pd_secret_file: str | None = None,
) -> RouterConfig:
    return RouterConfig(
        version=ROUTER_CONFIG_VERSION,
        deployment=meta.name,
        port=spec.router.port,
        status_port=status_port,
        max_context_tokens=spec.max_context_tokens,
        transfer=spec.kv.transfer,
        roles={r: endpoints[r] for r in WORKER_ROLES},
        api_key_file=api_key_file,
        pd_secret_file=pd_secret_file,
    )


def rank_config_to_dict(config: RankConfig) -> dict[str, Any]:
    doc: dict[str, Any] = to_document(config)
    return doc


def router_config_to_dict(config: RouterConfig) -> dict[str, Any]:
    doc: dict[str, Any] = to_document(config)
    return doc


def parse_rank_config(doc: object) -> RankConfig:
    """Parse a rank-config document; raises DocumentError naming the first bad field."""
    check_version(doc, "rank_config", RANK_CONFIG_VERSION)
    config = from_document(RankConfig, doc, "rank_config")
    _check_rank(config)
    return config


def parse_router_config(doc: object) -> RouterConfig:
    """Parse a router-config document; raises DocumentError naming the first bad field."""
    check_version(doc, "router_config", ROUTER_CONFIG_VERSION)
    config = from_document(RouterConfig, doc, "router_config")
    missing = sorted(set(WORKER_ROLES) - set(config.roles))
    if missing:
        raise DocumentError(f"router_config.roles: missing {', '.join(missing)}")
    return config


def _check_rank(c: RankConfig) -> None:
    if not 0 <= c.pp_rank < c.pp_size:
        raise DocumentError(f"rank_config.pp_rank: must be in [0, {c.pp_size}), got {c.pp_rank}")
    if len(c.plan.layer_split) != c.pp_size:
        raise DocumentError(
            f"rank_config.plan.layer_split: has {len(c.plan.layer_split)} entries, "
            f"pp_size is {c.pp_size}"
        )
    if c.serving_rank != (c.pp_rank == SERVING_RANK):
        raise DocumentError(
            f"rank_config.serving_rank: only PP rank {SERVING_RANK} serves, got "
            f"serving_rank={c.serving_rank} for PP rank {c.pp_rank}"
        )
    if (c.model.preset is None) == (c.model.config_path is None):
        raise DocumentError("rank_config.model: exactly one of preset and config_path")
    names = c.model.served_model_names
    if any(not n.strip() for n in names) or len(set(names)) != len(names):
        raise DocumentError(
            f"rank_config.model.served_model_names: must be unique non-empty names, got {names!r}"
        )
    missing = sorted(set(WORKER_ROLES) - set(c.role_services))
    if missing:
        raise DocumentError(f"rank_config.role_services: missing {', '.join(missing)}")
    if c.torch_threads is not None and c.torch_threads < 1:
        raise DocumentError(f"rank_config.torch_threads: must be >= 1, got {c.torch_threads}")
    if c.max_queue_requests is not None and c.max_queue_requests < 1:
        raise DocumentError(
            f"rank_config.max_queue_requests: must be >= 1, got {c.max_queue_requests}"
        )
    if c.queue_timeout_s is not None and not c.queue_timeout_s > 0:
        raise DocumentError(f"rank_config.queue_timeout_s: must be > 0, got {c.queue_timeout_s}")
