"""The engine loop: carries out the scheduler's plan (the only place requests touch the pools),
runs the paged forward, samples, finishes requests and frees their pages.

    step():  views -> plan_step (pure)
             rejects / retracts (CPU offload) / resumes (reload) / admits (open a slot)
             decode and extend the page tables, run one batch, sample, finish, evict the window

One engine class for every role and place (`role.EngineConfig`, fixed when it is built):
what differs is told by its config's role, its events (`events.EngineEvents`, the PD agent)
and its step source (`steps.StepSource`: planning alone, or leading or following a PP group).

PD disaggregation uses the same loop. A prefill worker submits with `keep_pages=True`: a
finished request keeps its pages (in `held`) until the transfer is done and `release` frees
them. In a decode engine (role decode) requests start in PREALLOC, the scheduler
preallocates them (full pages for the prompt, SWA for the window tail), and
`complete_transfer` turns them into decoders with the first token. Two events tell the
prefill side: `on_admit` as soon as the step's plan admits a request (prefill starts
computing while this step allocates and runs its batch), `on_prealloc` once its pages exist
on every stage (where to write). A request aborted while its KV may still be landing keeps
its pages until the prefill side confirms (`on_cancel`, then `release`/`fail_transfer`).

Every change made outside a step (submit, abort, release, transfers, notes) is reported to
the step source once made (`changes`): a PP leader's followers replay them in order.

NOTE: every pool is back to zero used units once every request has finished and every held
request was released; `check_integrity` checks it once the engine has stayed idle a while
(`check_if_idle`: off every request's latency path).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, NamedTuple

import numpy as np
import torch

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_worker.engine.changes import (
    Abort,
    CompleteTransfer,
    FailTransfer,
    Note,
    Release,
    Submit,
)
from dsv4_worker.engine.events import NO_EVENTS, EngineEvents
from dsv4_worker.engine.failures import Failure, batch_failure, failure_of
from dsv4_worker.engine.grammar import GrammarCompiler, Matcher, allowed_tokens
from dsv4_worker.engine.logprobs import TokenLogprob, row_layout, token_logprobs
from dsv4_worker.engine.paged import PagedModel, Segment
from dsv4_worker.engine.penalties import Processed, TokenCounts, apply_processors, penalized
from dsv4_worker.engine.role import EngineConfig, Role
from dsv4_worker.engine.sampler import SamplingParams, draw, greedy_tokens, make_generator
from dsv4_worker.engine.steps import Planner, StepSource
from dsv4_worker.mem.errors import KVMemoryError
from dsv4_worker.mem.offload import OffloadedRequest, offload_request, reload_request
from dsv4_worker.sched.budget import NOTHING, Need, PoolRoom
from dsv4_worker.sched.scheduler import Phase, RequestId, ReqView, StepPlan, plan_step

FinishReason = Literal["stop", "length", "error", "abort"]

# new-token ratio: the share of each running request's remaining tokens reserved as decode
# headroom; back to the maximum after a retraction, then decaying step by step.
RATIO_MAX, RATIO_MIN, RATIO_DECAY = 1.0, 0.1, 0.002


@dataclass(slots=True)
class Request:
    rid: RequestId  # its one id, from the caller (unique among the engine's requests)
    prompt: tuple[int, ...]
    params: SamplingParams
    seq: int = 0  # arrival number in this engine (the scheduler's order: smaller = older)
    output: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    slot: int | None = None
    num_tokens: int = 0  # tokens whose KV is in the pools (or in the snapshot)
    snapshot: OffloadedRequest | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # an OpenAI error code for its answer (`failures`)
    generator: torch.Generator | None = None
    retractions: int = 0
    keep_pages: bool = False  # PD prefill: keep the pages after finishing, until release()
    prefill: str | None = None  # PD decode: the prefill instance that computes the prompt
    epoch: int = 0  # PD decode: its pages' grant (`_prealloc`; the same on every PP stage)
    retryable: bool = False  # failed before its first token for a reason another pair may not hit
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt[1:], if asked
    plain: bool = True  # greedy on the raw logits, no logprobs: the batch's argmax serves it
    counts: TokenCounts | None = None  # its tokens for the penalties, kept step by step
    matcher: Matcher | None = None  # params.json_schema's: masks its logits, ends it when done

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


SampleAt = Sequence[tuple[int, "Request"]]  # (segment index, request), in batch order


NO_FAILURES: Final[Mapping[RequestId, Failure]] = MappingProxyType({})


class Scored(NamedTuple):
    """What one batch's logits give: a token per sampling request (in `sample_at` order),
    its logprob entry where the request asks for logprobs, and the prompt logprobs of the
    chunks that score their prompt: (rid, index into `prompt_logprobs`, entries). `failed`:
    the requests whose sampling or scoring raised (their token is meaningless); `batch`: the
    forward itself failed, so every request of the batch fails (`failures`)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    prompt: list[tuple[RequestId, int, tuple[TokenLogprob, ...]]]
    failed: Mapping[RequestId, Failure] = NO_FAILURES
    batch: Failure | None = None


def ends_with(req: Request, token: int) -> FinishReason | None:
    """Why `token`, sampled next, ends `req` (a stop id once `min_tokens` are out, or its
    last allowed token), if it does."""
    if token in req.params.stop_token_ids and len(req.output) >= req.params.min_tokens:
        return "stop"
    if len(req.output) + 1 >= req.params.max_new_tokens:
        return "length"
    return None


class Adjusted(NamedTuple):
    """One step's logit processors: the scores of the requests that have some (row
    `rows[j]` for sample_at entry j) and the tokens of the greedy ones (by entry)."""

    scores: torch.Tensor
    rows: dict[int, int]
    greedy: dict[int, int]


NOTHING_ADJUSTED: Final = Adjusted(torch.empty(0), {}, {})


class DuplicateRequest(ValueError):
    """A request id already in flight here (unfinished, or holding pages until released)."""


class EngineFailed(RuntimeError):
    """The engine cannot serve any more (e.g. its PP group lost a stage)."""


class Engine:
    def __init__(
        self,
        paged: PagedModel,
        config: EngineConfig,
        *,
        events: EngineEvents = NO_EVENTS,
        source: StepSource | None = None,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        """`source`: where its steps come from (None: a single stage's `Planner`); its
        place must be the config's."""
        source = source or Planner()
        if source.place is not config.place:
            raise ValueError(f"a {config.place} engine given a {source.place} step source")
        self.paged = paged
        self.mem = paged.memory
        self.config = config
        self.events = events
        self.source = source
        self.grammar = grammar  # set: requests may carry a json_schema
        # unfinished, by rid; insertion order is arrival order (seq)
        self.requests: dict[RequestId, Request] = {}
        self.held: dict[RequestId, Request] = {}  # finished but holding pages until release()
        self._held_needs: dict[tuple[int, int], Need] = {}  # _views' shared Need per count
        self._finished_between: list[Request] = []  # finished outside step()
        self._seqs = itertools.count()
        # PD decode: numbers each preallocation's grant (plans run in the same order on every
        # stage of a PP group, so a request's epoch is the same on all of them)
        self._epochs = itertools.count(1)
        self.new_token_ratio = RATIO_MAX
        self.steps = 0
        self._idle_since_s: float | None = None  # a step left the engine idle, unchecked since
        # why the head of the queue waited -> steps (reasons name units, never a request id:
        # the keys stay few however many requests pass)
        self.waits: dict[str, int] = {}
        self.failure: str | None = None  # set: the engine cannot serve (fail_all)
        totals = {u.pool: u.total for u in self.mem.usage()}
        self.own_total = PoolRoom(totals["full"], totals["swa"], totals["req_slots"])
        self.total = config.schedulable or self.own_total  # what the scheduler hands out

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self,
        prompt: tuple[int, ...] | list[int],
        params: SamplingParams,
        *,
        rid: RequestId | None = None,
        keep_pages: bool = False,
        prefill: str | None = None,
    ) -> Request:
        """Queue a request under `rid`, the caller's id for it (None: the engine names it
        `req-<arrival number>`). A rid still in flight here raises DuplicateRequest."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        if not prompt:
            raise ValueError("prompt: must hold at least one token")
        seq = next(self._seqs)  # a refused request leaves a gap: only the order matters
        rid = rid if rid is not None else f"req-{seq}"
        if rid in self.requests or rid in self.held:  # (a caller may have chosen that name)
            raise DuplicateRequest(f"request id {rid!r} is already in flight")
        req = Request(rid, tuple(prompt), params, seq, keep_pages=keep_pages)
        if self.config.role is Role.DECODE:
            req.phase, req.prefill = Phase.PREALLOC, prefill
        if params.json_schema is not None:
            if self.grammar is None:
                raise ValueError("json_schema: this engine has no grammar compiler")
            req.matcher = self.grammar.matcher(params.json_schema)
        req.generator = make_generator(params, self.mem.device)
        req.plain = (
            req.generator is None
            and not params.processed
            and params.logprobs is None
            and req.matcher is None
        )
        self.requests[req.rid] = req
        self.source.record(Submit(req.rid, req.prompt, params, keep_pages, prefill))
        return req

    def abort(self, rid: RequestId) -> None:
        """End a request at once (a client went away): its pages are freed now, except while
        its KV may still be landing (PD decode): then they are held until `release`."""
        req = self.requests.get(rid)
        if req is None:
            self.release(rid)  # a held request: the caller gives up waiting for its transfer
        elif self.config.role is Role.DECODE and req.phase is Phase.TRANSFER:
            req.finish_reason = "abort"
            del self.requests[rid]
            self.held[rid] = req
            self.events.on_cancel(req)
        else:
            self._finish(req, "abort")
        self.source.record(Abort(rid))

    def release(self, rid: RequestId) -> None:
        """Free the pages of a held request (its transfer finished, failed or was cancelled)."""
        req = self.held.pop(rid, None)
        if req is not None and req.epoch:
            self.events.on_transfer_end(req)
        if req is not None and req.slot is not None:
            self.mem.free(np.array([req.slot], dtype=np.int64))
            req.slot = None
        self.source.record(Release(rid))

    def complete_transfer(
        self,
        rid: RequestId,
        first_token: int,
        generator_state: torch.Tensor | None = None,
        first_logprob: TokenLogprob | None = None,
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """PD decode: the prompt's KV and state have landed; `first_token` was sampled by the
        prefill side (with the generator state it left behind, and the logprobs it computed
        where the request asks for them). The request decodes next."""
        req = self.requests.get(rid)
        if req is None or req.phase is not Phase.TRANSFER:
            self.release(rid)  # cancelled while in flight: its pages are safe to free now
        else:
            self.events.on_transfer_end(req)
            req.phase = Phase.DECODE
            if generator_state is not None and req.generator is not None:
                req.generator.set_state(generator_state)
            req.prompt_logprobs = list(prompt_logprobs)
            self._accept(req, first_token, self._finished_between, first_logprob)
        self.source.record(
            CompleteTransfer(rid, first_token, generator_state, first_logprob, prompt_logprobs)
        )

    def fail_transfer(self, rid: RequestId, why: str, *, hold: bool = False) -> None:
        """PD decode: the prefill side failed or timed out; the request ends with an error.
        `hold`: a write may still land in its pages (a target that cannot refuse it): they
        stay held until `release`, however the request ended."""
        req = self.requests.get(rid)
        if req is None:
            if not hold:
                self.release(rid)
        else:
            if req.epoch:
                self.events.on_transfer_end(req)
            req.error, req.retryable = why, not req.output  # (before its first token: always)
            if hold:
                req.finish_reason = "error"
                del self.requests[rid]
                self.held[rid] = req
            else:
                self._finish(req, "error")
            self._finished_between.append(req)
        self.source.record(FailTransfer(rid, why, hold))

    def take_finished(self) -> list[Request]:
        """Requests finished outside `step` (transfers completed or failed) since the last
        call."""
        out, self._finished_between = self._finished_between, []
        return out

    @property
    def idle(self) -> bool:
        return not self.requests

    @property
    def has_work(self) -> bool:
        """A step would do something (its step source decides: a PP leader also steps to
        send its changes or a heartbeat, a follower until its leader stops)."""
        return self.source.has_work(self)

    @property
    def runnable(self) -> bool:
        """Some request moves in a step (requests only waiting for their KV to land do not)."""
        return any(r.phase is not Phase.TRANSFER for r in self.requests.values())

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Plan (or, as a PP follower, receive) and run one batch; returns the requests that
        finished in it."""
        return self.source.step(self)

    def plan(self) -> StepPlan:
        """This step's decisions (pure: the scheduler over the requests' views, or the
        steady-decode shortcut where it gives the scheduler's answer)."""
        free = self._free()
        steady = self._steady_decode(free)
        if steady is not None:
            return steady
        return plan_step(
            self._views(),
            free,
            self.total,
            self.config.scheduler,
            self.new_token_ratio,
        )

    def _steady_decode(self, free: PoolRoom) -> StepPlan | None:
        """The plan `plan_step` returns when every request decodes (or awaits its KV, PD) and
        the pools give each decoder its next token: all of them decode, nothing else happens.
        None in any other case, which goes to `plan_step`. Saves building a view per request
        in the common step (a test checks it against `plan_step` on random engine states)."""
        page, decode, transfer = self.config.scheduler.page_size, Phase.DECODE, Phase.TRANSFER
        rids: list[RequestId] = []  # in arrival order (the dict's), as plan_step orders them
        rollovers = 0  # decoders whose next token opens a page (and its SWA page)
        for req in self.requests.values():
            phase = req.phase
            if phase is decode:
                rids.append(req.rid)
                rollovers += req.num_tokens % page == 0
            elif phase is not transfer:
                return None
        if not rids or rollovers > free.full_pages or rollovers > free.swa_pages:
            return None
        return StepPlan(decodes=tuple(rids))

    def execute(self, plan: StepPlan) -> list[Request]:
        """Carry `plan` out: admission, page tables, one batch, sampling, finishing."""
        self.steps += 1
        finished: list[Request] = []
        for rid in plan.preallocs:  # the plan is final: their allocation cannot fail
            self.events.on_admit(self.requests[rid])
        self._apply_admin(plan, finished)
        if plan.waiting is not None:
            why = plan.waiting[1]
            self.waits[why] = self.waits.get(why, 0) + 1
        segments, sample_at, score_at = self._grow(plan)
        if segments or self.source.always_run_batch:
            scored = self.run_batch(segments, sample_at, score_at)
            if scored.batch is not None:
                batch = (*plan.decodes, *(rid for rid, _ in plan.chunks))
                self._fail_each({rid: scored.batch for rid in batch}, finished)
            else:
                self._take(scored, sample_at, finished)
        # After the batch: in a PP group that is after the step's barrier, so every stage has
        # preallocated these requests before the prefill side may write into them.
        for rid in plan.preallocs:
            announced = self.requests.get(rid)
            if announced is not None and announced.phase is Phase.TRANSFER:
                self.events.on_prealloc(announced)
        self.mem.pages.evict_window()
        if plan.retracts:
            self.new_token_ratio = RATIO_MAX
        else:
            self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)
        if not self.idle:
            self._idle_since_s = None
        elif self._idle_since_s is None:
            self._idle_since_s = time.monotonic()
        return finished

    def _take(self, scored: Scored, sample_at: SampleAt, finished: list[Request]) -> None:
        """A batch's results: prompt logprobs and tokens of the requests that did not fail,
        each accepted on its own (one that raises fails alone), then the failed ones end."""
        failed = dict(scored.failed)
        for rid, start, entries in scored.prompt:
            req = self.requests[rid]
            assert len(req.prompt_logprobs) >= start, "prompt chunks are scored in order"
            req.prompt_logprobs[start:] = entries
        for (_, req), token, logprob in zip(sample_at, scored.tokens, scored.logprobs, strict=True):
            if req.rid in failed:
                continue
            try:
                self._accept(req, token, finished, logprob)
            except Exception as exc:
                failed[req.rid] = failure_of("accepting its token", req.rid, exc)
        self._fail_each(failed, finished)

    def _fail_each(self, failed: Mapping[RequestId, Failure], finished: list[Request]) -> None:
        """End each request of `failed` that is still running with its error."""
        for rid, failure in failed.items():
            req = self.requests.get(rid)
            if req is None:
                continue  # it finished on the token it was accepted with
            req.error, req.error_code = failure.why, failure.code
            self._finish(req, "error")
            finished.append(req)

    @property
    def idle_check_pending(self) -> bool:
        """A step left the engine idle and `check_if_idle` has not checked it since."""
        return self._idle_since_s is not None

    def idle_check_due_s(self, settled_s: float) -> float | None:
        """When `check_if_idle(settled_s)` will check (`time.monotonic()`), if it is pending."""
        since = self._idle_since_s
        return None if since is None else since + settled_s

    def check_if_idle(self, settled_s: float = 0.0) -> None:
        """The whole-state check (`check_integrity`, milliseconds) once the engine has stayed
        idle `settled_s` since a step left it idle. The serving loop waits a while, so the
        check delays neither the step's results (a PD prefill's `done`, a client's last token)
        nor a request that arrives right after them."""
        since = self._idle_since_s
        if since is None or not self.idle:
            self._idle_since_s = None
            return
        if time.monotonic() - since >= settled_s:
            self._idle_since_s = None
            self.mem.check_integrity()

    def run_batch(
        self,
        segments: list[Segment],
        sample_at: SampleAt,
        score_at: SampleAt = (),
    ) -> Scored:
        """The forward over the batch, one sampled token per `sample_at` entry, and the
        prompt logprobs of the `score_at` chunks (a PP stage: its layers, over its link)."""
        return self.source.run_batch(self, segments, sample_at, score_at)

    def run_local_batch(
        self,
        segments: list[Segment],
        sample_at: SampleAt,
        score_at: SampleAt = (),
    ) -> Scored:
        """`run_batch` of a single stage: the whole model's forward, sampled here. A forward
        that raises fails the batch (`failures`)."""
        try:
            if score_at:
                logits = self.paged.forward(segments, scored_segments(len(segments), score_at))
            else:
                logits = self.paged.forward(segments)
        except Exception as exc:
            return Scored([], [], [], batch=batch_failure(exc))
        return self.sample(logits, segments, sample_at, score_at)

    @torch.inference_mode()  # the logits are the forward's inference tensors
    def sample(
        self,
        logits: torch.Tensor,
        segments: list[Segment],
        sample_at: SampleAt,
        score_at: SampleAt = (),
    ) -> Scored:
        """Tokens (and logprobs) from a forward's logits: one row per segment, or one per
        token of the `score_at` segments (`logprobs.row_layout`)."""
        prompt: list[tuple[RequestId, int, tuple[TokenLogprob, ...]]] = []
        failed: dict[RequestId, Failure] = {}  # each request's work is its own (`failures`)
        if score_at:
            every = scored_segments(len(segments), score_at)
            rows = row_layout([len(s.token_ids) for s in segments], every)
            for i, req in score_at:
                try:
                    prompt.append(_prompt_logprobs(logits, rows[i], segments[i], req))
                except Exception as exc:
                    failed[req.rid] = failure_of("prompt logprobs", req.rid, exc)
            logits = logits[torch.tensor([last for _, last in rows], device=logits.device)]
        greedy = greedy_tokens(logits)  # one sync for every plain greedy request
        tokens = [greedy[i] for i, _ in sample_at]
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        processed = self._processed(logits, sample_at, failed)
        masks = self._masks(logits, sample_at, failed)
        for j, (i, req) in enumerate(sample_at):
            if req.plain or req.rid in failed:
                continue
            try:
                tokens[j], logprobs[j] = self._pick(logits, i, j, req, tokens[j], processed, masks)
            except Exception as exc:
                failed[req.rid] = failure_of("sampling", req.rid, exc)
        return Scored(tokens, logprobs, prompt, failed)

    def _pick(
        self,
        logits: torch.Tensor,
        i: int,
        j: int,
        req: Request,
        token: int,
        processed: Adjusted,
        masks: dict[int, torch.Tensor],
    ) -> tuple[int, TokenLogprob | None]:
        """The token (and logprob entry) of sample_at entry `j`, a request that is not plain,
        from logits row `i`; `token`, the batch's argmax, when nothing changes it."""
        p = req.params
        k = processed.rows.get(j)
        if j in masks:  # the grammar last, on what the processors left
            scores = logits[i] if k is None else processed.scores[k]
            token = draw(scores.masked_fill(~masks[j], float("-inf")), p, req.generator)
        elif j in processed.greedy:
            token = processed.greedy[j]
        elif req.generator is not None or p.processed:
            token = draw(logits[i] if k is None else processed.scores[k], p, req.generator)
        logprob = None
        if p.logprobs is not None:
            logprob = token_logprobs(logits[i : i + 1], [token], p.logprobs)[0]
        return token, logprob

    def _processed(
        self, logits: torch.Tensor, sample_at: SampleAt, failed: dict[RequestId, Failure]
    ) -> Adjusted:
        """The logit processors of every request that has one, batched, and the tokens of
        the greedy ones among them (one argmax). When the batch raises, each request runs
        alone: one that raises again goes into `failed`, the others keep their results."""
        todo = [
            (j, i, req)
            for j, (i, req) in enumerate(sample_at)
            if not req.plain and req.params.processed and req.rid not in failed
        ]
        if not todo:  # the usual step: one pass, nothing built
            return NOTHING_ADJUSTED
        try:
            return self._process(logits, sample_at, todo)
        except Exception:
            pass  # find the request at fault (a TokenCounts catch-up is idempotent)
        kept = []
        for entry in todo:
            try:
                self._process(logits, sample_at, [entry])
            except Exception as exc:
                failed[entry[2].rid] = failure_of("logit processors", entry[2].rid, exc)
            else:
                kept.append(entry)
        return self._process(logits, sample_at, kept) if kept else NOTHING_ADJUSTED

    def _process(
        self, logits: torch.Tensor, sample_at: SampleAt, todo: Sequence[tuple[int, int, Request]]
    ) -> Adjusted:
        batch: list[Processed] = []
        at: list[int] = []
        for j, i, req in todo:
            if req.counts is None and penalized(req.params):
                req.counts = TokenCounts.new(req.params, req.prompt, logits.device)
            batch.append(Processed(i, req.params, req.output, req.counts))
            at.append(j)
        scores = apply_processors(logits, batch)
        rows = {j: k for k, j in enumerate(at)}
        picks = [k for k, j in enumerate(at) if sample_at[j][1].generator is None]
        if len(picks) == len(at):  # all greedy: no copy
            tops = greedy_tokens(scores)
        else:
            tops = greedy_tokens(scores[picks]) if picks else []
        return Adjusted(scores, rows, {at[k]: t for k, t in zip(picks, tops, strict=True)})

    def _masks(
        self, logits: torch.Tensor, sample_at: SampleAt, failed: dict[RequestId, Failure]
    ) -> dict[int, torch.Tensor]:
        """The allowed tokens of every request with a grammar, batched: sample_at index ->
        bool [vocab]. A request without one costs a test. When the batch raises, each
        matcher runs alone: one that raises again goes into `failed`."""
        index = [
            j
            for j, (_, req) in enumerate(sample_at)
            if req.matcher is not None and req.rid not in failed
        ]
        if not index:
            return {}
        vocab, dev = logits.shape[-1], logits.device
        matchers = [m for j in index if (m := sample_at[j][1].matcher) is not None]
        try:
            allowed = allowed_tokens(matchers, vocab, dev)
            return {j: allowed[k] for k, j in enumerate(index)}
        except Exception:
            pass  # find the matcher at fault
        masks = {}
        for j, matcher in zip(index, matchers, strict=True):
            try:
                masks[j] = allowed_tokens([matcher], vocab, dev)[0]
            except Exception as exc:
                rid = sample_at[j][1].rid
                failed[rid] = failure_of("the response_format grammar", rid, exc)
        return masks

    def fail_all(self, why: str) -> list[Request]:
        """End every request with an error and free everything it holds (the engine cannot
        go on, e.g. a PP stage died); further submissions are refused."""
        self.failure = why
        out = []
        for req in list(self.requests.values()):
            req.error, req.retryable = why, not req.output  # another instance may serve it
            self._finish(req, "error")
            out.append(req)
        for rid in list(self.held):
            self.release(rid)
        self.mem.check_integrity()
        return out

    def fail_all_between(self, why: str) -> None:
        """`fail_all` outside a step (a PD agent's thread died): `take_finished` reports them."""
        self._finished_between += self.fail_all(why)

    def close(self) -> None:
        """The serving loop is ending (a PP leader tells its followers)."""
        self.source.close(self)

    def note(self, payload: object) -> None:
        """Tell the same component on the other stages of a PP group (in order with this
        engine's own changes; `EngineEvents.on_note` there); a single stage drops it."""
        self.source.record(Note(payload))

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.idle:
                self.check_if_idle()
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
        for rid in plan.preallocs:
            self._prealloc(self.requests[rid])

    def _prealloc(self, req: Request) -> None:
        """Open a slot with full pages for the whole prompt and SWA pages for its window tail
        only (`execute` then tells the prefill side where to write: `on_prealloc`)."""
        assert self.config.role is Role.DECODE, "only a decode engine preallocates"
        slots = self.mem.open(1)
        n = np.array([len(req.prompt)], dtype=np.int64)
        try:
            self.mem.pages.alloc_tail(slots, n)
        except KVMemoryError as exc:
            self.mem.free(slots)
            raise AssertionError(
                f"the scheduler planned a preallocation the allocator refuses: {exc}"
            ) from exc
        req.slot, req.num_tokens, req.phase = int(slots[0]), len(req.prompt), Phase.TRANSFER
        req.epoch = next(self._epochs)
        self.events.on_allocated(req)

    def _grow(self, plan: StepPlan) -> tuple[list[Segment], SampleAt, SampleAt]:
        """Grow the page tables by this step's tokens; the batch's segments, which segment
        each sampling request reads its logits from, and the prompt chunks whose tokens get
        logprobs."""
        segments: list[Segment] = []
        sample_at: list[tuple[int, Request]] = []
        score_at: list[tuple[int, Request]] = []
        decoders = [self.requests[rid] for rid in plan.decodes]
        if decoders:
            slot_ids = [r.slot for r in decoders if r.slot is not None]
            assert len(slot_ids) == len(decoders), "a decoding request holds a slot"
            slots = np.array(slot_ids, dtype=np.int64)  # host values: no device sync
            try:  # the command checks before it writes: no separate can_decode pass
                self.mem.pages.decode(slots)
            except KVMemoryError as exc:
                raise AssertionError(
                    f"the scheduler planned a decode the allocator refuses: {exc}"
                ) from exc
            # Decodes come first: segment i is decoders[i]. tuple.__new__ builds the NamedTuple
            # without its Python-level __new__ (half the cost, once per request per step).
            make = tuple.__new__
            segments = [
                make(Segment, (slot, r.num_tokens, (r.output[-1],)))
                for slot, r in zip(slot_ids, decoders, strict=True)
            ]
            sample_at = list(enumerate(decoders))
            for req in decoders:
                req.num_tokens += 1
        for rid, tokens in plan.chunks:
            req = self.requests[rid]
            assert req.slot is not None
            slot = np.array([req.slot], dtype=np.int64)
            count = np.array([tokens], dtype=np.int64)
            try:
                self.mem.pages.extend(slot, count)
            except KVMemoryError as exc:
                raise AssertionError(
                    f"the scheduler planned a chunk the allocator refuses: {exc}"
                ) from exc
            start = req.num_tokens
            segments.append(Segment(req.slot, start, req.prompt[start : start + tokens]))
            if req.params.prompt_logprobs is not None:
                score_at.append((len(segments) - 1, req))
            req.num_tokens += tokens
            if req.num_tokens == len(req.prompt):
                sample_at.append((len(segments) - 1, req))
                req.phase = Phase.DECODE
        return segments, sample_at, score_at

    def _accept(
        self,
        req: Request,
        token: int,
        finished: list[Request],
        logprob: TokenLogprob | None = None,
    ) -> None:
        reason = ends_with(req, token)
        matcher = req.matcher
        if matcher is not None:  # a PD decode replays the prefill's first token here too
            if not matcher.accept(token):
                req.error = f"token {token} breaks the response_format grammar"
                reason = "error"
            elif matcher.done:
                reason = "stop"  # the JSON is complete (even on the last allowed token)
        req.output.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        if reason is not None:
            self._finish(req, reason)
            finished.append(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.keep_pages and reason in ("stop", "length"):
            self.held[req.rid] = req
        elif req.slot is not None:
            self.mem.free(np.array([req.slot], dtype=np.int64))
            req.slot = None
        req.snapshot = None
        req.finish_reason = reason
        self.requests.pop(req.rid, None)

    # -- views for the scheduler -------------------------------------------------------------------

    def _free(self) -> PoolRoom:
        """Free units the scheduler may hand out: this engine's free units, less what the
        smallest stage of its PP group lacks (`EngineConfig.schedulable`)."""
        free = {u.pool: u.free for u in self.mem.usage()}
        own = PoolRoom(free["full"], free["swa"], free["req_slots"])
        if self.total is self.own_total:
            return own
        t, g = self.own_total, self.total
        return PoolRoom(
            own.full_pages - (t.full_pages - g.full_pages),
            own.swa_pages - (t.swa_pages - g.swa_pages),
            own.request_slots - (t.request_slots - g.request_slots),
        )

    def _views(self) -> list[ReqView]:
        """Every unfinished request as the scheduler sees it. Pages held follow from the page
        table's invariant (columns below ceil(n/P) have a full page; those at or past
        swa_start/P also an SWA page), read from the allocator's host tables.

        Runs over every request on each step the shortcut declines, hence the plain loop:
        positional tuples (ReqView's field order) and one `Need` per distinct (full, swa)
        count, shared (they are immutable)."""
        page = self.config.scheduler.page_size
        pages = self.mem.pages
        num_tokens = pages.host.num_tokens.tolist()
        swa_start = pages.host.swa_start_tokens.tolist()
        shared = self._held_needs
        make = tuple.__new__
        views: list[ReqView] = []
        for req in self.requests.values():
            held = resume = NOTHING
            slot = req.slot
            if slot is not None:
                full = -(-num_tokens[slot] // page)
                swa = full - swa_start[slot] // page
                key = (full, swa if swa > 0 else 0)
                held = shared.get(key) or shared.setdefault(key, Need(*key, 1))
            if req.snapshot is not None:
                full = pages_for_tokens(req.snapshot.num_tokens, page)
                resume = Need(full, int(req.snapshot.swa_mask.sum()))
            fields = (
                req.rid,
                req.phase,
                len(req.prompt),
                req.params.max_new_tokens,
                req.num_tokens,
                len(req.output),
                held,
                resume,
                req.seq,
            )
            views.append(make(ReqView, fields))
        return views


def scored_segments(count: int, score_at: SampleAt) -> list[bool]:
    """Per segment of a batch: whether the forward returns logits at each of its tokens."""
    every = [False] * count
    for i, _ in score_at:
        every[i] = True
    return every


def _prompt_logprobs(
    logits: torch.Tensor, rows: tuple[int, int], seg: Segment, req: Request
) -> tuple[RequestId, int, tuple[TokenLogprob, ...]]:
    """The prompt logprobs one chunk gives: position t's logits score prompt token t + 1 (the
    last prompt position's score the first sampled token instead). Entry j of
    `prompt_logprobs` is prompt token j + 1's."""
    first, last = rows
    targets = req.prompt[seg.start + 1 : seg.end + 1]  # at most to the end of the prompt
    k = req.params.prompt_logprobs
    assert k is not None
    entries = token_logprobs(logits[first : first + len(targets)], targets, k)
    assert first + len(targets) <= last + 1
    return req.rid, seg.start, tuple(entries)
