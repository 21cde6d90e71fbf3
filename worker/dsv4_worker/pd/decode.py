"""The decode side of PD: preallocates arriving requests (the engine's scheduler decides when,
under the one admission function), sends each to its prefill instance as soon as the plan
admits it (`prefill`: prefill computes while this side allocates and runs its step), then
where to write once the pages exist (`destination`), and turns them into decoders when their
KV, state and first token have landed.

Threads: the control thread owns one DEALER socket per prefill instance (handshake first:
manifest, backend and this side's transfer descriptor; a mismatch fails every request sent
there with the prefill's message naming the field) and the transfer target's landed tags;
the engine thread hands it typed messages through its mailbox (`on_admit`, `on_prealloc`,
`on_cancel`: `_Admitted`, `_Allocated`, `_Cancelled`; at a step's first admission it waits,
at most `ADMIT_HANDOFF_S`, until the control thread has handled it: `Mailbox.hand_over`)
and gets results back through `post` (`complete_transfer`, `fail_transfer`, `release`); the
first token of a request goes to its client from the control thread as `done` arrives
(`show`, the runner's `show_first_token`: the stream has it while the last write lands).
Each request is a `flight.Flight`: the control thread turns messages, landed tags and the
clock into its events, and does what `flight.decode_step` returns.

A request completes when `done` arrived and every tag it lists landed. A request whose prefill
does not answer within `transfer_timeout_s` fails (the client may retry elsewhere); a cancelled
request keeps its pages until the prefill side says `aborted` (nothing more will land) or the
timeout passes.

Liveness (`liveness`): the control thread pings every prefill it talks to; a prefill silent for
the heartbeat timeout (killed, stopped, unreachable) is lost: every request sent there fails at
once (retryable: the router tries another pair) and it is handshaken again after a short pause.
A pong from another process at the address (a restarted prefill), or one that no longer knows
this connection, does the same at once. If the control thread itself dies, the worker fails
everything it holds and reports `failure` (unready; `dsv4 serve` exits non-zero).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import zmq

from dsv4_common.api.manifest import Manifest
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.pd import control as C
from dsv4_worker.pd import flight as F
from dsv4_worker.pd.channel import Mailbox, Post, ShowFirst, bound, guarded, socket
from dsv4_worker.pd.columns import tail_cols
from dsv4_worker.pd.liveness import (
    Heartbeat,
    PongVerdict,
    ping_due,
    pong_verdict,
    rooms_of,
    silent,
)
from dsv4_worker.pd.transfer import TransferTarget
from dsv4_worker.sched.scheduler import RequestId

log = logging.getLogger(__name__)

POLL_MS = 50
# The most the engine thread waits, at a step's first admission, for the control thread to
# send the request to prefill: the rest of the step holds the GIL and a core meanwhile.
ADMIT_HANDOFF_S = 0.002
LANDED_POLL_S = 0.05  # a decode follower's wait for its target's wake-up (a safety net)
HANDSHAKE_TIMEOUT_S = 10.0  # a prefill that answers pings but not the handshake
# Test hook: "control-crash" makes the control thread raise at its first request.
FAULT_ENV = "DSV4_TEST_PD_FAULT"


@dataclass(slots=True)
class _Prefill:
    address: str  # host:port of its control socket
    sock: zmq.Socket[bytes]
    state: F.Link = "connecting"
    error: str = ""
    since_s: float = field(default_factory=time.monotonic)
    queued: list[tuple[str, list[bytes]]] = field(default_factory=list)  # (room, encoded)
    instance: str = ""  # the prefill process that welcomed us
    heard_s: float = field(default_factory=time.monotonic)  # its last message (or our hello)
    pinged_s: float | None = None
    retry_at_s: float | None = None  # failed: handshake again from then on (None: not by itself)


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
    """Its pages exist on every stage: send its `destination` (`frames`, encoded)."""

    address: str
    room: str
    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class _Cancelled:
    """The engine cancelled the request (client gone)."""

    room: str


_Out = _Connect | _Admitted | _Allocated | _Cancelled


class DecodeAgent(EngineEvents):
    """The decode engine's events (`on_admit`, `on_prealloc`, `on_cancel`): built before its
    engine, then `attach`ed to it once, before `start`."""

    engine: Engine  # set by attach
    post: Post  # runs a function on the engine thread (the runner's `call`)
    show: ShowFirst  # hands a first token to its client now (any thread; the runner's)

    def __init__(
        self,
        target: TransferTarget,
        manifest: Manifest,
        *,
        default_prefill: str | None = None,
        transfer_timeout_s: float = 60.0,
        peer_id: str | None = None,
        stages: tuple[C.StageTarget, ...] = (),
        landed_bind: str | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.heartbeat = heartbeat or Heartbeat()
        self.target = target
        self.manifest = manifest
        self.default_prefill = default_prefill
        self.transfer_timeout_s = transfer_timeout_s
        self.peer_id = peer_id or new_peer_id()
        self.stages = stages  # a PP group: every stage's target, this one first
        self._descriptor = C.b64(target.descriptor())
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # A PP group's followers report the tags that landed in their own targets here.
        self._landed_in: zmq.Socket[bytes] | None = None
        self.landed_endpoint: str | None = None
        if landed_bind is not None:
            self._landed_in, self.landed_endpoint = bound(self._ctx, zmq.PULL, landed_bind)
        self._outbox: Mailbox[_Out] = Mailbox(self._ctx, "decode")
        self._prefills: dict[str, _Prefill] = {}
        self._flights: dict[str, _Flight] = {}  # room -> in flight
        self._expecting = False  # told the target: tags are due (`tags_due`)
        self._landed: set[str] = set()
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
        for p in self._prefills.values():
            p.sock.close(linger=0)
        if self._landed_in is not None:
            self._landed_in.close(linger=0)
        self._ctx.destroy(linger=0)  # closes any socket a crash left open, then terminates

    def _crashed(self, why: str) -> None:
        """The control thread died: nothing will land or complete; fail everything."""
        self.failure = why
        with self._lock:
            self._status = (False, why)
        self.post(functools.partial(self._fail_all, why))

    def _fail_all(self, why: str) -> None:
        self.engine.fail_all_between(why)

    def kv_status(self) -> tuple[bool, str | None]:
        """(some prefill's handshake is in force, the last handshake or liveness error)."""
        with self._lock:
            return self._status

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
        assert req.slot is not None
        address = self._address(req)
        if not address:  # on_admit failed it
            return
        m = self.manifest
        full, swa = self.engine.mem.pages.request_pages(req.slot)
        tail = tail_cols(len(req.prompt), m.page_size, m.window_tokens + m.draft_tokens)
        msg = C.Destination(
            room=self._room(req),
            dst_full_pages=tuple(full.tolist()),
            dst_swa_pages=tuple(swa[tail.start : tail.stop].tolist()),
            dst_slot=req.slot,
        )
        self._forward(address, msg)

    def _forward(self, address: str, msg: C.PrefillRequest | C.Destination) -> None:
        # Encoded here, once: the control thread forwards the frames as they are.
        if isinstance(msg, C.Destination):
            self._outbox.put(_Allocated(address, msg.room, C.encode(msg)))
            return
        ticket = self._outbox.put(_Admitted(address, msg.room, C.encode(msg)))
        # The prefill computes from this message on: let the control thread send it now rather
        # than when the rest of this step lets it have the GIL (bounded; once a step).
        self._outbox.hand_over(ticket, ADMIT_HANDOFF_S, self.engine.steps)

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
            for sock, _ in poller.poll(POLL_MS):  # a landed tag or stop() kicks the outbox
                if sock is self._outbox.pull:
                    for out in self._outbox.take():
                        self._outgoing(out, poller)
                    self._outbox.handled()  # sent, queued for the handshake, or failed
                elif self._landed_in is not None and sock is self._landed_in:
                    self._landed.update(t.decode() for t in self._landed_in.recv_multipart())
                else:
                    self._incoming(sock, sock.recv_multipart())
            self._landed.update(self.target.poll_landed())
            landed = F.Landed(self._landed)
            for room in list(self._flights):
                self._on(room, landed)
            now = time.monotonic()
            self._heartbeat(now, poller)
            self._expire(now)
            due = tags_due(self._flights.values())
            if due != self._expecting:
                self._expecting = due
                self.target.expect(due)

    def _peer(self, address: str, poller: zmq.Poller) -> _Prefill:
        peer = self._prefills.get(address)
        if peer is not None and peer.state != "failed":
            return peer
        if peer is not None:  # failed before: try again with a fresh socket
            self._close(peer, poller)
        sock = socket(self._ctx, zmq.DEALER)
        peer = _Prefill(address, sock)
        self._prefills[address] = peer
        try:
            sock.connect(f"tcp://{address}")
        except zmq.ZMQError as exc:  # not an address (a bad --prefill or header): fail now
            sock.close(linger=0)
            self._lose(peer, f"prefill {address}: cannot connect: {exc}", retry=False)
            return peer
        poller.register(sock, zmq.POLLIN)
        hello = C.Hello(
            self.peer_id,
            self.target.backend,
            self.manifest,
            self._descriptor,
            self.stages,
            protocol=C.PROTOCOL,
        )
        sock.send_multipart(C.encode(hello))
        return peer

    def _outgoing(self, out: _Out, poller: zmq.Poller) -> None:
        if isinstance(out, _Connect):
            self._peer(out.address, poller)
        elif isinstance(out, _Admitted):
            if self._crash_on_request:
                raise RuntimeError(f"{FAULT_ENV}=control-crash")
            peer = self._peer(out.address, poller)
            admitted: tuple[_Flight | None, list[F.DecodeAction[C.Done]]] = F.admit(
                out.address,
                timeout_s=self.transfer_timeout_s,
                now_s=time.monotonic(),
                link=peer.state,
                link_error=peer.error,
            )
            self._apply(out.room, *admitted, out.frames)
        elif isinstance(out, _Allocated):  # always after its `_Admitted`: the outbox keeps order
            self._on(out.room, F.DestinationReady(self._link(out.address)), out.frames)
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
    ) -> None:
        """Run the request's machine (`flight.decode_step`) on `event` and do what it says.
        `frames`: the message the event came with."""
        state, actions = F.decode_step(self._flights.get(room), event)
        self._apply(room, state, actions, frames)

    def _apply(
        self,
        room: str,
        state: _Flight | None,
        actions: list[F.DecodeAction[C.Done]],
        frames: list[bytes] | None,
    ) -> None:
        """`room` is the engine request's id too."""
        rid = room
        flight = self._flights.get(room, state)
        if state is None:
            self._flights.pop(room, None)
        else:
            self._flights[room] = state
        peer = self._prefills.get(flight.prefill) if flight is not None else None
        for action in actions:
            if isinstance(action, F.Forward):
                assert peer is not None and frames is not None
                if action.queue:
                    peer.queued.append((room, frames))
                else:
                    peer.sock.send_multipart(frames)
            elif isinstance(action, F.SendAbort):
                assert peer is not None
                peer.sock.send_multipart(C.encode(C.Abort(room)))
            elif isinstance(action, F.Unqueue):
                assert peer is not None
                peer.queued = [q for q in peer.queued if q[0] != room]
            elif isinstance(action, F.ClaimTags):
                self._landed.difference_update(action.tags)
            elif isinstance(action, F.ShowFirstToken):  # from here: one thread hop less
                done = action.done
                self.show(rid, done.first_token, done.first_logprob, done.prompt_logprobs)
            elif isinstance(action, F.Complete):
                self.post(functools.partial(self._complete, rid, done=action.done))
            elif isinstance(action, F.Fail):
                self.post(functools.partial(self.engine.fail_transfer, rid, action.why))
            else:
                self.post(functools.partial(self.engine.release, rid))

    def _incoming(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        peer = next((p for p in self._prefills.values() if p.sock is sock), None)
        if peer is None or peer.state == "failed":
            return
        peer.heard_s = time.monotonic()
        try:
            msg = C.decode(frames)
        except C.ControlError as exc:
            log.warning("bad control message from prefill %s: %s", peer.address, exc)
            return
        if isinstance(msg, C.Pong):
            if peer.state == "ready":
                verdict = pong_verdict(peer.instance, msg.instance, msg.known)
                if verdict is not PongVerdict.ALIVE:
                    why = f"prefill {peer.address}: {verdict.value} (pong from {msg.instance})"
                    self._lose(peer, why, retry=True)
                    peer.retry_at_s = peer.heard_s  # handshake with it again at once
        elif isinstance(msg, C.Welcome):
            self._welcome(peer, msg)
        elif isinstance(msg, C.Done):
            self._on(msg.room, F.DoneArrived(msg, msg.tags))
        elif isinstance(msg, C.Failed):
            self._on(msg.room, F.FailedArrived(msg.message))
        elif isinstance(msg, C.Aborted):
            self._on(msg.room, F.AbortedArrived())

    def _welcome(self, peer: _Prefill, msg: C.Welcome) -> None:
        if msg.ok:
            peer.state, peer.instance, peer.error = "ready", msg.instance, ""
            self._set_status(None)
            for _, encoded in peer.queued:
                peer.sock.send_multipart(encoded)
            peer.queued.clear()
            log.info("KV transfer handshake with prefill %s: ok", peer.address)
            return
        why = f"prefill {peer.address} refused the handshake: {msg.message}"
        self._lose(peer, why, retry=False)  # the next request to it tries again

    def _heartbeat(self, now: float, poller: zmq.Poller) -> None:
        """Ping every live prefill, lose the silent ones, handshake again with lost ones."""
        hb = self.heartbeat
        for peer in list(self._prefills.values()):
            if peer.state == "failed":
                if peer.retry_at_s is not None and now >= peer.retry_at_s:
                    self._peer(peer.address, poller)
                continue
            if silent(peer.heard_s, now, hb):
                self._lose(peer, f"prefill {peer.address}: no answer for {hb.timeout_s:g} s")
            elif ping_due(peer.pinged_s, now, hb):
                peer.pinged_s = now
                with contextlib.suppress(zmq.Again):  # a full queue: it is silent anyway
                    peer.sock.send_multipart(C.encode(C.Ping(self.peer_id)), zmq.NOBLOCK)

    def _lose(self, peer: _Prefill, why: str, *, retry: bool = True) -> None:
        """The prefill is gone (or refused us): every request sent there ends now (a cancelled
        one frees its pages: nothing more will land), and with `retry` it is handshaken again
        after the reconnect pause; one that never answered (still connecting: it is down) at
        once, so a Hello always waits on a socket for the prefill to come back (the pause only
        delayed the handshake with a restarted prefill, by up to its length)."""
        connecting = peer.state == "connecting"
        if peer.state == "ready" or not retry:
            log.error("%s", why)
        else:  # still connecting (it is down): once per attempt, quietly
            log.info("%s", why)
        peer.state, peer.error = "failed", why
        pause_s = 0.0 if connecting else self.heartbeat.reconnect_s
        peer.retry_at_s = time.monotonic() + pause_s if retry else None
        peer.queued.clear()
        self._close(peer, self._poller)
        self._set_status(why)
        for room in rooms_of(((r, f.prefill) for r, f in self._flights.items()), peer.address):
            self._on(room, F.PrefillLost(why))

    def _set_status(self, error: str | None) -> None:
        """Ready while some prefill's handshake is in force: one lost prefill (retried every
        few seconds) must not take a decode that others serve out of the router's choice."""
        ready = any(p.state == "ready" for p in self._prefills.values())
        with self._lock:
            self._status = (ready, error)

    @staticmethod
    def _close(peer: _Prefill, poller: zmq.Poller) -> None:
        if peer.sock.closed:
            return
        with contextlib.suppress(KeyError):  # never registered: its connect failed
            poller.unregister(peer.sock)
        peer.sock.close(linger=0)

    def _expire(self, now: float) -> None:
        for peer in self._prefills.values():
            if peer.state == "connecting" and now - peer.since_s > HANDSHAKE_TIMEOUT_S:
                self._lose(
                    peer,
                    f"prefill {peer.address}: no handshake answer in {HANDSHAKE_TIMEOUT_S:g} s",
                )
        for room, flight in list(self._flights.items()):
            if now > flight.deadline_s:
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
    return any(f.done is not None for f in flights)


def new_peer_id() -> str:
    return f"decode-{uuid.uuid4().hex[:12]}"


def _generator_state(text: str | None) -> torch.Tensor | None:
    """The sampler's generator state after the first token (`Done.generator_state`)."""
    return torch.frombuffer(bytearray(C.unb64(text)), dtype=torch.uint8) if text else None


class DecodeFollower(EngineEvents):
    """A later stage of a decode PP group: its target receives the prefill stages' writes of
    its layers; it reports the tags that landed to the leader, which completes a request only
    when every stage's tags landed (the engine replica follows the leader's orders). Its
    engine's events: the base's no-ops (only the leader talks to prefill)."""

    def __init__(self, target: TransferTarget, leader_landed: str) -> None:
        self.target = target
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

    def _crashed(self, why: str) -> None:
        self.failure = why

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
