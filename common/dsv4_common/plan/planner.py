"""The planner: model + role + parallelism + memory -> a per-PP-rank plan. Pure Python.

One planner, three consumers (operator, worker, local runner). Steps:
  1. split target layers over PP ranks (the last rank also owns the draft layer when speculating):
     the given `layer_split`, else the capacity-balanced split (`split.balanced_split`: the
     contiguous split whose bottleneck, as ordered below, is best)
  2. slice the one KV layout per rank (`KVLayout.select`) and estimate each rank's weights
  3. choose max running requests (given, or auto per rank; the group uses the minimum)
  4. solve every rank's pools with that common request count; the bottleneck rank is the one
     with the smallest max context (then the fewest requests, then the fewest full tokens)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dsv4_common.core.capacity import RankCapacity
from dsv4_common.core.index_space import pages_for_tokens
from dsv4_common.core.layout import KVLayout, LayoutError, build_layout
from dsv4_common.core.units import format_bytes
from dsv4_common.plan.capacity import (
    PoolSizes,
    SwaNeed,
    auto_max_running,
    solve_rank,
    swa_need,
)
from dsv4_common.plan.inputs import (
    AUTO_MAX_RUNNING_CAP,
    DEFAULT_TOKENS_PER_REQUEST,
    PlanError,
    PlanInputs,
    Role,
)
from dsv4_common.plan.split import (
    MAX_DP_LAYERS,
    BottleneckKey,
    SplitChoice,
    balanced_split,
    even_split,
    max_min_split,
    sglang_split,
)
from dsv4_common.plan.stages import StageModel
from dsv4_common.plan.weights import estimate_weight_bytes

_LAYOUT_INPUTS = frozenset({"page_size", "speculative_draft_tokens", "request_state"})


@dataclass(frozen=True, slots=True)
class RankPlan:
    pp_rank: int
    layers: tuple[int, int]  # target layers [start, end)
    layout: KVLayout  # this rank's slice (target layers + draft layers it owns)
    weight_bytes: int
    available_bytes: int  # for KV after weights and the memory fraction
    pools: PoolSizes
    swa_need: SwaNeed
    context_len: int

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity(self) -> RankCapacity:
        """The tokens and requests its pools hold. The longest context is bounded by the full
        pool and the model context only, never by the SWA pool."""
        full_tokens = self.pools.full_pages * self.page_size
        return RankCapacity(
            full_tokens=full_tokens,
            swa_tokens=self.pools.swa_pages * self.page_size,
            max_running_requests=self.pools.request_slots,
            max_context_tokens=min(self.context_len, full_tokens),
        )

    @property
    def swa_ratio(self) -> float:
        return self.pools.swa_pages / self.pools.full_pages

    def component_units(self) -> dict[str, int]:
        """Units (pages or request slots) per layer of every component, reserved unit 0 included."""
        units = self.pools.units
        return {c.name: units[c.index_space] for c in self.layout.components}


class _Stage(NamedTuple):
    """One PP rank after steps 1-2: its layers, KV layout and what is left for KV."""

    rank: int
    layers: range
    layout: KVLayout
    weight_bytes: int
    available_bytes: int
    need: SwaNeed


@dataclass(frozen=True, slots=True)
class Plan:
    inputs: PlanInputs
    ranks: tuple[RankPlan, ...]
    split: SplitChoice

    @property
    def role(self) -> Role:
        return self.inputs.role

    @property
    def bottleneck_key(self) -> BottleneckKey:
        """(max context, max running requests, full tokens) of the worst rank: the order in
        which plans of one group compare (larger is better)."""
        return min(_rank_key(r) for r in self.ranks)

    @property
    def bottleneck_rank(self) -> int:
        return min(self.ranks, key=_rank_key).pp_rank

    @property
    def max_context_tokens(self) -> int:
        return min(r.capacity.max_context_tokens for r in self.ranks)

    @property
    def max_running_requests(self) -> int:
        return min(r.capacity.max_running_requests for r in self.ranks)


def _rank_key(r: RankPlan) -> BottleneckKey:
    c = r.capacity
    return (c.max_context_tokens, c.max_running_requests, c.full_tokens)


def split_layers(num_layers: int, pp_size: int, split: tuple[int, ...] | None) -> list[range]:
    """Contiguous target-layer ranges per PP rank (None: the even split, the first
    `num_layers % pp` ranks get one more); raises PlanError naming a bad `layer_split`."""
    if pp_size > num_layers:
        raise PlanError(
            f"pp_size={pp_size} exceeds the model's {num_layers} target layers", "pp_size"
        )
    if split is None:
        split = even_split(num_layers, pp_size)
    if len(split) != pp_size:
        raise PlanError(
            f"layer_split has {len(split)} entries but pp_size={pp_size}", "layer_split"
        )
    if any(n < 1 for n in split):
        raise PlanError(
            f"layer_split={list(split)}: every PP rank needs at least one layer", "layer_split"
        )
    if sum(split) != num_layers:
        raise PlanError(
            f"layer_split={list(split)} sums to {sum(split)}, the model has {num_layers} layers",
            "layer_split",
        )
    ranges, start = [], 0
    for n in split:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def choose_split(inputs: PlanInputs, full_layout: KVLayout) -> SplitChoice:
    """Step 1: the given split, else the balanced one. When no split can be planned this
    returns the even split, so `plan` reports the even split's error."""
    n, pp = inputs.model.num_hidden_layers, inputs.pp_size
    split_layers(n, pp, inputs.layer_split)  # validates pp_size and a given split
    model = StageModel(inputs, full_layout)
    even = even_split(n, pp)
    even_key = model.key_of(even)
    if inputs.layer_split is not None:
        return SplitChoice(inputs.layer_split, "fixed", even, even_key)
    if pp == 1:
        return SplitChoice(even, "balanced", even, even_key)
    if inputs.max_running_requests is not None:
        counts = [inputs.max_running_requests]
    else:  # the largest count any split allows, and the counts of the two default splits
        counts = [c for s in (even, sglang_split(n, pp)) if (c := model.max_running(s))]
        most = max_min_split(n, pp, model.auto_value()) if n <= MAX_DP_LAYERS else None
        if most is not None and (c := model.max_running(most)) is not None:
            counts.insert(0, c)
    found = balanced_split(n, pp, model.key_of, model.segment_values(counts))
    return SplitChoice(found[0] if found else even, "balanced", even, even_key)


def plan(inputs: PlanInputs) -> Plan:
    model = inputs.model
    page = inputs.resolved_page_size
    draft = inputs.speculative_draft_tokens
    try:
        full_layout = build_layout(model, page, draft, inputs.tp_size, inputs.request_state)
    except LayoutError as exc:
        setting = str(exc).split("=", 1)[0]  # layout errors open with the setting at fault
        raise PlanError(str(exc), setting if setting in _LAYOUT_INPUTS else None) from exc
    if inputs.weight_bytes_per_rank is not None and len(inputs.weight_bytes_per_rank) != (
        inputs.pp_size
    ):
        raise PlanError(
            f"weight_bytes_per_rank has {len(inputs.weight_bytes_per_rank)} entries, "
            f"pp_size={inputs.pp_size}"
        )
    choice = choose_split(inputs, full_layout)
    ranges = split_layers(model.num_hidden_layers, inputs.pp_size, choice.layers_per_rank)
    context_len = inputs.resolved_context_len
    usable = int(inputs.gpu_memory_bytes * inputs.mem_fraction)
    last = len(ranges) - 1

    # Steps 1-2: per-rank layouts, weights, what is left for KV.
    staged: list[_Stage] = []
    for rank, layers in enumerate(ranges):
        owned = list(layers) + (list(full_layout.draft_layer_ids) if rank == last else [])
        layout = full_layout.select(owned)
        if inputs.weight_bytes_per_rank is not None:
            weights = inputs.weight_bytes_per_rank[rank]
        else:
            weights = estimate_weight_bytes(
                model,
                layers,
                first=rank == 0,
                last=rank == last,
                with_draft=draft > 0,
                tp_size=inputs.tp_size,
            )
        available = usable - weights
        if available <= 0:
            raise PlanError(
                f"PP rank {rank}: weights need {format_bytes(weights)} per GPU but only "
                f"{format_bytes(usable)} is usable (gpu memory x mem_fraction "
                f"{inputs.mem_fraction}); raise tp_size or pp_size"
            )
        need = swa_need(layout, inputs.role, inputs.resolved_chunk_tokens)
        staged.append(_Stage(rank, layers, layout, weights, available, need))

    # Step 3: one request count for the whole PP group (every rank holds every request).
    if inputs.max_running_requests is not None:
        max_running = inputs.max_running_requests
    else:
        tokens = min(DEFAULT_TOKENS_PER_REQUEST, context_len)
        max_running = min(
            auto_max_running(
                stage.layout,
                available_bytes=stage.available_bytes,
                need=stage.need,
                tokens_per_request=tokens,
                cap=AUTO_MAX_RUNNING_CAP[inputs.role],
            )
            for stage in staged
        )

    # Step 4: solve every rank with the common request count.
    max_full_pages = pages_for_tokens(context_len, page) * max_running
    ranks = tuple(
        RankPlan(
            pp_rank=stage.rank,
            layers=(stage.layers.start, stage.layers.stop),
            layout=stage.layout,
            weight_bytes=stage.weight_bytes,
            available_bytes=stage.available_bytes,
            pools=solve_rank(
                stage.layout,
                pp_rank=stage.rank,
                available_bytes=stage.available_bytes,
                max_running=max_running,
                need=stage.need,
                swa_ratio=inputs.swa_ratio,
                max_full_pages=max_full_pages,
            ),
            swa_need=stage.need,
            context_len=context_len,
        )
        for stage in staged
    )
    return Plan(inputs=inputs, ranks=ranks, split=choice)
