"""The decode side of PD: preallocates arriving requests (the engine's scheduler decides when,
under the one admission function), sends each to its prefill instance as soon as the plan
admits it (`prefill`: prefill computes while this side allocates and runs its step), then
where to write once the pages exist (`destination`), and turns them into decoders when their
KV, state and first token have landed.

Threads: the control thread owns one DEALER socket per prefill connection and the transfer
target's landed tags; the engine thread hands it typed messages through its mailbox
(`on_admit`, `on_prealloc`, `on_cancel`: `_Admitted`, `_Allocated`, `_Cancelled`; at a step's
first admission it waits, at most `ADMIT_HANDOFF_S`, until the control thread has handled it:
`Mailbox.hand_over`) and gets results back through `post` (`complete_transfer`,
`fail_transfer`, `release`); the first token of a request goes to its client from the control
thread as `done` arrives (`show`, the runner's `show_first_token`: the stream has it while the
last write lands). Each request is a `flight.Flight`: the control thread turns messages,
landed tags and the clock into its events, and does what `flight.decode_step` returns.

Handshake (`auth`, protocol 5): `hello` with a fresh nonce; the prefill's `challenge` must prove
the deployment's secret over it (else the prefill is refused and learns nothing: the transfer
descriptor goes only in the `join`, sealed under the session the prefill assigned); then every
message is sealed. A mismatch (manifest, backend) fails every request sent there with the
prefill's message naming the field.

Fencing: a destination leaves only with its grant open at the target (`Grant`: the request's
epoch, its pages, its session); every write carries the epoch. Every end of a flight revokes
it. A flight given up on while its prefill may still write (its deadline, a lost prefill) keeps
its pages when the target cannot refuse writes (NIXL): held until its writer is provably done:
`failed` / `aborted` from that session (a lost session's socket stays open, `lame`, to hear
them), the prefill's confirmation in a later handshake with the same process (`supersedes` ->
`welcome.closed`), or the session's connection dropped (the socket monitor) for
`2 x` the heartbeat timeout (a live prefill stops writing for a session whose pings stopped
within one).

A request completes when `done` arrived and every tag it lists landed under its epoch. A request
whose prefill does not answer within `transfer_timeout_s` fails (the client may retry
elsewhere); a cancelled request keeps its pages until the prefill side says `aborted` (nothing
more will land) or the timeout passes.

Liveness (`liveness`): the control thread pings every prefill it is connected to, echoing the
last pong; a prefill silent for the heartbeat timeout (killed, stopped, unreachable) is lost:
every request sent there fails at once (retryable: the router tries another pair) and it is
handshaken again after a short pause. A pong from a process that no longer knows this session
(restarted, or it dropped it) does the same at once. If the control thread itself dies, the
worker fails everything it holds and reports `failure` (unready; `dsv4 serve` exits non-zero).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from dsv4_common.api.manifest import Manifest
from dsv4_common.core.layout import IndexSpace
from dsv4_worker.engine import wake
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.pd import control as C
from dsv4_worker.pd import flight as F
from dsv4_worker.pd.auth import (
    TO_DECODE,
    TO_PREFILL,
    AuthError,
    Opener,
    Sealer,
    SessionKeys,
    instance_of,
    new_nonce,
)
from dsv4_worker.pd.channel import (
    Mailbox,
    OnFailure,
    Post,
    ShowFirst,
    bound,
    guarded,
    no_hook,
    socket,
)
from dsv4_worker.pd.columns import tail_cols
from dsv4_worker.pd.liveness import (
    Heartbeat,
    next_ping_s,
    ping_due,
    pong_verdict,
    rooms_of,
    silent,
    silent_after_s,
)
from dsv4_worker.pd.transfer import Grant, TransferError, TransferTarget, epoch_of, landed_key
from dsv4_worker.sched.scheduler import RequestId

log = logging.getLogger(__name__)

# The most the engine thread waits, at a step's first admission, for the control thread to
# send the request to prefill: the rest of the step holds the GIL and a core meanwhile.
ADMIT_HANDOFF_S = 0.002
LANDED_POLL_S = 0.05  # a decode follower's wait for its target's wake-up (a safety net)
HANDSHAKE_TIMEOUT_S = 10.0  # a prefill that answers pings but not the handshake
LOST_KEPT = 8  # lost sessions per prefill address named in the next join (`supersedes`)
# Test hook: "control-crash" makes the control thread raise at its first request.
FAULT_ENV = "DSV4_TEST_PD_FAULT"
MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass(slots=True, eq=False)
class _Prefill:
    """One connection to a prefill address; a session once the prefill challenged it."""

    address: str  # host:port of its control socket
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes] | None  # its connection events (`_dropped`)
    nonce: str  # this connection's hello
    state: F.Link = "connecting"
    error: str = ""
    since_s: float = field(default_factory=time.monotonic)
    # (room, encoded message, its grant if a destination): sent at the welcome
    queued: list[tuple[str, list[bytes], Grant | None]] = field(default_factory=list)
    session: str = ""  # assigned by the prefill in its challenge
    instance: str = ""  # the prefill process that challenged us
    sealer: Sealer | None = None
    opener: Opener | None = None
    heard_s: float = field(default_factory=time.monotonic)  # its last message (or our hello)
    pinged_s: float | None = None
    retry_at_s: float | None = None  # failed: handshake again from then on (None: not by itself)
    echo: int = 0  # the number of its last pong (the welcome is 0)
    connected: bool = False  # its TCP connection was up once
    dropped_s: float | None = None  # the connection dropped (after being up), when
    lame: bool = False  # lost, kept open only to hear its held requests' `failed`/`aborted`


_Flight = F.Flight[C.Done]  # a request on its way from its prefill (`flight`)


# Engine thread -> control thread (the outbox), in order.
@dataclass(frozen=True, slots=True)
class _Connect:
    """Handshake with a prefill now (the default one, at start)."""

    address: str


@dataclass(frozen=True, slots=True)
class _Admitted:
    """The engine admitted the request: send its `prefill` (`frames`, encoded)."""

    address: str
    room: str
    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class _Allocated:
    """Its pages exist on every stage: send its `destination` (`frames`, encoded) once its
    `grant` is open at the target under the session it goes on."""

    address: str
    room: str
    frames: list[bytes]
    grant: Grant


@dataclass(frozen=True, slots=True)
class _Cancelled:
    """The engine cancelled the request (client gone)."""

    room: str


_Out = _Connect | _Admitted | _Allocated | _Cancelled


def destination_units(
    engine: Engine, req: Request, manifest: Manifest
) -> dict[str, tuple[int, ...]]:
    """The units a request's destination names, per index space: its full page per column,
    its SWA page per window-tail column, its slot (the grant's units on every stage)."""
    assert req.slot is not None
    full, swa = engine.mem.pages.request_pages(req.slot)
    tail = tail_cols(
        len(req.prompt), manifest.page_size, manifest.window_tokens + manifest.draft_tokens
    )
    return {
        IndexSpace.FULL_PAGE: tuple(full.tolist()),
        IndexSpace.SWA_PAGE: tuple(swa[tail.start : tail.stop].tolist()),
        IndexSpace.REQ_SLOT: (req.slot,),
    }


class DecodeAgent(EngineEvents):
    """The decode engine's events (`on_admit`, `on_prealloc`, `on_cancel`, `on_transfer_end`):
    built before its engine, then `attach`ed to it once, before `start`."""

    engine: Engine  # set by attach
    post: Post  # runs a function on the engine thread (the runner's `call`)
    show: ShowFirst  # hands a first token to its client now (any thread; the runner's)

    def __init__(
        self,
        target: TransferTarget,
        manifest: Manifest,
        keys: SessionKeys,
        *,
        default_prefill: str | None = None,
        transfer_timeout_s: float = 60.0,
        stages: tuple[C.StageTarget, ...] = (),
        landed_bind: str | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.heartbeat = heartbeat or Heartbeat()
        self.target = target
        self.manifest = manifest
        self.keys = keys
        self.default_prefill = default_prefill
        self.transfer_timeout_s = transfer_timeout_s
        self.stages = stages  # a PP group: every stage's target, this one first
        self._descriptor = C.b64(target.descriptor())
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # A PP group's followers report the tags that landed in their own targets here.
        self._landed_in: zmq.Socket[bytes] | None = None
        self.landed_endpoint: str | None = None
        if landed_bind is not None:
            self._landed_in, self.landed_endpoint = bound(self._ctx, zmq.PULL, landed_bind)
        self._outbox: Mailbox[_Out] = Mailbox(self._ctx, "decode")
        self._prefills: dict[str, _Prefill] = {}  # address -> its current connection
        self._lame: list[_Prefill] = []  # lost sessions whose held requests wait for proof
        self._socks: dict[zmq.Socket[bytes], _Prefill] = {}  # every open connection's socket
        self._monitors: dict[zmq.Socket[bytes], _Prefill] = {}
        self._lost: dict[str, list[str]] = {}  # address -> sessions lost there (`supersedes`)
        self._flights: dict[str, _Flight] = {}  # room -> in flight (or held)
        self._epochs: dict[str, int] = {}  # room -> its grant's epoch (once granted)
        self._session_of: dict[str, str] = {}  # room -> the session its destination went on
        self._rooms_of: dict[str, set[str]] = {}  # session -> rooms granted under it
        self._expecting = False  # told the target: tags are due (`tags_due`)
        self._landed: set[str] = set()  # `landed_key`s not yet claimed
        self._held = 0  # flights held (`held_requests`)
        target.on_landed(self._outbox.kick)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=guarded, args=("decode control", self._run, self._crashed), daemon=True
        )
        self._thread.name = "dsv4-pd-decode"
        self._poller = zmq.Poller()  # the control thread's
        self._lock = threading.Lock()
        self._status: tuple[bool, str | None] = (False, None)
        self.failure: str | None = None  # set: the control thread died
        self.on_failure: OnFailure = no_hook  # called once `failure` is set
        self.control_turns = 0  # turns of the control loop (each wake-up: tests)
        self._crash_on_request = os.environ.get(FAULT_ENV) == "control-crash"

    def attach(self, engine: Engine, post: Post, show: ShowFirst) -> None:
        """The engine built with this agent as its events, how to run code on its thread, and
        how to show a request's first token before its KV lands (`show_first_token`)."""
        self.engine, self.post, self.show = engine, post, show

    def start(self) -> None:
        self._thread.start()
        if self.default_prefill:
            self._outbox.put(_Connect(self.default_prefill))

    def stop(self) -> None:
        self._stop.set()
        self._outbox.kick()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # its sockets are still in use: leave them to the exit
            log.error("the PD decode control thread did not stop")
            return
        self._outbox.close()
        for p in list(self._socks.values()):
            self._close(p)
        if self._landed_in is not None:
            self._landed_in.close(linger=0)
        self._ctx.destroy(linger=0)  # closes any socket a crash left open, then terminates

    def _crashed(self, why: str) -> None:
        """The control thread died: nothing will land or complete; fail everything."""
        self.failure = why
        with self._lock:
            self._status = (False, why)
        self.post(functools.partial(self._fail_all, why))
        self.on_failure(why)

    def _fail_all(self, why: str) -> None:
        self.engine.fail_all_between(why)

    def kv_status(self) -> tuple[bool, str | None]:
        """(some prefill's handshake is in force, the last handshake or liveness error)."""
        with self._lock:
            return self._status

    @property
    def held_requests(self) -> int:
        """Requests given up on whose pages wait for their writer to be provably done (any
        thread)."""
        return self._held

    # -- engine thread ---------------------------------------------------------------------------

    def on_admit(self, req: Request) -> None:
        """The step's plan preallocates the request: send it to its prefill instance now."""
        address = self._address(req)
        if not address:
            self.post(lambda: self.engine.fail_transfer(req.rid, "no prefill instance given"))
            return
        p = req.params
        msg = C.PrefillRequest(
            room=self._room(req),
            prompt=req.prompt,
            sampling=C.sampling_of(p),
            stop_token_ids=p.stop_token_ids,
            timeout_s=self.transfer_timeout_s,
        )
        self._forward(address, msg)

    def on_prealloc(self, req: Request) -> None:
        """The request's pages exist on every stage: tell its prefill instance where to write."""
        address = self._address(req)
        if not address:  # on_admit failed it
            return
        room = self._room(req)
        units = destination_units(self.engine, req, self.manifest)
        msg = C.Destination(
            room=room,
            dst_full_pages=units[IndexSpace.FULL_PAGE],
            dst_swa_pages=units[IndexSpace.SWA_PAGE],
            dst_slot=units[IndexSpace.REQ_SLOT][0],
            epoch=req.epoch,
        )
        self._forward(address, msg, Grant(req.epoch, room, units))

    def _forward(
        self, address: str, msg: C.PrefillRequest | C.Destination, grant: Grant | None = None
    ) -> None:
        # Encoded here, once: the control thread forwards the frames as they are.
        if isinstance(msg, C.Destination):
            assert grant is not None
            self._outbox.put(_Allocated(address, msg.room, C.encode(msg), grant))
            return
        ticket = self._outbox.put(_Admitted(address, msg.room, C.encode(msg)))
        # The prefill computes from this message on: let the control thread send it now rather
        # than when the rest of this step lets it have the GIL (bounded; once a step).
        self._outbox.hand_over(ticket, ADMIT_HANDOFF_S, self.engine.steps)

    def on_transfer_end(self, req: Request) -> None:
        self.target.revoke(req.epoch)  # (idempotent: the control thread's `Revoke` came first)

    def _address(self, req: Request) -> str | None:
        """The request's prefill instance (the router's pick, else this worker's default)."""
        return req.prefill or self.default_prefill

    def _room(self, req: Request) -> str:
        """The transfer's room: the request's id (unique here: the engine refuses a second)."""
        return req.rid

    def on_cancel(self, req: Request) -> None:
        self._outbox.put(_Cancelled(self._room(req)))

    # -- control thread --------------------------------------------------------------------------

    def _run(self) -> None:
        poller = self._poller
        poller.register(self._outbox.pull, zmq.POLLIN)
        if self._landed_in is not None:
            poller.register(self._landed_in, zmq.POLLIN)
        while not self._stop.is_set():
            # Messages, a landed tag and stop() wake it (the outbox's kicks); else it sleeps
            # until the next thing due by the clock (`_due_s`): idle, the next ping.
            self.control_turns += 1
            now = time.monotonic()
            for sock, _ in poller.poll(wake.wait_ms(self._due_s(now), now)):
                if sock is self._outbox.pull:
                    for out in self._outbox.take():
                        self._outgoing(out)
                    self._outbox.handled()  # sent, queued for the handshake, or failed
                elif self._landed_in is not None and sock is self._landed_in:
                    self._landed.update(t.decode() for t in self._landed_in.recv_multipart())
                elif sock in self._monitors:
                    self._monitored(self._monitors[sock])
                elif sock in self._socks:
                    self._incoming(self._socks[sock], sock.recv_multipart())
            self._landed.update(self.target.poll_landed())
            if self._landed:
                landed = F.Landed(self._landed)
                for room in list(self._flights):
                    self._on(room, landed)
                live = set(self._epochs.values())  # a tag of an ended grant never counts
                self._landed = {k for k in self._landed if epoch_of(k) in live}
            now = time.monotonic()
            self._heartbeat(now)
            self._expire(now)
            due = tags_due(self._flights.values())
            if due != self._expecting:
                self._expecting = due
                self.target.expect(due)

    def _due_s(self, now: float) -> float | None:
        """The first instant at which `_heartbeat` or `_expire` has something to do: a ping
        to send, a peer turning silent, a lost prefill to handshake again, a connection's
        handshake or a flight's deadline passing, a dropped lame session counting as closed.
        Only this thread changes any of them."""
        hb, due = self.heartbeat, []
        for p in self._prefills.values():
            if p.state == "failed":
                due.append(p.retry_at_s)
                continue
            due.append(silent_after_s(p.heard_s, hb))
            if p.state == "ready":
                due.append(next_ping_s(p.pinged_s, now, hb))
            else:  # connecting
                due.append(p.since_s + HANDSHAKE_TIMEOUT_S)
        for lame in self._lame:
            if lame.dropped_s is not None:
                due.append(lame.dropped_s + 2 * hb.timeout_s)
        due += [f.deadline_s for f in self._flights.values() if not f.held]
        return wake.earliest(*due)

    def _peer(self, address: str) -> _Prefill:
        """The address's connection: a new one (hello sent) unless one is live."""
        peer = self._prefills.get(address)
        if peer is not None and peer.state != "failed":
            return peer
        if peer is not None and not peer.lame:  # failed before: try again with a fresh socket
            self._close(peer)
        sock = socket(self._ctx, zmq.DEALER)
        # Watched before it connects: its first connection's events all arrive.
        peer = _Prefill(address, sock, sock.get_monitor_socket(MONITORED), new_nonce())
        assert peer.monitor is not None
        self._prefills[address] = peer
        try:
            sock.connect(f"tcp://{address}")
        except zmq.ZMQError as exc:  # not an address (a bad --prefill or header): fail now
            self._close(peer)
            self._lose(peer, f"prefill {address}: cannot connect: {exc}", retry=False)
            return peer
        self._socks[sock] = peer
        self._monitors[peer.monitor] = peer
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(peer.monitor, zmq.POLLIN)
        sock.send_multipart(C.encode(C.Hello(C.PROTOCOL, peer.nonce)))
        return peer

    def _outgoing(self, out: _Out) -> None:
        if isinstance(out, _Connect):
            self._peer(out.address)
        elif isinstance(out, _Admitted):
            if self._crash_on_request:
                raise RuntimeError(f"{FAULT_ENV}=control-crash")
            peer = self._peer(out.address)
            admitted: tuple[_Flight | None, list[F.DecodeAction[C.Done]]] = F.admit(
                out.address,
                timeout_s=self.transfer_timeout_s,
                now_s=time.monotonic(),
                link=peer.state,
                link_error=peer.error,
                fences=self.target.fences,
            )
            self._apply(out.room, *admitted, out.frames)
        elif isinstance(out, _Allocated):  # always after its `_Admitted`: the outbox keeps order
            event = F.DestinationReady(self._link(out.address))
            self._on(out.room, event, out.frames, out.grant)
        else:
            flight = self._flights.get(out.room)
            link = self._link(flight.prefill) if flight is not None else None
            self._on(out.room, F.Cancel(link))

    def _link(self, address: str) -> F.Link | None:
        peer = self._prefills.get(address)
        return None if peer is None else peer.state

    def _on(
        self,
        room: str,
        event: F.DecodeEvent[C.Done],
        frames: list[bytes] | None = None,
        grant: Grant | None = None,
    ) -> None:
        """Run the request's machine (`flight.decode_step`) on `event` and do what it says.
        `frames`: the message the event came with (`grant`: a destination's)."""
        state, actions = F.decode_step(self._flights.get(room), event)
        self._apply(room, state, actions, frames, grant)

    def _apply(
        self,
        room: str,
        state: _Flight | None,
        actions: list[F.DecodeAction[C.Done]],
        frames: list[bytes] | None,
        grant: Grant | None = None,
    ) -> None:
        """`room` is the engine request's id too."""
        rid = room
        old = self._flights.get(room)
        flight = old if old is not None else state
        self._held += (state is not None and state.held) - (old is not None and old.held)
        if state is None:
            self._flights.pop(room, None)
        else:
            self._flights[room] = state
        peer = self._prefills.get(flight.prefill) if flight is not None else None
        for action in actions:
            if isinstance(action, F.Forward):
                assert peer is not None and frames is not None
                if action.queue:
                    peer.queued.append((room, frames, grant))
                else:
                    self._send(peer, room, frames, grant)
            elif isinstance(action, F.SendAbort):
                assert peer is not None
                self._seal_send(peer, C.encode(C.Abort(room)))
            elif isinstance(action, F.Unqueue):
                assert peer is not None
                peer.queued = [q for q in peer.queued if q[0] != room]
            elif isinstance(action, F.Revoke):
                epoch = self._epochs.get(room)
                if epoch is not None:
                    self.target.revoke(epoch)  # zmq: after this, nothing of it lands
            elif isinstance(action, F.ClaimTags):
                self._landed.difference_update(action.tags)
            elif isinstance(action, F.ShowFirstToken):  # from here: one thread hop less
                done = action.done
                self.show(rid, done.first_token, done.first_logprob, done.prompt_logprobs)
            elif isinstance(action, F.Complete):
                self.post(functools.partial(self._complete, rid, done=action.done))
            elif isinstance(action, F.Fail):
                fail = functools.partial(self.engine.fail_transfer, rid, action.why)
                self.post(functools.partial(fail, hold=action.hold))
            else:
                self.post(functools.partial(self.engine.release, rid))
        if state is None:
            self._forget(room)

    def _send(self, peer: _Prefill, room: str, frames: list[bytes], grant: Grant | None) -> None:
        """Send a request's message on the peer's session; a destination only once its grant
        is open at the target for that session."""
        if grant is not None:
            try:
                self.target.grant(replace(grant, session=peer.session))
            except TransferError as exc:  # its pages are still granted: a bug, loud
                log.error("request %s: %s", room, exc)
                self._on(room, F.FailedArrived(f"decode: {exc}"))
                return
            self._epochs[room] = grant.epoch
            self._session_of[room] = peer.session
            self._rooms_of.setdefault(peer.session, set()).add(room)
        self._seal_send(peer, frames)
        if grant is not None:
            self._on(room, F.Granted())

    def _seal_send(self, peer: _Prefill, frames: list[bytes], *, flags: int = 0) -> None:
        assert peer.sealer is not None, "a session's messages go after its challenge"
        peer.sock.send_multipart(peer.sealer.seal(frames), flags)

    def _forget(self, room: str) -> None:
        """The request's flight ended: its bookkeeping goes (and a lame session with it once
        it holds nothing any more)."""
        self._epochs.pop(room, None)
        session = self._session_of.pop(room, None)
        if session is None:
            return
        rooms = self._rooms_of.get(session)
        if rooms is not None:
            rooms.discard(room)
            if not rooms:
                del self._rooms_of[session]
                for lame in [p for p in self._lame if p.session == session]:
                    log.info("prefill %s: session %s closed for good", lame.address, session)
                    self._lame.remove(lame)
                    self._close(lame)

    def _incoming(self, peer: _Prefill, frames: list[bytes]) -> None:
        if peer.state == "failed" and not peer.lame:
            return
        try:
            if len(frames) == 3 and peer.opener is not None:
                msg = C.decode(peer.opener.open(frames))
                sealed = True
            else:
                msg, sealed = C.decode(frames), False
        except (AuthError, C.ControlError) as exc:
            log.warning("refused a control message from prefill %s: %s", peer.address, exc)
            return
        if peer.lame:  # only its held requests' news
            if sealed and isinstance(msg, C.Failed | C.Aborted):
                self._news(peer, msg)
            return
        peer.heard_s = time.monotonic()
        if not sealed:
            self._unsealed(peer, msg)
        elif isinstance(msg, C.Pong):
            peer.echo = max(peer.echo, msg.number)
        elif isinstance(msg, C.Welcome):
            self._welcome(peer, msg)
        elif isinstance(msg, C.Done):
            if self._session_of.get(msg.room) == peer.session:
                epoch = self._epochs[msg.room]
                tags = tuple(landed_key(epoch, t) for t in msg.tags)
                self._on(msg.room, F.DoneArrived(msg, tags))
        elif isinstance(msg, C.Failed | C.Aborted):
            self._news(peer, msg)

    def _news(self, peer: _Prefill, msg: C.Failed | C.Aborted) -> None:
        """`failed` / `aborted` for a request sent on this session (a request of another
        session is not this prefill's to end)."""
        flight = self._flights.get(msg.room)
        if flight is None or flight.prefill != peer.address:
            return
        session = self._session_of.get(msg.room)
        if session is not None and session != peer.session:
            return
        if isinstance(msg, C.Failed):
            self._on(msg.room, F.FailedArrived(msg.message))
        else:
            self._on(msg.room, F.AbortedArrived())

    def _unsealed(self, peer: _Prefill, msg: C.Message) -> None:
        """Before a session: the challenge, or a refusal; after: a pong saying it lost us."""
        if isinstance(msg, C.Challenge) and peer.sealer is None:
            self._challenged(peer, msg)
        elif isinstance(msg, C.Welcome) and not msg.ok and peer.sealer is None:
            self._lose(
                peer, f"prefill {peer.address} refused the handshake: {msg.message}", retry=False
            )
        elif isinstance(msg, C.Pong) and not msg.known and peer.state == "ready":
            verdict = pong_verdict(peer.instance, msg.instance, msg.known)
            self._lose(peer, f"prefill {peer.address}: {verdict.value} (pong from {msg.instance})")
            peer.retry_at_s = peer.heard_s  # handshake with it again at once
        else:
            log.warning("prefill %s: ignored an unsealed %s", peer.address, type(msg).__name__)

    def _challenged(self, peer: _Prefill, msg: C.Challenge) -> None:
        """Join the session the prefill assigned, if it proved the secret over our nonce."""
        if not self.keys.check_challenge(peer.nonce, msg.session, msg.instance, msg.proof):
            why = (
                f"prefill {peer.address} failed authentication: its challenge does not prove "
                "this deployment's PD secret"
            )
            self._lose(peer, why, retry=False)
            return
        key = self.keys.key(msg.session)
        peer.session, peer.instance = msg.session, msg.instance
        peer.sealer, peer.opener = Sealer(key, TO_PREFILL), Opener(key, TO_DECODE)
        supersedes = tuple(
            s for s in self._lost.get(peer.address, ()) if instance_of(s) == msg.instance
        )
        join = C.Join(self.target.backend, self.manifest, self._descriptor, self.stages, supersedes)
        self._seal_send(peer, C.encode(join))

    def _welcome(self, peer: _Prefill, msg: C.Welcome) -> None:
        if msg.closed:  # the prefill ended these sessions: nothing more is written for them
            self._closed(peer.address, set(msg.closed))
        if msg.ok:
            peer.state, peer.error, peer.pinged_s = "ready", "", None
            self._set_status(None)
            for room, encoded, grant in peer.queued:
                self._send(peer, room, encoded, grant)
            peer.queued.clear()
            log.info("KV transfer handshake with prefill %s: ok", peer.address)
            return
        why = f"prefill {peer.address} refused the handshake: {msg.message}"
        self._lose(peer, why, retry=False)  # the next request to it tries again

    def _closed(self, address: str, sessions: set[str]) -> None:
        """These sessions are provably closed: their held requests' pages go."""
        lost = self._lost.get(address)
        if lost is not None:
            self._lost[address] = [s for s in lost if s not in sessions]
        for session in sessions:
            for room in list(self._rooms_of.get(session, ())):
                self._on(room, F.SessionClosed())

    def _monitored(self, peer: _Prefill) -> None:
        """A connection event: a drop after the connection was up starts the countdown after
        which its session counts as closed (`_heartbeat`)."""
        assert peer.monitor is not None
        event = recv_monitor_message(peer.monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            peer.connected = True
            return
        if not (peer.connected or peer.session):  # (a session proves it was up)
            return
        if event == zmq.EVENT_DISCONNECTED and peer.dropped_s is None:
            peer.dropped_s = time.monotonic()

    def _heartbeat(self, now: float) -> None:
        """Ping every live prefill, lose the silent ones, handshake again with lost ones; a
        lost session whose connection dropped long enough ago is closed."""
        hb = self.heartbeat
        for peer in list(self._prefills.values()):
            if peer.state == "failed":
                if peer.retry_at_s is not None and now >= peer.retry_at_s:
                    self._peer(peer.address)
                continue
            if silent(peer.heard_s, now, hb):
                self._lose(peer, f"prefill {peer.address}: no answer for {hb.timeout_s:g} s")
            elif peer.state == "ready" and ping_due(peer.pinged_s, now, hb):
                peer.pinged_s = now
                with contextlib.suppress(zmq.Again):  # a full queue: it is silent anyway
                    self._seal_send(peer, C.encode(C.Ping(peer.echo)), flags=zmq.NOBLOCK)
        for lame in list(self._lame):
            if lame.dropped_s is not None and now - lame.dropped_s > 2 * hb.timeout_s:
                log.info(
                    "prefill %s: session %s: its connection dropped %.1f s ago: closed",
                    lame.address,
                    lame.session,
                    now - lame.dropped_s,
                )
                self._closed(lame.address, {lame.session})

    def _lose(self, peer: _Prefill, why: str, *, retry: bool = True) -> None:
        """The prefill is gone (or refused us): every request sent there ends now (a cancelled
        one frees its pages: nothing more will land; one that may still be written keeps
        them), and with `retry` it is handshaken again after the reconnect pause; one that
        never answered (still connecting: it is down) at once, so a Hello always waits on a
        socket for the prefill to come back (the pause only delayed the handshake with a
        restarted prefill, by up to its length). A session that still holds requests stays
        open (`lame`) to hear that its writer is done."""
        connecting = peer.state == "connecting"
        if peer.state == "ready" or not retry:
            log.error("%s", why)
        else:  # still connecting (it is down): once per attempt, quietly
            log.info("%s", why)
        peer.state, peer.error = "failed", why
        pause_s = 0.0 if connecting else self.heartbeat.reconnect_s
        peer.retry_at_s = time.monotonic() + pause_s if retry else None
        peer.queued.clear()
        self._set_status(why)
        for room in rooms_of(((r, f.prefill) for r, f in self._flights.items()), peer.address):
            self._on(room, F.PrefillLost(why))
        if peer.session:
            lost = self._lost.setdefault(peer.address, [])
            lost.append(peer.session)
            del lost[:-LOST_KEPT]
        if peer.session and self._rooms_of.get(peer.session):
            peer.lame = True
            self._lame.append(peer)
            log.warning(
                "prefill %s: %d requests of session %s keep their pages until it is provably "
                "closed",
                peer.address,
                len(self._rooms_of[peer.session]),
                peer.session,
            )
        else:
            self._close(peer)

    def _set_status(self, error: str | None) -> None:
        """Ready while some prefill's handshake is in force: one lost prefill (retried every
        few seconds) must not take a decode that others serve out of the router's choice."""
        ready = any(p.state == "ready" for p in self._prefills.values())
        with self._lock:
            self._status = (ready, error)

    def _close(self, peer: _Prefill) -> None:
        if peer.sock.closed:
            return
        self._socks.pop(peer.sock, None)
        with contextlib.suppress(KeyError):  # never registered: its connect failed
            self._poller.unregister(peer.sock)
        if peer.monitor is not None:
            self._monitors.pop(peer.monitor, None)
            with contextlib.suppress(KeyError):
                self._poller.unregister(peer.monitor)
            with contextlib.suppress(zmq.ZMQError):
                peer.sock.disable_monitor()
            peer.monitor.close(linger=0)
        peer.sock.close(linger=0)

    def _expire(self, now: float) -> None:
        for peer in list(self._prefills.values()):
            if peer.state == "connecting" and now - peer.since_s > HANDSHAKE_TIMEOUT_S:
                self._lose(
                    peer,
                    f"prefill {peer.address}: no handshake answer in {HANDSHAKE_TIMEOUT_S:g} s",
                )
        for room, flight in list(self._flights.items()):
            if now > flight.deadline_s and not flight.held:
                self._on(room, F.Tick(now, self._link(flight.prefill)))

    def _complete(self, rid: RequestId, *, done: C.Done) -> None:
        self.engine.complete_transfer(
            rid,
            done.first_token,
            _generator_state(done.generator_state),
            done.first_logprob,
            done.prompt_logprobs,
        )


def tags_due(flights: Iterable[_Flight]) -> bool:
    """Whether some request's `done` arrived and it waits for its tags: prefill sends `done`
    just before its last write, so that write is landing now (the target's busy rate). Before
    `done` the prefill computes: a target polling at its busy rate then would take the CPU the
    prefill's forward needs, on a host they share."""
    return any(f.done is not None and not f.held for f in flights)


def _generator_state(text: str | None) -> torch.Tensor | None:
    """The sampler's generator state after the first token (`Done.generator_state`)."""
    return torch.frombuffer(bytearray(C.unb64(text)), dtype=torch.uint8) if text else None


class DecodeFollower(EngineEvents):
    """A later stage of a decode PP group: its target receives the prefill stages' writes of
    its layers; it reports the tags that landed to the leader, which completes a request only
    when every stage's tags landed (the engine replica follows the leader's orders). Its
    target grants a request's pages as its engine replica allocates them (any session of the
    deployment may write under the epoch: the leader alone knows the session) and revokes them
    when its transfer ends, before the pages change hands."""

    engine: Engine  # set by attach

    def __init__(self, target: TransferTarget, leader_landed: str, manifest: Manifest) -> None:
        self.target = target
        self.manifest = manifest
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._push = socket(self._ctx, zmq.PUSH)
        self._push.connect(leader_landed)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the target when tags land, and on stop
        target.on_landed(self._wake.set)
        self._thread = threading.Thread(
            target=guarded, args=("decode landed", self._run, self._crashed), daemon=True
        )
        self._thread.name = "dsv4-pd-landed"
        self.failure: str | None = None  # set: its thread died (the leader times out)
        self.on_failure: OnFailure = no_hook  # called once `failure` is set

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def on_allocated(self, req: Request) -> None:
        units = destination_units(self.engine, req, self.manifest)
        self.target.grant(Grant(req.epoch, req.rid, units))

    def on_transfer_end(self, req: Request) -> None:
        self.target.revoke(req.epoch)

    def _crashed(self, why: str) -> None:
        self.failure = why
        self.on_failure(why)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._push.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(LANDED_POLL_S)
            self._wake.clear()  # before draining: a tag landing from here on sets it again
            tags = self.target.poll_landed()
            if tags:
                self._push.send_multipart([t.encode() for t in tags])
