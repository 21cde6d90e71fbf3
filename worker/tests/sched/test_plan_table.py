"""`plan_step` as a table (the way LWS tests its planner): each row is a named case, the
requests' states and the pools' free units in, the whole step plan out (who decodes, is
retracted, resumed, admitted, chunked, preallocated, rejected, or waits and why) and the units
and prefill tokens left once the plan is carried out. Page size 4, chunk budget 8 tokens,
64 tokens per request unless a row says otherwise; the new-token ratio is 0 (no decode
headroom) unless a row sets it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sched_helpers import (
    PAGE,
    Pools,
    arriving,
    decoding,
    held_by,
    left_after,
    pools_plus,
    preallocating,
    prefilling,
    retracted,
    waiting,
)

from dsv4_worker.sched.scheduler import ReqView, SchedulerConfig, StepPlan, plan_step

CONFIG = SchedulerConfig(page_size=PAGE, chunk_tokens=8, max_tokens_per_request=64)
PD = SchedulerConfig(page_size=PAGE, chunk_tokens=8, max_tokens_per_request=64, retained_tokens=8)


@dataclass(frozen=True)
class Case:
    name: str
    views: tuple[ReqView, ...]
    free: Pools
    want: StepPlan
    left: Pools  # free units after the plan (retractions give back what they held)
    tokens_left: int  # prefill budget the chunks leave
    total: Pools | None = None  # default: free + what the views hold
    config: SchedulerConfig = CONFIG
    ratio: float = 0.0


CASES = [
    Case(
        "empty step: nothing to plan",
        views=(),
        free=Pools(10, 10, 2),
        want=StepPlan(),
        left=Pools(10, 10, 2),
        tokens_left=8,
    ),
    # -- admission ---------------------------------------------------------------------------
    Case(
        "admit: a short prompt runs whole in one chunk",
        views=(waiting(0, prompt=6, max_new=2),),
        free=Pools(10, 10, 2),
        want=StepPlan(admits=(0,), chunks=((0, 6),)),
        left=Pools(8, 8, 1),
        tokens_left=2,
    ),
    Case(
        "admit by full pages: the whole prompt and its first token must fit, not the chunk",
        views=(waiting(0, prompt=16),),  # 17 tokens: 5 full pages; the chunk needs 2
        free=Pools(4, 10, 2),
        total=Pools(10, 10, 2),
        want=StepPlan(waiting=(0, "waits for 5 full pages (have 4)")),
        left=Pools(4, 10, 2),
        tokens_left=8,
    ),
    Case(
        "admit by SWA pages: the chunk's SWA pages must be free now",
        views=(waiting(0, prompt=8),),
        free=Pools(10, 1, 2),
        total=Pools(10, 10, 2),
        want=StepPlan(waiting=(0, "waits for 2 SWA pages (have 1)")),
        left=Pools(10, 1, 2),
        tokens_left=8,
    ),
    Case(
        "SWA pool smaller than a chunk: the chunk shrinks to (SWA pages - 1) pages of tokens",
        views=(waiting(0, prompt=16),),
        free=Pools(20, 2, 2),
        config=SchedulerConfig(page_size=PAGE, chunk_tokens=16, max_tokens_per_request=64),
        want=StepPlan(admits=(0,), chunks=((0, 4),)),
        left=Pools(19, 1, 1),
        tokens_left=12,
    ),
    Case(
        "request slots exhausted: admission waits for a slot",
        views=(decoding(0, prompt=5), waiting(1, prompt=4)),
        free=Pools(10, 10, 0),
        want=StepPlan(decodes=(0,), waiting=(1, "waits for 1 request slots (have 0)")),
        left=Pools(10, 10, 0),
        tokens_left=8,
    ),
    Case(
        "no request slots at all: rejected, never queued",
        views=(waiting(0, prompt=4),),
        free=Pools(10, 10, 0),
        want=StepPlan(rejects=((0, "the worker has no request slots"),)),
        left=Pools(10, 10, 0),
        tokens_left=8,
    ),
    Case(
        "max tokens per request: prompt + max_tokens at the limit is admitted",
        views=(waiting(0, prompt=60, max_new=4),),  # 64 tokens: 16 full pages
        free=Pools(16, 16, 1),
        want=StepPlan(admits=(0,), chunks=((0, 8),)),
        left=Pools(14, 14, 0),
        tokens_left=0,
    ),
    Case(
        "never fits: over the context or over the full pool is rejected and blocks nobody",
        views=(
            waiting(0, prompt=60, max_new=10),
            waiting(1, prompt=4),
            waiting(2, prompt=40),  # 41 tokens: 11 full pages, the pool has 10
        ),
        free=Pools(10, 10, 4),
        want=StepPlan(
            admits=(1,),
            chunks=((1, 4),),
            rejects=(
                (
                    0,
                    "prompt (60 tokens) + max_tokens (10) exceeds the maximum context of 64 tokens",
                ),
                (2, "needs 11 full KV pages, the pool has 10"),
            ),
        ),
        left=Pools(9, 9, 3),
        tokens_left=4,
    ),
    Case(
        "head of the queue waits and blocks a later request that would fit",
        views=(waiting(0, prompt=30), waiting(1, prompt=2)),  # 31 tokens: 8 full pages
        free=Pools(5, 20, 4),
        total=Pools(20, 20, 4),
        want=StepPlan(waiting=(0, "waits for 8 full pages (have 5)")),
        left=Pools(5, 20, 4),
        tokens_left=8,
    ),
    # -- chunked prefill ---------------------------------------------------------------------
    Case(
        "chunked prefill: a long prompt splits at the chunk budget",
        views=(waiting(0, prompt=20),),
        free=Pools(10, 10, 2),
        want=StepPlan(admits=(0,), chunks=((0, 8),)),
        left=Pools(8, 8, 1),
        tokens_left=0,
    ),
    Case(
        "chunked prefill: a running prefill continues first, a new one gets the budget's rest",
        views=(prefilling(0, prompt=12, computed=8), waiting(1, prompt=6)),
        free=Pools(10, 10, 2),
        want=StepPlan(admits=(1,), chunks=((0, 4), (1, 4))),
        left=Pools(8, 8, 1),
        tokens_left=0,
    ),
    Case(
        "chunked prefill: a spent budget admits nobody else this step",
        views=(prefilling(0, prompt=20, computed=4), waiting(1, prompt=2)),
        free=Pools(10, 10, 2),
        want=StepPlan(chunks=((0, 8),)),
        left=Pools(8, 8, 2),
        tokens_left=0,
    ),
    Case(
        "chunked prefill: a finishing prefill keeps its first decode token's page reserved",
        views=(prefilling(0, prompt=16, computed=8), waiting(1, prompt=2)),
        # rid 0's last chunk takes 2 pages; token 17 will open a 5th page: 1 page reserved
        free=Pools(3, 10, 2),
        config=SchedulerConfig(page_size=PAGE, chunk_tokens=10, max_tokens_per_request=64),
        want=StepPlan(chunks=((0, 8),), waiting=(1, "waits for 1 full pages (have 0)")),
        left=Pools(1, 8, 2),
        tokens_left=2,
    ),
    # -- decode ------------------------------------------------------------------------------
    Case(
        "decode first: the running request's next page before a new prompt",
        views=(decoding(0, prompt=4), waiting(1, prompt=4)),  # rid 0's next token opens a page
        free=Pools(2, 2, 1),
        want=StepPlan(decodes=(0,), waiting=(1, "waits for 2 full pages (have 1)")),
        left=Pools(1, 1, 1),
        tokens_left=8,
    ),
    Case(
        "decode headroom: the new-token ratio reserves pages for running requests",
        views=(decoding(0, prompt=4, max_new=33), waiting(1, prompt=8)),
        # 32 tokens left x 0.5 = 16 future tokens: 3 pages beyond the next one
        free=Pools(6, 6, 1),
        ratio=0.5,
        want=StepPlan(decodes=(0,), waiting=(1, "waits for 3 full pages (have 2)")),
        left=Pools(5, 5, 1),
        tokens_left=8,
    ),
    Case(
        "decode headroom: with ratio 0 the same prompt is admitted",
        views=(decoding(0, prompt=4, max_new=33), waiting(1, prompt=8)),
        free=Pools(6, 6, 1),
        want=StepPlan(decodes=(0,), admits=(1,), chunks=((1, 8),)),
        left=Pools(3, 3, 0),
        tokens_left=0,
    ),
    Case(
        "decode only: every running request gets its next token",
        views=(decoding(0, prompt=4), decoding(1, prompt=5), decoding(2, prompt=8)),
        free=Pools(2, 2, 0),
        want=StepPlan(decodes=(0, 1, 2)),
        left=Pools(0, 0, 0),
        tokens_left=8,
    ),
    # -- retraction --------------------------------------------------------------------------
    Case(
        "retraction: the newest decode goes first, even one that needs no new page",
        views=(
            decoding(0, prompt=4),  # next token opens a page
            decoding(1, prompt=8),  # next token opens a page
            decoding(2, prompt=4, generated=2),  # 5 tokens: its next one fits its last page
        ),
        free=Pools(1, 1, 0),
        want=StepPlan(decodes=(0, 1), retracts=(2,)),
        left=Pools(1, 1, 1),
        tokens_left=8,
    ),
    Case(
        "retraction: newest first until the survivors fit, down to one",
        views=(decoding(0, prompt=4), decoding(1, prompt=4), decoding(2, prompt=4)),
        free=Pools(0, 0, 0),
        want=StepPlan(decodes=(0,), retracts=(2, 1)),
        left=Pools(1, 1, 2),
        tokens_left=8,
    ),
    Case(
        "retraction: a victim frees its SWA pages as well as its full pages",
        views=(decoding(0, prompt=8, swa=1), decoding(1, prompt=8, swa=1)),
        free=Pools(4, 1, 0),  # full pages to spare, SWA short by one
        want=StepPlan(decodes=(0,), retracts=(1,)),
        left=Pools(5, 1, 1),
        tokens_left=8,
    ),
    Case(
        "resume: a retracted request comes back before new admissions",
        views=(retracted(0, prompt=4, generated=2), waiting(1, prompt=4)),
        free=Pools(10, 10, 2),
        want=StepPlan(resumes=(0,), admits=(1,), chunks=((1, 4),)),
        left=Pools(7, 7, 0),
        tokens_left=4,
    ),
    Case(
        "resume: short pools make it wait, and it blocks newer arrivals",
        views=(retracted(0, prompt=4, generated=2), waiting(1, prompt=1)),
        free=Pools(1, 1, 2),
        total=Pools(10, 10, 2),
        want=StepPlan(waiting=(0, "waits for 2 full pages (have 1), 2 SWA pages (have 1)")),
        left=Pools(1, 1, 2),
        tokens_left=8,
    ),
    Case(
        "resume: a spent chunk budget holds resumes back (a resume runs no prefill)",
        views=(prefilling(0, prompt=20, computed=4), retracted(1, prompt=4, generated=2)),
        free=Pools(20, 20, 2),
        want=StepPlan(chunks=((0, 8),)),
        left=Pools(18, 18, 2),
        tokens_left=0,
    ),
    # -- PD decode ---------------------------------------------------------------------------
    Case(
        "PD preallocation: full pages for the whole prompt, SWA pages for the window tail",
        views=(preallocating(0, prompt=30),),  # 8 full pages; tokens [20, 30): 3 SWA pages
        free=Pools(10, 3, 2),
        config=PD,
        want=StepPlan(preallocs=(0,)),
        left=Pools(2, 0, 1),
        tokens_left=8,
    ),
    Case(
        "PD preallocation ignores the chunk budget; the pool's limit makes the next wait",
        views=(preallocating(0, 30), preallocating(1, 30), preallocating(2, 30)),
        free=Pools(16, 20, 4),
        total=Pools(20, 20, 4),
        config=PD,
        want=StepPlan(preallocs=(0, 1), waiting=(2, "waits for 8 full pages (have 0)")),
        left=Pools(0, 14, 2),
        tokens_left=8,
    ),
    Case(
        "PD preallocation: request slots bound how many are preallocated",
        views=(preallocating(0, prompt=4), preallocating(1, prompt=4)),
        free=Pools(20, 20, 1),
        total=Pools(20, 20, 2),
        config=PD,
        want=StepPlan(preallocs=(0,), waiting=(1, "waits for 1 request slots (have 0)")),
        left=Pools(19, 19, 0),
        tokens_left=8,
    ),
    Case(
        "PD preallocation: a prompt over the full pool is rejected",
        views=(preallocating(0, prompt=60),),
        free=Pools(10, 10, 2),
        config=PD,
        want=StepPlan(rejects=((0, "needs 16 full KV pages, the pool has 10"),)),
        left=Pools(10, 10, 2),
        tokens_left=8,
    ),
    Case(
        "PD preallocation: a window tail over the SWA pool is rejected",
        views=(preallocating(0, prompt=30),),  # 3 SWA tail pages
        free=Pools(10, 2, 2),
        config=PD,
        want=StepPlan(rejects=((0, "cannot preallocate: needs 3 SWA pages (have 2) in total"),)),
        left=Pools(10, 2, 2),
        tokens_left=8,
    ),
    Case(
        "PD transfer: requests whose KV is arriving are not planned (an idle step)",
        views=(arriving(0, prompt=30, config=PD),),
        free=Pools(2, 0, 1),
        config=PD,
        want=StepPlan(),
        left=Pools(2, 0, 1),
        tokens_left=8,
    ),
    Case(
        "PD transfer: an arriving request's decode headroom is reserved",
        views=(arriving(0, prompt=8, config=PD, max_new=17), preallocating(1, prompt=4)),
        # 17 future tokens after the 8 arrived: 4 full pages beyond the next token's
        free=Pools(4, 5, 1),
        config=PD,
        ratio=1.0,
        want=StepPlan(waiting=(1, "waits for 1 full pages (have 0)")),
        left=Pools(4, 5, 1),
        tokens_left=8,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plan_step_table(case: Case) -> None:
    total = case.total or pools_plus(case.free, held_by(case.views))
    plan = plan_step(case.views, case.free, total, case.config, case.ratio)
    assert plan == case.want
    assert left_after(plan, case.views, case.free, case.config) == case.left
    assert case.config.chunk_tokens - sum(t for _, t in plan.chunks) == case.tokens_left
    assert plan.idle == (plan == StepPlan(waiting=plan.waiting))  # waiting alone does nothing


def test_case_names_are_unique() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
