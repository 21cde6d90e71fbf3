"""What differs between the engines the operator deploys, behind one protocol (`EngineFlavor`),
chosen once per spec from `spec.engine.name` through `FLAVORS`. Pure.

| concern                 | member                      | dsv4              | sglang              |
| ----------------------- | --------------------------- | ----------------- | ------------------- |
| images                  | worker_image, router_image  | spec.image        | spec.engine.*image  |
| checks beyond the CRD   | spec_errors                 | none              | engineArgs, split   |
| podTemplate `args`      | args_refused                | allowed           | refused             |
| containers              | worker_/router_container    | `dsv4 serve`      | SGLang, its router  |
| pod volumes and labels  | tmp_limit, worker_pod_labels| 1Gi, none         | 16Gi, ENGINE_LABEL  |
| router follows a roll   | router_lists_groups         | no: finds groups  | yes: lists groups   |
| port observed, scraped  | observed_port               | status, each rank | http, PP rank 0     |
| realized capacity       | observe, capacity_source    | /status per rank  | /server_info, group |
| what a rank must realize| pinned                      | its rank's plan   | its group's argv    |
| KVTransferReady         | kv_transfer_unreported      | from /status      | Unknown             |

NOTE: shared modules import this package only, never a flavor's modules (an import-linter
contract); each flavor is imported when first chosen, so a flavor module may import the
shared builders without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from dsv4_common.api.names import Engine

if TYPE_CHECKING:
    from dsv4_common.api.deployment import MemoryPlan
    from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
    from dsv4_operator import labels as L
    from dsv4_operator.capacity import Pinned
    from dsv4_operator.manifests import Obj
    from dsv4_operator.observe import Observed, PodState, WorkerProbe


class EngineFlavor(Protocol):
    """One engine's part of the plan and of the observation; every member is pure except
    `observe`, which only calls the probe it is given."""

    @property
    def name(self) -> Engine: ...

    @property
    def tmp_limit(self) -> str:
        """Size limit of the `/tmp` emptyDir of the worker and router pods."""
        ...

    @property
    def observed_port(self) -> str:
        """The worker port name the operator and the metrics scrapers reach."""
        ...

    @property
    def capacity_source(self) -> str:
        """Where realized capacity is read (named in CapacityMatchesPlan)."""
        ...

    @property
    def router_lists_groups(self) -> bool:
        """The router's command line lists the PP groups, so surge groups change it."""
        ...

    def worker_image(self, spec: DeploymentSpec, default_image: str) -> str: ...

    def router_image(self, spec: DeploymentSpec, worker_image: str) -> str: ...

    def spec_errors(
        self, spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan
    ) -> list[str]:
        """What the engine refuses beyond the CRD's rules, one message per field."""
        ...

    def args_refused(self, main: L.Component) -> str | None:
        """Why a podTemplate may not set the main container's `args`; None: it may."""
        ...

    def worker_pod_labels(self, spec: DeploymentSpec) -> Mapping[str, str]: ...

    def worker_container(
        self,
        meta: DeploymentMeta,
        spec: DeploymentSpec,
        memory: MemoryPlan,
        role: L.WorkerRole,
        replica: int,
        image: str,
    ) -> Obj: ...

    def router_container(
        self,
        meta: DeploymentMeta,
        spec: DeploymentSpec,
        image: str,
        surge: Mapping[L.WorkerRole, int],
    ) -> Obj: ...

    def observe(
        self, probe: WorkerProbe, pods: Sequence[PodState], router_ready_replicas: int
    ) -> Observed:
        """The pods, the router's readiness and what the engine reports of its capacity."""
        ...

    def pinned(self, plan: MemoryPlan, role: L.WorkerRole, pp_rank: int) -> Pinned:
        """What a rank of `role` was asked to realize."""
        ...

    def kv_transfer_unreported(self, backend: str) -> str | None:
        """Why KVTransferReady is Unknown whatever runs; None: the workers report it."""
        ...


def _dsv4() -> EngineFlavor:
    from dsv4_operator.flavors.dsv4.flavor import DSV4

    return DSV4


def _sglang() -> EngineFlavor:
    from dsv4_operator.flavors.sglang.flavor import SGLANG

    return SGLANG


FLAVORS: Final[Mapping[Engine, Callable[[], EngineFlavor]]] = {
    "dsv4": _dsv4,
    "sglang": _sglang,
}


def flavor_of(spec: DeploymentSpec) -> EngineFlavor:
    """The flavor `spec.engine.name` selects."""
    return FLAVORS[spec.engine.name]()
