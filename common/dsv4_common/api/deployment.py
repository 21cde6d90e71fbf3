"""The memory plan of a deployment: the planner's per-PP-rank plan for each role, and whether
`spec.maxContextTokens` fits.

Pure: the same planner the workers use (`dsv4_common.plan`), no Kubernetes. Used by the
operator, `dsv4 render` and `dsv4 up` alike. Errors name the
spec field to change.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Final

from dsv4_common.api.model_source import LocalSource
from dsv4_common.api.names import WORKER_ROLES, WorkerRole
from dsv4_common.api.spec import DeploymentSpec
from dsv4_common.core.hf import config_model_name, parse_hf_config
from dsv4_common.core.model import ModelConfig, ModelConfigError
from dsv4_common.core.presets import load_model_config
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import DEFAULT_MEM_FRACTION, PlanError, PlanInputs
from dsv4_common.plan.planner import Plan, plan

# CPU mode (no gpu.type, gpu.memoryGiB 0, a CPU preset): each worker pod plans its pools as if
# it had a device of this size. Worker pods get a memory limit above it (see manifests).
CPU_MODE_MEMORY_BYTES: Final = 1 * GIB
CONFIG_MAP_REF_FIELD: Final = "spec.model.configMapRef"
SOURCE_FIELD: Final = "spec.model.source"


class MemoryPlanError(ValueError):
    """The spec is well-formed but cannot be planned; the message names the field to change."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    requested_context_tokens: int
    model_context_tokens: int  # the model's max_position_embeddings
    prefill: Plan
    decode: Plan

    def role(self, role: WorkerRole) -> Plan:
        return self.prefill if role == "prefill" else self.decode

    @property
    def max_context_tokens(self) -> int:
        """The largest context every role holds (the pool of its bottleneck rank)."""
        return min(self.prefill.max_context_tokens, self.decode.max_context_tokens)

    @property
    def bottleneck(self) -> tuple[WorkerRole, int]:
        """(role, PP rank) that limits the context."""
        role = min(WORKER_ROLES, key=lambda r: self.role(r).max_context_tokens)
        return role, self.role(role).bottleneck_rank

    @property
    def context_fits(self) -> bool:
        return self.max_context_tokens >= self.requested_context_tokens

    def context_message(self) -> str:
        role, rank = self.bottleneck
        largest = self.max_context_tokens
        if self.context_fits:
            return (
                f"maxContextTokens {self.requested_context_tokens} fits every role "
                f"(bottleneck: {role} PP rank {rank})"
            )
        if self.requested_context_tokens > self.model_context_tokens:
            why = f"the model's context is {self.model_context_tokens} tokens"
            fix = f"lower maxContextTokens to at most {largest}"
        else:
            why = f"{role} PP rank {rank} holds at most {largest} full-KV tokens"
            fix = (
                f"lower maxContextTokens to at most {largest}, or add memory per rank: more "
                f"{role}.pipelineParallel, a larger GPU (gpu.type or gpu.memoryGiB) or memFraction"
            )
        return (
            f"maxContextTokens {self.requested_context_tokens} does not fit: {why}; the largest "
            f"context that fits is {largest} tokens ({fix})"
        )


def device_memory_bytes(spec: DeploymentSpec) -> int:
    memory = spec.gpu.memory_bytes
    return CPU_MODE_MEMORY_BYTES if memory is None else memory


def plan_inputs(spec: DeploymentSpec, role: WorkerRole, model: ModelConfig) -> PlanInputs:
    """What the planner (operator side and worker side) is given for one role."""
    role_spec = spec.role(role)
    return PlanInputs(
        model=model,
        role=role,
        gpu_memory_bytes=device_memory_bytes(spec),
        pp_size=role_spec.pipeline_parallel,
        layer_split=role_spec.layer_split,  # None: the planner balances the split
        tp_size=role_spec.tensor_parallel,
        page_size=spec.kv.page_size,
        chunked_prefill_tokens=role_spec.chunked_prefill_tokens,
        max_running_requests=role_spec.max_running_requests,
        swa_ratio=spec.kv.swa_ratio,
        mem_fraction=spec.mem_fraction if spec.mem_fraction is not None else DEFAULT_MEM_FRACTION,
        speculative_draft_tokens=spec.speculative_draft_tokens,
        # Never plan past the model's own context: the cap keeps "largest fit" honest.
        context_len=min(spec.max_context_tokens, model.max_position_embeddings),
    )


def load_model(spec: DeploymentSpec) -> ModelConfig:
    """The model of a preset or a configPath (read here); a configMapRef has no local source."""
    if (ref := spec.model.config_map) is not None:
        raise MemoryPlanError(
            f"{CONFIG_MAP_REF_FIELD}: ConfigMap {ref.name!r} is read from the cluster, by the "
            "operator; without a cluster (dsv4 render, dsv4 up) give its config.json as a file: "
            "dsv4 render --model-config FILE, or model.configPath for a local run"
        )
    if spec.model.config_from_origin:
        return _model_from_origin(spec)
    field = "spec.model.preset" if spec.model.preset is not None else "spec.model.configPath"
    try:
        return load_model_config(spec.model.source)
    except ModelConfigError as exc:
        hint = ""
        if spec.model.preset is None:
            hint = (
                " (configPath is read where the plan is made: mount the model's config.json "
                "into the operator pod; without a cluster give the file: dsv4 render "
                "--model-config FILE)"
            )
        raise MemoryPlanError(f"{field}: {exc}{hint}") from exc


def _model_from_origin(spec: DeploymentSpec) -> ModelConfig:
    """The config.json that comes with an hf:// or local model.source."""
    origin = spec.model.origin
    if isinstance(origin, LocalSource):
        try:
            return load_model_config(origin.path)
        except ModelConfigError as exc:
            raise MemoryPlanError(f"{SOURCE_FIELD}: {exc}") from exc
    uri = origin.uri if origin is not None else "?"
    raise MemoryPlanError(
        f"{SOURCE_FIELD}: {uri}: its config.json is fetched from the hub first (the operator, "
        "dsv4 up and dsv4 render --model-config FILE plan from it)"
    )


def model_from_config_text(spec: DeploymentSpec, text: str, name: str) -> ModelConfig:
    """The model of an hf:// source from its config.json text (`name`: what the model is called,
    its repo's name)."""
    try:
        return parse_hf_config(text, name=name, where=f"{SOURCE_FIELD} config.json")
    except ModelConfigError as exc:
        raise MemoryPlanError(f"{SOURCE_FIELD}: {exc}") from exc


def model_from_config_map(spec: DeploymentSpec, text: str) -> ModelConfig:
    """The model of `spec.model.configMapRef` from the text its ConfigMap holds at its key."""
    ref = spec.model.config_map
    assert ref is not None, "the spec names no configMapRef"
    try:
        return parse_hf_config(text, name=ref.name, where=f"ConfigMap {ref.name!r} key {ref.key!r}")
    except ModelConfigError as exc:
        raise MemoryPlanError(f"{CONFIG_MAP_REF_FIELD}: {exc}") from exc


def model_from_config_path_text(spec: DeploymentSpec, text: str, where: str) -> ModelConfig:
    """The model of `spec.model.configPath` from that file's text, read elsewhere (`dsv4 render
    --model-config FILE`: the path is the cluster's); named as if read at that path."""
    path = spec.model.config_path
    assert path is not None, "the spec names no configPath"
    file = PurePosixPath(posixpath.normpath(path))
    if file.suffix != ".json":  # a model directory (as `load_model_config` reads one)
        file = file / "config.json"
    try:
        return parse_hf_config(text, name=config_model_name(file), where=where)
    except ModelConfigError as exc:
        raise MemoryPlanError(f"spec.model.configPath: {exc}") from exc


# PlanInputs fields -> the spec field that sets them ({role} filled in).
_SPEC_FIELDS: Final[dict[str, str]] = {
    "tp_size": "spec.{role}.tensorParallel",
    "pp_size": "spec.{role}.pipelineParallel",
    "layer_split": "spec.{role}.layerSplit",
    "max_running_requests": "spec.{role}.maxRunningRequests",
    "chunked_prefill_tokens": "spec.{role}.chunkedPrefillTokens",
    "page_size": "spec.kv.pageSize",
    "swa_ratio": "spec.kv.swaRatio",
    "mem_fraction": "spec.memFraction",
    "speculative_draft_tokens": "spec.speculativeDraftTokens",
    "context_len": "spec.maxContextTokens",
    "gpu_memory_bytes": "spec.gpu",
}


def spec_field(role: WorkerRole, input_name: str | None) -> str:
    """The spec field behind a planner input (`spec.<role>` when there is no single one)."""
    return _SPEC_FIELDS.get(input_name or "", "spec.{role}").format(role=role)


def plan_memory(spec: DeploymentSpec, model: ModelConfig | None = None) -> MemoryPlan:
    """Plan both roles, for `model` when given (a configMapRef's, read by the caller), else the
    spec's preset or configPath. Raises MemoryPlanError when a role cannot be planned at all."""
    model = model if model is not None else load_model(spec)
    plans: dict[WorkerRole, Plan] = {}
    for role in WORKER_ROLES:
        try:
            plans[role] = plan(plan_inputs(spec, role, model))
        except PlanError as exc:
            raise MemoryPlanError(f"{spec_field(role, exc.input_name)}: {exc}") from exc
    return MemoryPlan(
        requested_context_tokens=spec.max_context_tokens,
        model_context_tokens=model.max_position_embeddings,
        prefill=plans["prefill"],
        decode=plans["decode"],
    )
