"""The engine's steady-decode shortcut (`Engine._steady_decode`) returns exactly the plan the
scheduler (`plan_step`) returns whenever it returns one, on engine states reached by random
workloads: arrivals mid-decode, prompts spanning pages, pools small enough to force page
rollovers that do not fit, retraction and resume. The model is a no-op (the plan does not
depend on the tokens' values)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mem_helpers import small_memory

from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import Segment
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.sched.scheduler import ReqView, SchedulerConfig, StepPlan, plan_step

VOCAB = 256


class NoOpModel:
    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory

    def forward(self, segments: Sequence[Segment]) -> torch.Tensor:
        logits = torch.zeros(len(segments), VOCAB)
        logits[:, 7] = 1.0  # never a stop id below
        return logits


def _engine(full_pages: int, swa_pages: int, slots: int) -> Engine:
    memory = small_memory(
        full_pages=full_pages,
        swa_pages=swa_pages,
        slots=slots,
        max_pages=full_pages,
    )
    config = SchedulerConfig(
        page_size=16,
        chunk_tokens=32,
        max_tokens_per_request=memory.config.max_tokens_per_request,
        retained_tokens=memory.config.retained_tokens,
    )
    return Engine(NoOpModel(memory), EngineConfig(config))  # type: ignore[arg-type]


def _scheduler_plan(eng: Engine) -> StepPlan:
    return plan_step(
        eng._views(), eng._free(), eng.total, eng.config.scheduler, eng.new_token_ratio
    )


Arrival = tuple[int, int, int]  # (step, prompt tokens, max new tokens)


def _run(eng: Engine, arrivals: Sequence[Arrival], steps: int) -> tuple[int, int, int]:
    """Drive the engine; at every step compare the shortcut with the scheduler. Returns how
    often the shortcut answered, how often it declined, and how many retractions ran."""
    answered = declined = retracted = 0
    for step in range(steps):
        for at, prompt, new in arrivals:
            if at == step:
                eng.submit([3] * prompt, SamplingParams(max_new_tokens=new))
        if eng.idle:
            continue
        want = _scheduler_plan(eng)
        got = eng._steady_decode(eng._free())
        if got is None:
            declined += 1
        else:
            answered += 1
            assert got == want
        retracted += len(want.retracts)
        eng.execute(want)
    return answered, declined, retracted


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 40), st.integers(1, 60)),
        min_size=1,
        max_size=8,
    ),
    full_pages=st.integers(8, 24),
    swa_pages=st.integers(6, 16),
)
def test_the_shortcut_agrees_with_the_scheduler(
    arrivals: list[Arrival], full_pages: int, swa_pages: int
) -> None:
    eng = _engine(full_pages, swa_pages, slots=4)
    _run(eng, arrivals, steps=120)
    eng.run_until_idle()
    eng.mem.check_integrity()


def test_it_answers_the_steady_state_and_declines_under_pressure() -> None:
    """A case where both happen: four requests decode past page boundaries in a pool too
    small for all of them, so rollovers that do not fit go to the scheduler, which retracts."""
    eng = _engine(full_pages=13, swa_pages=16, slots=4)  # as test_engine's retraction case
    arrivals = [(0, 30, 40), (0, 28, 40), (0, 33, 40), (0, 26, 40)]
    answered, declined, retracted = _run(eng, arrivals, steps=150)
    assert answered > 20 and declined > 3 and retracted > 0, (answered, declined, retracted)
    eng.run_until_idle()
    eng.mem.check_integrity()


def test_views_carry_each_field_by_name() -> None:
    """Engine._views builds ReqViews positionally: each field must hold what its name says."""
    eng = _engine(full_pages=13, swa_pages=16, slots=4)
    _run(eng, [(0, 30, 40), (0, 5, 9), (3, 20, 40)], steps=6)
    page = eng.config.scheduler.page_size
    for view in eng._views():
        req = eng.requests[view.rid]
        assert view == ReqView(
            rid=req.rid,
            phase=req.phase,
            prompt_len=len(req.prompt),
            max_new_tokens=req.params.max_new_tokens,
            num_tokens=req.num_tokens,
            generated=len(req.output),
            held=view.held,
            resume=view.resume,
            seq=req.seq,
        )
        if req.slot is not None:
            assert view.held.full_pages == -(-req.num_tokens // page)
            assert view.held.request_slots == 1
