"""Requests as the engine shows them to the scheduler (`Engine._views`), one builder per phase,
and the units a step plan takes from the pools, counted the way the allocator spends them
(`KVAllocator._plan_extend` / `_plan_decode`, `alloc_tail`, offload and reload).

NOTE: the engine's views obey: a request with a slot holds full pages for its `num_tokens`, at
most as many SWA pages, and one request slot; a decoding request has written the KV of all but
its newest token (num_tokens = prompt + generated - 1); a retracted one holds nothing and
resumes with what it held; a request whose KV is arriving (PD) holds its preallocation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_worker.sched.budget import Need, decode_need, extend_need
from dsv4_worker.sched.budget import PoolRoom as Pools  # the one line a rename of PoolRoom touches
from dsv4_worker.sched.scheduler import Phase, ReqView, SchedulerConfig, StepPlan, prealloc_need

PAGE = 4


def waiting(rid: int, prompt: int, max_new: int = 1) -> ReqView:
    return ReqView(rid, Phase.WAITING, prompt, max_new)


def prefilling(
    rid: int, prompt: int, computed: int, max_new: int = 1, swa: int | None = None
) -> ReqView:
    """Admitted, `computed` prompt tokens in the pools; holds every SWA page unless `swa`."""
    full = pages_for_tokens(computed, PAGE)
    held = Need(full, full if swa is None else swa, 1)
    return ReqView(rid, Phase.PREFILL, prompt, max_new, computed, 0, held)


def decoding(
    rid: int, prompt: int, generated: int = 1, max_new: int = 8, swa: int | None = None
) -> ReqView:
    """Prompt computed, `generated` tokens sampled; the newest one's KV is not written yet."""
    num_tokens = prompt + generated - 1
    full = pages_for_tokens(num_tokens, PAGE)
    held = Need(full, full if swa is None else swa, 1)
    return ReqView(rid, Phase.DECODE, prompt, max_new, num_tokens, generated, held)


def retracted(
    rid: int, prompt: int, generated: int = 1, max_new: int = 8, swa: int | None = None
) -> ReqView:
    """Offloaded to CPU: holds nothing, a resume reloads what it held."""
    view = decoding(rid, prompt, generated, max_new, swa)
    resume = Need(view.held.full_pages, view.held.swa_pages)
    return view._replace(phase=Phase.RETRACTED, held=Need(), resume=resume)


def preallocating(rid: int, prompt: int, max_new: int = 1) -> ReqView:
    return ReqView(rid, Phase.PREALLOC, prompt, max_new)


def arriving(rid: int, prompt: int, config: SchedulerConfig, max_new: int = 1) -> ReqView:
    """PD decode: preallocated (`Engine._prealloc`), its KV and first token in flight."""
    held = prealloc_need(ReqView(rid, Phase.PREALLOC, prompt, max_new), config)
    return ReqView(rid, Phase.TRANSFER, prompt, max_new, prompt, 0, held)


def held_by(views: Iterable[ReqView]) -> Need:
    out = Need()
    for v in views:
        out = out + v.held
    return out


def pools_plus(pools: Pools, need: Need) -> Pools:
    return Pools(
        pools.full_pages + need.full_pages,
        pools.swa_pages + need.swa_pages,
        pools.request_slots + need.request_slots,
    )


def taken_by(plan: StepPlan, views: Sequence[ReqView], config: SchedulerConfig) -> Need:
    """Units carrying out `plan` takes from the pools; what its retractions give back counts
    negative (the engine offloads them before it allocates anything)."""
    by_rid = {v.rid: v for v in views}
    page = config.page_size
    out = Need()
    for rid in plan.retracts:
        held = by_rid[rid].held
        out = out + Need(-held.full_pages, -held.swa_pages, -1)
    for rid in plan.decodes:
        out = out + decode_need(by_rid[rid].num_tokens, page)
    for rid in plan.resumes:
        out = out + by_rid[rid].resume + Need(request_slots=1)
    out = out + Need(request_slots=len(plan.admits))  # an admission opens a slot
    for rid, tokens in plan.chunks:
        out = out + extend_need(by_rid[rid].num_tokens, tokens, page)
    for rid in plan.preallocs:
        out = out + prealloc_need(by_rid[rid], config)
    return out


def left_after(
    plan: StepPlan, views: Sequence[ReqView], free: Pools, config: SchedulerConfig
) -> Pools:
    """Free units once `plan` has been carried out."""
    return free.minus(taken_by(plan, views, config))
