"""SGLang's command lines for engine `sglang`, computed from the spec and the memory plan: the
server's argv per role and PP group, its environment, and sglang-router's argv in PD mode. Pure.

One StatefulSet per PP group shares one pod template across its ranks, so the argv is the same
on every rank: the rank itself is `$(DSV4_PP_RANK)`, which Kubernetes expands from the pod's
environment (the pod-index label). A PP group runs with its smallest figures on every rank, as
our own worker does: every rank of a group holds every request, and SGLang takes the least
token capacity over the ranks anyway (an all-reduce MIN of the pool size).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Final

from dsv4_common.api.deployment import MemoryPlan
from dsv4_common.api.spec import DeploymentMeta, DeploymentSpec
from dsv4_common.plan.planner import Plan
from dsv4_operator import labels as L
from dsv4_operator.flavors.sglang.flags import ROUTER_ENTRY, SERVER_ENTRY
from dsv4_operator.workerconfig import HTTP_PORT, STATUS_PORT, WORKER_PORTS
from dsv4_operator.workloads import STARTUP_FAILURES, STARTUP_PERIOD_S

# The entry points whose parsers the flag snapshots hold.
SERVER_COMMAND: Final = SERVER_ENTRY
ROUTER_COMMAND: Final = ROUTER_ENTRY
# The PP rank of a pod (set from its pod-index label, see workloads.worker_pod_template).
PP_RANK_ENV: Final = "DSV4_PP_RANK"
# SGLang 0.5.23 takes the PP layer split from this variable (sglang.srt.distributed.utils.
# get_pp_indices: comma-separated layers per rank); without it, the last ranks get the extras.
LAYER_PARTITION_ENV: Final = "SGLANG_PP_LAYER_PARTITION"
WORKER_STARTUP_TIMEOUT_S: Final = STARTUP_PERIOD_S * STARTUP_FAILURES
BIND_ALL: Final = "0.0.0.0"

# Every flag the operator sets on the server, with the spec field (or fact) it comes from.
# engineArgs may not set them (engine_args.py), whether or not this role's argv has them.
SERVER_FLAGS: Final = {
    "--model-path": "spec.model.weights.path",
    "--host": "the pod's address",
    "--port": "the worker's http port",
    "--tp-size": "spec.<role>.tensorParallel",
    "--pp-size": "spec.<role>.pipelineParallel",
    "--nnodes": "spec.<role>.pipelineParallel",
    "--node-rank": "the pod's PP rank",
    "--dist-init-addr": "the group's headless Service",
    "--disaggregation-mode": "the role",
    "--disaggregation-transfer-backend": "spec.kv.transfer",
    "--disaggregation-bootstrap-port": "the worker's kv port",
    "--page-size": "spec.kv.pageSize",
    "--chunked-prefill-size": "spec.<role>.chunkedPrefillTokens",
    "--max-running-requests": "the memory plan (spec.<role>.maxRunningRequests)",
    "--context-length": "spec.maxContextTokens",
    "--max-total-tokens": "the memory plan",
    "--swa-full-tokens-ratio": "the memory plan (spec.kv.swaRatio)",
    "--mem-fraction-static": "spec.memFraction",
    "--enable-metrics": "always on",
}
# Set from spec.model.servedModelNames (one name: SGLang takes one) when the spec gives names;
# without them engineArgs may set it.
SERVED_NAME_FLAG: Final = "--served-model-name"
SERVED_NAME_SOURCE: Final = "spec.model.servedModelNames"
# DeepSeek-V4's chat replies: SGLang's DSML tool-call parser and its think-tag reasoning parser
# (names from the 0.5.23 flag snapshot), so its OpenAI API splits tool calls and
# reasoning_content as ours does. engineArgs that set either flag win.
PARSER_FLAGS: Final = (("--tool-call-parser", "deepseekv4"), ("--reasoning-parser", "deepseek-v4"))

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """What the planner decided for one role, as every rank of its PP groups runs it."""

    page_size: int
    chunked_prefill_tokens: int
    max_running_requests: int
    context_tokens: int
    full_tokens: int  # the least full pool over the ranks (SGLang's max_total_tokens)
    swa_tokens: int  # the least SWA pool over the ranks
    mem_fraction: float
    layer_split: tuple[int, ...]  # target layers per PP rank

    @property
    def swa_ratio(self) -> str:
        return swa_ratio_text(self.full_tokens, self.swa_tokens, self.page_size)


def group_figures(plan: Plan) -> GroupFigures:
    inputs = plan.inputs
    full = min(r.capacity.full_tokens for r in plan.ranks)
    return GroupFigures(
        page_size=inputs.resolved_page_size,
        chunked_prefill_tokens=inputs.resolved_chunk_tokens,
        max_running_requests=plan.max_running_requests,
        context_tokens=inputs.resolved_context_len,
        full_tokens=full,
        # SGLang takes a ratio of at most 1; a context of a few pages can plan more SWA than full.
        swa_tokens=min(min(r.capacity.swa_tokens for r in plan.ranks), full),
        mem_fraction=inputs.mem_fraction,
        layer_split=tuple(r.layers[1] - r.layers[0] for r in plan.ranks),
    )


def sglang_swa_tokens(full_tokens: int, ratio: str, page_size: int) -> int:
    """SGLang's SWA pool for an explicit --swa-full-tokens-ratio (DSV4PoolConfigurator's ratio
    mode: `int(full × ratio) // page × page`, in float arithmetic)."""
    return int(full_tokens * float(ratio)) // page_size * page_size


def swa_ratio_text(full_tokens: int, swa_tokens: int, page_size: int) -> str:
    """The shortest decimal ratio in (0, 1] for which SGLang sizes exactly `swa_tokens` (page
    aligned, <= full_tokens) from `full_tokens`."""
    assert 0 < swa_tokens <= full_tokens and swa_tokens % page_size == 0, (swa_tokens, page_size)
    for digits in range(1, 19):
        scale = 10**digits
        least = -(-swa_tokens * scale // full_tokens)  # ceil: full × ratio >= swa exactly
        for numerator in (least, least + 1):
            text = _decimal(numerator, digits)
            if 0 < float(text) <= 1 and sglang_swa_tokens(full_tokens, text, page_size) == (
                swa_tokens
            ):
                return text
    raise AssertionError(f"no ratio gives {swa_tokens} SWA tokens from {full_tokens}")


def _decimal(numerator: int, digits: int) -> str:
    text = format(Decimal(numerator).scaleb(-digits), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def layer_partition(split: Sequence[int]) -> str:
    """SGLANG_PP_LAYER_PARTITION's value: layers per PP rank, comma-separated."""
    return ",".join(str(n) for n in split)


def rank0_host(meta: DeploymentMeta, role: L.WorkerRole, replica: int) -> str:
    """PP rank 0 of a group, through the group's headless Service (published before ready)."""
    group = L.group_name(meta.name, role, replica)
    return f"{group}-0.{group}.{meta.namespace}.svc"


def server_args(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    memory: MemoryPlan,
    role: L.WorkerRole,
    replica: int,
) -> tuple[str, ...]:
    """The argv after SERVER_COMMAND for every PP rank of one group: the operator's flags (see
    SERVER_FLAGS, SERVED_NAME_FLAG and PARSER_FLAGS), then the role's engineArgs as written
    (engine_args.py checks them)."""
    role_spec = spec.role(role)
    figures = group_figures(memory.role(role))
    weights = spec.model.weights
    assert weights is not None, "engine sglang: model.weights, or a resolved model.source"
    pp = role_spec.pipeline_parallel
    args = [
        "--model-path", weights.model_dir,
        "--host", BIND_ALL,
        "--port", str(HTTP_PORT),
        "--tp-size", str(role_spec.tensor_parallel),
        "--pp-size", str(pp),
    ]  # fmt: skip
    if pp > 1:  # one node per PP rank; rank 0 hosts torch.distributed's store
        args += [
            "--nnodes", str(pp),
            "--node-rank", f"$({PP_RANK_ENV})",
            "--dist-init-addr", f"{rank0_host(meta, role, replica)}:{WORKER_PORTS['pp']}",
        ]  # fmt: skip
    args += [
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", spec.kv.transfer,
        "--disaggregation-bootstrap-port", str(WORKER_PORTS["kv"]),
        "--page-size", str(figures.page_size),
        "--chunked-prefill-size", str(figures.chunked_prefill_tokens),
        "--max-running-requests", str(figures.max_running_requests),
        "--context-length", str(figures.context_tokens),
        "--max-total-tokens", str(figures.full_tokens),
        "--swa-full-tokens-ratio", figures.swa_ratio,
        "--mem-fraction-static", repr(figures.mem_fraction),
        "--enable-metrics",
    ]  # fmt: skip
    if spec.model.served_model_names:
        (name,) = spec.model.served_model_names  # one with engine sglang (spec.py)
        args += [SERVED_NAME_FLAG, name]
    for flag, value in PARSER_FLAGS:
        if not any(a == flag or a.startswith(f"{flag}=") for a in role_spec.engine_args):
            args += [flag, value]
    return (*args, *role_spec.engine_args)


def server_env(memory: MemoryPlan, role: L.WorkerRole) -> dict[str, str]:
    """Literal environment of the server, beyond the pod's own (caches under the writable /tmp,
    the weights are local, and the PP layer split)."""
    env = {
        "HOME": "/tmp",
        "XDG_CACHE_HOME": "/tmp/.cache",
        "HF_HOME": "/tmp/hf",
        "HF_HUB_OFFLINE": "1",
        "TRITON_CACHE_DIR": "/tmp/triton",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor",
    }
    figures = group_figures(memory.role(role))
    if len(figures.layer_split) > 1:
        env[LAYER_PARTITION_ENV] = layer_partition(figures.layer_split)
    return env


def worker_url(meta: DeploymentMeta, role: L.WorkerRole, replica: int) -> str:
    return f"http://{rank0_host(meta, role, replica)}:{HTTP_PORT}"


def router_args(
    spec: DeploymentSpec,
    meta: DeploymentMeta,
    surge: Mapping[L.WorkerRole, int] | None = None,
) -> tuple[str, ...]:
    """The argv after ROUTER_COMMAND: sglang-router in PD mode over a static list of the groups
    that exist, each by its PP rank 0's DNS name (the prefill URL's host is also where decode
    finds the bootstrap server, so it must name one pod): the role's replicas plus the first
    `surge[role]` surge groups of a rollout. Its metrics go on the status port."""
    surge = surge or {}
    args = [
        "--host", BIND_ALL,
        "--port", str(spec.router.port),
        "--pd-disaggregation",
    ]  # fmt: skip
    for role in L.WORKER_ROLES:
        for replica in range(spec.role(role).replicas + surge.get(role, 0)):
            url = worker_url(meta, role, replica)
            args += (
                ["--prefill", url, str(WORKER_PORTS["kv"])]
                if role == "prefill"
                else [
                    "--decode",
                    url,
                ]
            )
    args += [
        # A worker registers once healthy; loading big weights takes as long as our workers'
        # startup probe allows.
        "--worker-startup-timeout-secs", str(WORKER_STARTUP_TIMEOUT_S),
        "--prometheus-host", BIND_ALL,
        "--prometheus-port", str(STATUS_PORT),
    ]  # fmt: skip
    return tuple(args)


def expand(args: Sequence[str], env: Mapping[str, str]) -> tuple[str, ...]:
    """`args` as the kubelet runs them: `$(VAR)` replaced by VAR's value when the container
    defines it (kept as written otherwise), `$$` by `$`."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return tuple(_VAR.sub(one, a) for a in args)
