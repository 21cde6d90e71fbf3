"""Invariants of `plan_step` over random request mixes (every phase, page sizes, budgets,
pools from empty to roomy, any new-token ratio):
- the plan never takes more units than are free once its retractions gave back what they held;
- a retracted request frees exactly what it held: retraction takes the newest decoders and
  stops as soon as the survivors' next tokens fit;
- each request gets at most one decision, one that fits its phase; requests whose KV is arriving
  get none;
- prefill stays within the chunk budget and goes in queue order, and nothing behind the request
  that waits is acted on (the head of the queue never starves)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_helpers import Pools, decoding, held_by, left_after, pools_plus, waiting

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_worker.sched.budget import Need, decode_need
from dsv4_worker.sched.scheduler import (
    Phase,
    ReqView,
    SchedulerConfig,
    StepPlan,
    plan_step,
    prealloc_need,
)

COLOCATED = (Phase.WAITING, Phase.PREFILL, Phase.DECODE, Phase.RETRACTED)
# PREALLOC twice: it is a PD decode's only admission, and the rarest decision otherwise
PD_DECODE = (Phase.PREALLOC, Phase.PREALLOC, Phase.TRANSFER, Phase.DECODE, Phase.RETRACTED)


@dataclass(frozen=True)
class Mix:
    views: tuple[ReqView, ...]
    free: Pools
    total: Pools
    config: SchedulerConfig
    ratio: float


@st.composite
def _view(draw: st.DrawFn, rid: int, config: SchedulerConfig, phases: tuple[Phase, ...]) -> ReqView:
    """One request in a state the engine can reach (see sched_helpers' NOTE)."""
    page = config.page_size
    phase = draw(st.sampled_from(phases))
    prompt = draw(st.one_of(st.integers(1, 12), st.integers(1, 80)))
    max_new = draw(st.one_of(st.integers(1, 4), st.integers(1, 40)))
    if phase in (Phase.WAITING, Phase.PREALLOC):
        return ReqView(rid, phase, prompt, max_new)
    if phase is Phase.TRANSFER:
        held = prealloc_need(ReqView(rid, phase, prompt, max_new), config)
        return ReqView(rid, phase, prompt, max_new, prompt, 0, held)
    if phase is Phase.PREFILL and prompt == 1:  # a one-token prompt is never mid-prefill
        return ReqView(rid, Phase.WAITING, prompt, max_new)
    if phase is Phase.PREFILL:
        computed, generated = draw(st.integers(1, prompt - 1)), 0
    else:
        generated = draw(st.integers(1, max_new))
        computed = prompt + generated - 1
    full = pages_for_tokens(computed, page)
    swa = draw(st.integers(min(full, 1), full))
    if phase is Phase.RETRACTED:
        return ReqView(rid, phase, prompt, max_new, computed, generated, resume=Need(full, swa))
    return ReqView(rid, phase, prompt, max_new, computed, generated, Need(full, swa, 1))


@st.composite
def mixes(draw: st.DrawFn) -> Mix:
    config = SchedulerConfig(
        page_size=draw(st.sampled_from([1, 2, 4, 16])),
        chunk_tokens=draw(st.integers(1, 48)),
        max_tokens_per_request=draw(st.sampled_from([16, 64, 160])),
        clip_new_tokens=draw(st.integers(1, 64)),
        retained_tokens=draw(st.integers(0, 32)),
    )
    phases = draw(st.sampled_from([COLOCATED, PD_DECODE, tuple(Phase)]))
    count = draw(st.integers(0, 10))
    views = tuple(draw(_view(rid, config, phases)) for rid in range(count))
    rids = draw(st.permutations(range(count)))  # arrival order is the rid, not list order
    views = tuple(views[i]._replace(rid=r) for i, r in enumerate(rids))
    few, many = st.integers(0, 3), st.integers(0, 80)
    free = Pools(draw(st.one_of(few, many)), draw(st.one_of(few, many)), draw(st.integers(0, 6)))
    used = Need(draw(st.integers(0, 8)), draw(st.integers(0, 8)), draw(st.integers(0, 2)))
    total = pools_plus(free, held_by(views) + used)  # units held elsewhere (kept pages)
    for v in views:  # a retracted request held its resume units once: the pools are as large
        total = Pools(
            max(total.full_pages, v.resume.full_pages),
            max(total.swa_pages, v.resume.swa_pages),
            max(total.request_slots, 1 if v.phase is Phase.RETRACTED else 0),
        )
    ratio = draw(st.floats(0.0, 1.0))
    return Mix(views, free, total, config, ratio)


def _plan(mix: Mix) -> StepPlan:
    return plan_step(mix.views, mix.free, mix.total, mix.config, mix.ratio)


def _queue_key(v: ReqView) -> tuple[int, int]:
    rank = {Phase.PREFILL: 0, Phase.RETRACTED: 1, Phase.PREALLOC: 2, Phase.WAITING: 2}
    return rank[v.phase], v.rid


@settings(max_examples=400, deadline=None)
@given(mix=mixes())
def test_a_plan_never_takes_more_than_is_free(mix: Mix) -> None:
    plan = _plan(mix)
    left = left_after(plan, mix.views, mix.free, mix.config)
    assert min(left.full_pages, left.swa_pages, left.request_slots) >= 0, (plan, left)


@settings(max_examples=400, deadline=None)
@given(mix=mixes())
def test_retraction_frees_what_the_victims_held_newest_first_and_no_more(mix: Mix) -> None:
    plan = _plan(mix)
    by_rid = {v.rid: v for v in mix.views}
    decoders = sorted(v.rid for v in mix.views if v.phase is Phase.DECODE)
    assert sorted((*plan.decodes, *plan.retracts)) == decoders
    assert list(plan.retracts) == sorted(plan.retracts, reverse=True)  # newest first
    assert all(r > d for r in plan.retracts for d in plan.decodes)

    def room_with(victims: tuple[int, ...]) -> Pools:
        freed = held_by(by_rid[r] for r in victims)
        return pools_plus(mix.free, Need(freed.full_pages, freed.swa_pages))

    def fits(survivors: list[int], room: Pools) -> bool:
        need = Need()
        for rid in survivors:
            need = need + decode_need(by_rid[rid].num_tokens, mix.config.page_size)
        return room.covers(need)

    assert fits(list(plan.decodes), room_with(plan.retracts))
    if plan.retracts:  # the last victim was needed: keeping it, the survivors would not fit
        kept = plan.retracts[-1]
        assert not fits([*plan.decodes, kept], room_with(plan.retracts[:-1]))


@settings(max_examples=400, deadline=None)
@given(mix=mixes())
def test_each_request_gets_one_decision_that_fits_its_phase(mix: Mix) -> None:
    plan = _plan(mix)
    phase = {v.rid: v.phase for v in mix.views}
    chunked = [rid for rid, _ in plan.chunks]
    decided = [
        *plan.decodes,
        *plan.retracts,
        *plan.resumes,
        *chunked,
        *plan.preallocs,
        *(rid for rid, _ in plan.rejects),
        *([plan.waiting[0]] if plan.waiting else []),
    ]
    assert len(decided) == len(set(decided))
    assert set(plan.admits) <= set(chunked)
    assert all(phase[r] is Phase.DECODE for r in (*plan.decodes, *plan.retracts))
    assert all(phase[r] is Phase.RETRACTED for r in plan.resumes)
    assert all(phase[r] is Phase.PREALLOC for r in plan.preallocs)
    assert all(phase[r] in (Phase.WAITING, Phase.PREFILL) for r in chunked)
    assert set(plan.admits) == {r for r in chunked if phase[r] is Phase.WAITING}
    assert not any(phase[r] is Phase.TRANSFER for r in decided)
    assert all(why for _, why in plan.rejects)
    if plan.waiting is not None:
        assert plan.waiting[1]


@settings(max_examples=400, deadline=None)
@given(mix=mixes())
def test_prefill_keeps_the_budget_and_queue_order(mix: Mix) -> None:
    plan = _plan(mix)
    by_rid = {v.rid: v for v in mix.views}
    assert sum(t for _, t in plan.chunks) <= mix.config.chunk_tokens
    for rid, tokens in plan.chunks:
        v = by_rid[rid]
        assert 1 <= tokens <= v.prompt_len - v.num_tokens
    acted = [*plan.resumes, *(rid for rid, _ in plan.chunks), *plan.preallocs]
    keys = sorted(_queue_key(by_rid[r]) for r in acted)
    assert [_queue_key(by_rid[r]) for r, _ in plan.chunks] == sorted(
        _queue_key(by_rid[r]) for r, _ in plan.chunks
    )
    if plan.waiting is not None:  # the head waits: nobody behind it moves
        head = _queue_key(by_rid[plan.waiting[0]])
        assert all(k < head for k in keys)
        assert all(_queue_key(by_rid[r]) < head for r, _ in plan.rejects)


@settings(max_examples=200, deadline=None)
@given(mix=mixes())
def test_a_step_that_acts_is_not_idle(mix: Mix) -> None:
    plan = _plan(mix)
    assert plan.idle == (plan == StepPlan(waiting=plan.waiting))


def test_a_step_that_retracts_admits_no_newer_request() -> None:
    """Found by these tables: the pages a retraction freed admitted a newer waiting request in
    the same step (an older request offloaded while a newer one took its place)."""
    config = SchedulerConfig(page_size=4, chunk_tokens=8, max_tokens_per_request=64)
    # both decoders' next tokens open a page; one page is free
    views = (decoding(0, prompt=4), decoding(1, prompt=4), waiting(2, prompt=3))
    free = Pools(1, 1, 0)
    plan = plan_step(views, free, pools_plus(free, held_by(views)), config, 0.0)
    assert plan.retracts == (1,)
    assert plan.admits == ()
    assert plan.waiting is not None and plan.waiting[0] == 2


@settings(max_examples=300, deadline=None)
@given(mix=mixes())
def test_a_step_that_retracts_starts_nothing_new(mix: Mix) -> None:
    """Retraction means the pools ran short: that step resumes, admits and preallocates
    nothing (only prefills already under way continue)."""
    plan = _plan(mix)
    if plan.retracts:
        assert (plan.admits, plan.resumes, plan.preallocs) == ((), (), ()), plan


@settings(max_examples=300, deadline=None)
@given(mix=mixes())
def test_an_engine_holding_nothing_always_makes_progress(mix: Mix) -> None:
    """Nobody holds a unit (queued and retracted requests only, every pool free): the step
    admits, resumes, preallocates or rejects someone; it never just waits."""
    queued = (Phase.WAITING, Phase.PREALLOC, Phase.RETRACTED)
    views = tuple(v for v in mix.views if v.phase in queued)
    plan = plan_step(views, mix.total, mix.total, mix.config, mix.ratio)
    assert plan.idle == (not views), plan
