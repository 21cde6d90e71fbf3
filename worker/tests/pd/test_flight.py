"""The PD request state machines (`pd.flight`), without sockets or engines: each table row is
a state and an event, and the state and actions expected; the properties drive either side
through any interleaving of its events and check what must hold whatever the order (a request
ends once, with exactly one engine action that frees or completes it; nothing is written
before the destination or after the end; a cancelled request never completes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.pd import flight as F
from dsv4_worker.pd.columns import SendStep

G = F.Geometry(page_size=4, retained_tokens=4)  # a 10-token prompt: 3 columns, SWA tail 1..2
DEST = "dest"
T0 = 100.0
TX: F.Tx[None, str] = F.start_tx(
    "room", "decode-a", None, prompt_tokens=10, geometry=G, timeout_s=5.0, now_s=T0
)
WRITING = replace(TX, dest=DEST, sent_cols=2, writes=1)
FINISHING = replace(WRITING, sent_cols=3, writes=2, finishing=True)
FOLLOWER = replace(TX, leader=False)
RUNNING = F.ReqView(num_tokens=8, admitted=True)
QUEUED = F.ReqView()
STOPPED = F.ReqView(finish_reason="stop", num_tokens=10, admitted=True)
LAST = F.Write(SendStep(range(2, 3), range(1, 3), True), 1)


def fail(why: str) -> list[object]:
    return [F.AbortRequest(), F.SendFailed(why)]


def arrive(req: F.ReqView = RUNNING, full: int = 3, swa: int = 2) -> F.DestinationArrived[str]:
    return F.DestinationArrived(DEST, full, swa, req, T0 + 1)


PREFILL_ROWS: list[tuple[str, F.Tx[None, str] | None, object, object, list[object]]] = [
    # computing, no destination yet
    ("computes without a destination", TX, F.Stepped(RUNNING, T0 + 1), TX, []),
    (
        "deadline before the destination",
        TX,
        F.Stepped(QUEUED, T0 + 6),
        None,
        fail("prefill did not get its destination from decode within 5 s"),
    ),
    (
        "deadline after the destination",
        WRITING,
        F.Stepped(RUNNING, T0 + 6),
        None,
        fail("prefill did not finish within 5 s"),
    ),
    (
        "the engine failed it",
        TX,
        F.Stepped(F.ReqView(finish_reason="error", error="stage lost"), T0),
        None,
        fail("stage lost"),
    ),
    (
        "the engine aborted it",
        WRITING,
        F.Stepped(F.ReqView(finish_reason="abort"), T0),
        None,
        fail("prefill ended: abort"),
    ),
    # the destination
    (
        "destination: what finished goes at once",
        TX,
        arrive(),
        replace(TX, dest=DEST, sent_cols=2, writes=1),
        [F.NoteDestination(), F.Write(SendStep(range(0, 2), range(0), False), 0)],
    ),
    (
        "destination before admission: nothing to write",
        TX,
        arrive(QUEUED),
        replace(TX, dest=DEST),
        [F.NoteDestination()],
    ),
    (
        "destination of the wrong size",
        TX,
        arrive(full=2),
        None,
        fail("destination: 2 full / 2 SWA pages for a 10-token prompt, expected 3 / 2"),
    ),
    ("a second destination is not this transfer's", WRITING, arrive(full=9), WRITING, []),
    (
        "destination after finishing: done and the last write",
        TX,
        arrive(STOPPED),
        replace(TX, dest=DEST, sent_cols=3, writes=1, finishing=True),
        [
            F.NoteDestination(),
            F.SendDone(1),
            F.Write(SendStep(range(0, 3), range(1, 3), True), 0),
        ],
    ),
    # writing
    ("no page finished since the last write", WRITING, F.Stepped(RUNNING, T0 + 1), WRITING, []),
    (
        "finished: done goes before the last write",
        WRITING,
        F.Stepped(STOPPED, T0 + 1),
        FINISHING,
        [F.SendDone(2), LAST],
    ),
    ("the last write went out: free", FINISHING, F.Written(), None, [F.ReleaseRequest()]),
    ("a streaming write went out", WRITING, F.Written(), WRITING, []),
    ("the last write failed", FINISHING, F.WriteFailed("nixl"), None, fail("nixl")),
    ("a streaming write failed", WRITING, F.WriteFailed("nixl"), None, fail("nixl")),
    (
        "a quiet decode is not written to (nor timed out)",
        WRITING,
        F.Stepped(STOPPED, T0 + 60, quiet=True),
        WRITING,
        [],
    ),
    # decode ends it
    (
        "abort before the destination",
        TX,
        F.AbortReceived(),
        None,
        [F.AbortRequest(), F.SendAborted()],
    ),
    (
        "abort after the destination",
        WRITING,
        F.AbortReceived(),
        None,
        [F.AbortRequest(), F.SendAborted()],
    ),
    ("abort of a room that ended", None, F.AbortReceived(), None, [F.SendAborted()]),
    ("nothing else of a room that ended", None, F.Stepped(STOPPED, T0), None, []),
    (
        "a second handshake ends the old session's transfers",
        WRITING,
        F.PeerGone("decode decode-a handshook again"),
        None,
        fail("decode decode-a handshook again"),
    ),
    (
        "a silent decode is dropped",
        TX,
        F.PeerGone("decode decode-a: nothing heard for 1.5 s"),
        None,
        fail("decode decode-a: nothing heard for 1.5 s"),
    ),
    # a PP follower: the same machine, deciding nothing
    ("follower: the leader aborted it", FOLLOWER, F.Stepped(F.ReqView("abort"), T0), None, []),
    (
        "follower: the leader released it",
        FOLLOWER,
        F.Stepped(F.ReqView(known=False), T0),
        None,
        [],
    ),
    ("follower: no deadline of its own", FOLLOWER, F.Stepped(RUNNING, 1e9), FOLLOWER, []),
    (
        "follower: the destination is the leader's (checked there), no note",
        FOLLOWER,
        arrive(full=2),
        replace(FOLLOWER, dest=DEST, sent_cols=2, writes=1),
        [F.Write(SendStep(range(0, 2), range(0), False), 0)],
    ),
    (
        "follower: writes even when the leader finds decode quiet",
        replace(FOLLOWER, dest=DEST, sent_cols=2, writes=1),
        F.Stepped(STOPPED, T0, quiet=True),
        replace(FOLLOWER, dest=DEST, sent_cols=3, writes=2, finishing=True),
        [LAST],
    ),
    ("follower: its last write went out", replace(FINISHING, leader=False), F.Written(), None, []),
    (
        "follower: its write failed (decode times it out)",
        replace(WRITING, leader=False),
        F.WriteFailed("nixl"),
        None,
        [F.Warn("nixl")],
    ),
]


@pytest.mark.parametrize(
    ("state", "event", "want_state", "want_actions"),
    [pytest.param(*row[1:], id=row[0]) for row in PREFILL_ROWS],
)
def test_prefill_transition(
    state: F.Tx[None, str] | None, event: object, want_state: object, want_actions: list[object]
) -> None:
    assert F.prefill_step(state, event) == (want_state, want_actions)  # type: ignore[arg-type]


def test_done_lists_every_write_of_every_stage_pair() -> None:
    assert F.done_tags("r", 2, [(0, 0), (1, 0)]) == ("r:0:0:0", "r:1:0:0", "r:0:0:1", "r:1:0:1")
    assert F.write_tag("r", 1, 0, 3) == "r:1:0:3"


# ---- decode ---------------------------------------------------------------------------------

DONE = "done"
TAGS = ("room:0:0:0", "room:0:0:1")
FL: F.Flight[str] = F.Flight("prefill-a:1", timeout_s=5.0, deadline_s=T0 + 5)
LANDING = replace(FL, done=DONE, tags=TAGS)
GONE = replace(FL, cancelled=True)
SENT = replace(FL, granted=True)  # its destination left (a fencing target: zmq)
OPEN = replace(FL, granted=True, fences=False)  # ... to a target that cannot refuse (NIXL)
HELD = replace(OPEN, held=True)
LATE = "prefill prefill-a:1 did not deliver within 5 s"

DECODE_ROWS: list[tuple[str, F.Flight[str] | None, object, object, list[object]]] = [
    ("destination: send", FL, F.DestinationReady("ready"), FL, [F.Forward(queue=False)]),
    ("destination: queue", FL, F.DestinationReady("connecting"), FL, [F.Forward(queue=True)]),
    ("destination: prefill failed", FL, F.DestinationReady("failed"), FL, []),
    ("destination: prefill forgotten", FL, F.DestinationReady(None), FL, []),
    ("destination after the cancel", GONE, F.DestinationReady("ready"), GONE, []),
    ("destination sent: granted", FL, F.Granted(), SENT, []),
    ("cancel: tell prefill, keep the pages", FL, F.Cancel("ready"), GONE, [F.SendAbort()]),
    (
        "cancel before the handshake",
        FL,
        F.Cancel("connecting"),
        None,
        [F.Unqueue(), F.Revoke(), F.Release()],
    ),
    (
        "cancel after the prefill failed",
        FL,
        F.Cancel("failed"),
        None,
        [F.Unqueue(), F.Revoke(), F.Release()],
    ),
    (
        "granted, cancel after its session was lost: keep holding",
        OPEN,
        F.Cancel("connecting"),
        replace(HELD, cancelled=True),
        [F.Unqueue(), F.Revoke()],
    ),
    ("cancel, prefill forgotten: wait", FL, F.Cancel(None), GONE, []),
    ("cancel of no flight: free now", None, F.Cancel("ready"), None, [F.Release()]),
    (
        "done: show its first token",
        FL,
        F.DoneArrived(DONE, TAGS),
        LANDING,
        [F.ShowFirstToken(DONE)],
    ),
    ("a second done", LANDING, F.DoneArrived(DONE, TAGS), LANDING, []),
    (
        "done after the cancel",
        GONE,
        F.DoneArrived(DONE, TAGS),
        replace(LANDING, cancelled=True),
        [],
    ),
    ("some tags landed", LANDING, F.Landed({TAGS[0]}), LANDING, []),
    ("tags before done", FL, F.Landed(set(TAGS)), FL, []),
    (
        "every tag landed: revoke, complete",
        LANDING,
        F.Landed({*TAGS, "other:0:0:0"}),
        None,
        [F.Revoke(), F.ClaimTags(TAGS), F.Complete(DONE)],
    ),
    (
        "every tag of a cancelled one landed: free",
        replace(LANDING, cancelled=True),
        F.Landed(set(TAGS)),
        None,
        [F.Revoke(), F.ClaimTags(TAGS), F.Release()],
    ),
    ("failed", FL, F.FailedArrived("oom"), None, [F.Revoke(), F.Fail("prefill: oom")]),
    (
        "failed after the cancel",
        GONE,
        F.FailedArrived("oom"),
        None,
        [F.Revoke(), F.Fail("prefill: oom")],
    ),
    ("aborted: free", GONE, F.AbortedArrived(), None, [F.Revoke(), F.Release()]),
    ("before the deadline", FL, F.Tick(T0 + 5, "ready"), FL, []),
    (
        "deadline: abort and fail",
        FL,
        F.Tick(T0 + 6, "ready"),
        None,
        [F.SendAbort(), F.Revoke(), F.Fail(LATE)],
    ),
    (
        "deadline of a cancelled one, prefill not ready: free",
        GONE,
        F.Tick(T0 + 6, "failed"),
        None,
        [F.Revoke(), F.Release()],
    ),
    (
        "prefill lost: fail (the router retries)",
        LANDING,
        F.PrefillLost("gone"),
        None,
        [F.Revoke(), F.Fail("gone")],
    ),
    (
        "prefill lost after the cancel: free",
        GONE,
        F.PrefillLost("gone"),
        None,
        [F.Revoke(), F.Release()],
    ),
    ("nothing else of a flight that ended", None, F.DoneArrived(DONE, TAGS), None, []),
    # Fencing: a granted flight whose target cannot refuse writes (NIXL) keeps its pages.
    (
        "granted, fencing target, prefill lost: revoke, free",
        SENT,
        F.PrefillLost("gone"),
        None,
        [F.Revoke(), F.Fail("gone")],
    ),
    (
        "granted, prefill lost: fail, hold the pages",
        OPEN,
        F.PrefillLost("gone"),
        HELD,
        [F.Revoke(), F.Fail("gone", hold=True)],
    ),
    (
        "granted, deadline: abort, fail, hold the pages",
        OPEN,
        F.Tick(T0 + 6, "ready"),
        HELD,
        [F.SendAbort(), F.Revoke(), F.Fail(LATE, hold=True)],
    ),
    (
        "granted, cancelled, prefill lost: keep holding",
        replace(OPEN, cancelled=True),
        F.PrefillLost("gone"),
        replace(HELD, cancelled=True),
        [F.Revoke()],
    ),
    ("held: no deadline", HELD, F.Tick(T0 + 1e9, "failed"), HELD, []),
    ("held: a lost prefill changes nothing", HELD, F.PrefillLost("gone"), HELD, []),
    ("held: no cancel", HELD, F.Cancel("ready"), HELD, []),
    ("held: failed frees", HELD, F.FailedArrived("gone"), None, [F.Release()]),
    ("held: aborted frees", HELD, F.AbortedArrived(), None, [F.Release()]),
    ("held: its session closed frees", HELD, F.SessionClosed(), None, [F.Release()]),
    (
        "held: a late done, then every tag landed frees",
        replace(HELD, done=DONE, tags=TAGS),
        F.Landed(set(TAGS)),
        None,
        [F.ClaimTags(TAGS), F.Release()],
    ),
    (
        "held: a late done is kept",
        HELD,
        F.DoneArrived(DONE, TAGS),
        replace(HELD, done=DONE, tags=TAGS),
        [],
    ),
    ("a live flight's session does not close", OPEN, F.SessionClosed(), OPEN, []),
]


@pytest.mark.parametrize(
    ("state", "event", "want_state", "want_actions"),
    [pytest.param(*row[1:], id=row[0]) for row in DECODE_ROWS],
)
def test_decode_transition(
    state: F.Flight[str] | None, event: object, want_state: object, want_actions: list[object]
) -> None:
    assert F.decode_step(state, event) == (want_state, want_actions)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("link", "want"),
    [
        ("ready", (FL, [F.Forward(queue=False)])),
        ("connecting", (FL, [F.Forward(queue=True)])),
        ("failed", (None, [F.Fail("bad address")])),
    ],
)
def test_admit(link: F.Link, want: object) -> None:
    got: object = F.admit(
        "prefill-a:1", timeout_s=5.0, now_s=T0, link=link, link_error="bad address"
    )
    assert got == want


# ---- any order --------------------------------------------------------------------------------

PREFILL_OPS = st.sampled_from(["step", "dest", "finish", "error", "abort", "lost", "late", "quiet"])
ENDS_PREFILL = (F.AbortRequest, F.ReleaseRequest)


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(PREFILL_OPS, max_size=12),
    write_ok=st.lists(st.booleans(), min_size=12, max_size=12),
    leader=st.booleans(),
)
def test_prefill_any_order_ends_once_and_writes_each_column_once(
    ops: list[str], write_ok: list[bool], leader: bool
) -> None:
    """Whatever decode, the engine and the transfers do in whatever order: the request is
    freed (aborted or released) at most once and only as it ends, every write comes after the
    destination and before the end, writes are numbered 0, 1, ... and send each column once,
    and `done` (leader only) goes once, listing every write."""
    tx: F.Tx[None, str] | None = replace(TX, leader=leader)
    tokens, finished, dest, ended = 0, False, False, False
    frees = 0
    writes: list[int] = []
    cols: list[int] = []
    dones: list[int] = []
    oks = iter(write_ok)
    for op in ops:
        if op in ("step", "quiet") and not finished:
            tokens = min(10, tokens + 3)
        finished = finished or op == "finish"
        reason = "error" if op == "error" else ("stop" if finished else None)
        view = F.ReqView(reason, "boom", 10 if finished else tokens, admitted=True)
        now = T0 + (10 if op == "late" else 1)
        event: object = {
            "dest": F.DestinationArrived(DEST, 3, 2, view, now),
            "abort": F.AbortReceived(),
            "lost": F.PeerGone("gone"),
        }.get(op, F.Stepped(view, now, quiet=op == "quiet"))
        if op in ("abort", "lost") and not leader:
            continue  # the leader's events: a follower hears of them as an engine change
        while event is not None:
            before = tx
            tx, actions = F.prefill_step(tx, event)  # type: ignore[arg-type]
            event = None
            if before is None:
                assert all(isinstance(a, F.SendAborted) for a in actions)
                continue
            dest = dest or (tx is not None and tx.dest is not None)
            frees += sum(isinstance(a, ENDS_PREFILL) for a in actions)
            dones += [a.writes for a in actions if isinstance(a, F.SendDone)]
            for a in actions:
                if isinstance(a, F.Write):
                    assert dest and tx is not None and not ended
                    writes.append(a.k)
                    cols.extend(a.step.full_cols)
                    event = F.Written() if next(oks, True) else F.WriteFailed("nixl")
            ended = tx is None
    assert frees == (1 if ended and leader else 0)
    assert writes == list(range(len(writes)))
    assert cols == list(range(len(cols)))  # each column once, in order
    assert dones == ([len(writes)] if dones else [])
    assert len(dones) <= (1 if leader else 0)


DECODE_OPS = st.sampled_from(
    [
        "cancel",
        "done",
        "some",
        "landed",
        "failed",
        "aborted",
        "tick",
        "late",
        "lost",
        "dest",
        "granted",
        "closed",
    ]
)
LINKS = st.sampled_from(["ready", "connecting", "failed", None])
PROOFS = ("failed", "aborted", "closed")  # the writer is provably done


@settings(max_examples=600, deadline=None)
@given(ops=st.lists(st.tuples(DECODE_OPS, LINKS), max_size=10), fences=st.booleans())
def test_decode_any_interleaving_of_abort_and_landed_ends_once(
    ops: list[tuple[str, F.Link | None]], fences: bool
) -> None:
    """Any interleaving of the client's cancel, prefill's answers, landed tags, the deadline,
    a lost prefill, the destination leaving and its session closing: the flight ends at most
    once for its client and frees its pages once (complete, fail or release), never completes
    after a cancel, shows its first token at most once (before it ends, never after a cancel),
    and always ends by its deadline, except that while its target cannot refuse writes, a
    granted flight frees its pages only once its writer is provably done (its pages are never
    handed out while a stale write may land; they are freed once it is proven)."""
    flight: F.Flight[str] | None = replace(FL, fences=fences)
    ends: list[object] = []
    frees = 0
    shown = 0
    cancelled = granted = writer_done = False
    for op, link in [*ops, ("late", "ready"), ("closed", None)]:
        if op == "cancel" and cancelled:
            continue  # the engine cancels a request once
        if op == "landed" and flight is not None and flight.done is not None:
            writer_done = True  # every write `done` lists landed
        writer_done = writer_done or op in PROOFS
        cancelled = cancelled or op == "cancel"
        event: object = {
            "cancel": F.Cancel(link),
            "done": F.DoneArrived(DONE, TAGS),
            "some": F.Landed({TAGS[0]}),
            "landed": F.Landed(set(TAGS)),
            "failed": F.FailedArrived("oom"),
            "aborted": F.AbortedArrived(),
            "tick": F.Tick(T0 + 1, link),
            "late": F.Tick(T0 + 6, link),
            "lost": F.PrefillLost("gone"),
            "dest": F.DestinationReady(link),
            "granted": F.Granted(),
            "closed": F.SessionClosed(),
        }[op]
        before = flight
        flight, actions = F.decode_step(flight, event)  # type: ignore[arg-type]
        if before is None:
            continue  # a cancel of an ended flight releases (idempotent in the engine)
        granted = granted or (flight is not None and flight.granted)
        ended = [a for a in actions if isinstance(a, F.Complete | F.Fail | F.Release)]
        ends += [a for a in ended if not (isinstance(a, F.Fail) and a.hold)]
        freeing = [a for a in ended if not (isinstance(a, F.Fail) and a.hold)]
        if freeing and granted and not fences:
            assert writer_done, (op, actions)
        frees += len(freeing)
        if any(isinstance(a, F.Fail) and a.hold for a in actions):
            assert flight is not None and flight.held and not fences
        shows = [a for a in actions if isinstance(a, F.ShowFirstToken)]
        shown += len(shows)
        assert not shows or (flight is not None and not cancelled and not flight.held)
        if flight is None:
            assert frees == 1
            assert any(isinstance(a, F.Revoke) for a in actions) or before.held
        if cancelled:
            assert not any(isinstance(a, F.Complete) for a in actions)
    assert flight is None and frees == 1
    assert shown <= 1
