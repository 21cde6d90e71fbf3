"""EngineRunner: the engine loop on its own thread, fed and drained through thread-safe hand-offs.

The HTTP side never touches the engine: it submits (prompt, params) and gets a `Handle` whose
asyncio queue receives `Token` and `Done` events; `abort(rid)` ends a request (its pages are
freed at the runner's next turn). A request keeps one id from its submitter to the engine
(`Handle.rid` is the engine's `Request.rid`); an id still in flight is refused
(`DuplicateRequest`). After every step the runner publishes a `Snapshot` of pool
usage and queue lengths for `/metrics` and `/status`. Other components (the PD agents) run
code on the engine thread with `call(fn)`, and the engine's events' `after_step` runs after
every turn. What a call publishes (a PD decode's landed first token) goes out before the next
step, and the listeners' loops take it before that step starts (bounded: `HANDOFF_WAIT_S`). A
PD decode's agent hands a stream its first token sooner, from its own thread, before the KV
has landed (`show_first_token`: under the lock, exactly once, always before its Done).

Admission (`admission`'s rules): the HTTP side asks `admission(need_tokens)` before it
submits; the runner counts every submitted request until the engine schedules it (`_queued`,
in arrival order), and one still unscheduled after `queue_timeout_s` is removed at the next
turn and answered with Done("error", code="queue_timeout"). NOTE: a queued request (WAITING,
PREALLOC) holds no slot and no pages, so removing it frees nothing.

Failures (`engine.failures`): a request the engine fails alone ends with Done("error") and its
code; a submission or a `call` that raises fails that request or that call (logged), and the
thread serves on. Anything else that escapes a turn kills the thread: every request it knew
and every one submitted later gets Done("error", retryable: nothing ran here), `failure` says
why, and the app's `/live` fails so a supervisor restarts the worker (`health` counts it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsv4_common.api.request_id import new_request_id
from dsv4_worker.engine import wake
from dsv4_worker.engine.failures import INTERNAL_CODE
from dsv4_worker.engine.logprobs import TokenLogprob
from dsv4_worker.engine.loop import DuplicateRequest as DuplicateRequest
from dsv4_worker.engine.loop import Engine, EngineFailed, Request
from dsv4_worker.engine.role import Place
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.usage import PoolUsage
from dsv4_worker.sched.scheduler import Phase, RequestId
from dsv4_worker.server.admission import (
    AdmissionPolicy,
    QueueView,
    Verdict,
    decide,
    default_policy,
    expired,
    timeout_message,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long a PP stage's runner blocks waiting for work
IDLE_CHECK_S = 0.05  # the engine's integrity check waits for this much quiet (it is slow)
# The most the engine thread waits, before its next step, for an event loop to take what was
# published between steps (a PD decode's first token): the step would hold the GIL meanwhile.
HANDOFF_WAIT_S = 0.002
QUEUED_PHASES = (Phase.WAITING, Phase.PREALLOC)  # accepted, not scheduled: no slot, no pages
DUPLICATE_CODE = "duplicate_request_id"  # Done.code of a request whose id is in flight here
ENGINE_DEAD_CODE = "engine_unavailable"  # Done.code of a request the dead engine never served
REFUSED_CODE = "invalid_request"  # Done.code of a request the engine refused at submission (400)


@dataclass(frozen=True, slots=True)
class Token:
    token_id: int
    at_s: float  # time.monotonic() when sampled
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with the first token, if asked


@dataclass(frozen=True, slots=True)
class Done:
    reason: str  # stop | length | error | abort
    error: str | None = None
    retryable: bool = False  # failed before any token; another instance may succeed
    code: str | None = None  # an OpenAI error code ("draining": the worker is stopping)


@dataclass(slots=True)
class Handle:
    rid: RequestId  # the request's id, the engine's too
    events: asyncio.Queue[Token | Done]
    submitted_s: float
    first_token_ahead: bool = False  # it may be shown its first token early (`submit`)
    first_shown: bool = False  # that happened (`show_first_token`)


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A request whose first token may go out before its KV lands (a PD decode stream)."""

    handle: Handle
    loop: asyncio.AbstractEventLoop
    with_prompt_logprobs: bool  # it asked for them: they come with the first token


@dataclass(frozen=True, slots=True)
class Health:
    """What `/metrics` says of the worker's threads: deaths by thread (`engine`; the server
    adds `pd_control` for a PD agent's), whether the engine still serves, and the calls on
    the engine thread that raised (each failed alone)."""

    deaths: tuple[tuple[str, int], ...] = (("engine", 0),)
    serving: bool = True
    call_errors: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    usage: tuple[PoolUsage, ...] = ()
    running: int = 0
    waiting: int = 0
    retracted: int = 0
    steps: int = 0


@dataclass(slots=True)
class _Submit:
    prompt: tuple[int, ...]
    params: SamplingParams
    handle: Handle
    loop: asyncio.AbstractEventLoop
    prefill: str | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    rid: RequestId


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[], None]


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        policy: AdmissionPolicy | None = None,
        handoff_wait_s: float = HANDOFF_WAIT_S,
    ) -> None:
        self.engine = engine
        self.policy = policy or default_policy(engine.total.request_slots)
        self.handoff_wait_s = handoff_wait_s
        self._inbox: queue.SimpleQueue[_Submit | _Call | _Abort | None] = queue.SimpleQueue()
        # rid -> (handle, its event loop, tokens sent), for requests the engine took
        self._listeners: dict[RequestId, tuple[Handle, asyncio.AbstractEventLoop, int]] = {}
        self._lock = threading.Lock()
        # Under _lock: every rid submitted and not yet answered with its Done (what `submit`
        # refuses to take again), and rid -> time.monotonic() at submit for those not yet
        # scheduled (insertion order is arrival order, so the first entry is the oldest).
        self._live: set[RequestId] = set()
        self._queued: dict[RequestId, float] = {}
        self._ahead: dict[RequestId, _Ahead] = {}  # under _lock: may still show a first token
        self._snapshot = Snapshot(usage=engine.mem.usage())
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._started = self._stopping = False
        self.error: BaseException | None = None  # set (under _lock): the engine thread died
        self.call_errors = 0  # calls (`call`) that raised; the thread went on
        self.timed_wakes = 0  # times the idle thread woke by itself, nothing having arrived

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and self.engine.failure is None

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving, if it did (its thread died, it exited unasked, or
        the engine failed for good: a PP stage or the PD agent was lost)."""
        if self.engine.failure is not None:
            return self.engine.failure
        if self.error is not None:
            return f"the engine thread died: {self.error!r}"
        if self._started and not self._stopping and not self._thread.is_alive():
            return "the engine thread exited"
        return None

    def health(self) -> Health:
        """Deaths of the engine thread (0 or 1: a dead thread is never restarted in-process;
        the worker is, once `/live` fails), and the rest of `Health`."""
        deaths = (("engine", int(self.error is not None)),)
        return Health(deaths, self.failure is None, self.call_errors)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def queue_view(self) -> QueueView:
        """The queue now (requests submitted and not yet scheduled, and the engine's own
        waiting ones) and the free capacity of the last snapshot."""
        now = time.monotonic()
        with self._lock:
            snap = self._snapshot
            queued = len(self._queued)
            oldest_s = next(iter(self._queued.values()), now)
        free = {u.pool: u.free for u in snap.usage}
        return QueueView(
            waiting=max(queued, snap.waiting),
            oldest_wait_s=now - oldest_s,
            free_request_slots=free.get("req_slots", 0),
            free_full_tokens=free.get("full", 0) * self.engine.config.scheduler.page_size,
        )

    def admission(self, need_tokens: int) -> Verdict:
        """Whether a request needing `need_tokens` of KV may be submitted now."""
        return decide(self.queue_view(), self.policy, need_tokens)

    def overloaded(self) -> bool:
        """A small request would be shed now (what /status reports as not accepting)."""
        return not self.admission(1).admitted

    def submit(
        self,
        prompt: tuple[int, ...],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        prefill: str | None = None,
        rid: RequestId | None = None,
        first_token_ahead: bool = False,
    ) -> Handle:
        """Queue a request under `rid` (None: a new one). Raises DuplicateRequest while
        a request of that id has not ended here. `first_token_ahead`: a PD decode may show its
        first token as soon as the prefill side sampled it (`show_first_token`); a failure
        after that is an error after a token, no longer one another instance may retry. A
        stream asks for it; an answer sent whole gains nothing from it."""
        rid = rid if rid is not None else new_request_id()
        with self._lock:
            if rid in self._live:
                raise DuplicateRequest(f"request id {rid!r} is already in flight")
            handle = Handle(rid, asyncio.Queue(), time.monotonic(), first_token_ahead)
            if self.error is not None:  # the thread died: nothing will take it from the inbox
                _emit(loop, handle, _dead(self.error))
                return handle
            self._live.add(rid)
            self._queued[rid] = handle.submitted_s
            if first_token_ahead:
                self._ahead[rid] = _Ahead(handle, loop, params.prompt_logprobs is not None)
            self._inbox.put(_Submit(prompt, params, handle, loop, prefill))
        return handle

    def show_first_token(
        self,
        rid: RequestId,
        token_id: int,
        logprob: TokenLogprob | None = None,
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """PD decode, any thread (the agent's control thread, as `done` arrives): the prefill
        side sampled the request's first token and its KV is landing. A request that asked
        (`submit(first_token_ahead=True)`) and has not ended gets it now, once; the engine
        still decodes it only from `complete_transfer` (whose first token then is not sent
        again), and `fail_transfer` still fails it. Emitted under the lock `_end` takes, so
        it always comes before the request's Done."""
        with self._lock:
            ahead = self._ahead.pop(rid, None)
            if ahead is None:
                return
            prompt = prompt_logprobs if ahead.with_prompt_logprobs else None
            ahead.handle.first_shown = True  # before the engine thread can publish it
            _emit(ahead.loop, ahead.handle, Token(token_id, time.monotonic(), logprob, prompt))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread at its next turn (FIFO with submissions)."""
        self._inbox.put(_Call(fn))

    def abort(self, handle: Handle) -> None:
        """End the request at the runner's next turn (after its submission, FIFO)."""
        self._inbox.put(_Abort(handle.rid))

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                calls = self._drain(block=not self.engine.has_work)
                if calls is None:
                    self.engine.close()
                    return
                self._expire(time.monotonic())
                finished = self.engine.take_finished()
                if calls or finished:
                    # What changed outside a step (a PD decode's first token, which a call
                    # delivers; a failed transfer) goes out now, not after the next forward:
                    # a forward holds the GIL for most of its length, so the listeners' loops
                    # run their turn first (bounded).
                    loops = self._publish(finished)
                    if loops and self.engine.has_work:
                        _turned(loops, self.handoff_wait_s)
                if self.engine.has_work:
                    finished += self.engine.step()
                finished += self.engine.take_finished()
                self.engine.events.after_step(finished)
                self._publish(finished)
                self.engine.check_if_idle(settled_s=IDLE_CHECK_S)
        except BaseException as exc:  # surface to /live and /ready; fail every waiting client
            log.critical("the engine thread died; this worker serves no more", exc_info=exc)
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Answer every request the thread knew, and every one still in the inbox, with an
        error; from here on `submit` answers at once (under the lock: none slips between)."""
        with self._lock:
            self.error = exc
            self._live.clear()
            self._queued.clear()
            self._ahead.clear()
        for handle, loop, _ in self._listeners.values():
            _emit(loop, handle, _dead(exc))
        self._listeners.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submit):
                _emit(item.loop, item.handle, _dead(exc))

    def _wait_s(self) -> float | None:
        """How long the engine thread may block on its inbox: until the first thing it holds
        that depends on the clock is due (`wake`): the engine's integrity check once it has
        been idle `IDLE_CHECK_S`, the oldest queued request's queue deadline, and what the
        engine's events' `after_step` checks (a PD session's heartbeat, a transfer's
        deadline); until work arrives (None) when nothing is. An idle worker then wakes only
        when something is due (a PD prefill with a live session: about once per heartbeat
        timeout). A PP stage keeps IDLE_WAIT_S: its leader's heartbeat steps keep the bound."""
        engine = self.engine
        if engine.config.place is not Place.SINGLE:
            return IDLE_WAIT_S
        now = time.monotonic()
        with self._lock:
            oldest_s = next(iter(self._queued.values()), None)
        due = wake.earliest(
            engine.idle_check_due_s(IDLE_CHECK_S),
            None if oldest_s is None else oldest_s + self.policy.queue_timeout_s,
            engine.events.wake_at_s(now),
        )
        return wake.wait_s(due, now)

    def _drain(self, *, block: bool) -> int | None:
        """Take every queued command; how many calls ran, or None on stop."""
        calls = 0
        while True:
            try:
                item = (
                    self._inbox.get(timeout=self._wait_s()) if block else self._inbox.get_nowait()
                )
            except queue.Empty:
                self.timed_wakes += block  # woke by itself: something was due
                return calls
            block = False
            if item is None:
                return None
            if isinstance(item, _Abort):
                self._abort(item.rid)
                continue
            if isinstance(item, _Call):
                try:
                    item.fn()
                except Exception:  # that call's work fails; the engine serves on
                    self.call_errors += 1
                    log.exception("a call on the engine thread failed")
                calls += 1
                continue
            rid = item.handle.rid
            try:
                self.engine.submit(item.prompt, item.params, rid=rid, prefill=item.prefill)
            except EngineFailed as exc:  # another instance may serve it
                self._end(rid)
                _emit(item.loop, item.handle, Done("error", str(exc), retryable=True))
                continue
            except DuplicateRequest as exc:  # its namesake still holds pages here
                self._end(rid)
                _emit(item.loop, item.handle, Done("error", str(exc), code=DUPLICATE_CODE))
                continue
            except ValueError as exc:  # refused before it ran: tell the client, keep serving
                self._end(rid)
                _emit(item.loop, item.handle, Done("error", str(exc), code=REFUSED_CODE))
                continue
            except Exception as exc:  # a bug: this request fails alone
                log.exception("request %s: submission failed", rid)
                self._end(rid)
                why = f"internal error at submission: {exc!r}"
                _emit(item.loop, item.handle, Done("error", why, code=INTERNAL_CODE))
                continue
            self._listeners[rid] = (item.handle, item.loop, 0)

    def _end(self, rid: RequestId) -> None:
        """The request got (or gets now) its Done: not queued, and its id free again."""
        with self._lock:
            self._queued.pop(rid, None)
            self._live.discard(rid)
            self._ahead.pop(rid, None)

    def _expire(self, now: float) -> None:
        """Remove the requests that waited past the queue deadline without being scheduled;
        each gets Done("error", code="queue_timeout"), which the app answers with 503."""
        with self._lock:
            due = []
            for rid, at_s in self._queued.items():
                if not expired(now - at_s, self.policy):
                    break  # arrival order: the rest waited less
                due.append(rid)
        for rid in due:
            if rid not in self._listeners:
                continue  # still in the inbox (taken at the next turn)
            req = self.engine.requests.get(rid)
            if req is None or req.phase not in QUEUED_PHASES:
                continue  # scheduled or finished since (the next publish unqueues it)
            assert req.slot is None, "a queued request holds no slot and no pages"
            self.engine.abort(rid)
            handle, loop, _ = self._listeners.pop(rid)
            self._end(rid)
            message = timeout_message(self.policy)
            _emit(loop, handle, Done("error", message, code="queue_timeout"))

    def _abort(self, rid: RequestId) -> None:
        listener = self._listeners.pop(rid, None)
        if listener is None:
            return  # already finished (and ended), or refused at submission
        self._end(rid)
        handle, loop, _ = listener
        self.engine.abort(rid)
        _emit(loop, handle, Done("abort"))

    def _close_ahead(self, rid: RequestId, handle: Handle) -> int:
        """The request's output is out from here on (or it ended): no first token may be shown
        ahead any more. How many of its tokens went out already: the first, if it was shown
        (`show_first_token` decides under the same lock, so exactly one of them sends it)."""
        with self._lock:
            self._ahead.pop(rid, None)
            return int(handle.first_shown)

    def _publish(self, finished: list[Request]) -> set[asyncio.AbstractEventLoop]:
        """Hand every listener its new events; the event loops that got some."""
        now = time.monotonic()
        loops: set[asyncio.AbstractEventLoop] = set()
        done = {r.rid: r for r in finished}
        reqs = {**self.engine.requests, **done}
        with self._lock:  # bounded by the queue's bound, unlike the listeners
            queued = set(self._queued)
        scheduled: list[RequestId] = []  # rids that left the queue
        for rid, (handle, loop, sent) in list(self._listeners.items()):
            req = reqs.get(rid)
            if req is None:
                if rid in queued:
                    scheduled.append(rid)  # gone from the engine: not queued any more
                continue
            if not sent and handle.first_token_ahead and (req.output or req.finished):
                sent = self._close_ahead(rid, handle)
            events: list[Token | Done] = [_token(req, i, now) for i in range(sent, len(req.output))]
            if req.finished:
                # Its id is free before its Done goes out: the client may reuse it at once.
                self._end(rid)
                retryable = req.retryable and not handle.first_shown  # a token went out
                events.append(Done(str(req.finish_reason), req.error, retryable, req.error_code))
            if events:
                loops.add(loop)
            if not all(_emit(loop, handle, e) for e in events):
                # The listener's event loop is gone: nobody will read this request again.
                self.engine.abort(rid)
            self._listeners[rid] = (handle, loop, max(sent, len(req.output)))
            if req.finished or rid not in self.engine.requests:
                del self._listeners[rid]
                if not req.finished:  # aborted just above
                    self._end(rid)
            elif rid in queued and req.phase not in QUEUED_PHASES:
                scheduled.append(rid)
        if scheduled:
            with self._lock:
                for rid in scheduled:
                    self._queued.pop(rid, None)
        phases = [r.phase for r in self.engine.requests.values()]
        snap = Snapshot(
            usage=self.engine.mem.usage(),
            running=sum(p in (Phase.PREFILL, Phase.DECODE, Phase.TRANSFER) for p in phases),
            waiting=sum(p in (Phase.WAITING, Phase.PREALLOC) for p in phases),
            retracted=sum(p is Phase.RETRACTED for p in phases),
            steps=self.engine.steps,
        )
        with self._lock:
            self._snapshot = snap
        return loops


def _dead(exc: BaseException) -> Done:
    """The answer of a request the dead engine thread will never serve (nothing ran here:
    another instance may)."""
    why = f"the engine is not running: the engine thread died: {exc!r}"
    return Done("error", why, retryable=True, code=ENGINE_DEAD_CODE)


def _turned(loops: set[asyncio.AbstractEventLoop], timeout_s: float) -> None:
    """Wait until every loop in `loops` ran the turn after taking what was queued to it so
    far (the tasks those events woke have run), or `timeout_s` passed. Waiting releases the
    GIL, which a loop needs to run at all."""
    turned: list[threading.Event] = []
    for loop in loops:
        done = threading.Event()
        try:  # FIFO: runs after the queued events; `call_soon` puts `set` after the tasks they woke
            loop.call_soon_threadsafe(loop.call_soon, done.set)
        except RuntimeError:  # closed: nothing to wait for
            continue
        turned.append(done)
    deadline_s = time.monotonic() + timeout_s
    for done in turned:
        if not done.wait(max(0.0, deadline_s - time.monotonic())):
            return


def _token(req: Request, i: int, now: float) -> Token:
    """Output token `i` of `req` as an event (with what it asked for: logprobs)."""
    logprob = req.logprobs[i] if i < len(req.logprobs) else None
    prompt = None
    if i == 0 and req.params.prompt_logprobs is not None:
        prompt = tuple(req.prompt_logprobs)
    return Token(req.output[i], now, logprob, prompt)


def _emit(loop: asyncio.AbstractEventLoop, handle: Handle, event: Token | Done) -> bool:
    """Hand `event` to the listener's event loop; False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(handle.events.put_nowait, event)
    except RuntimeError:
        return False
    return True
