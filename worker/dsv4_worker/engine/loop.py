"""The engine loop: carries out the scheduler's plan (the only place requests touch the pools),
runs the paged forward, samples, finishes requests and frees their pages.

    step():  views -> plan_step (pure)
             rejects / retracts (CPU offload) / resumes (reload) / admits (open a slot)
             decode and extend the page tables, run one batch, sample, finish, evict the window

NOTE: every pool is back to zero used units once every request has finished; `check_integrity`
runs whenever the engine goes idle.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_worker.engine.paged import PagedModel, Segment
from dsv4_worker.engine.sampler import SamplingParams, make_generator, sample
from dsv4_worker.mem.errors import KVMemoryError
from dsv4_worker.mem.offload import OffloadedRequest, offload_request, reload_request
from dsv4_worker.sched.budget import NOTHING, Capacity, Need
from dsv4_worker.sched.scheduler import Phase, ReqView, SchedulerConfig, StepPlan, plan_step

FinishReason = Literal["stop", "length", "error", "abort"]

# new-token ratio: the share of each running request's remaining tokens reserved as decode
# headroom; back to the maximum after a retraction, then decaying step by step.
RATIO_MAX, RATIO_MIN, RATIO_DECAY = 1.0, 0.1, 0.002


@dataclass(slots=True)
class Request:
    rid: int
    prompt: tuple[int, ...]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    slot: int | None = None
    num_tokens: int = 0  # tokens whose KV is in the pools (or in the snapshot)
    snapshot: OffloadedRequest | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    retractions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, paged: PagedModel, config: SchedulerConfig) -> None:
        self.paged = paged
        self.mem = paged.memory
        self.config = config
        self.requests: dict[int, Request] = {}  # unfinished, by rid
        self._rids = itertools.count()
        self.new_token_ratio = RATIO_MAX
        self.steps = 0
        self.waits: dict[str, int] = {}  # why the head of the queue waited -> steps
        totals = {u.pool: u.total for u in self.mem.usage()}
        self.total = Capacity(totals["full"], totals["swa"], totals["req_slots"])

    # -- requests --------------------------------------------------------------------------------

    def submit(self, prompt: tuple[int, ...] | list[int], params: SamplingParams) -> Request:
        if not prompt:
            raise ValueError("prompt: must hold at least one token")
        req = Request(next(self._rids), tuple(prompt), params)
        req.generator = make_generator(params, self.mem.device)
        self.requests[req.rid] = req
        return req

    def abort(self, rid: int) -> None:
        """End a request at once (a client went away): its pages are freed now."""
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req, "abort")

    @property
    def idle(self) -> bool:
        return not self.requests

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Plan and run one batch; returns the requests that finished in it."""
        self.steps += 1
        finished: list[Request] = []
        plan = plan_step(
            self._views(),
            self._free(),
            self.total,
            self.config,
            self.new_token_ratio,
        )
        self._apply_admin(plan, finished)
        if plan.waiting is not None:
            why = plan.waiting[1]
            self.waits[why] = self.waits.get(why, 0) + 1
        segments, sample_at = self._grow(plan)
        if segments:
            logits = self.paged.forward(segments)
            greedy = logits.argmax(dim=-1).tolist()  # one sync for every greedy request
            for i, req in sample_at:
                token = (
                    greedy[i]
                    if req.generator is None
                    else sample(logits[i], req.params, req.generator)
                )
                self._accept(req, token, finished)
        self.mem.pages.evict_window()
        if plan.retracts:
            self.new_token_ratio = RATIO_MAX
        else:
            self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)
        if self.idle:
            self.mem.check_integrity()
        return finished

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise RuntimeError(f"engine not idle after {max_steps} steps")

    # -- plan application --------------------------------------------------------------------------

    def _apply_admin(self, plan: StepPlan, finished: list[Request]) -> None:
        for rid, why in plan.rejects:
            req = self.requests[rid]
            req.error = why
            self._finish(req, "error")
            finished.append(req)
        for rid in plan.retracts:
            req = self.requests[rid]
            assert req.slot is not None
            req.snapshot = offload_request(self.mem, req.slot)
            req.slot, req.phase = None, Phase.RETRACTED
            req.retractions += 1
        for rid in plan.resumes:
            req = self.requests[rid]
            assert req.snapshot is not None
            req.slot = reload_request(self.mem, req.snapshot)
            req.snapshot = None
            req.phase = Phase.DECODE if req.num_tokens >= len(req.prompt) else Phase.PREFILL
        for rid in plan.admits:
            req = self.requests[rid]
            req.slot = int(self.mem.open(1)[0])
            req.phase = Phase.PREFILL

    def _grow(self, plan: StepPlan) -> tuple[list[Segment], list[tuple[int, Request]]]:
        """Grow the page tables by this step's tokens; the batch's segments and which segment
        each sampling request reads its logits from."""
        dev = self.mem.device
        segments: list[Segment] = []
        sample_at: list[tuple[int, Request]] = []
        decoders = [self.requests[rid] for rid in plan.decodes]
        if decoders:
            slots = torch.tensor([r.slot for r in decoders], dtype=torch.int64, device=dev)
            try:  # the command checks before it writes: no separate can_decode pass
                self.mem.pages.decode(slots)
            except KVMemoryError as exc:
                raise AssertionError(
                    f"the scheduler planned a decode the allocator refuses: {exc}"
                ) from exc
            for req in decoders:
                assert req.slot is not None
                sample_at.append((len(segments), req))
                segments.append(Segment(req.slot, req.num_tokens, (req.output[-1],)))
                req.num_tokens += 1
        for rid, tokens in plan.chunks:
            req = self.requests[rid]
            assert req.slot is not None
            slot = torch.tensor([req.slot], dtype=torch.int64, device=dev)
            count = torch.tensor([tokens], dtype=torch.int64, device=dev)
            try:
                self.mem.pages.extend(slot, count)
            except KVMemoryError as exc:
                raise AssertionError(
                    f"the scheduler planned a chunk the allocator refuses: {exc}"
                ) from exc
            start = req.num_tokens
            segments.append(Segment(req.slot, start, req.prompt[start : start + tokens]))
            req.num_tokens += tokens
            if req.num_tokens == len(req.prompt):
                sample_at.append((len(segments) - 1, req))
                req.phase = Phase.DECODE
        return segments, sample_at

    def _accept(self, req: Request, token: int, finished: list[Request]) -> None:
        req.output.append(token)
        if token in req.params.stop_token_ids:
            self._finish(req, "stop")
        elif len(req.output) >= req.params.max_new_tokens:
            self._finish(req, "length")
        else:
            return
        finished.append(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.slot is not None:
            self.mem.free(torch.tensor([req.slot], dtype=torch.int64, device=self.mem.device))
            req.slot = None
        req.snapshot = None
        req.finish_reason = reason
        self.requests.pop(req.rid, None)

    # -- views for the scheduler -------------------------------------------------------------------

    def _free(self) -> Capacity:
        free = {u.pool: u.free for u in self.mem.usage()}
        return Capacity(free["full"], free["swa"], free["req_slots"])

    def _views(self) -> list[ReqView]:
        """Every unfinished request as the scheduler sees it. Pages held follow from the page
        table's invariant (columns below ceil(n/P) have a full page; those at or past
        swa_start/P also an SWA page): two host reads for the whole batch."""
        page = self.config.page_size
        pages = self.mem.pages
        num_tokens = pages.num_tokens.tolist()
        swa_start = pages.swa_start_tokens.tolist()
        views = []
        for req in self.requests.values():
            held = resume = NOTHING
            if req.slot is not None:
                full = pages_for_tokens(num_tokens[req.slot], page)
                held = Need(full, max(0, full - swa_start[req.slot] // page), 1)
            if req.snapshot is not None:
                full = pages_for_tokens(req.snapshot.num_tokens, page)
                resume = Need(full, int(req.snapshot.swa_mask.sum()))
            views.append(
                ReqView(
                    rid=req.rid,
                    phase=req.phase,
                    prompt_len=len(req.prompt),
                    max_new_tokens=req.params.max_new_tokens,
                    num_tokens=req.num_tokens,
                    generated=len(req.output),
                    held=held,
                    resume=resume,
                )
            )
        return views
