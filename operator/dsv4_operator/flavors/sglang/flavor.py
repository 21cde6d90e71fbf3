"""`SGLANG`: engine `sglang` as an `EngineFlavor` (upstream SGLang; see `flavors`' table). Pure.

Only PP rank 0 of a group serves HTTP, on the `http` port: its `/server_info` speaks for the
whole group (`info`), and every rank of a group is pinned to the figures on the group's
command line (`command.group_figures`). SGLang reports nothing of its KV transfer engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from dsv4_common.api import RankCapacity
from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.names import Engine
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec, SpecError
from dsv4_operator import labels as L
from dsv4_operator.capacity import Pinned
from dsv4_operator.flavors.sglang.command import group_figures, sglang_swa_tokens
from dsv4_operator.flavors.sglang.engine_args import check_sglang_spec
from dsv4_operator.flavors.sglang.info import parse_server_infos
from dsv4_operator.flavors.sglang.workloads import (
    DEFAULT_SGLANG_IMAGE,
    sglang_router_container,
    sglang_worker_container,
)
from dsv4_operator.manifests import Obj
from dsv4_operator.observe import Observed, PodState, WorkerProbe

# A podTemplate's main-container `args`, by container, and where to go instead.
_ARGS_REFUSED: Final[Mapping[L.Component, str]] = {
    "worker": "not supported with engine sglang: put SGLang flags in spec.<role>.engineArgs",
    "router": "not supported with engine sglang: the operator owns sglang-router's command line",
}
# SGLang compiles kernels at start-up (Triton, DeepGEMM, FlashInfer) into caches under /tmp.
SGLANG_TMP_LIMIT: Final = "16Gi"


@dataclass(frozen=True, slots=True)
class SglangFlavor:
    name: Engine = "sglang"
    tmp_limit: str = SGLANG_TMP_LIMIT
    observed_port: str = "http"  # SGLang serves nothing on `status`
    capacity_source: str = "/server_info"
    router_lists_groups: bool = True  # sglang-router's static list of the groups that exist

    def worker_image(self, spec: DeploymentSpec, default_image: str) -> str:
        return spec.engine.image or DEFAULT_SGLANG_IMAGE

    def router_image(self, spec: DeploymentSpec, worker_image: str) -> str:
        return spec.engine.router_image or worker_image

    def spec_errors(
        self, spec: DeploymentSpec, meta: DeploymentMeta, memory: MemoryPlan
    ) -> list[str]:
        try:
            check_sglang_spec(spec, meta, memory)
        except SpecError as exc:
            return list(exc.errors)
        return []

    def args_refused(self, main: L.Component) -> str | None:
        return _ARGS_REFUSED[main]

    def worker_pod_labels(self, spec: DeploymentSpec) -> Mapping[str, str]:
        return {L.ENGINE_LABEL: spec.engine.name}  # the chart's PodMonitor tells them apart

    def worker_container(
        self,
        meta: DeploymentMeta,
        spec: DeploymentSpec,
        memory: MemoryPlan,
        role: L.WorkerRole,
        replica: int,
        image: str,
    ) -> Obj:
        return sglang_worker_container(meta, spec, memory, role, replica, image)

    def router_container(
        self,
        meta: DeploymentMeta,
        spec: DeploymentSpec,
        image: str,
        surge: Mapping[L.WorkerRole, int],
    ) -> Obj:
        return sglang_router_container(meta, spec, image, surge)

    def observe(
        self, probe: WorkerProbe, pods: Sequence[PodState], router_ready_replicas: int
    ) -> Observed:
        # No /status documents: SGLang's /server_info on PP rank 0.
        info, unreadable = parse_server_infos(probe.server_info(pods))
        return Observed(
            pods=tuple(pods),
            router_ready_replicas=router_ready_replicas,
            server_info=info,
            unreadable=unreadable,
        )

    def pinned(self, plan: MemoryPlan, role: L.WorkerRole, pp_rank: int) -> Pinned:
        role_plan = plan.role(role)
        page = role_plan.inputs.resolved_page_size
        g = group_figures(role_plan)
        pinned = RankCapacity(
            full_tokens=g.full_tokens,
            swa_tokens=sglang_swa_tokens(g.full_tokens, g.swa_ratio, page),
            max_running_requests=g.max_running_requests,
            max_context_tokens=min(g.context_tokens, g.full_tokens),  # as SGLang serves
        )
        return Pinned(pinned, page)

    def kv_transfer_unreported(self, backend: str) -> str | None:
        # NOTE: Ready does not wait on KVTransferReady here.
        return (
            f"engine sglang: SGLang workers do not report their {backend} transfer engine; "
            "Ready follows the workers' and the router's readiness"
        )


SGLANG: Final = SglangFlavor()
