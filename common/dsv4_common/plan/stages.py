"""A PP group's ranks for any contiguous split, without building plans: what the split search
evaluates. Pure.

A rank holding target layers [start, end) (the last rank also the draft layers) gets its pool
coefficients and weight estimate in O(1), as prefix-sum differences: both are exact sums over
layers (`PoolCoefficients` are additive; `layer_bytes` is whole bytes). `key_of(split)`
computes the plan's bottleneck key with the planner's formulas (`auto_request_slots`,
`pool_pages`, `swa_fits`) on these numbers, so it equals `plan(...).bottleneck_key` for the same
split; `segment_values` are the per-rank values the prefix DP maximizes.
"""

from __future__ import annotations

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_common.core.layout import IndexSpace, KVLayout
from dsv4_common.plan.capacity import (
    PoolCoefficients,
    auto_request_slots,
    pool_pages,
    swa_fits,
    swa_need,
)
from dsv4_common.plan.inputs import AUTO_MAX_RUNNING_CAP, DEFAULT_TOKENS_PER_REQUEST, PlanInputs
from dsv4_common.plan.split import BottleneckKey, SegmentValue, Split
from dsv4_common.plan.weights import layer_bytes, rank_extra_bytes

_SPACES = (IndexSpace.FULL_PAGE, IndexSpace.SWA_PAGE, IndexSpace.REQ_SLOT)


class StageModel:
    """The group of `inputs` over the full-model layout."""

    def __init__(self, inputs: PlanInputs, full_layout: KVLayout) -> None:
        self.inputs = inputs
        self.num_layers = inputs.model.num_hidden_layers
        self.last = inputs.pp_size - 1
        self.page_size = full_layout.page_size
        self.context_len = inputs.resolved_context_len
        self.usable_bytes = int(inputs.gpu_memory_bytes * inputs.mem_fraction)
        self.need = swa_need(full_layout, inputs.role, inputs.resolved_chunk_tokens)
        n = self.num_layers
        per_layer = {space: [0] * n for space in _SPACES}
        draft = dict.fromkeys(_SPACES, 0)
        for c in full_layout.components:
            for layer in c.layer_ids:
                if layer < n:
                    per_layer[c.index_space][layer] += c.unit_bytes
                else:  # a draft layer: owned by the last rank
                    draft[c.index_space] += c.unit_bytes
        self._prefix = {s: _prefix_sums(per_layer[s]) for s in _SPACES}
        self._draft = PoolCoefficients(*(draft[s] for s in _SPACES))
        tp = inputs.tp_size
        self._layer_weights = _prefix_sums([layer_bytes(inputs.model, i, tp) for i in range(n)])
        with_draft = inputs.speculative_draft_tokens > 0
        self._extra_weights = {
            (first, last): rank_extra_bytes(
                inputs.model, first=first, last=last, with_draft=with_draft, tp_size=tp
            )
            for first in (False, True)
            for last in (False, True)
        }

    # --- one rank ----------------------------------------------------------------------------

    def coefficients(self, rank: int, start: int, end: int) -> PoolCoefficients:
        p = self._prefix
        own = PoolCoefficients(*(p[s][end] - p[s][start] for s in _SPACES))
        if rank != self.last:
            return own
        return PoolCoefficients(*(a + b for a, b in zip(own, self._draft, strict=True)))

    def weight_bytes(self, rank: int, start: int, end: int) -> int:
        """`estimate_weight_bytes` of the rank (exact: whole bytes per layer and GPU), or as
        given."""
        given = self.inputs.weight_bytes_per_rank
        if given is not None:
            return given[rank]
        layers = self._layer_weights[end] - self._layer_weights[start]
        extra = self._extra_weights[(rank == 0, rank == self.last)]
        return layers + extra

    def available_bytes(self, rank: int, start: int, end: int) -> int:
        return self.usable_bytes - self.weight_bytes(rank, start, end)

    def auto_slots(self, rank: int, start: int, end: int) -> int | None:
        """The request slots this rank alone would choose (auto); None: its weights do not fit."""
        available = self.available_bytes(rank, start, end)
        if available <= 0:
            return None
        return auto_request_slots(
            self.coefficients(rank, start, end),
            self.page_size,
            available_bytes=available,
            need=self.need,
            tokens_per_request=min(DEFAULT_TOKENS_PER_REQUEST, self.context_len),
            cap=AUTO_MAX_RUNNING_CAP[self.inputs.role],
        )

    def full_tokens(self, rank: int, start: int, end: int, max_running: int) -> int | None:
        """Full-pool tokens of this rank at `max_running`; None where the planner would fail."""
        available = self.available_bytes(rank, start, end)
        if available <= 0:
            return None
        pages = pool_pages(
            self.coefficients(rank, start, end),
            available_bytes=available,
            max_running=max_running,
            need=self.need,
            swa_ratio=self.inputs.swa_ratio,
            max_full_pages=pages_for_tokens(self.context_len, self.page_size) * max_running,
        )
        if pages is None or pages[0] < 1 or not swa_fits(pages[1], self.need):
            return None
        return pages[0] * self.page_size

    # --- a whole split -----------------------------------------------------------------------

    def max_running(self, split: Split) -> int | None:
        """The group's request count (given, or the least auto count over ranks)."""
        given = self.inputs.max_running_requests
        counts = [self.auto_slots(k, *seg) for k, seg in enumerate(_segments(split))]
        if any(c is None for c in counts):
            return None
        return given if given is not None else min(c for c in counts if c is not None)

    def key_of(self, split: Split) -> BottleneckKey | None:
        """`Plan.bottleneck_key` of this split; None where `plan` would raise."""
        running = self.max_running(split)
        if running is None:
            return None
        worst: BottleneckKey | None = None
        for k, (start, end) in enumerate(_segments(split)):
            full = self.full_tokens(k, start, end, running)
            if full is None:
                return None
            key = (min(self.context_len, full), running, full)
            worst = key if worst is None else min(worst, key)
        return worst

    def segment_values(self, request_counts: list[int]) -> list[SegmentValue]:
        """Per request count R, a rank's (max context, full tokens) at R; in auto mode a rank
        whose own auto count is below R is excluded (its group would run fewer requests)."""
        auto = self.inputs.max_running_requests is None
        return [self._value_at(r, auto) for r in dict.fromkeys(request_counts)]

    def auto_value(self) -> SegmentValue:
        """A rank's own auto request count: the DP over it finds the largest group count."""

        def value(rank: int, start: int, end: int) -> tuple[int, ...] | None:
            slots = self.auto_slots(rank, start, end)
            return None if slots is None else (slots,)

        return value

    def _value_at(self, running: int, auto: bool) -> SegmentValue:
        def value(rank: int, start: int, end: int) -> tuple[int, ...] | None:
            if auto:
                slots = self.auto_slots(rank, start, end)
                if slots is None or slots < running:
                    return None
            full = self.full_tokens(rank, start, end, running)
            return None if full is None else (min(self.context_len, full), full)

        return value


def _prefix_sums(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _segments(split: Split) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in split:
        out.append((start, start + n))
        start += n
    return out
