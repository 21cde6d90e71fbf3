"""A PD request as a pure state machine, one per side: `prefill_step` and `decode_step` take
a request's state and one event and return its next state (None: the request ended here) and
the actions its agent executes, in order. No sockets, threads, torch or clocks: the agents
(`pd/prefill.py`, `pd/decode.py`) turn socket frames and engine callbacks into events, and
time comes in as an event field.

Prefill (`Tx`, one per request per stage; a PP follower runs the same machine with
`leader=False`: it writes what its replica of the leader's engine says and decides nothing):

    start ──Stepped*──> computing ──DestinationArrived──> writing ──Stepped(finished)──>
    finishing ──Written──> ended (Release)
    any ──fails (engine error, deadline, bad destination, WriteFailed, PeerGone)──> ended
    (AbortRequest, SendFailed); AbortReceived ──> ended (AbortRequest, SendAborted)

Decode (`Flight`, one per request; the leader of a decode PP group):

    admit ──Granted──> granted (its destination left: writes may come)
    admit ──DoneArrived──> done (ShowFirstToken) ──Landed(all tags)──> ended (Complete, or
    Release if cancelled)
    any ──FailedArrived──> ended (Fail); AbortedArrived ──> ended (Release)
    any ──Tick(past deadline) | PrefillLost──> given up: ended (Fail, or Release if
    cancelled) when nothing can land any more, else held (below)
    any ──Cancel──> cancelled: its pages stay until AbortedArrived, its tags land, or it expires

Fencing: every end revokes the request's grant (`Revoke`: the target refuses or ignores its
later writes). A granted flight given up on while its prefill may still be writing (its
deadline passed, its prefill went silent) ends for its client but, when the target cannot
refuse writes (`fences` False: NIXL's one-sided writes), keeps its pages: `held`
(`Fail(hold=True)`), until its writer is provably done: `failed` or `aborted` from it, every
tag of its `done` landed, or its session provably closed (`SessionClosed`: the prefill said so
in a later handshake, or its connection dropped a while ago). Then `Release`. A held flight
has no deadline: pages are never handed out again while a stale write could land in them.

A `Write` is always the last action of its list: the agent answers it with `Written` or
`WriteFailed` before anything else happens to the request.

Invariants (tests/pd/test_flight.py): every path to an ended state emits exactly one engine
action that frees the request (prefill leader: AbortRequest or ReleaseRequest, a follower
none: the leader's engine ends it on every stage; decode: Complete, Fail or Release, where
a held flight's Fail(hold=True) ends it for the client and its later Release frees it); an
ended request only answers a late `abort` (SendAborted) or cancel (Release: the engine's
release is idempotent); nothing is written before the destination or after the end, each
column once; a cancelled flight never completes; a flight shows its first token at most
once, never after a cancel, and only before it ends; and no decode flight frees its pages
while a granted write may still land (a target that cannot refuse one holds them).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Final, Generic, Literal, TypeVar

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_worker.pd.columns import SendStep, send_step, tail_cols

R = TypeVar("R")  # the engine's request (opaque here: the agent reads and writes it)
D = TypeVar("D")  # the destination message (opaque here: the agent writes to its pages)
P = TypeVar("P")  # the `done` message (opaque here: the agent completes the request with it)

NORMAL_ENDS: Final = frozenset({"stop", "length"})


def write_tag(room: str, stage: int, decode_stage: int, k: int) -> str:
    """The tag of write `k` of a request from prefill stage `stage` to decode stage
    `decode_stage`."""
    return f"{room}:{stage}:{decode_stage}:{k}"


def done_tags(room: str, writes: int, pairs: list[tuple[int, int]]) -> tuple[str, ...]:
    """Every tag of a request's `writes` writes over the (prefill stage, decode stage) pairs
    that share layers: what `done` lists and decode waits for."""
    return tuple(write_tag(room, s, d, k) for k in range(writes) for s, d in pairs)


# ---- prefill ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the columns of a request depend on (the prefill stage's manifest)."""

    page_size: int
    retained_tokens: int  # window + draft tokens


@dataclass(frozen=True, slots=True)
class Tx(Generic[R, D]):
    """One request's transfer on one prefill stage."""

    room: str
    peer: str  # the decode worker (group) it writes to
    req: R  # the prefill engine's request
    prompt_tokens: int
    geometry: Geometry
    timeout_s: float
    deadline_s: float  # the leader fails it past this (a follower: never)
    leader: bool = True
    dest: D | None = None  # nothing is written before it arrives
    sent_cols: int = 0  # full page columns written so far
    writes: int = 0  # writes issued so far (each one's tag ends in its index)
    finishing: bool = False  # the last write went out: ended once it is written


@dataclass(frozen=True, slots=True)
class ReqView:
    """What the engine says about the request now."""

    finish_reason: str | None = None
    error: str | None = None
    num_tokens: int = 0  # computed so far
    admitted: bool = False  # it holds a slot (its pages exist)
    known: bool = True  # still in the engine (running or held)


@dataclass(frozen=True, slots=True)
class Stepped:
    """An engine step ended (or the transfer was just created)."""

    req: ReqView
    now_s: float
    quiet: bool = False  # decode not heard from lately: write nothing to it


@dataclass(frozen=True, slots=True)
class DestinationArrived(Generic[D]):
    dest: D
    full_pages: int
    swa_pages: int
    req: ReqView
    now_s: float


@dataclass(frozen=True, slots=True)
class AbortReceived:
    """Decode said `abort` (client gone, its timeout)."""


@dataclass(frozen=True, slots=True)
class PeerGone:
    """Its decode went silent or handshook again: it failed the request already."""

    why: str


@dataclass(frozen=True, slots=True)
class Written:
    """The last `Write` action went out (queued on every route)."""


@dataclass(frozen=True, slots=True)
class WriteFailed:
    why: str


PrefillEvent = Stepped | DestinationArrived[D] | AbortReceived | PeerGone | Written | WriteFailed


@dataclass(frozen=True, slots=True)
class Write:
    """Write these columns of the request (write index `k`) to its decode; answer with
    `Written` or `WriteFailed`."""

    step: SendStep
    k: int


@dataclass(frozen=True, slots=True)
class SendDone:
    """Send `done`: the first token and the tags of `writes` writes."""

    writes: int


@dataclass(frozen=True, slots=True)
class SendFailed:
    """Send `failed` once every stage stopped writing (settled)."""

    why: str


@dataclass(frozen=True, slots=True)
class SendAborted:
    """Send `aborted` once every stage stopped writing (settled)."""


@dataclass(frozen=True, slots=True)
class NoteDestination:
    """Tell the PP followers the destination (in order with the engine's changes)."""


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """engine.abort: free its pages (or release them, when it already finished)."""


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    """engine.release: the request finished and its pages are written: free them."""


@dataclass(frozen=True, slots=True)
class Warn:
    """A follower's transfer ended on its own error (decode fails it on its timeout; the
    leader's abort or deadline frees the pages on every stage)."""

    why: str


PrefillAction = (
    Write
    | SendDone
    | SendFailed
    | SendAborted
    | NoteDestination
    | AbortRequest
    | ReleaseRequest
    | Warn
)
PrefillResult = tuple["Tx[R, D] | None", list[PrefillAction]]


def start_tx(
    room: str,
    peer: str,
    req: R,
    *,
    prompt_tokens: int,
    geometry: Geometry,
    timeout_s: float,
    now_s: float,
    leader: bool = True,
) -> Tx[R, D]:
    """A request the engine took (`submit`): it computes from now on."""
    return Tx(room, peer, req, prompt_tokens, geometry, timeout_s, now_s + timeout_s, leader)


def check_destination(tx: Tx[R, D], full_pages: int, swa_pages: int) -> str | None:
    """Why decode's destination cannot hold the request's columns (None: it fits)."""
    g, n = tx.geometry, tx.prompt_tokens
    cols = pages_for_tokens(n, g.page_size)
    tail = len(tail_cols(n, g.page_size, g.retained_tokens))
    if full_pages != cols or swa_pages != tail:
        return (
            f"destination: {full_pages} full / {swa_pages} SWA "
            f"pages for a {n}-token prompt, expected {cols} / {tail}"
        )
    return None


def prefill_step(tx: Tx[R, D] | None, event: PrefillEvent[D]) -> PrefillResult[R, D]:
    """The prefill side's transition (`tx` None: no transfer under that room)."""
    if tx is None:
        # An abort of a room that ended (or never began) still gets its answer.
        return None, [SendAborted()] if isinstance(event, AbortReceived) else []
    if isinstance(event, Stepped):
        if event.quiet and tx.leader:
            return tx, []  # its decode may have given the pages away: wait for news of it
        return _advance(tx, event.req, event.now_s)
    if isinstance(event, DestinationArrived):
        if tx.dest is not None:
            return tx, []  # a second one: not this transfer's
        if tx.leader:
            why = check_destination(tx, event.full_pages, event.swa_pages)
            if why is not None:
                return _fail(tx, why)
        state, actions = _advance(replace(tx, dest=event.dest), event.req, event.now_s)
        note: list[PrefillAction] = [NoteDestination()] if tx.leader else []
        return state, note + actions
    if isinstance(event, AbortReceived):
        return None, [AbortRequest(), SendAborted()]
    if isinstance(event, PeerGone):
        return _fail(tx, event.why)
    if isinstance(event, Written):
        if not tx.finishing:
            return tx, []
        return None, [ReleaseRequest()] if tx.leader else []  # a follower: the leader frees
    return _fail(tx, event.why)  # WriteFailed


def _advance(tx: Tx[R, D], req: ReqView, now_s: float) -> PrefillResult[R, D]:
    """Write what the request's steps computed, if its destination is known; end it when its
    first token is out (or it failed, or ran out of time)."""
    if tx.finishing:
        return tx, []  # waits for `Written`
    if req.finish_reason is not None and req.finish_reason not in NORMAL_ENDS:
        if not tx.leader:
            return None, []  # the leader aborted or failed it
        return _fail(tx, req.error or f"prefill ended: {req.finish_reason}")
    if not tx.leader and not req.known:
        return None, []  # the leader released it (failed before its destination)
    if tx.leader and now_s > tx.deadline_s:
        what = "finish" if tx.dest is not None else "get its destination from decode"
        return _fail(tx, f"prefill did not {what} within {tx.timeout_s:g} s")
    if tx.dest is None:
        return tx, []  # computing on; the finished columns go once the destination is here
    g = tx.geometry
    if req.finish_reason is not None:
        # `done` goes first and travels while the last step is written: decode completes
        # once it and every tag it lists arrived (the last step always writes: it carries
        # the request state). A failed write follows it with `failed`.
        step = send_step(
            tx.sent_cols,
            tx.prompt_tokens,
            last=True,
            page_size=g.page_size,
            retained_tokens=g.retained_tokens,
        )
        done: list[PrefillAction] = [SendDone(tx.writes + 1)] if tx.leader else []
        nxt = replace(tx, sent_cols=step.full_cols.stop, writes=tx.writes + 1, finishing=True)
        return nxt, [*done, Write(step, tx.writes)]
    if not req.admitted:
        return tx, []
    step = send_step(
        tx.sent_cols,
        req.num_tokens,
        last=False,
        page_size=g.page_size,
        retained_tokens=g.retained_tokens,
    )
    if step.empty:  # no page finished since the last write
        return tx, []
    return replace(tx, sent_cols=step.full_cols.stop, writes=tx.writes + 1), [
        Write(step, tx.writes)
    ]


def _fail(tx: Tx[R, D], why: str) -> PrefillResult[R, D]:
    """End the transfer: free the request's pages, tell decode why (a follower only drops its
    part: the leader's engine ends the request on every stage)."""
    if not tx.leader:
        return None, [Warn(why)]
    return None, [AbortRequest(), SendFailed(why)]


# ---- decode -----------------------------------------------------------------------------------

Link = Literal["ready", "connecting", "failed"]  # the prefill connection's state, if any


@dataclass(frozen=True, slots=True)
class Flight(Generic[P]):
    """One request on the decode side, from its admission to its first token's landing (kept
    under its room: the request's id, its engine request's too)."""

    prefill: str  # the prefill instance's control address
    timeout_s: float
    deadline_s: float
    done: P | None = None
    tags: tuple[str, ...] = ()  # what `done` lists: every write that must land
    cancelled: bool = False  # the client left: its pages go once nothing more can land
    fences: bool = True  # its target refuses a revoked grant's writes (zmq; NIXL cannot)
    granted: bool = False  # its destination left: the prefill may write into its pages
    held: bool = False  # ended for its client; its pages wait until its writer is done


@dataclass(frozen=True, slots=True)
class Granted:
    """Its destination was sent to its prefill (its grant is open at the target)."""


@dataclass(frozen=True, slots=True)
class SessionClosed:
    """The session its messages went on is provably closed: nothing more is written for it."""


@dataclass(frozen=True, slots=True)
class DestinationReady:
    """The request's pages exist on every stage (its `destination` message is at hand)."""

    link: Link | None


@dataclass(frozen=True, slots=True)
class Cancel:
    """The engine cancelled the request (client gone)."""

    link: Link | None


@dataclass(frozen=True, slots=True)
class DoneArrived(Generic[P]):
    done: P
    tags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FailedArrived:
    message: str


@dataclass(frozen=True, slots=True)
class AbortedArrived:
    """Prefill: nothing more will be written for it."""


@dataclass(frozen=True, slots=True)
class Landed:
    """These tags landed in this worker's targets (every stage's), not yet claimed."""

    tags: AbstractSet[str]  # read at once (the agent's own set, not a copy)


@dataclass(frozen=True, slots=True)
class Tick:
    now_s: float
    link: Link | None


@dataclass(frozen=True, slots=True)
class PrefillLost:
    """Its prefill went silent, restarted, refused the handshake or could not be reached."""

    why: str


DecodeEvent = (
    DestinationReady
    | Granted
    | SessionClosed
    | Cancel
    | DoneArrived[P]
    | FailedArrived
    | AbortedArrived
    | Landed
    | Tick
    | PrefillLost
)


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the event's message to the prefill now, or queue it until the handshake."""

    queue: bool


@dataclass(frozen=True, slots=True)
class SendAbort:
    """Tell the prefill to stop and forget the request."""


@dataclass(frozen=True, slots=True)
class Unqueue:
    """Drop the request's messages still waiting for the handshake."""


@dataclass(frozen=True, slots=True)
class ClaimTags:
    """These landed tags belong to the request (forget them)."""

    tags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ShowFirstToken(Generic[P]):
    """The runner's `show_first_token`: `done`'s first token may go to the client before the
    KV lands (the request still completes or fails by what lands)."""

    done: P


@dataclass(frozen=True, slots=True)
class Complete(Generic[P]):
    """engine.complete_transfer: the request decodes from its first token."""

    done: P


@dataclass(frozen=True, slots=True)
class Fail:
    """engine.fail_transfer: the request fails (the router may retry it elsewhere); with
    `hold`, its pages stay held (a write may still land) until a `Release`."""

    why: str
    hold: bool = False


@dataclass(frozen=True, slots=True)
class Release:
    """engine.release: a held or cancelled request's pages go (nothing more will land)."""


@dataclass(frozen=True, slots=True)
class Revoke:
    """Close the request's grant at the target: a fencing target refuses its later writes,
    any target ignores their tags."""


DecodeAction = (
    Forward
    | SendAbort
    | Unqueue
    | ClaimTags
    | ShowFirstToken[P]
    | Complete[P]
    | Fail
    | Release
    | Revoke
)
DecodeResult = tuple["Flight[P] | None", list[DecodeAction[P]]]


def admit(
    prefill: str,
    *,
    timeout_s: float,
    now_s: float,
    link: Link,
    link_error: str = "",
    fences: bool = True,
) -> DecodeResult[P]:
    """The engine admitted the request (its `prefill` message is at hand): send it. `fences`:
    its target refuses a revoked grant's writes."""
    flight: Flight[P] = Flight(prefill, timeout_s, now_s + timeout_s, fences=fences)
    if link == "failed":  # the address does not parse: nothing will answer
        return None, [Fail(link_error)]
    return flight, [Forward(queue=link == "connecting")]


def decode_step(flight: Flight[P] | None, event: DecodeEvent[P]) -> DecodeResult[P]:
    """The decode side's transition (`flight` None: no request under that room)."""
    if flight is None:
        # A cancel of a request that never flew (or ended): its pages go now.
        return None, [Release()] if isinstance(event, Cancel) else []
    if flight.held:
        return _held(flight, event)
    if isinstance(event, Granted):
        return replace(flight, granted=True), []
    if isinstance(event, SessionClosed):
        return flight, []  # (a live flight's session is not closed: PrefillLost comes first)
    if isinstance(event, DestinationReady):
        if flight.cancelled or event.link is None or event.link == "failed":
            return flight, []  # nothing will be written
        return flight, [Forward(queue=event.link == "connecting")]
    if isinstance(event, Cancel):
        cancelled = replace(flight, cancelled=True)
        if event.link == "ready":
            return cancelled, [SendAbort()]  # its pages go with `aborted`
        if event.link is not None:  # its session is gone (or not yet there)
            return _give_up(cancelled, "cancelled", [Unqueue()])
        return cancelled, []
    if isinstance(event, DoneArrived):
        # Its first token is final: a stream may show it while the last write lands (once;
        # never to a client that left).
        first = flight.done is None and not flight.cancelled
        show: list[DecodeAction[P]] = [ShowFirstToken(event.done)] if first else []
        return replace(flight, done=event.done, tags=event.tags), show
    if isinstance(event, FailedArrived):
        # (cancelled: the engine releases)
        return None, [Revoke(), Fail(f"prefill: {event.message}")]
    if isinstance(event, AbortedArrived):
        return None, [Revoke(), Release()]
    if isinstance(event, Landed):
        if not _all_landed(flight, event):
            return flight, []
        assert flight.done is not None
        end: DecodeAction[P] = Release() if flight.cancelled else Complete(flight.done)
        return None, [Revoke(), ClaimTags(flight.tags), end]
    if isinstance(event, Tick):
        if event.now_s <= flight.deadline_s:
            return flight, []
        why = f"prefill {flight.prefill} did not deliver within {flight.timeout_s:g} s"
        abort: list[DecodeAction[P]] = [SendAbort()] if event.link == "ready" else []
        return _give_up(flight, why, abort)
    return _give_up(flight, event.why, [])  # PrefillLost


def _all_landed(flight: Flight[P], event: Landed) -> bool:
    return flight.done is not None and all(t in event.tags for t in flight.tags)


def _give_up(flight: Flight[P], why: str, first: list[DecodeAction[P]]) -> DecodeResult[P]:
    """The flight ends without its first token while its prefill may not have stopped: free
    its pages when nothing can land in them any more (never granted, or a fencing target),
    else end it for its client and hold them (`held`). A cancelled one has no client."""
    if not flight.granted or flight.fences:
        end: DecodeAction[P] = Release() if flight.cancelled else Fail(why)
        return None, [*first, Revoke(), end]
    hold: list[DecodeAction[P]] = [] if flight.cancelled else [Fail(why, hold=True)]
    return replace(flight, held=True), [*first, Revoke(), *hold]


def _held(flight: Flight[P], event: DecodeEvent[P]) -> DecodeResult[P]:
    """A held flight frees its pages once its writer is provably done; nothing else moves it
    (no deadline, no cancel: its client has its answer)."""
    if isinstance(event, DoneArrived):  # late: the tags it lists may still land
        return replace(flight, done=event.done, tags=event.tags), []
    if isinstance(event, FailedArrived | AbortedArrived | SessionClosed):
        return None, [Release()]
    if isinstance(event, Landed) and _all_landed(flight, event):
        return None, [ClaimTags(flight.tags), Release()]
    return flight, []
