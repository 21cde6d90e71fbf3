"""The layer split: even and SGLang splits, the DP and hill climb of the search, and the
balanced plan's guarantees (never worse than the even or SGLang split, strictly better where
the even split is unbalanced, locally optimal, a fixed split honoured exactly)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4_common.core.gpus import GPU_TYPES
from dsv4_common.core.layout import KVLayout, build_layout
from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import deepseek_v4_flash, deepseek_v4_pro, tiny
from dsv4_common.core.units import GIB
from dsv4_common.plan import stages
from dsv4_common.plan.inputs import PlanError, PlanInputs, Role
from dsv4_common.plan.planner import Plan, plan
from dsv4_common.plan.split import (
    MAX_DP_LAYERS,
    BottleneckKey,
    Split,
    boundary_moves,
    climb,
    even_split,
    max_min_split,
    sglang_split,
)
from dsv4_common.plan.stages import StageModel

PRESETS: dict[str, DSV4Config] = {"pro": deepseek_v4_pro(), "flash": deepseek_v4_flash()}


def compositions(n: int, parts: int) -> Iterator[Split]:
    """Every split of n layers over `parts` ranks, each >= 1 (brute force, small cases only)."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def key_or_none(inputs: PlanInputs, split: Split) -> BottleneckKey | None:
    """The bottleneck of `plan` with this split fixed; None when it cannot be planned."""
    try:
        return plan(dataclasses.replace(inputs, layer_split=split)).bottleneck_key
    except PlanError:
        return None


def layout_of(inputs: PlanInputs) -> KVLayout:
    return build_layout(
        inputs.model,
        inputs.resolved_page_size,
        inputs.speculative_draft_tokens,
        inputs.tp_size,
        inputs.request_state,
    )


def better(a: BottleneckKey | None, b: BottleneckKey | None) -> bool:
    return a is not None and (b is None or a > b)


def at_least(a: BottleneckKey | None, b: BottleneckKey | None) -> bool:
    return b is None or (a is not None and a >= b)


# ------------------------------------------------------------------------------------------
# The pure search


def test_even_gives_extra_layers_to_the_first_ranks_sglang_to_the_last() -> None:
    assert even_split(61, 4) == (16, 15, 15, 15)
    assert sglang_split(61, 4) == (15, 15, 15, 16)
    assert even_split(43, 8) == (6, 6, 6, 5, 5, 5, 5, 5)
    assert sglang_split(43, 8) == (5, 5, 5, 5, 5, 6, 6, 6)
    assert even_split(8, 4) == sglang_split(8, 4) == (2, 2, 2, 2)


def test_boundary_moves_keep_every_rank_and_every_layer() -> None:
    assert boundary_moves((2, 1, 3)) == [(1, 2, 3), (2, 2, 2)]  # rank 1 never drops to 0
    for move in boundary_moves((16, 15, 15, 15)):
        assert sum(move) == 61 and min(move) >= 1
        assert sum(a != b for a, b in zip(move, (16, 15, 15, 15), strict=True)) == 2
    assert boundary_moves((5,)) == []


@settings(max_examples=60, deadline=None)
@given(
    # Every layer costs something, as real layers do: values shrink as a segment grows (the
    # DP's precondition; a free layer would make (left, layers) grow).
    costs=st.lists(st.integers(1, 50), min_size=2, max_size=9),
    extra=st.lists(st.integers(0, 80), min_size=4, max_size=4),
    pp=st.integers(1, 4),
    budget=st.integers(20, 300),
)
def test_dp_finds_the_brute_force_max_min(
    costs: list[int], extra: list[int], pp: int, budget: int
) -> None:
    """Random monotone segment values (budget minus the segment's cost and a per-rank cost)."""
    n = len(costs)
    if pp > n:
        return

    def value(rank: int, start: int, end: int) -> tuple[int, ...] | None:
        left = budget - sum(costs[start:end]) - extra[rank]
        return None if left < 0 else (left, end - start)

    def worst(split: Split) -> tuple[int, ...] | None:
        bounds = list(itertools.accumulate(split, initial=0))
        values = [value(k, a, b) for k, (a, b) in enumerate(itertools.pairwise(bounds))]
        return None if any(v is None for v in values) else min(v for v in values if v)

    best = max((w for s in compositions(n, pp) if (w := worst(s)) is not None), default=None)
    found = max_min_split(n, pp, value)
    if best is None:
        assert found is None
    else:
        assert found is not None and sum(found) == n and min(found) >= 1
        assert worst(found) == best


def test_climb_reaches_a_local_optimum_and_refuses_an_unplannable_start() -> None:
    target = (3, 3, 3)

    def key_of(split: Split) -> BottleneckKey | None:
        if split[0] > 6:
            return None
        bounds = itertools.accumulate(split)  # each boundary's distance to the target's
        return (0, 0, -sum(abs(a - b) for a, b in zip(bounds, (3, 6, 9), strict=True)))

    found = climb((7, 1, 1), key_of)
    assert found is None
    found = climb((6, 1, 2), key_of)
    assert found is not None and found[0] == target and found[1] == (0, 0, 0)


# ------------------------------------------------------------------------------------------
# The balanced plan over the DSV4 presets

SETTINGS: dict[str, dict[str, object]] = {
    "defaults": {},
    "issue": {"swa_ratio": 0.1, "mem_fraction": 0.88, "request_state": "online"},
    "mtp": {"speculative_draft_tokens": 2},
    "many-requests": {"max_running_requests": 4096, "swa_ratio": 0.1},
    "short-context": {"context_len": 131_072},
}


def preset_inputs(preset: str, role: Role, gpu: str, tp: int, pp: int, setting: str) -> PlanInputs:
    return PlanInputs(
        model=PRESETS[preset],
        role=role,
        gpu_memory_bytes=GPU_TYPES[gpu].memory_bytes,
        tp_size=tp,
        pp_size=pp,
        **SETTINGS[setting],  # type: ignore[arg-type]
    )


# Configurations whose even split one boundary move improves (found by the property below).
UNBALANCED = [
    ("pro", "decode", "h100-80gb", 4, 3, "defaults"),
    ("pro", "prefill", "h100-80gb", 4, 4, "mtp"),
    ("pro", "decode", "h200", 8, 2, "many-requests"),
    ("pro", "decode", "h100-80gb", 4, 4, "mtp"),
]


@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    role=st.sampled_from(["prefill", "decode", "colocated"]),
    gpu=st.sampled_from(["h200", "h100-80gb", "a100-40gb"]),
    tp=st.sampled_from([4, 8, 16]),
    pp=st.integers(2, 8),
    setting=st.sampled_from(sorted(SETTINGS)),
)
@example(preset="pro", role="decode", gpu="h100-80gb", tp=4, pp=3, setting="defaults")
@example(preset="pro", role="decode", gpu="h200", tp=8, pp=2, setting="many-requests")
@example(preset="pro", role="decode", gpu="h200", tp=8, pp=4, setting="issue")
def test_balanced_plan_beats_the_default_splits_and_is_locally_optimal(
    preset: str, role: Role, gpu: str, tp: int, pp: int, setting: str
) -> None:
    inputs = preset_inputs(preset, role, gpu, tp, pp, setting)
    n = inputs.model.num_hidden_layers
    even, sglang = even_split(n, pp), sglang_split(n, pp)
    even_key, sglang_key = key_or_none(inputs, even), key_or_none(inputs, sglang)
    try:
        p = plan(inputs)
    except PlanError:  # then neither default split can be planned either
        assert even_key is None and sglang_key is None
        return
    key, split = p.bottleneck_key, p.split.layers_per_rank
    # contiguous, every layer once, every rank >= 1 layer
    assert p.split.mode == "balanced" and len(split) == pp and min(split) >= 1
    bounds = list(itertools.accumulate(split, initial=0))
    assert [r.layers for r in p.ranks] == list(itertools.pairwise(bounds))
    assert bounds[-1] == n
    # the search scores splits exactly as the plan does
    assert p.split.even == even and p.split.even_key == even_key
    assert at_least(key, even_key) and at_least(key, sglang_key)
    # "unbalanced": one boundary move improves the even split; then the balanced plan is better
    if even_key is None or any(
        better(key_or_none(inputs, m), even_key) for m in boundary_moves(even)
    ):
        assert better(key, even_key)
    # locally optimal: no single boundary move improves the result
    for move in boundary_moves(split):
        assert not better(key_or_none(inputs, move), key), move


@pytest.mark.parametrize(("preset", "role", "gpu", "tp", "pp", "setting"), UNBALANCED)
def test_balanced_split_is_strictly_better_where_the_even_split_is_unbalanced(
    preset: str, role: Role, gpu: str, tp: int, pp: int, setting: str
) -> None:
    inputs = preset_inputs(preset, role, gpu, tp, pp, setting)
    p = plan(inputs)
    even = even_split(inputs.model.num_hidden_layers, pp)
    assert any(better(key_or_none(inputs, m), p.split.even_key) for m in boundary_moves(even))
    assert p.split.layers_per_rank != even and better(p.bottleneck_key, p.split.even_key)


@pytest.mark.parametrize(
    ("preset", "role", "gpu", "tp", "pp", "setting"),
    [
        *UNBALANCED[:3],
        ("pro", "decode", "h200", 8, 4, "issue"),
        ("flash", "decode", "a100-40gb", 8, 4, "defaults"),
        ("flash", "prefill", "h100-80gb", 8, 3, "mtp"),
    ],
)
def test_balanced_split_is_the_best_of_every_split(
    preset: str, role: Role, gpu: str, tp: int, pp: int, setting: str
) -> None:
    """Brute force over every composition (PP <= 4), scored like the plan (`StageModel.key_of`,
    whose agreement with `plan` is checked below)."""
    inputs = preset_inputs(preset, role, gpu, tp, pp, setting)
    model = StageModel(inputs, layout_of(inputs))
    keys = (model.key_of(s) for s in compositions(inputs.model.num_hidden_layers, pp))
    assert plan(inputs).bottleneck_key == max(k for k in keys if k is not None)


@settings(max_examples=40, deadline=None)
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    role=st.sampled_from(["prefill", "decode"]),
    setting=st.sampled_from(sorted(SETTINGS)),
    data=st.data(),
)
def test_stage_model_scores_a_split_exactly_as_the_plan(
    preset: str, role: Role, setting: str, data: st.DataObject
) -> None:
    pp = data.draw(st.integers(1, 8))
    n = PRESETS[preset].num_hidden_layers
    cuts = data.draw(st.lists(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1, unique=True))
    bounds = [0, *sorted(cuts), n]
    split = tuple(b - a for a, b in itertools.pairwise(bounds))
    inputs = preset_inputs(preset, role, "h200", 8, pp, setting)
    assert StageModel(inputs, layout_of(inputs)).key_of(split) == key_or_none(inputs, split)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), preset=st.sampled_from(["pro", "flash", "tiny"]))
def test_a_fixed_split_is_honoured_exactly(data: st.DataObject, preset: str) -> None:
    model = tiny() if preset == "tiny" else PRESETS[preset]
    n = model.num_hidden_layers
    pp = data.draw(st.integers(1, min(n, 8)))
    cuts = data.draw(st.lists(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1, unique=True))
    bounds = [0, *sorted(cuts), n]
    split = tuple(b - a for a, b in itertools.pairwise(bounds))
    memory = GIB if preset == "tiny" else GPU_TYPES["h200"].memory_bytes
    inputs = PlanInputs(
        model=model,
        role="decode",
        gpu_memory_bytes=memory,
        tp_size=1 if preset == "tiny" else 8,
        pp_size=pp,
        layer_split=split,
    )
    try:
        p = plan(inputs)
    except PlanError:
        return
    assert p.split.mode == "fixed" and p.split.layers_per_rank == split
    assert [r.layers for r in p.ranks] == list(itertools.pairwise(bounds))


def test_no_split_fits_reports_the_even_splits_error() -> None:
    inputs = PlanInputs(
        model=deepseek_v4_pro(), role="decode", gpu_memory_bytes=40 * GIB, tp_size=8, pp_size=2
    )
    with pytest.raises(PlanError, match=r"PP rank 0: weights need"):
        plan(inputs)


def test_balanced_plan_fits_where_the_even_split_does_not() -> None:
    inputs = preset_inputs("pro", "decode", "h200", 8, 2, "defaults")
    inputs = dataclasses.replace(inputs, max_running_requests=4000)
    assert key_or_none(inputs, (31, 30)) is None
    p = plan(inputs)
    assert p.split.layers_per_rank == (30, 31) and p.split.even_key is None


def test_ties_keep_the_even_split() -> None:
    """tiny in CPU mode: every split holds the whole context at the capped request count."""
    p = plan(PlanInputs(model=tiny(), role="decode", gpu_memory_bytes=GIB, pp_size=2))
    assert p.split.layers_per_rank == (3, 3) and p.bottleneck_key == p.split.even_key


def test_search_evaluates_few_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pro at PP=8 has C(60, 7) ~ 3.9e8 splits; the search scores a few dozen (plus a few
    thousand single-rank segments in the DP)."""
    calls = {"splits": 0, "segments": 0}
    key_of, full_tokens = StageModel.key_of, StageModel.full_tokens

    def counted_key_of(self: StageModel, split: Split) -> BottleneckKey | None:
        calls["splits"] += 1
        return key_of(self, split)

    def counted_full_tokens(self: StageModel, *args: int) -> int | None:
        calls["segments"] += 1
        return full_tokens(self, *args)

    monkeypatch.setattr(stages.StageModel, "key_of", counted_key_of)
    monkeypatch.setattr(stages.StageModel, "full_tokens", counted_full_tokens)
    for pp in (3, 4, 8):
        calls.update(splits=0, segments=0)
        p: Plan = plan(preset_inputs("pro", "decode", "h100-80gb", 4, pp, "mtp"))
        assert p.split.mode == "balanced"
        assert calls["splits"] <= 100 and calls["segments"] <= 10_000, (pp, calls)


def test_models_past_the_dp_bound_get_a_locally_optimal_split() -> None:
    """Past MAX_DP_LAYERS only the climb runs; its guarantees still hold."""
    flash = deepseek_v4_flash()
    n = MAX_DP_LAYERS + 88
    ratios = tuple(flash.compress_ratios[i % flash.num_hidden_layers] for i in range(n))
    model = dataclasses.replace(flash, num_hidden_layers=n, compress_ratios=(*ratios, 0))
    inputs = PlanInputs(
        model=model,
        role="decode",
        gpu_memory_bytes=GPU_TYPES["h200"].memory_bytes,
        tp_size=8,
        pp_size=16,
        speculative_draft_tokens=2,
    )
    p = plan(inputs)
    assert at_least(p.bottleneck_key, p.split.even_key)
    assert at_least(p.bottleneck_key, key_or_none(inputs, sglang_split(n, 16)))
    for move in boundary_moves(p.split.layers_per_rank):
        assert not better(key_or_none(inputs, move), p.bottleneck_key)
