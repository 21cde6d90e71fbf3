"""The launch plan of `dsv4 up`: which processes run, with which argv, environment, config
documents and loopback ports. Pure: ports come from an injected allocator, nothing is written.

Invariants: workers come first (prefill, then decode, each replica's PP ranks in order), the
router last; every port in the plan is distinct, except that the ranks of a PP group share
rank 0's PP port (where the group meets); the router config lists exactly the serving
rank (PP rank 0) of every replica of each role. A worker group's config directory holds the
rank configs of its ranks, the router's holds `router.json`: the same documents the operator
puts in its ConfigMap, with 127.0.0.1 for every address.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.rank_config import (
    ROUTER_CONFIG_KEY,
    SERVING_RANK,
    Instance,
    RoleEndpoint,
    WorkerPorts,
    build_rank_config,
    build_router_config,
    rank_config_key,
    rank_config_to_dict,
    router_config_to_dict,
)
from dsv4_common.api.spec import DeploymentSpec
from dsv4_common.plan.threads import torch_threads
from dsv4_local.deployment import Deployment

__all__ = [
    "HOST",
    "LaunchPlan",
    "PortAllocator",
    "ProcessSpec",
    "build_launch_plan",
]

HOST: Final = "127.0.0.1"
ROUTER: Final = "router"
PORTS_PER_RANK: Final = 4  # http, status, pp, kv
API_KEY_FILE_NAME: Final = "api-key"
PD_SECRET_FILE: Final = "pd-secret"

# (how many ports, ports it must not return) -> that many distinct free ports.
PortAllocator = Callable[[int, frozenset[int]], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process to run: `argv` with `env` added to the caller's environment."""

    name: str  # unique; also the log file's stem
    role: str  # prefill | decode | router
    replica: int
    pp_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    config_dir: Path
    ready_url: str  # GET answers 200 once the process serves
    status_url: str
    api_url: str = ""  # its HTTP port ("": none)
    live_url: str = ""  # GET answers non-200 once it never will serve again ("": not probed)


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    workdir: Path
    processes: tuple[ProcessSpec, ...]  # start order: workers, then the router
    documents: dict[Path, dict[str, Any]]  # config file -> its JSON document
    router_url: str
    # The API key every process wants (written to `api_key_path`, which every config names);
    # None: no key.
    api_key: bytes | None = None
    # What a group added later needs (`dsv4_local.autoscaler`): the router's ports, the torch
    # threads of a rank, the interpreter.
    router_status_port: int = 0
    router_api_port: int = 0
    torch_threads: int | None = None
    python: str = sys.executable

    @property
    def api_key_file(self) -> str | None:
        return str(self.api_key_path) if self.api_key is not None else None

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def api_key_path(self) -> Path:
        return self.workdir / API_KEY_FILE_NAME

    @property
    def status_path(self) -> Path:
        """Every unit's state, restarts and pids, as `dsv4 up` supervises them (JSON)."""
        return self.workdir / "status.json"

    @property
    def secret_path(self) -> Path:
        return pd_secret_path(self.workdir)


def pd_secret_path(workdir: Path) -> Path:
    """The run's PD secret (`write_workdir` makes a new one each run; every process's config
    names it)."""
    return workdir / PD_SECRET_FILE


def build_launch_plan(
    deployment: Deployment,
    workdir: Path,
    *,
    router_port: int | None,
    allocate_ports: PortAllocator,
    python: str = sys.executable,
    cpus: float | None = None,
    api_key: bytes | None = None,
) -> LaunchPlan:
    """`router_port`: None = the CR's `spec.router.port`, 0 = any free port. `cpus`: the
    cores this machine lends the deployment; every worker rank's rank config gets the torch
    threads of an equal share (None: each worker decides from all it sees, and they
    oversubscribe). `api_key`: the key every process wants (the router sends it to the
    workers), in WORKDIR/api-key, which every config names."""
    spec = deployment.spec
    key_file = str(workdir / API_KEY_FILE_NAME) if api_key is not None else None
    fixed_port = spec.router.port if router_port is None else router_port
    groups = [
        (role, replica, spec.role(role).pipeline_parallel)
        for role in WORKER_ROLES
        for replica in range(first_groups(spec, role))
    ]
    rank_count = sum(pp_size for _, _, pp_size in groups)
    # Torch threads: an equal share of the CPUs for every rank the deployment may run (an
    # autoscaled role at its maxReplicas).
    most_ranks = sum(
        spec.role(role).pipeline_parallel * most_groups(spec, role) for role in WORKER_ROLES
    )
    threads = None if cpus is None else torch_threads(cpus / most_ranks)
    free = _allocate(
        allocate_ports,
        PORTS_PER_RANK * rank_count + 1 + (1 if fixed_port == 0 else 0),
        reserved=frozenset({fixed_port} - {0}),
    )

    processes: list[ProcessSpec] = []
    documents: dict[Path, dict[str, Any]] = {}
    instances: dict[WorkerRole, list[Instance]] = {role: [] for role in WORKER_ROLES}
    for role, replica, pp_size in groups:
        group = build_group(
            deployment,
            workdir,
            role,
            replica,
            [WorkerPorts(*_take(free, PORTS_PER_RANK)) for _ in range(pp_size)],
            first_prefill=instances["prefill"][0] if instances["prefill"] else None,
            python=python,
            torch_threads=threads,
            api_key_file=key_file,
        )
        processes.extend(group.processes)
        documents.update(group.documents)
        instances[role].append(group.instance)

    (status_port,) = _take(free, 1)
    api_port = fixed_port or _take(free, 1)[0]
    router_config = router_document(
        deployment,
        instances,
        status_port=status_port,
        api_port=api_port,
        api_key_file=key_file,
        pd_secret_file=str(pd_secret_path(workdir)),
    )
    router = _router(workdir, python, status_port, api_port)
    processes.append(router)
    documents[router.config_dir / ROUTER_CONFIG_KEY] = router_config
    return LaunchPlan(
        workdir=workdir,
        processes=tuple(processes),
        documents=documents,
        router_url=f"http://{HOST}:{api_port}",
        api_key=api_key,
        router_status_port=status_port,
        router_api_port=api_port,
        torch_threads=threads,
        python=python,
    )


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One PP group's processes and config documents, and the instance the router lists."""

    processes: tuple[ProcessSpec, ...]
    documents: dict[Path, dict[str, Any]]
    instance: Instance  # its serving rank (PP rank 0)


def first_groups(spec: DeploymentSpec, role: WorkerRole) -> int:
    """The groups `role` starts with: its replicas (clamped to its autoscaling range)."""
    auto = spec.role(role).autoscaling
    return auto.clamp(spec.role(role).replicas) if auto is not None else spec.role(role).replicas


def most_groups(spec: DeploymentSpec, role: WorkerRole) -> int:
    """The most groups `role` may run: its autoscaling maxReplicas, else its replicas."""
    auto = spec.role(role).autoscaling
    return auto.max_replicas if auto is not None else spec.role(role).replicas


def build_group(
    deployment: Deployment,
    workdir: Path,
    role: WorkerRole,
    replica: int,
    ports: list[WorkerPorts],
    *,
    first_prefill: Instance | None,
    python: str = sys.executable,
    torch_threads: int | None = None,
    api_key_file: str | None = None,
) -> GroupPlan:
    """The processes of one PP group, one rank per entry of `ports`; the ranks meet on rank
    0's PP port. A decode group handshakes with `first_prefill` at start."""
    spec = deployment.spec
    processes: list[ProcessSpec] = []
    documents: dict[Path, dict[str, Any]] = {}
    instance: Instance | None = None
    group_pp_port = ports[0].pp
    for pp_rank, rank_ports in enumerate(ports):
        # The group meets on rank 0's PP port (as on the pods' shared port number).
        rank_ports = dataclasses.replace(rank_ports, pp=group_pp_port)
        process = _worker(deployment, workdir, python, role, replica, pp_rank, rank_ports)
        if role == "decode" and first_prefill is not None:
            # The prefill it handshakes with at start (the router names one per request).
            where = f"{first_prefill.host}:{first_prefill.kv_port}"
            process = dataclasses.replace(process, argv=(*process.argv, "--prefill", where))
        config = build_rank_config(
            spec,
            deployment.meta,
            deployment.memory,
            role,
            pp_rank,
            peers_host_template=HOST,
            role_services={r: HOST for r in WORKER_ROLES},
            ports=rank_ports,
            torch_threads=torch_threads,
            api_key_file=api_key_file,
            pd_secret_file=str(pd_secret_path(workdir)),
            files=deployment.files,
        )
        processes.append(process)
        documents[process.config_dir / rank_config_key(role, pp_rank)] = rank_config_to_dict(config)
        if pp_rank == SERVING_RANK:
            instance = Instance(HOST, rank_ports.http, rank_ports.status, rank_ports.kv)
    assert instance is not None, "a group has a serving rank"
    return GroupPlan(tuple(processes), documents, instance)


def router_document(
    deployment: Deployment,
    instances: Mapping[WorkerRole, Sequence[Instance]],
    *,
    status_port: int,
    api_port: int,
    api_key_file: str | None,
    pd_secret_file: str,
) -> dict[str, Any]:
    """router.json listing exactly `instances` (the serving rank of every group)."""
    config = build_router_config(
        deployment.spec,
        deployment.meta,
        _endpoints(instances),
        status_port=status_port,
        api_key_file=api_key_file,
        pd_secret_file=pd_secret_file,
    )
    return router_config_to_dict(dataclasses.replace(config, port=api_port))  # --port wins


def _worker(
    deployment: Deployment,
    workdir: Path,
    python: str,
    role: WorkerRole,
    replica: int,
    pp_rank: int,
    ports: WorkerPorts,
) -> ProcessSpec:
    """One worker rank; its config directory holds the rank configs of its whole group."""
    pp_size = deployment.spec.role(role).pipeline_parallel
    config_dir = workdir / f"{role}-{replica}"
    return ProcessSpec(
        name=f"{role}-{replica}" if pp_size == 1 else f"{role}-{replica}-rank-{pp_rank}",
        role=role,
        replica=replica,
        pp_rank=pp_rank,
        argv=_serve_argv(python, role, config_dir),
        env={
            "DSV4_PP_RANK": str(pp_rank),
            "DSV4_GROUP": f"{deployment.meta.name}-{role}-{replica}",
            "PYTHONUNBUFFERED": "1",
        },
        config_dir=config_dir,
        ready_url=_url(ports.status, "/ready"),
        status_url=_url(ports.status, "/status"),
        api_url=_url(ports.http, ""),
        live_url=_url(ports.status, "/live"),
    )


def _router(workdir: Path, python: str, status_port: int, api_port: int) -> ProcessSpec:
    config_dir = workdir / ROUTER
    return ProcessSpec(
        name=ROUTER,
        role=ROUTER,
        replica=0,
        pp_rank=0,
        argv=_serve_argv(python, ROUTER, config_dir),
        env={"PYTHONUNBUFFERED": "1"},
        config_dir=config_dir,
        ready_url=_url(status_port, "/ready"),
        status_url=_url(status_port, "/status"),
        api_url=_url(api_port, ""),
        live_url=_url(status_port, "/live"),
    )


def _endpoints(
    instances: Mapping[WorkerRole, Sequence[Instance]],
) -> dict[WorkerRole, RoleEndpoint]:
    """Each role's serving ranks; `port`/`bootstrap_port` are its first instance's."""
    return {
        role: RoleEndpoint(
            service=HOST,
            port=instances[role][0].http_port,
            bootstrap_port=instances[role][0].kv_port,
            instances=tuple(instances[role]),
        )
        for role in WORKER_ROLES
    }


def _allocate(
    allocate_ports: PortAllocator, count: int, *, reserved: frozenset[int]
) -> Iterator[int]:
    ports = allocate_ports(count, reserved)
    if len(set(ports) | reserved) != count + len(reserved):
        raise ValueError(f"port allocator: expected {count} distinct free ports, got {ports}")
    return iter(ports)


def _serve_argv(python: str, role: str, config_dir: Path) -> tuple[str, ...]:
    # --host: `serve --config-dir` listens on every interface by default (pods); not here.
    return (
        python,
        "-m",
        "dsv4_cli",
        "serve",
        "--role",
        role,
        "--config-dir",
        str(config_dir),
        "--host",
        HOST,
    )


def _url(port: int, path: str) -> str:
    return f"http://{HOST}:{port}{path}"


def _take(ports: Iterator[int], count: int) -> tuple[int, ...]:
    return tuple(next(ports) for _ in range(count))
