"""The prefill side of PD: takes admitted requests from decode workers, runs their chunked
prefill in the ordinary engine, and writes their KV and state into decode's memory.

Threads: the control thread owns the ROUTER socket decode workers connect to and hands every
message to the engine thread (`post`); everything else (handshake, submit, transfers, frees)
runs on the engine thread, between steps (`after_step`), so the pools have one writer;
messages out go back to the control thread through a `channel.Mailbox`.

Per request (a `flight.Tx`; every decision is `flight.prefill_step`'s: this module turns
messages and engine steps into its events and does what it returns): decode sends the prompt
as soon as its scheduler admits the request (`prefill`), and where to write once its pages
exist (`destination`); the request computes from the first message on and nothing is written
before the second, after which what was held back goes at once. Then, after each step, the
full pages its chunks completed travel (`columns.send_step`); when prefill samples the first
token (the engine keeps the finished request's pages: `keep_pages`), `done` with the first
token and every write's tag goes out, then the last step writes the remaining pages, the
window tail and the request state; only then are the pages freed. A transfer error, a decode
`abort` or the request's own timeout frees everything at once.

Liveness (`liveness`): the control thread answers each decode's `ping` at once with a `pong`
(this process's instance, and whether that connection's handshake is in force); after every
step the engine thread drops a decode not heard from within the heartbeat timeout: its
transfers fail and free, nothing more is written to it, and its next message needs a new
handshake (its pongs say so).

PP: every stage of a prefill group writes its own layers (`transfer_blocks` filters by layer
id). The leader (rank 0) owns the control socket, the handshake and every decision; it tells
the followers (`PrefillFollower`) about each decode peer and each request through the engine's
`note`, in order with the engine's own changes, and they run the same machine
(`leader=False`: it writes and decides nothing) on their replica of the leader's state: the
same columns at the same steps, so each write `k` of a request has a tag
`room:stage:decode_stage:k` on every stage and `done` lists all of them.

NOTE: admission is the engine's: by the full pool, never capped by the SWA pool (a chunk
shrinks when it cannot fit the SWA pool; ref. PR #26607, issue #31205).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from dsv4_common.api.manifest import (
    Manifest,
    group_mismatch,
    manifest_hash,
    manifest_mismatch,
    shared_layers,
)
from dsv4_common.core.layout import IndexSpace
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, EngineFailed, Request
from dsv4_worker.pd import control as C
from dsv4_worker.pd import flight as F
from dsv4_worker.pd.blocks import transfer_blocks
from dsv4_worker.pd.channel import Mailbox, Post, bound, guarded
from dsv4_worker.pd.columns import SendStep
from dsv4_worker.pd.flight import write_tag
from dsv4_worker.pd.liveness import Heartbeat, silent
from dsv4_worker.pd.transfer import TransferError, TransferInitiator

log = logging.getLogger(__name__)

POLL_MS = 100
# The most the engine thread waits, after queuing a request's `done`, for the control thread
# to send it: the first token then reaches decode while the last write is prepared and lands.
DONE_HANDOFF_S = 0.002
WRITE_TIMEOUT_S = 30.0  # default of `write_timeout_s`


@dataclass(slots=True)
class _Peer:
    identity: bytes  # the decode worker's zmq identity on the leader's ROUTER socket
    manifest: Manifest  # its layers and units per index space


@dataclass(frozen=True, slots=True)
class ConnectNote:
    """Leader -> followers: a decode worker (group) passed the handshake; connect to the
    stages of it that share layers with yours."""

    peer: str
    targets: tuple[C.StageTarget, ...]


@dataclass(frozen=True, slots=True)
class TransferNote:
    """Leader -> followers: request `room` (its engine request's id) is a transfer to `peer`."""

    room: str
    peer: str
    msg: C.PrefillRequest


@dataclass(frozen=True, slots=True)
class DestinationNote:
    """Leader -> followers: the transfer's destination arrived (and passed the checks)."""

    dest: C.Destination


_Tx = F.Tx[Request, C.Destination]  # a request's transfer on this stage (`flight`)


@dataclass(frozen=True, slots=True)
class _Send:
    """Engine thread -> control thread: send `frames` (one encoded message) to a decode."""

    identity: bytes
    frames: list[bytes]


class _StageWriter(EngineEvents):
    """Writes this stage's layers of a request's finished columns into its decode peer. The
    prefill engine's events (`after_step`; `on_note` on a follower): built before its engine,
    then `attach`ed to it once, before `start`."""

    engine: Engine  # set by attach

    def __init__(
        self,
        initiator: TransferInitiator,
        manifest: Manifest,
        *,
        rank: int,
        write_timeout_s: float,
    ) -> None:
        self.initiator = initiator
        self.manifest = manifest
        self.rank = rank
        self.write_timeout_s = write_timeout_s
        self._peer_manifests: dict[str, Manifest] = {}  # decode stage peer -> its manifest
        # decode worker (group) -> (decode stage, its peer) this stage writes to
        self._routes: dict[str, list[tuple[int, str]]] = {}
        self._txs: dict[str, _Tx] = {}  # room -> transfer
        self._geometry = F.Geometry(
            manifest.page_size, manifest.window_tokens + manifest.draft_tokens
        )

    def _connect(self, peer: str, targets: tuple[C.StageTarget, ...]) -> None:
        """Connect to every decode stage that holds some of this stage's layers (once per
        decode process: a peer id names one process, so a second handshake keeps the routes)."""
        if peer in self._routes:
            return
        routes = []
        for d, t in enumerate(targets):
            if not shared_layers(self.manifest, t.manifest):
                continue
            self.initiator.connect(t.peer, C.unb64(t.descriptor))
            self._peer_manifests[t.peer] = t.manifest
            routes.append((d, t.peer))
        self._routes[peer] = routes

    def _on(self, room: str, event: F.PrefillEvent[C.Destination], to: bytes = b"") -> None:
        """Run the request's machine (`flight.prefill_step`) on `event` and do what it says; a
        write (always its batch's last action) answers with `Written` or `WriteFailed`. `to`:
        the sender of the message the event came with."""
        answer: F.PrefillEvent[C.Destination] | None = event
        while answer is not None:
            tx = self._txs.get(room)
            state, actions = F.prefill_step(tx, answer)
            if state is None:
                self._txs.pop(room, None)
            else:
                self._txs[room] = state
            answer = None
            for action in actions:
                answer = self._do(room, state if state is not None else tx, action, to)

    def _do(
        self, room: str, tx: _Tx | None, action: F.PrefillAction, to: bytes
    ) -> F.Written | F.WriteFailed | None:
        if isinstance(action, F.Write):
            assert tx is not None
            try:
                self._write(tx, action.step, action.k)
            except (_Fail, TransferError) as exc:
                return F.WriteFailed(str(exc))
            return F.Written()
        if isinstance(action, F.Warn):
            log.warning("stage %d: request %s: %s", self.rank, room, action.why)
        elif isinstance(action, F.AbortRequest):
            assert tx is not None
            self.engine.abort(tx.req.rid)  # frees it, or releases it when already finished
        elif isinstance(action, F.ReleaseRequest):
            assert tx is not None
            self.engine.release(tx.req.rid)
        else:
            self._tell(room, tx, action, to)
        return None

    def _tell(
        self,
        room: str,
        tx: _Tx | None,
        action: F.SendDone | F.SendFailed | F.SendAborted | F.NoteDestination,
        to: bytes,
    ) -> None:
        """The leader's messages (a follower's machine never asks for one)."""
        raise AssertionError(f"stage {self.rank}: {action} for {room}")

    def _view(self, req: Request) -> F.ReqView:
        """What the machine needs to know of the engine's request now."""
        engine = self.engine
        return F.ReqView(
            req.finish_reason,
            req.error,
            req.num_tokens,
            admitted=req.slot is not None,
            known=req.rid in engine.requests or req.rid in engine.held,
        )

    def _write(self, tx: _Tx, step: SendStep, k: int) -> None:
        """Write `step`'s columns of the request (its write `k`) into every decode stage that
        holds some of this stage's layers."""
        req, dest, m = tx.req, tx.dest, self.manifest
        assert req.slot is not None and dest is not None
        full, swa = self.engine.mem.pages.request_pages(req.slot)
        full_l, swa_l = full.tolist(), swa.tolist()
        tail0 = step.swa_cols.start
        pairs: dict[str, list[tuple[int, int]]] = {
            IndexSpace.FULL_PAGE: [(full_l[c], dest.dst_full_pages[c]) for c in step.full_cols],
            IndexSpace.SWA_PAGE: [(swa_l[c], dest.dst_swa_pages[c - tail0]) for c in step.swa_cols],
            IndexSpace.REQ_SLOT: [(req.slot, dest.dst_slot)] if step.request_state else [],
        }
        if any(src < 1 for src, _ in pairs[IndexSpace.SWA_PAGE]):
            raise _Fail("internal: a window-tail column has no SWA page on the prefill side")
        for d, target in self._routes[tx.peer]:
            theirs = self._peer_manifests[target]
            blocks = transfer_blocks(m, theirs, _local_units(self.engine), theirs.units, pairs)
            tag = write_tag(tx.room, self.rank, d, k)
            self.initiator.write(target, blocks, tag, self.write_timeout_s)


class PrefillAgent(_StageWriter):
    """The prefill side (the leader of its PP group): control socket, handshake, decisions."""

    post: Post  # runs a function on the engine thread (the runner's `call`); set by attach

    def __init__(
        self,
        initiator: TransferInitiator,
        manifest: Manifest,
        bind: str,
        *,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        stages: tuple[Manifest, ...] | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        super().__init__(initiator, manifest, rank=0, write_timeout_s=write_timeout_s)
        self.heartbeat = heartbeat or Heartbeat()
        self.instance = uuid.uuid4().hex[:12]  # this process, as decode sees it in pongs
        self.stages = stages or (manifest,)  # every stage's manifest, in rank order
        self.hash = manifest_hash(manifest)
        self._peers: dict[str, _Peer] = {}
        self._pairs: dict[str, list[tuple[int, int]]] = {}  # decode peer -> (stage, its stage)
        # (engine step when queued, decode identity, message): sent after the next step
        self._unsettled: list[tuple[int, bytes, C.Message]] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._router, self.endpoint = bound(self._ctx, zmq.ROUTER, bind)
        self._outbox: Mailbox[_Send] = Mailbox(self._ctx, "prefill")
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=guarded, args=("prefill control", self._run, self._crashed), daemon=True
        )
        self._thread.name = "dsv4-pd-prefill"
        # Identities with a handshake in force: written by the engine thread (a new frozenset
        # each time), read by the control thread to answer pings.
        self._known: frozenset[bytes] = frozenset()
        self._heard_lock = threading.Lock()
        self._heard: dict[bytes, float] = {}  # identity -> when a message last came from it
        # Every message that arrived before this was read (the control thread's own clock: a
        # starved control thread must not make its peers look silent).
        self._caught_up_s = time.monotonic()
        self.ready = False  # a decode worker completed the handshake
        self.failure: str | None = None  # set: the control thread died

    def attach(self, engine: Engine, post: Post) -> None:
        """The engine built with this agent as its events, and how to run code on its thread."""
        self.engine, self.post = engine, post

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._outbox.close()
        self._router.close(linger=0)
        if not self._thread.is_alive():  # else a socket may still be open: term would hang
            self._ctx.term()

    def _crashed(self, why: str) -> None:
        self.failure = why
        self.ready = False
        self.post(lambda: self._fail_everything(why))

    def _fail_everything(self, why: str) -> None:
        self._txs.clear()
        self.engine.fail_all_between(why)

    # -- control thread --------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.pull, zmq.POLLIN)
        while not self._stop.is_set():
            started_s = time.monotonic()
            for sock, _ in poller.poll(POLL_MS):
                if sock is self._outbox.pull:
                    for out in self._outbox.take():
                        self._router.send_multipart([out.identity, *out.frames])
                    self._outbox.handled()
                    continue
                while self._router.poll(0):  # all of it: see `_caught_up_s`
                    self._receive(*self._router.recv_multipart())
            self._caught_up_s = started_s

    def _receive(self, identity: bytes, *frames: bytes) -> None:
        with self._heard_lock:
            self._heard[identity] = time.monotonic()
        try:
            msg = C.decode(list(frames))
        except C.ControlError as exc:
            log.warning("bad control message from a decode worker: %s", exc)
            return
        if isinstance(msg, C.Ping):  # answered here: a long step must not look dead
            pong = C.Pong(self.instance, identity in self._known)
            self._router.send_multipart([identity, *C.encode(pong)])
            return
        self.post(functools.partial(self._handle, identity, msg))

    def _send(self, identity: bytes, msg: C.Message) -> int:
        """Queue `msg` for the control thread; its mailbox ticket."""
        return self._outbox.put(_Send(identity, C.encode(msg)))

    def _send_settled(self, identity: bytes, msg: C.Message) -> None:
        """Send once every stage has stopped writing for the request: a PP follower may still
        be writing the step before it learns of the abort, which reaches it with the next
        step's order; decode frees the pages when this message arrives."""
        if len(self.stages) == 1:
            self._send(identity, msg)
        else:
            self._unsettled.append((self.engine.steps, identity, msg))

    # -- engine thread ---------------------------------------------------------------------------

    def _handle(self, identity: bytes, msg: C.Message) -> None:
        if isinstance(msg, C.Hello):
            self._hello(identity, msg)
        elif isinstance(msg, C.PrefillRequest):
            self._prefill(identity, msg)
        elif isinstance(msg, C.Destination):
            self._destination(identity, msg)
        elif isinstance(msg, C.Abort):
            tx = self._txs.get(msg.room)
            if tx is not None and self._peers[tx.peer].identity != identity:
                # Another decode's request of the same id: not the sender's to abort; the
                # sender's own request of that room ended (or never began) here.
                self._send(identity, C.Aborted(msg.room))
                return
            self._on(msg.room, F.AbortReceived(), identity)
        else:
            log.warning("unexpected %s from a decode worker", type(msg).__name__)

    def _hello(self, identity: bytes, msg: C.Hello) -> None:
        targets = C.hello_targets(msg)
        why: str | None = None
        if msg.protocol != C.PROTOCOL:
            why = f"control protocol: prefill speaks {C.PROTOCOL}, decode {msg.protocol}"
        elif len(self.stages) == 1 and len(targets) == 1:
            why = manifest_mismatch(self.manifest, msg.manifest)
        else:
            why = group_mismatch(self.stages, tuple(t.manifest for t in targets))
        if why is None and msg.backend != self.initiator.backend:
            why = f"transfer backend: prefill uses {self.initiator.backend}, decode {msg.backend}"
        if why is None:
            try:
                self._connect(msg.peer, targets)
            except TransferError as exc:
                why = f"transfer connect: {exc}"
        if why is not None:
            log.error("refused decode worker %s at handshake: %s", msg.peer, why)
            self._send(identity, C.Welcome(False, why))
            return
        old = self._peers.get(msg.peer)
        if old is not None:
            # Decode handshakes again (it lost us: a new socket, a new session). It failed
            # every request of the old session, so none of their transfers may go on: one
            # still waiting for its destination would hold its pages until its deadline,
            # one with a destination would write into pages decode has since given away.
            for room in [r for r, t in self._txs.items() if t.peer == msg.peer]:
                self._on(room, F.PeerGone(f"decode {msg.peer} handshook again"))
            self._known = self._known - {old.identity}
        self._peers[msg.peer] = _Peer(identity, msg.manifest)
        self._known = self._known | {identity}  # before the welcome: its pongs say "known"
        # Every (prefill stage, decode stage) pair that shares layers writes each step.
        self._pairs[msg.peer] = [
            (s, d)
            for s, stage in enumerate(self.stages)
            for d, t in enumerate(targets)
            if shared_layers(stage, t.manifest)
        ]
        self.engine.note(ConnectNote(msg.peer, targets))
        self.ready = True
        log.info("decode worker %s connected (manifest %s)", msg.peer, self.hash)
        self._send(identity, C.Welcome(True, manifest_hash=self.hash, instance=self.instance))

    def _peer_of(self, identity: bytes) -> str | None:
        for name, peer in self._peers.items():
            if peer.identity == identity:
                return name
        return None

    def _prefill(self, identity: bytes, msg: C.PrefillRequest) -> None:
        peer = self._peer_of(identity)
        if peer is None:
            self._send(identity, C.Failed(msg.room, "no handshake from this decode worker"))
            return
        try:
            params = C.first_token_params(msg.sampling, msg.stop_token_ids)
            # The room is the request's id: its engine request's too. A second request of a
            # room in flight (another decode's client chose the same X-Request-Id) is refused.
            req = self.engine.submit(msg.prompt, params, rid=msg.room, keep_pages=True)
        except (ValueError, EngineFailed) as exc:  # failed: its PP group lost a stage
            self._send(identity, C.Failed(msg.room, str(exc)))
            return
        self._txs[msg.room] = F.start_tx(
            msg.room,
            peer,
            req,
            prompt_tokens=len(req.prompt),
            geometry=self._geometry,
            timeout_s=msg.timeout_s,
            now_s=time.monotonic(),
        )
        self.engine.note(TransferNote(msg.room, peer, msg))

    def _destination(self, identity: bytes, dest: C.Destination) -> None:
        tx = self._txs.get(dest.room)
        if tx is None or self._peers[tx.peer].identity != identity:
            return  # ended already (aborted, failed, timed out), or not this peer's
        event = F.DestinationArrived(
            dest,
            len(dest.dst_full_pages),
            len(dest.dst_swa_pages),
            self._view(tx.req),
            time.monotonic(),
        )
        self._on(dest.room, event)

    def _tell(
        self,
        room: str,
        tx: _Tx | None,
        action: F.SendDone | F.SendFailed | F.SendAborted | F.NoteDestination,
        to: bytes,
    ) -> None:
        if isinstance(action, F.SendAborted):
            self._send_settled(to, C.Aborted(room))
            return
        assert tx is not None
        if isinstance(action, F.NoteDestination):
            assert tx.dest is not None
            self.engine.note(DestinationNote(tx.dest))
        elif isinstance(action, F.SendFailed):
            log.warning("request %s failed: %s", room, action.why)
            peer = self._peers.get(tx.peer)
            if peer is not None:
                self._send_settled(peer.identity, C.Failed(room, action.why))
        else:
            req = tx.req
            state = req.generator.get_state() if req.generator is not None else None
            done = C.Done(
                room,
                req.output[0],
                C.b64(state.numpy().tobytes()) if state is not None else None,
                F.done_tags(room, action.writes, self._pairs[tx.peer]),
                req.logprobs[0] if req.logprobs else None,
                tuple(req.prompt_logprobs),
            )
            ticket = self._send(self._peers[tx.peer].identity, done)
            # The last write comes next and holds the GIL for most of its preparation: let the
            # control thread send `done` first, so the first token travels meanwhile (bounded;
            # once a step: the writes' polls sleep, which lets the control thread send the rest).
            self._outbox.hand_over(ticket, DONE_HANDOFF_S, self.engine.steps)

    def after_step(self, finished: list[Request]) -> None:
        """Send what this step computed; finish transfers whose first token is out."""
        # A step ran since these were queued: every follower has applied the abort (its order)
        # and finished writing the step before (the step's collective waits for it).
        steps = self.engine.steps
        for _, identity, msg in [u for u in self._unsettled if u[0] < steps]:
            self._send(identity, msg)
        self._unsettled = [u for u in self._unsettled if u[0] >= steps]
        now = time.monotonic()
        with self._heard_lock:
            heard = {name: self._heard.get(p.identity) for name, p in self._peers.items()}
        self._drop_silent(heard)
        # Not heard lately (by the wall clock): write nothing to it, since it may have given
        # the pages away (this process was stopped); dropped once the control thread catches up.
        quiet = {n for n, at in heard.items() if at is None or silent(at, now, self.heartbeat)}
        for room, tx in list(self._txs.items()):
            self._on(room, F.Stepped(self._view(tx.req), now, quiet=tx.peer in quiet))

    def _drop_silent(self, heard: dict[str, float | None]) -> None:
        """Forget every decode not heard from within the heartbeat timeout before the control
        thread last caught up: its transfers fail (pages freed, nothing more written), and its
        next message needs a new handshake."""
        caught_up_s = self._caught_up_s
        for name, at in heard.items():
            if at is not None and not silent(at, caught_up_s, self.heartbeat):
                continue
            why = f"decode {name}: nothing heard for {self.heartbeat.timeout_s:g} s"
            log.warning("%s: dropping it and its transfers", why)
            for room in [r for r, t in self._txs.items() if t.peer == name]:
                self._on(room, F.PeerGone(why))
            identity = self._peers.pop(name).identity
            self._known = self._known - {identity}
            with self._heard_lock:
                self._heard.pop(identity, None)


class PrefillFollower(_StageWriter):
    """A later stage of a prefill group: connects to the decode peers the leader accepted and
    writes its own layers of every transfer the leader started, at the same steps. It decides
    nothing: a request ends (and its pages go) only when the leader's engine says so."""

    def __init__(
        self,
        initiator: TransferInitiator,
        manifest: Manifest,
        *,
        rank: int,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        super().__init__(initiator, manifest, rank=rank, write_timeout_s=write_timeout_s)
        self.ready = False
        self.failure: str | None = None  # no thread of its own: nothing dies here
        self._failed: set[str] = set()  # peers this stage could not connect to

    def attach(self, engine: Engine) -> None:
        """The engine replica built with this follower as its events."""
        self.engine = engine

    def on_note(self, note: object) -> None:
        """Engine thread, in order with the leader's engine events."""
        if isinstance(note, ConnectNote):
            try:
                self._connect(note.peer, note.targets)
            except TransferError as exc:
                log.error("stage %d: cannot connect to decode %s: %s", self.rank, note.peer, exc)
                self._failed.add(note.peer)
                return
            self._failed.discard(note.peer)
            self.ready = True
        elif isinstance(note, TransferNote):
            req = self.engine.requests.get(note.room)
            if req is not None and note.peer not in self._failed:
                self._txs[note.room] = F.start_tx(
                    note.room,
                    note.peer,
                    req,
                    prompt_tokens=len(req.prompt),
                    geometry=self._geometry,
                    timeout_s=note.msg.timeout_s,
                    now_s=0.0,  # a follower has no deadline: the leader's ends the request
                    leader=False,
                )
        elif isinstance(note, DestinationNote):
            tx = self._txs.get(note.dest.room)
            if tx is not None:
                dest = note.dest
                event = F.DestinationArrived(
                    dest, len(dest.dst_full_pages), len(dest.dst_swa_pages), self._view(tx.req), 0.0
                )
                self._on(dest.room, event)

    def after_step(self, finished: list[Request]) -> None:
        for room, tx in list(self._txs.items()):
            self._on(room, F.Stepped(self._view(tx.req), 0.0))

    def stop(self) -> None:
        """Nothing runs on its own thread."""

    def start(self) -> None:
        """Nothing runs on its own thread."""


class _Fail(Exception):
    pass


def _local_units(engine: Engine) -> dict[str, int]:
    pool = engine.mem.pool
    assert pool is not None
    return {str(space): n for space, n in pool.units.items()}
