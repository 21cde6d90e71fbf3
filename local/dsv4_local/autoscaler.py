"""`dsv4 up` scales too: the operator's policy (`dsv4_common.api.scaling`) run by the local
supervisor. Side effects: GETs of the workers' /status, config files, router.json, and
processes started and retired through the `Supervisor`.

Every `interval_s` (on the supervisor's loop):

    1 read      every rank's /status; a role's figures from its groups (`load_figures`)
    2 decide    the same decision as the operator's, the memory kept here
    3 grow      a new group: free loopback ports, its rank configs written, its processes
                started (`Supervisor.add_unit`), router.json rewritten with its serving rank
                (the router reads the file again when it changes: `dsv4_router.reload`)
    4 shrink    the highest groups leave router.json first; `retire_after_s` later (the router
                has polled the file by then) they get SIGTERM and drain: what they hold
                finishes, a request that still reaches one is answered 503 + Retry-After and
                the router retries it on another decode

Each change is one line (`dsv4 up: autoscaling: decode 1 -> 2 group(s): ...`) and
WORKDIR/autoscaling.json holds each role's last decision (the operator's status.autoscaling).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.load_figures import role_figures
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.rank_config import ROUTER_CONFIG_KEY, Instance, WorkerPorts
from dsv4_common.api.scaling import RoleDecision, RoleInput, RoleMemory, decide
from dsv4_common.api.worker_status import WorkerStatus, parse_worker_status
from dsv4_local.deployment import Deployment
from dsv4_local.plan import (
    PORTS_PER_RANK,
    GroupPlan,
    LaunchPlan,
    PortAllocator,
    ProcessSpec,
    build_group,
    router_document,
)
from dsv4_local.ports import free_ports
from dsv4_local.supervisor import PREFIX, Supervisor

DEFAULT_INTERVAL_S: Final = 2.0
RETIRE_AFTER_S: Final = 2.0  # router.json rewritten -> SIGTERM (the router polls every 0.5 s)
STATUS_TIMEOUT_S: Final = 1.0
DECISIONS_FILE: Final = "autoscaling.json"


def scales(deployment: Deployment) -> bool:
    return any(deployment.spec.role(r).autoscaling is not None for r in WORKER_ROLES)


def autoscale_every(scaler: LocalAutoscaler) -> float:
    return scaler.interval_s


def fetch_status(url: str, timeout_s: float = STATUS_TIMEOUT_S) -> WorkerStatus | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return parse_worker_status(json.loads(resp.read()))
    except (OSError, ValueError, DocumentError):
        return None


@dataclass(slots=True)
class _Group:
    replica: int
    processes: tuple[ProcessSpec, ...]
    instance: Instance


class LocalAutoscaler:
    def __init__(
        self,
        deployment: Deployment,
        plan: LaunchPlan,
        supervisor: Supervisor,
        *,
        out: TextIO,
        interval_s: float = DEFAULT_INTERVAL_S,
        retire_after_s: float = RETIRE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        fetch: Callable[[str], WorkerStatus | None] = fetch_status,
        ports: PortAllocator = free_ports,
    ) -> None:
        self._deployment = deployment
        self._plan = plan
        self._supervisor = supervisor
        self._out = out
        self.interval_s = interval_s
        self._retire_after_s = retire_after_s
        self._clock = clock
        self._wall = wall
        self._fetch = fetch
        self._ports = ports
        self._next_s = clock() + interval_s
        self._memory: dict[WorkerRole, RoleMemory | None] = {r: None for r in WORKER_ROLES}
        self._retiring: list[tuple[float, str]] = []  # (when, unit name)
        self._router_path = plan.workdir / "router" / ROUTER_CONFIG_KEY
        self._groups: dict[WorkerRole, list[_Group]] = {r: [] for r in WORKER_ROLES}
        router = plan.documents[self._router_path]
        for role in WORKER_ROLES:
            instances = router["roles"][role]["instances"]
            for replica, raw in enumerate(instances):
                members = tuple(
                    p for p in plan.processes if p.role == role and p.replica == replica
                )
                instance = Instance(
                    raw["host"], raw["http_port"], raw["status_port"], raw["kv_port"]
                )
                self._groups[role].append(_Group(replica, members, instance))
        self._taken: set[int] = {
            port
            for groups in self._groups.values()
            for g in groups
            for port in (g.instance.http_port, g.instance.status_port, g.instance.kv_port)
        }
        self.decisions: list[dict[WorkerRole, RoleDecision]] = []

    # ---- the loop ---------------------------------------------------------------------

    def tick(self) -> None:
        """Called on every pass of the supervisor's loop; acts every `interval_s`."""
        now = self._clock()
        for due, name in [r for r in self._retiring if r[0] <= now]:
            self._retiring.remove((due, name))
            self._supervisor.retire_unit(name)
        if now < self._next_s:
            return
        self._next_s = now + self.interval_s
        self.step()

    def step(self) -> dict[WorkerRole, RoleDecision]:
        """Steps 1-4 once."""
        spec = self._deployment.spec
        states = self._supervisor.unit_states()
        inputs = {}
        for role in WORKER_ROLES:
            groups = {
                f"{role}-{g.replica}": [s for p in g.processes if (s := self._fetch(p.status_url))]
                for g in self._groups[role]
            }
            ready = sum(states.get(f"{role}-{g.replica}") == "ready" for g in self._groups[role])
            inputs[role] = RoleInput(
                replicas=len(self._groups[role]),
                autoscaling=spec.role(role).autoscaling,
                memory=self._memory[role],
                figures=role_figures(groups),
                ready=ready,
            )
        decisions = decide(inputs, spec.autoscaling, float(int(self._wall())))
        self.decisions.append(decisions)
        changed = False
        for role in WORKER_ROLES:
            d = decisions[role]
            self._memory[role] = d.memory
            before = len(self._groups[role])
            if d.replicas == before:
                continue
            self._say(
                f"autoscaling: {role} {before} -> {d.replicas} group(s): {d.message} ({d.reason})"
            )
            while len(self._groups[role]) < d.replicas:
                self._grow(role)
            while len(self._groups[role]) > d.replicas:
                group = self._groups[role].pop()
                self._retiring.append(
                    (self._clock() + self._retire_after_s, f"{role}-{group.replica}")
                )
            changed = True
        if changed:
            self._write_router()
        self._write_decisions(decisions, inputs)
        return decisions

    # ---- side effects ---------------------------------------------------------------------

    def _grow(self, role: WorkerRole) -> None:
        spec = self._deployment.spec
        replica = self._free_replica(role)
        pp_size = spec.role(role).pipeline_parallel
        # Not a port handed out before: a group started this step has not bound its own yet.
        taken = self._ports(PORTS_PER_RANK * pp_size, frozenset(self._taken))
        self._taken.update(taken)
        ports = iter(taken)
        prefills = self._groups["prefill"]
        group: GroupPlan = build_group(
            self._deployment,
            self._plan.workdir,
            role,
            replica,
            [WorkerPorts(*(next(ports) for _ in range(PORTS_PER_RANK))) for _ in range(pp_size)],
            first_prefill=prefills[0].instance if prefills else None,
            python=self._plan.python,
            torch_threads=self._plan.torch_threads,
            api_key_file=self._plan.api_key_file,
        )
        for path, doc in group.documents.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_json(path, doc)
        self._supervisor.add_unit(f"{role}-{replica}", group.processes)
        self._groups[role].append(_Group(replica, group.processes, group.instance))

    def _free_replica(self, role: WorkerRole) -> int:
        """The lowest index no group of the role holds, running or still draining."""
        taken = {g.replica for g in self._groups[role]}
        taken |= {int(n.rsplit("-", 1)[1]) for _, n in self._retiring if n.startswith(role)}
        states = self._supervisor.unit_states()
        replica = 0
        while replica in taken or states.get(f"{role}-{replica}") == "stopping":
            replica += 1
        return replica

    def _write_router(self) -> None:
        doc = router_document(
            self._deployment,
            {role: [g.instance for g in self._groups[role]] for role in WORKER_ROLES},
            status_port=self._plan.router_status_port,
            api_port=self._plan.router_api_port,
            api_key_file=self._plan.api_key_file,
            pd_secret_file=str(self._plan.secret_path),
        )
        _write_json(self._router_path, doc)

    def _write_decisions(
        self, decisions: dict[WorkerRole, RoleDecision], inputs: dict[WorkerRole, RoleInput]
    ) -> None:
        doc = {
            role: {
                "replicas": d.replicas,
                "desired": d.target,
                "recommended": d.recommended,
                "reason": d.reason,
                "message": d.message,
                "ready": inputs[role].ready,
            }
            for role, d in decisions.items()
            if self._deployment.spec.role(role).autoscaling is not None
        }
        try:
            _write_json(self._plan.workdir / DECISIONS_FILE, doc)
        except OSError as exc:
            self._say(f"cannot write {DECISIONS_FILE}: {exc}")

    def _say(self, message: str) -> None:
        self._out.write(f"{PREFIX} {message}\n")
        self._out.flush()


def _write_json(path: Path, doc: object) -> None:
    """Replaced atomically: a reader sees the old file or the new one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
