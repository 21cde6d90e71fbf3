"""The step sources of a PP group's engines (`engine.steps`): the leader (rank 0) plans and
records what it did; the followers replay it. Every stage runs its own layers of every batch.

    leader:    plan -> broadcast StepOrder(changes, plan, check) -> execute
    follower:  receive StepOrder -> replay changes -> check -> execute
    execute:   admission and page tables (every stage, identically), then
               [recv hidden] -> own layers -> [send hidden | logits, sample]
               -> all-gather Sampled from the last stage (a barrier) -> accept tokens

Admission uses the group's capacity, the minimum over its stages (`EngineConfig.schedulable`),
so an operation the leader plans fits every stage; since every stage runs the same allocator
operations in the same order, slots and page numbers agree too (checked each step). When a
link fails every stage fails every request, frees everything and refuses new work: the group
is one unit.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dsv4_worker.engine.changes import (
    Abort,
    Change,
    CompleteTransfer,
    FailTransfer,
    Note,
    Release,
    Submit,
)
from dsv4_worker.engine.failures import Failure, batch_failure
from dsv4_worker.engine.loop import (
    DuplicateRequest,
    Engine,
    Request,
    SampleAt,
    Scored,
    ends_with,
    scored_segments,
)
from dsv4_worker.engine.paged import Segment
from dsv4_worker.engine.role import Place
from dsv4_worker.pp.link import PipeLink, StageLost
from dsv4_worker.pp.order import Check, Sampled, StepOrder
from dsv4_worker.sched.scheduler import RequestId

HEARTBEAT_S = 1.0  # an idle leader runs an empty step this often: a dead stage shows at once


def stage_batch(
    engine: Engine,
    link: PipeLink,
    segments: list[Segment],
    sample_at: SampleAt,
    score_at: SampleAt,
) -> Scored:
    """One stage's part of a batch: its layers (hidden states in from the previous stage,
    out to the next), tokens sampled on the last stage and gathered by every stage. A stage
    whose forward raises still sends (zeros) and says so in the gather: every stage then
    fails the batch's requests (`failures`), and the group goes on."""
    paged = engine.paged
    stage = paged.stage
    out: torch.Tensor | None = None
    broken: Failure | None = None  # this stage's forward raised
    if segments:
        hidden = None
        tokens = sum(len(s.token_ids) for s in segments)
        if not stage.first:
            hidden = link.recv_hidden((tokens, paged.hidden_size), paged.dtype)
        every = scored_segments(len(segments), score_at) if score_at else ()
        try:
            out = paged.forward_stage(segments, hidden, every)
        except Exception as exc:
            broken = batch_failure(exc)
        if not stage.last:
            shape, dev = (tokens, paged.hidden_size), engine.mem.device
            link.send_hidden(
                out if out is not None else torch.zeros(shape, dtype=paged.dtype, device=dev)
            )
    sampled: Sampled | Failure | None = broken
    if stage.last:
        scored = Scored([], [], [])
        if out is not None:
            scored = engine.sample(out, segments, sample_at, score_at)
        sampled = Sampled(
            tuple(scored.tokens),
            _handoff_states(sample_at, scored.tokens) if broken is None else (),
            tuple(scored.logprobs),
            tuple(scored.prompt),
            tuple(scored.failed.items()),
            broken,
        )
    # All-gather, not a broadcast: it also makes the end of a step a barrier, so once the
    # leader's step is over every stage has applied its order and finished the step
    # before (what the PD prefill leader waits for before saying a request is settled).
    gathered = link.all_gather(sampled)
    last = gathered[-1]
    assert isinstance(last, Sampled)
    batch = next((f for f in (*gathered[:-1], last.batch) if f is not None), None)
    if batch is not None:
        assert isinstance(batch, Failure)
        return Scored([], [], [], batch=batch)
    for rid, state in last.generator_states:
        req = engine.requests.get(rid)
        if req is not None and req.generator is not None and not stage.last:
            req.generator.set_state(state)
    return Scored(
        list(last.tokens), list(last.logprobs), list(last.prompt_logprobs), dict(last.failed)
    )


def _handoff_states(sample_at: SampleAt, tokens: list[int]) -> tuple[tuple[RequestId, Any], ...]:
    """Generator states of seeded requests this token finishes while they keep their
    pages (the PD prefill sends the state to decode from the leader)."""
    out = []
    for (_, req), token in zip(sample_at, tokens, strict=True):
        if req.generator is not None and req.keep_pages and ends_with(req, token):
            out.append((req.rid, req.generator.get_state()))
    return tuple(out)


def state_check(engine: Engine) -> Check:
    """What a follower compares with the leader's: pool usage and the rid -> slot map."""
    used = tuple((u.pool, u.used) for u in engine.mem.usage())
    slots = tuple((r.rid, r.slot) for r in engine.requests.values() if r.slot is not None)
    return Check(used, slots)


class Leader:
    """PP rank 0: plans every step and broadcasts it with the changes it recorded since."""

    place = Place.LEADER
    always_run_batch = True  # every stage takes part in every step's exchange

    def __init__(self, link: PipeLink) -> None:
        self.link = link
        self._changes: list[Change] = []
        self._last_step_s = time.monotonic()

    def has_work(self, engine: Engine) -> bool:
        if engine.failure is not None:
            return False
        due = time.monotonic() - self._last_step_s >= HEARTBEAT_S
        return engine.runnable or bool(self._changes) or due

    def step(self, engine: Engine) -> list[Request]:
        if engine.failure is not None:
            return []
        plan = engine.plan()
        order = StepOrder(tuple(self._changes), plan, state_check(engine))
        self._changes.clear()
        self._last_step_s = time.monotonic()
        try:
            self.link.broadcast(order, src=0)
            return engine.execute(plan)
        except StageLost as exc:
            return engine.fail_all(str(exc))

    def run_batch(
        self, engine: Engine, segments: list[Segment], sample_at: SampleAt, score_at: SampleAt
    ) -> Scored:
        return stage_batch(engine, self.link, segments, sample_at, score_at)

    def record(self, change: Change) -> None:
        self._changes.append(change)

    def close(self, engine: Engine) -> None:
        if engine.failure is None:
            try:
                self.link.broadcast(StepOrder(stop=True), src=0)
            except StageLost:
                return
        self.link.close()


class Follower:
    """PP ranks 1..n-1: replay the leader's orders; never plan, never take requests."""

    place = Place.FOLLOWER
    always_run_batch = True

    def __init__(self, link: PipeLink) -> None:
        self.link = link
        self.stopped = False  # the leader's stop order came

    def has_work(self, engine: Engine) -> bool:
        return not self.stopped and engine.failure is None

    def step(self, engine: Engine) -> list[Request]:
        if not self.has_work(engine):
            return []
        try:
            order = self.link.broadcast(None, src=0)
            assert isinstance(order, StepOrder)
            if order.stop:
                self.stopped = True
                return []
            for change in order.events:
                self._replay(engine, change)
            self._verify(engine, order.check)
            return engine.execute(order.plan)
        except StageLost as exc:
            return engine.fail_all(str(exc))

    def run_batch(
        self, engine: Engine, segments: list[Segment], sample_at: SampleAt, score_at: SampleAt
    ) -> Scored:
        return stage_batch(engine, self.link, segments, sample_at, score_at)

    def record(self, change: Change) -> None:
        """A follower's changes are the leader's, replayed: nobody to tell."""

    def close(self, engine: Engine) -> None:
        if self.stopped:
            self.link.close()

    def _replay(self, engine: Engine, change: Change) -> None:
        match change:
            case Submit():
                self._submit(engine, change)
            case Abort():
                engine.abort(change.rid)
            case Release():
                engine.release(change.rid)
            case CompleteTransfer():
                engine.complete_transfer(
                    change.rid,
                    change.first_token,
                    change.generator_state,
                    change.first_logprob,
                    change.prompt_logprobs,
                )
            case FailTransfer():
                engine.fail_transfer(change.rid, change.why, hold=change.hold)
            case Note():
                engine.events.on_note(change.payload)

    def _submit(self, engine: Engine, e: Submit) -> None:
        # The leader's id: a replica never names a request itself.
        try:
            engine.submit(e.prompt, e.params, rid=e.rid, keep_pages=e.keep_pages, prefill=e.prefill)
        except DuplicateRequest as exc:  # the leader ended it and this replica did not
            raise StageLost(f"PP stage replica diverged from the leader: {exc}") from exc

    def _verify(self, engine: Engine, leader: Check) -> None:
        own = state_check(engine)
        if leader != own:
            raise StageLost(
                f"PP stage {self.link.rank} diverged from the leader: leader {leader}, "
                f"this stage {own}"
            )
