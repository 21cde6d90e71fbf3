"""One scheduling decision, pure: from the requests' views and the pools' free units to a step
plan (who decodes, who is retracted, resumed, admitted, which prefill chunks run). No tensors;
the engine loop carries the plan out.

Order of a step:
  1. decode every running request; when the pools cannot give each one its next token, retract
     the newest first (CPU offload) until they can
  2. reserve decode headroom for the survivors and the requests whose KV is arriving (remaining
     tokens x the new-token ratio) and the rest of every admitted prompt
  3. continue chunked prefills, then resume retracted requests, then admit waiting ones (PD
     decode: preallocate arriving ones, outside the token budget: full pages for the whole
     prompt, SWA pages only for its page-floored window tail, a request slot), in arrival
     order under one token budget, each by the one admission function. A step that
     retracted continues prefills only: no resume, admission or preallocation takes what a
     retracted request gave back. A request that fits
     later waits and blocks the ones behind it (so the head of the queue never starves); a
     chunk that can never fit the SWA pool shrinks; a request that can never fit is rejected
     at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, TypeAlias

from dsv4_common.core.index_space import pages_for_tokens, tail_pages
from dsv4_worker.sched.budget import (
    NOTHING,
    Admission,
    Fit,
    Need,
    PoolRoom,
    admit,
    extend_need,
)

RequestId: TypeAlias = str  # a request's one id, from its caller (HTTP entry, PD room, PP leader)


class Phase(StrEnum):
    WAITING = "waiting"  # never ran
    PREFILL = "prefill"  # has a slot, prompt partly computed
    DECODE = "decode"  # prompt computed, generating
    RETRACTED = "retracted"  # offloaded to CPU, waits to resume
    PREALLOC = "prealloc"  # PD decode: waits for its preallocation (prefill runs elsewhere)
    TRANSFER = "transfer"  # PD decode: preallocated, its KV and state are arriving


class ReqView(NamedTuple):
    """One request as the scheduler sees it (a NamedTuple: built once per request per step,
    so its construction cost is part of the engine's per-step overhead). NOTE: Engine._views
    builds it positionally; test_steady_decode checks its views field by field."""

    rid: RequestId  # the request's key in the plan
    phase: Phase
    prompt_len: int
    max_new_tokens: int
    num_tokens: int = 0  # tokens whose KV is in the pools (or in the snapshot)
    generated: int = 0
    held: Need = NOTHING  # units it holds now (none when waiting or retracted)
    resume: Need = NOTHING  # units a resume allocates (retracted only)
    seq: int = 0  # arrival number: smaller = older (ties, in views built by hand: by rid)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    page_size: int
    chunk_tokens: int  # prefill tokens per step
    max_tokens_per_request: int
    clip_new_tokens: int = 4096  # decode headroom is estimated over at most this many tokens
    retained_tokens: int = 0  # window + draft tokens: what a PD decode preallocates SWA for


@dataclass(frozen=True, slots=True)
class StepPlan:
    decodes: tuple[RequestId, ...] = ()
    retracts: tuple[RequestId, ...] = ()
    resumes: tuple[RequestId, ...] = ()
    admits: tuple[RequestId, ...] = ()  # waiting requests that get a slot (first chunk below)
    preallocs: tuple[RequestId, ...] = ()  # PD decode: requests whose pages are preallocated now
    chunks: tuple[tuple[RequestId, int], ...] = ()  # (rid, tokens) of prefill this step
    rejects: tuple[tuple[RequestId, str], ...] = ()
    waiting: tuple[RequestId, str] | None = None  # the head of the queue that waits, and why

    @property
    def idle(self) -> bool:
        return not (
            self.decodes
            or self.chunks
            or self.resumes
            or self.retracts
            or self.rejects
            or self.preallocs
        )


@dataclass(slots=True)
class _Pass:
    """Mutable bookkeeping of one planning pass."""

    free: PoolRoom
    total: PoolRoom
    reserved: dict[RequestId, Need] = field(default_factory=dict)

    def reserved_except(self, rid: RequestId) -> Need:
        out = Need()
        for other, need in self.reserved.items():
            if other != rid:
                out = out + need
        return out


def never_fits(view: ReqView, config: SchedulerConfig, total: PoolRoom) -> str | None:
    """Why a request can never run here, or None."""
    longest = view.prompt_len + view.max_new_tokens
    if longest > config.max_tokens_per_request:
        return (
            f"prompt ({view.prompt_len} tokens) + max_tokens ({view.max_new_tokens}) exceeds the "
            f"maximum context of {config.max_tokens_per_request} tokens"
        )
    pages = pages_for_tokens(longest, config.page_size)
    if pages > total.full_pages:
        return f"needs {pages} full KV pages, the pool has {total.full_pages}"
    if total.request_slots < 1:
        return "the worker has no request slots"
    return None


def prealloc_need(view: ReqView, config: SchedulerConfig) -> Need:
    """PD decode preallocation of a prompt (ref. #24036/#24857): full pages for all of it, SWA
    pages only for the page-floored window tail (`KVAllocator.alloc_tail`), one request slot."""
    n, page = view.prompt_len, config.page_size
    return Need(
        pages_for_tokens(n, page), tail_pages(n, page, config.retained_tokens), request_slots=1
    )


def _arrival(view: ReqView) -> tuple[int, RequestId]:
    return view.seq, view.rid


def plan_step(
    views: Sequence[ReqView],
    free: PoolRoom,
    total: PoolRoom,
    config: SchedulerConfig,
    new_token_ratio: float,
) -> StepPlan:
    p = _Pass(free=free, total=total)
    rejects: list[tuple[RequestId, str]] = []

    # 1. Decode; retract the newest until every survivor gets its next token. (One pass over
    # every view per step: comprehensions, not generators, for the 1024-running case.)
    decode, page = Phase.DECODE, config.page_size
    running = sorted([v for v in views if v.phase is decode], key=_arrival)
    retracts: list[RequestId] = []
    rollovers = len([v for v in running if v.num_tokens % page == 0])
    while running:
        need = Need(rollovers, rollovers)  # == the sum of decode_need over `running`
        if p.free.covers(need):
            p.free = p.free.minus(need)
            break
        # NOTE: a request alone always gets its next token: admission refused any request
        # whose prompt + max_tokens exceed the pools, and the planner sized the SWA pool.
        victim = running.pop()  # the newest
        rollovers -= victim.num_tokens % page == 0
        retracts.append(victim.rid)
        p.free = p.free.minus(Need(-victim.held.full_pages, -victim.held.swa_pages, -1))
    decodes = tuple([v.rid for v in running])
    queue = [v for v in views if v.phase is not decode and v.phase is not Phase.TRANSFER]
    if not queue:  # nobody to admit: headroom and prefill would change nothing
        return StepPlan(decodes=decodes, retracts=tuple(retracts))

    # 2. Headroom: future decode tokens of the survivors (and of requests whose KV is arriving:
    # they decode next), the rest of each admitted prompt.
    arriving = [v for v in views if v.phase is Phase.TRANSFER]
    for v in (*running, *arriving):
        p.reserved[v.rid] = _decode_headroom(v, config, new_token_ratio, v.num_tokens)
    for v in views:
        if v.phase is Phase.PREFILL:
            p.reserved[v.rid] = _prompt_rest(v, v.num_tokens, config)

    # 3. Prefill in arrival order under one token budget.
    budget = config.chunk_tokens
    chunks: list[tuple[RequestId, int]] = []
    resumes: list[RequestId] = []
    admits: list[RequestId] = []
    preallocs: list[RequestId] = []
    waiting: tuple[RequestId, str] | None = None
    retracted = set(retracts)
    queue = sorted(
        (v for v in queue if v.rid not in retracted),
        key=lambda v: (_queue_rank(v.phase), v.seq, v.rid),
    )
    for v in queue:
        if v.phase is not Phase.PREALLOC and budget <= 0:  # preallocation runs no prefill
            break
        if retracts and v.phase is not Phase.PREFILL:
            # The pools ran short this step: what the retracted gave back is theirs to resume
            # with, not a newer request's to start with (arrival order).
            waiting = (v.rid, "a request was retracted this step; it resumes first")
            break
        if (
            v.phase in (Phase.PREALLOC, Phase.WAITING)
            and (why := never_fits(v, config, p.total)) is not None
        ):
            rejects.append((v.rid, why))
            continue
        # One admission per request, whatever it asks for; `label` prefixes a refusal.
        tokens, label = 0, ""
        if v.phase is Phase.PREALLOC:
            need, label = prealloc_need(v, config), "cannot preallocate: "
            verdict = admit(need, p.free, p.total, p.reserved_except(v.rid))
        elif v.phase is Phase.RETRACTED:
            need, label = v.resume + Need(request_slots=1), "cannot resume: "
            verdict = admit(need, p.free, p.total, p.reserved_except(v.rid))
        else:
            tokens, verdict = _chunk(v, budget, p, config)
            need = extend_need(v.num_tokens, tokens, config.page_size)
            if v.phase is Phase.WAITING:
                need = need + Need(request_slots=1)
        if verdict.fit is Fit.NEVER:
            rejects.append((v.rid, label + verdict.reason))
            continue
        if verdict.fit is Fit.LATER:
            waiting = (v.rid, verdict.reason)
            break
        p.free = p.free.minus(need)
        if v.phase is Phase.PREALLOC:
            preallocs.append(v.rid)
            p.reserved[v.rid] = _decode_headroom(v, config, new_token_ratio, v.prompt_len)
        elif v.phase is Phase.RETRACTED:
            resumes.append(v.rid)
        else:
            if v.phase is Phase.WAITING:
                admits.append(v.rid)
            p.reserved[v.rid] = _prompt_rest(v, v.num_tokens + tokens, config)
            chunks.append((v.rid, tokens))
            budget -= tokens
    return StepPlan(
        decodes=decodes,
        retracts=tuple(retracts),
        resumes=tuple(resumes),
        admits=tuple(admits),
        preallocs=tuple(preallocs),
        chunks=tuple(chunks),
        rejects=tuple(rejects),
        waiting=waiting,
    )


def _queue_rank(phase: Phase) -> int:
    return {Phase.PREFILL: 0, Phase.RETRACTED: 1, Phase.PREALLOC: 2, Phase.WAITING: 2}[phase]


def _decode_headroom(
    v: ReqView, config: SchedulerConfig, new_token_ratio: float, num_tokens: int
) -> Need:
    """Full pages the estimated future decode tokens of `v` take beyond its next one."""
    left = min(v.max_new_tokens - v.generated, config.clip_new_tokens)
    future = int(left * new_token_ratio)
    pages = pages_for_tokens(num_tokens + future, config.page_size) - pages_for_tokens(
        num_tokens + 1, config.page_size
    )
    return Need(max(pages, 0))


def _prompt_rest(v: ReqView, computed: int, config: SchedulerConfig) -> Need:
    """Full pages the rest of the prompt and its first decode token will take."""
    rest = pages_for_tokens(v.prompt_len + 1, config.page_size) - pages_for_tokens(
        computed, config.page_size
    )
    return Need(max(rest, 0))


def _chunk(v: ReqView, budget: int, p: _Pass, config: SchedulerConfig) -> tuple[int, Admission]:
    """The next prefill chunk of `v` and whether it fits. The whole prompt's full pages must be
    available (they are reserved from now on); the chunk's SWA pages too. A chunk larger than
    the SWA pool itself shrinks (permanent shortage); a transient shortage waits."""
    page = config.page_size
    tokens = min(budget, v.prompt_len - v.num_tokens)
    slot = Need(request_slots=1) if v.phase is Phase.WAITING else Need()
    whole = _prompt_rest(v, v.num_tokens, config)
    while True:
        swa = extend_need(v.num_tokens, tokens, page).swa_pages
        need = Need(whole.full_pages, swa) + slot
        verdict = admit(need, p.free, p.total, p.reserved_except(v.rid))
        if verdict.fit is not Fit.NEVER or swa <= 1 or whole.full_pages > p.total.full_pages:
            return tokens, verdict
        # Permanent SWA shortfall: shrink the chunk to what the whole pool can hold.
        tokens = max(1, min(tokens - 1, (p.total.swa_pages - 1) * page - v.num_tokens % page))
