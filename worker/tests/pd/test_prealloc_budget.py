"""PD decode admits by the window tail (ref. #24036/#24857): with an SWA pool far smaller than
the prompts, long prompts are preallocated, and the number preallocated in one step equals the
binding budget of full pages, SWA tail pages and request slots. Whole-prompt SWA
preallocation (what the reference engine did before) would admit far fewer."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_common.core.index_space import pages_for_tokens, tail_pages
from dsv4_worker.sched.budget import PoolRoom
from dsv4_worker.sched.scheduler import Phase, ReqView, SchedulerConfig, plan_step

PAGE, RETAINED = 16, 64 + 0


def _views(n: int, count: int) -> list[ReqView]:
    # max_new_tokens=1: no decode headroom, so the budgets alone bind
    return [ReqView(rid, Phase.PREALLOC, n, 1) for rid in range(count)]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 4000),
    full=st.integers(1, 2000),
    swa=st.integers(1, 200),
    slots=st.integers(1, 64),
)
def test_preallocated_count_is_the_binding_budget(n: int, full: int, swa: int, slots: int) -> None:
    config = SchedulerConfig(PAGE, 256, 4096, retained_tokens=RETAINED)
    total = PoolRoom(full, swa, slots)
    plan = plan_step(_views(n, 100), total, total, config, 1.0)
    f, t = pages_for_tokens(n, PAGE), tail_pages(n, PAGE, RETAINED)
    longest = pages_for_tokens(n + 1, PAGE)  # prompt + max_tokens must fit the full pool
    if n + 1 > config.max_tokens_per_request or longest > full or t > swa:
        assert not plan.preallocs  # never fits: rejected, not waiting forever
        assert len(plan.rejects) == 100
        return
    assert len(plan.preallocs) == min(full // f, swa // t, slots, 100)
    assert plan.preallocs == tuple(range(len(plan.preallocs)))  # arrival order
    if len(plan.preallocs) < 100:
        assert plan.waiting is not None and plan.waiting[0] == len(plan.preallocs)


def test_long_prompts_beat_whole_prompt_swa_preallocation() -> None:
    n = 2000  # 125 pages; the window tail is 4 pages
    config = SchedulerConfig(PAGE, 256, 4096, retained_tokens=RETAINED)
    total = PoolRoom(full_pages=2000, swa_pages=40, request_slots=64)
    plan = plan_step(_views(n, 64), total, total, config, 1.0)
    whole_prompt = min(2000 // 125, 40 // 125)  # 0: not even one prompt fits the SWA pool
    assert whole_prompt == 0
    assert len(plan.preallocs) == min(2000 // 125, 40 // tail_pages(n, PAGE, RETAINED)) == 10
