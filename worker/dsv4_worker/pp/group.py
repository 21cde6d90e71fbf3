"""Build one stage of a PP group (a single stage is a group of one): the planner's layer
slice, that slice's weights and pools, the PP link; then its engine for a role
(`stage_engine`: the step source of its rank, the group's capacity).

The split is fixed before any weight is loaded (the rank config's, or the planner's choice
for the quick form); every stage then measures the weights it holds, the group exchanges the
figures, and every stage solves the same realized plan: so each stage's pools are exactly its
rank of a plan all stages agree on, and the leader schedules by the group's smallest pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from dsv4_common.core.model import DSV4Config
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import Plan, RankPlan, plan, split_layers
from dsv4_worker.engine.events import NO_EVENTS, EngineEvents
from dsv4_worker.engine.grammar import GrammarCompiler
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel, Stage
from dsv4_worker.engine.role import EngineConfig, Place, Role
from dsv4_worker.engine.steps import Planner, StepSource
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.device import host_shortcuts
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.moe import hold_stacked
from dsv4_worker.model.params import Params
from dsv4_worker.model.stored import Stored
from dsv4_worker.model.weights import stage_param_names
from dsv4_worker.pp.link import PipeLink
from dsv4_worker.pp.spec import PPSpec
from dsv4_worker.pp.stage import Follower, Leader
from dsv4_worker.sched.budget import PoolRoom
from dsv4_worker.sched.scheduler import SchedulerConfig

# names -> the stage's weights as held (a subset of the checkpoint, or seeded random weights)
LoadWeights = Callable[[set[str]], Mapping[str, Stored]]


@dataclass(frozen=True, slots=True)
class BuiltStage:
    paged: PagedModel  # this stage's layers over its pools
    memory: KVMemory
    group: Plan  # the realized plan every stage of the group agrees on
    rank: RankPlan
    link: PipeLink | None  # None: a single stage
    scheduler: SchedulerConfig  # the group's (every stage schedules alike)

    @property
    def place(self) -> Place:
        return Place.SINGLE if self.link is None else Place.of(self.link.rank, self.link.size)


def stage_engine(
    stage: BuiltStage,
    role: Role,
    events: EngineEvents = NO_EVENTS,
    grammar: GrammarCompiler | None = None,
) -> Engine:
    """The engine of `stage` for `role`: its step source by its place in the group (a PP
    stage schedules by the group's smallest pools); `events` given once, here."""
    source: StepSource
    link = stage.link
    if link is None:
        source, schedulable = Planner(), None
    else:
        source = Leader(link) if link.first else Follower(link)
        schedulable = group_capacity(stage.group)
    config = EngineConfig(stage.scheduler, role, source.place, schedulable)
    return Engine(stage.paged, config, events=events, source=source, grammar=grammar)


def realized_plan(
    inputs: PlanInputs,
    weight_bytes_per_rank: tuple[int, ...],
    device_memory_bytes: int | None = None,
) -> Plan:
    """The planner over what the group measured: the weights each stage loaded (and the
    device's memory when it has one), every other input as planned. Pure."""
    measured = dataclasses.replace(inputs, weight_bytes_per_rank=weight_bytes_per_rank)
    if device_memory_bytes is not None:
        measured = dataclasses.replace(measured, gpu_memory_bytes=device_memory_bytes)
    return plan(measured)


def fixed_split(inputs: PlanInputs) -> PlanInputs:
    """`inputs` with the planner's layer split made explicit (what every stage loads)."""
    if inputs.layer_split is not None:
        return inputs
    return dataclasses.replace(inputs, layer_split=plan(inputs).split.layers_per_rank)


def group_capacity(group: Plan) -> PoolRoom:
    """What the leader may schedule: the smallest stage's pools."""
    return PoolRoom(
        min(r.pools.full_pages for r in group.ranks),
        min(r.pools.swa_pages for r in group.ranks),
        min(r.pools.request_slots for r in group.ranks),
    )


def scheduler_config(group: Plan) -> SchedulerConfig:
    configs = [AllocatorConfig.from_rank_plan(r) for r in group.ranks]
    first = configs[0]
    return SchedulerConfig(
        page_size=first.page_size,
        chunk_tokens=group.inputs.resolved_chunk_tokens,
        max_tokens_per_request=min(c.max_tokens_per_request for c in configs),
        retained_tokens=first.retained_tokens,
    )


def build_stage(
    inputs: PlanInputs,
    load_weights: LoadWeights,
    device: torch.device,
    pp: PPSpec | None = None,
    *,
    device_memory_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> BuiltStage:
    """The stage computes in `dtype` (None: its weights' float dtype when they share one).
    Its weights are the names the plan counts for it (the MTP layers only when speculating),
    and the bytes they hold are what the realized plan subtracts. Raises PlanError (bad
    inputs), StageLost (the group did not meet) or what `load_weights` raises."""
    pp = pp or PPSpec(0, 1, "", 0)
    if inputs.pp_size != pp.size:
        raise ValueError(f"plan inputs pp_size={inputs.pp_size}, this group has {pp.size}")
    inputs = fixed_split(inputs)
    model = inputs.model
    layers = split_layers(model.num_hidden_layers, pp.size, inputs.layer_split)[pp.rank]
    stage = Stage(layers, first=pp.rank == 0, last=pp.rank == pp.size - 1)
    draft = inputs.speculative_draft_tokens > 0
    names = stage_param_names(model, stage.layers, first=stage.first, last=stage.last, draft=draft)
    params = Params.of(load_weights(names), dtype)
    if isinstance(model, DSV4Config) and not host_shortcuts(device):
        hold_stacked(model, params)  # before the KV pools: see hold_stacked
    weight_bytes = params.nbytes
    link = None
    if pp.size > 1:
        link = PipeLink(
            pp.rank,
            pp.size,
            pp.host,
            pp.port,
            device=device,
            start_timeout_s=pp.start_timeout_s,
            timeout_s=pp.timeout_s,
            listen_host=pp.listen_host,
        )
        per_rank = tuple(int(b) for b in link.all_gather(weight_bytes))
    else:
        per_rank = (weight_bytes,)
    group = realized_plan(inputs, per_rank, device_memory_bytes)
    rank = group.ranks[pp.rank]
    memory = KVMemory.from_rank_plan(rank, device)
    paged = PagedModel(model, params, memory, stage)
    return BuiltStage(paged, memory, group, rank, link, scheduler_config(group))
