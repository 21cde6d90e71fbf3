"""`DSV4`: engine `dsv4` as an `EngineFlavor` (our worker; see `flavors`' table). Pure.

Every rank serves `/status` on the `status` port with its own realized figures and its KV
transfer engine's state, so a rank is pinned to its own rank plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.names import Engine
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_operator import labels as L
from dsv4_operator.capacity import Pinned, rank_pinned
from dsv4_operator.flavors.dsv4.workloads import router_container, worker_container
from dsv4_operator.manifests import Obj
from dsv4_operator.observe import Observed, PodState, WorkerProbe, parse_reports

_NO_LABELS: Final[Mapping[str, str]] = {}


@dataclass(frozen=True, slots=True)
class Dsv4Flavor:
    name: Engine = "dsv4"
    tmp_limit: str = "1Gi"
    observed_port: str = "status"
    capacity_source: str = "/status"
    router_lists_groups: bool = False  # the router finds the groups itself

    def worker_image(self, spec: DeploymentSpec, default_image: str) -> str:
        return spec.image or default_image

    def router_image(self, spec: DeploymentSpec, worker_image: str) -> str:
        return worker_image  # one image runs both: `dsv4 serve --role ...`

    def spec_errors(
        self, spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan
    ) -> list[str]:
        return []

    def args_refused(self, main: L.Component) -> str | None:
        return None

    def worker_pod_labels(self, spec: DeploymentSpec) -> Mapping[str, str]:
        # NOTE: no engine label: a new label would change the template hash of every existing
        # deployment and roll it on an operator upgrade.
        return _NO_LABELS

    def worker_container(
        self,
        meta: DeploymentMeta,
        spec: DeploymentSpec,
        memory: MemoryPlan,
        role: L.WorkerRole,
        replica: int,
        image: str,
    ) -> Obj:
        return worker_container(meta, spec, role, image)

    def router_container(
        self,
        meta: DeploymentMeta,
        spec: DeploymentSpec,
        image: str,
        surge: Mapping[L.WorkerRole, int],
    ) -> Obj:
        return router_container(meta, spec, image)

    def observe(
        self, probe: WorkerProbe, pods: Sequence[PodState], router_ready_replicas: int
    ) -> Observed:
        return Observed(
            pods=tuple(pods),
            reports=parse_reports(probe.fetch(pods)),
            router_ready_replicas=router_ready_replicas,
        )

    def pinned(self, plan: MemoryPlan, role: L.WorkerRole, pp_rank: int) -> Pinned:
        return rank_pinned(plan, role, pp_rank)

    def kv_transfer_unreported(self, backend: str) -> str | None:
        return None


DSV4: Final = Dsv4Flavor()
