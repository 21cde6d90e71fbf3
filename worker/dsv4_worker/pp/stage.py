"""The engines of a PP group: the leader (rank 0) schedules and records what it did; the
followers replay it. Every stage runs its own layers of every batch.

    leader:    plan -> broadcast StepOrder(events, plan, check) -> execute
    follower:  receive StepOrder -> apply events -> check -> execute
    execute:   admission and page tables (every stage, identically), then
               [recv hidden] -> own layers -> [send hidden | logits, sample]
               -> all-gather Sampled from the last stage (a barrier) -> accept tokens

Admission uses the group's capacity, the minimum over its stages, so an operation the leader
plans fits every stage; since every stage runs the same allocator operations in the same
order, slots and page numbers agree too (checked each step). When a link fails every stage
fails every request, frees everything and refuses new work: the group is one unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dsv4_worker.engine.logprobs import TokenLogprob
from dsv4_worker.engine.loop import (
    Engine,
    Hook,
    Request,
    SampleAt,
    Scored,
    ends_with,
    scored_segments,
)
from dsv4_worker.engine.paged import PagedModel, Segment
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.pp.link import PipeLink, StageLost
from dsv4_worker.pp.order import (
    Abort,
    Check,
    CompleteTransfer,
    Event,
    FailTransfer,
    Note,
    Release,
    Sampled,
    StepOrder,
    Submit,
)
from dsv4_worker.sched.budget import Capacity
from dsv4_worker.sched.scheduler import SchedulerConfig

HEARTBEAT_S = 1.0  # an idle leader runs an empty step this often: a dead stage shows at once


class StageEngine(Engine):
    """One stage's engine: its layers of every batch, tokens from the last stage."""

    always_run_batch = True

    def __init__(
        self,
        paged: PagedModel,
        config: SchedulerConfig,
        link: PipeLink,
        group_total: Capacity,
        *,
        on_prealloc: Hook | None = None,
        on_cancel: Hook | None = None,
    ) -> None:
        super().__init__(paged, config, on_prealloc=on_prealloc, on_cancel=on_cancel)
        self.link = link
        self.own_total = self.total
        self.total = group_total  # what the leader's scheduler may hand out

    def _free(self) -> Capacity:
        """Free units of the group: this stage's free minus what the smallest stage lacks."""
        own = super()._free()
        t, g = self.own_total, self.total
        return Capacity(
            own.full_pages - (t.full_pages - g.full_pages),
            own.swa_pages - (t.swa_pages - g.swa_pages),
            own.request_slots - (t.request_slots - g.request_slots),
        )

    def run_batch(
        self, segments: list[Segment], sample_at: SampleAt, score_at: SampleAt = ()
    ) -> Scored:
        stage, link = self.paged.stage, self.link
        out: torch.Tensor | None = None
        if segments:
            hidden = None
            if not stage.first:
                tokens = sum(len(s.token_ids) for s in segments)
                hidden = link.recv_hidden((tokens, self.paged.hidden_size), self.paged.dtype)
            every = scored_segments(len(segments), score_at) if score_at else ()
            out = self.paged.forward_stage(segments, hidden, every)
            if not stage.last:
                link.send_hidden(out)
        sampled = None
        if stage.last:
            scored = (
                self.sample(out, segments, sample_at, score_at)
                if out is not None
                else Scored([], [], [])
            )
            sampled = Sampled(
                tuple(scored.tokens),
                self._handoff_states(sample_at, scored.tokens),
                tuple(scored.logprobs),
                tuple(scored.prompt),
            )
        # All-gather, not a broadcast: it also makes the end of a step a barrier, so once the
        # leader's step is over every stage has applied its order and finished the step
        # before (what the PD prefill leader waits for before saying a request is settled).
        sampled = link.all_gather(sampled)[-1]
        assert isinstance(sampled, Sampled)
        for rid, state in sampled.generator_states:
            req = self.requests.get(rid)
            if req is not None and req.generator is not None and not stage.last:
                req.generator.set_state(state)
        return Scored(list(sampled.tokens), list(sampled.logprobs), list(sampled.prompt_logprobs))

    def _handoff_states(
        self, sample_at: SampleAt, tokens: list[int]
    ) -> tuple[tuple[int, Any], ...]:
        """Generator states of seeded requests this token finishes while they keep their
        pages (the PD prefill sends the state to decode from the leader)."""
        out = []
        for (_, req), token in zip(sample_at, tokens, strict=True):
            if req.generator is not None and req.keep_pages and ends_with(req, token):
                out.append((req.rid, req.generator.get_state()))
        return tuple(out)

    def _check(self) -> Check:
        used = tuple((u.pool, u.used) for u in self.mem.usage())
        slots = tuple((r.rid, r.slot) for r in self.requests.values() if r.slot is not None)
        return Check(used, slots)


class LeaderEngine(StageEngine):
    """PP rank 0: schedules, records every change for the followers, serves the API."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._events: list[Event] = []
        self._last_step_s = time.monotonic()

    @property
    def has_work(self) -> bool:
        if self.failure is not None:
            return False
        due = time.monotonic() - self._last_step_s >= HEARTBEAT_S
        return super().has_work or bool(self._events) or due

    def step(self) -> list[Request]:
        if self.failure is not None:
            return []
        plan = self.plan()
        order = StepOrder(tuple(self._events), plan, self._check())
        self._events.clear()
        self._last_step_s = time.monotonic()
        try:
            self.link.broadcast(order, src=0)
            return self.execute(plan)
        except StageLost as exc:
            return self.fail_all(str(exc))

    def close(self) -> None:
        if self.failure is None:
            try:
                self.link.broadcast(StepOrder(stop=True), src=0)
            except StageLost:
                return
        self.link.close()

    # -- recorded changes ------------------------------------------------------------------------

    def submit(
        self,
        prompt: tuple[int, ...] | list[int],
        params: SamplingParams,
        *,
        keep_pages: bool = False,
        prefill: str | None = None,
    ) -> Request:
        req = super().submit(prompt, params, keep_pages=keep_pages, prefill=prefill)
        self._events.append(Submit(req.rid, req.prompt, params, keep_pages, prefill))
        return req

    def abort(self, rid: int) -> None:
        super().abort(rid)
        self._events.append(Abort(rid))

    def release(self, rid: int) -> None:
        super().release(rid)
        self._events.append(Release(rid))

    def complete_transfer(
        self,
        rid: int,
        first_token: int,
        generator_state: torch.Tensor | None = None,
        first_logprob: TokenLogprob | None = None,
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        super().complete_transfer(rid, first_token, generator_state, first_logprob, prompt_logprobs)
        self._events.append(
            CompleteTransfer(rid, first_token, generator_state, first_logprob, prompt_logprobs)
        )

    def fail_transfer(self, rid: int, why: str) -> None:
        super().fail_transfer(rid, why)
        self._events.append(FailTransfer(rid, why))

    def note(self, payload: Any) -> None:
        self._events.append(Note(payload))


class FollowerEngine(StageEngine):
    """PP ranks 1..n-1: replay the leader's orders; never plan, never take requests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stopped = False
        self.on_note: Callable[[Any], None] | None = None  # the follower side of `note`
        self._apply: dict[type, Callable[[Any], None]] = {
            Note: self._note,
            Submit: self._submit,
            Abort: lambda e: Engine.abort(self, e.rid),
            Release: lambda e: Engine.release(self, e.rid),
            CompleteTransfer: lambda e: Engine.complete_transfer(
                self, e.rid, e.first_token, e.generator_state, e.first_logprob, e.prompt_logprobs
            ),
            FailTransfer: lambda e: Engine.fail_transfer(self, e.rid, e.why),
        }

    @property
    def has_work(self) -> bool:
        return not self.stopped and self.failure is None

    def step(self) -> list[Request]:
        if not self.has_work:
            return []
        try:
            order = self.link.broadcast(None, src=0)
            assert isinstance(order, StepOrder)
            if order.stop:
                self.stopped = True
                return []
            for event in order.events:
                self._apply[type(event)](event)
            self._verify(order.check)
            return self.execute(order.plan)
        except StageLost as exc:
            return self.fail_all(str(exc))

    def close(self) -> None:
        if self.stopped:
            self.link.close()

    def _note(self, e: Note) -> None:
        if self.on_note is not None:
            self.on_note(e.payload)

    def _submit(self, e: Submit) -> None:
        req = Engine.submit(self, e.prompt, e.params, keep_pages=e.keep_pages, prefill=e.prefill)
        if req.rid != e.rid:
            raise StageLost(f"PP stage replica diverged: request id {req.rid} != leader's {e.rid}")

    def _verify(self, leader: Check) -> None:
        own = self._check()
        if leader != own:
            raise StageLost(
                f"PP stage {self.link.rank} diverged from the leader: leader {leader}, "
                f"this stage {own}"
            )
