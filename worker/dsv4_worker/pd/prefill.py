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

Sessions (`auth`): a decode's connection becomes a session only through the handshake, on the
control thread: `hello` gets a `challenge` (a session id this side assigns, and proof of the
deployment's secret), and the decode's `join` must be sealed with that session's key; from
then on every message both ways is sealed and a replay is refused. The engine thread checks
the join (manifest, backend), connects the transfer initiator under the session and answers
`welcome`; a join may name this process's earlier sessions of that decode (`supersedes`): their
transfers end first, and the welcome confirms them closed (so the decode frees pages it held
for them). A session ends when its decode goes silent, or it is superseded or refused: its
transfers fail and free, nothing more is written under it.

Liveness (`liveness`): the control thread answers each `ping` at once with a numbered `pong`;
the next ping echoes the number (`liveness.Echoes`). After every step the engine thread writes
to a session only while the last echoed pong was sent within the heartbeat timeout (its own
clock: a ping read late, after this process was stopped, is stale), and drops a session past
that by one more ping interval.

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
import os
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
from dsv4_worker.engine import wake
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, EngineFailed, Request
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
    new_session_id,
)
from dsv4_worker.pd.blocks import transfer_blocks
from dsv4_worker.pd.channel import Mailbox, OnFailure, Post, bound, guarded, no_hook
from dsv4_worker.pd.columns import SendStep
from dsv4_worker.pd.flight import write_tag
from dsv4_worker.pd.liveness import Echoes, Heartbeat, fresh, gone, gone_after_s
from dsv4_worker.pd.transfer import Session, TransferError, TransferInitiator

log = logging.getLogger(__name__)

# How often the engine thread looks whether a transfer paused on a stale session may write
# again (a fresh ping arrived: only the control thread sees it) or a welcome went out.
STALE_POLL_S = 0.05
# The most the engine thread waits, after queuing a request's `done`, for the control thread
# to send it: the first token then reaches decode while the last write is prepared and lands.
DONE_HANDOFF_S = 0.002
WRITE_TIMEOUT_S = 30.0  # default of `write_timeout_s`
HANDSHAKE_TIMEOUT_S = 10.0  # a challenge not answered by a join within this is forgotten
# Test hook: "write-when-stale" makes this side write on, and keep its sessions, when its
# decode's liveness is stale (as before #37: a test then sees the decode's fence alone stop
# the stale writes).
FAULT_ENV = "DSV4_TEST_PD_FAULT"
MAX_PENDING = 256  # challenged connections not yet joined (the oldest is forgotten first)


@dataclass(slots=True, eq=False)
class _Session:
    """One decode connection's session. The control thread owns the table of them (by zmq
    identity), seals and opens its messages; the engine thread reads `echoes` and sets
    `closed` (a closed session's messages are not read any more, its answers still go out)."""

    id: str
    identity: bytes  # the decode's zmq identity on the leader's ROUTER socket
    opener: Opener  # decode -> prefill
    sealer: Sealer  # prefill -> decode
    since_s: float
    joined: bool = False
    echoes: Echoes | None = None  # set as its welcome (ok) goes out
    closed: bool = False


@dataclass(slots=True)
class _Peer:
    session: _Session  # a joined, welcomed session
    manifest: Manifest  # its layers and units per index space


@dataclass(frozen=True, slots=True)
class ConnectNote:
    """Leader -> followers: a decode worker (group) passed the handshake under session
    `peer`; connect to the stages of it that share layers with yours."""

    peer: str
    targets: tuple[C.StageTarget, ...]


@dataclass(frozen=True, slots=True)
class DisconnectNote:
    """Leader -> followers: session `peer` ended (its transfers ended first)."""

    peer: str


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
    """Engine thread -> control thread: send `frames` (one encoded message) to a decode,
    sealed with its session's key."""

    session: _Session
    frames: list[bytes]
    welcome: bool = False  # a welcome (ok): the session's pongs start from it


class _StageWriter(EngineEvents):
    """Writes this stage's layers of a request's finished columns into its decode peer. The
    prefill engine's events (`after_step`; `on_note` on a follower): built before its engine,
    then `attach`ed to it once, before `start`."""

    engine: Engine  # set by attach

    def __init__(
        self,
        initiator: TransferInitiator,
        manifest: Manifest,
        keys: SessionKeys,
        *,
        rank: int,
        write_timeout_s: float,
    ) -> None:
        self.initiator = initiator
        self.manifest = manifest
        self.keys = keys
        self.rank = rank
        self.write_timeout_s = write_timeout_s
        self._peer_manifests: dict[str, Manifest] = {}  # decode stage peer -> its manifest
        # session -> (decode stage, its initiator peer) this stage writes to
        self._routes: dict[str, list[tuple[int, str]]] = {}
        self._txs: dict[str, _Tx] = {}  # room -> transfer
        self._geometry = F.Geometry(
            manifest.page_size, manifest.window_tokens + manifest.draft_tokens
        )

    def _connect(self, session: str, targets: tuple[C.StageTarget, ...]) -> None:
        """Connect to every decode stage that holds some of this stage's layers, under the
        session (its writes are MACed with the session's key)."""
        if session in self._routes:
            return
        auth = Session(session, self.keys.key(session))
        routes: list[tuple[int, str]] = []
        try:
            for d, t in enumerate(targets):
                if not shared_layers(self.manifest, t.manifest):
                    continue
                name = f"{session}/{d}"  # this side names its peers: none is self-declared
                self.initiator.connect(name, C.unb64(t.descriptor), auth)
                self._peer_manifests[name] = t.manifest
                routes.append((d, name))
        except TransferError:
            self._drop_routes(routes)
            raise
        self._routes[session] = routes

    def _disconnect(self, session: str) -> None:
        """The session ended: its initiator peers go."""
        self._drop_routes(self._routes.pop(session, []))

    def _drop_routes(self, routes: list[tuple[int, str]]) -> None:
        for _, name in routes:
            self.initiator.disconnect(name)
            self._peer_manifests.pop(name, None)

    def _on(
        self, room: str, event: F.PrefillEvent[C.Destination], to: _Session | None = None
    ) -> None:
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
        self, room: str, tx: _Tx | None, action: F.PrefillAction, to: _Session | None
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
        to: _Session | None,
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
        routes = self._routes.get(tx.peer)
        if routes is None:
            raise _Fail(f"session {tx.peer} ended")
        for d, target in routes:
            theirs = self._peer_manifests[target]
            blocks = transfer_blocks(m, theirs, _local_units(self.engine), theirs.units, pairs)
            tag = write_tag(tx.room, self.rank, d, k)
            self.initiator.write(target, blocks, tag, self.write_timeout_s, epoch=dest.epoch)


class PrefillAgent(_StageWriter):
    """The prefill side (the leader of its PP group): control socket, handshake, decisions."""

    post: Post  # runs a function on the engine thread (the runner's `call`); set by attach

    def __init__(
        self,
        initiator: TransferInitiator,
        manifest: Manifest,
        bind: str,
        keys: SessionKeys,
        *,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        stages: tuple[Manifest, ...] | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        super().__init__(initiator, manifest, keys, rank=0, write_timeout_s=write_timeout_s)
        self.heartbeat = heartbeat or Heartbeat()
        self.instance = uuid.uuid4().hex[:12]  # this process, as decode sees it in pongs
        self.stages = stages or (manifest,)  # every stage's manifest, in rank order
        self.hash = manifest_hash(manifest)
        self._peers: dict[str, _Peer] = {}  # session id -> a welcomed session (engine thread)
        self._pairs: dict[str, list[tuple[int, int]]] = {}  # session -> (stage, its stage)
        # (engine step when queued, session, message): sent after the next step
        self._unsettled: list[tuple[int, _Session, C.Message]] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._router, self.endpoint = bound(self._ctx, zmq.ROUTER, bind)
        self._outbox: Mailbox[_Send] = Mailbox(self._ctx, "prefill")
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=guarded, args=("prefill control", self._run, self._crashed), daemon=True
        )
        self._thread.name = "dsv4-pd-prefill"
        self._sessions: dict[bytes, _Session] = {}  # zmq identity -> session (control thread)
        self.ready = False  # a decode worker completed the handshake
        self.failure: str | None = None  # set: the control thread died
        self.on_failure: OnFailure = no_hook  # called once `failure` is set
        self.control_turns = 0  # turns of the control loop (each wake-up: tests)
        self._write_when_stale = os.environ.get(FAULT_ENV) == "write-when-stale"

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
        self._outbox.kick()
        self._thread.join(timeout=5)
        self._outbox.close()
        self._router.close(linger=0)
        if not self._thread.is_alive():  # else a socket may still be open: term would hang
            self._ctx.term()

    def _crashed(self, why: str) -> None:
        self.failure = why
        self.ready = False
        self.post(lambda: self._fail_everything(why))
        self.on_failure(why)

    def _fail_everything(self, why: str) -> None:
        self._txs.clear()
        self.engine.fail_all_between(why)

    # -- control thread --------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.pull, zmq.POLLIN)
        while not self._stop.is_set():
            self.control_turns += 1
            # Messages, the outbox and stop() wake it; the one timer: a handshake's expiry.
            for sock, _ in poller.poll(wake.wait_ms(self._handshake_due_s(), time.monotonic())):
                if sock is self._outbox.pull:
                    for out in self._outbox.take():
                        self._deliver(out)
                    self._outbox.handled()
                    continue
                while self._router.poll(0):
                    self._receive(*self._router.recv_multipart())
            self._forget_pending(time.monotonic())

    def _deliver(self, out: _Send) -> None:
        session = out.session
        if out.welcome:
            session.echoes = Echoes(time.monotonic())  # the welcome is pong 0
        frames = session.sealer.seal(out.frames)
        self._router.send_multipart([session.identity, *frames])

    def _receive(self, identity: bytes, *frames: bytes) -> None:
        session = self._sessions.get(identity)
        if len(frames) == 2:  # not sealed: only a hello (or a ping under a forgotten session)
            self._unsealed(identity, session, list(frames))
            return
        if session is None or session.closed:
            if frames and frames[0] == b"ping":  # it lost us: say so (the one unsealed pong)
                self._router.send_multipart([identity, *C.encode(C.Pong(self.instance, False))])
            return
        try:
            msg = C.decode(session.opener.open(list(frames)))
        except (AuthError, C.ControlError) as exc:
            log.warning("refused a control message from decode session %s: %s", session.id, exc)
            return
        if isinstance(msg, C.Ping):  # answered here: a long step must not look dead
            if session.echoes is not None:
                session.echoes.echoed(msg.echo)
                pong = C.Pong(self.instance, True, session.echoes.pong(time.monotonic()))
                self._router.send_multipart([identity, *session.sealer.seal(C.encode(pong))])
            return
        if isinstance(msg, C.Join):
            if session.joined:
                log.warning("decode session %s: a second join, ignored", session.id)
                return
            session.joined = True
            self.post(functools.partial(self._join, session, msg))
            return
        if session.echoes is None:
            log.warning("decode session %s: %s before its welcome", session.id, type(msg).__name__)
            return
        self.post(functools.partial(self._handle, session, msg))

    def _unsealed(self, identity: bytes, session: _Session | None, frames: list[bytes]) -> None:
        """A `hello` starts a session: challenge it. Anything else unsealed is refused."""
        try:
            msg = C.decode(frames)
        except C.ControlError as exc:
            log.warning("bad control message from a decode worker: %s", exc)
            return
        if not isinstance(msg, C.Hello) or session is not None:
            log.warning("refused an unauthenticated %s from a decode worker", type(msg).__name__)
            if isinstance(msg, C.Ping):
                self._router.send_multipart([identity, *C.encode(C.Pong(self.instance, False))])
            return
        if msg.protocol != C.PROTOCOL:
            why = f"control protocol: prefill speaks {C.PROTOCOL}, decode {msg.protocol}"
            log.error("refused a decode worker at handshake: %s", why)
            self._router.send_multipart([identity, *C.encode(C.Welcome(False, why))])
            return
        sid = new_session_id(self.instance)
        key = self.keys.key(sid)
        self._sessions[identity] = _Session(
            sid, identity, Opener(key, TO_PREFILL), Sealer(key, TO_DECODE), time.monotonic()
        )
        proof = self.keys.challenge_proof(msg.nonce, sid, self.instance)
        challenge = C.Challenge(sid, self.instance, proof)
        self._router.send_multipart([identity, *C.encode(challenge)])

    def _handshake_due_s(self) -> float | None:
        """When the oldest challenged connection that has not joined is forgotten."""
        pending = [s.since_s for s in self._sessions.values() if not s.joined and not s.closed]
        return min(pending) + HANDSHAKE_TIMEOUT_S if pending else None

    def _forget_pending(self, now_s: float) -> None:
        """Closed sessions, and challenged connections that never joined (too old, or too
        many), are forgotten (a closed session's last answers, already queued, still go)."""
        pending = [s for s in self._sessions.values() if not s.joined]
        old = [s for s in self._sessions.values() if s.closed]
        old += [s for s in pending if now_s - s.since_s > HANDSHAKE_TIMEOUT_S]
        if len(pending) - len(old) > MAX_PENDING:
            old += sorted(pending, key=lambda s: s.since_s)[: len(pending) - MAX_PENDING]
        for s in old:
            self._sessions.pop(s.identity, None)

    def _send(self, session: _Session, msg: C.Message, *, welcome: bool = False) -> int:
        """Queue `msg` for the control thread; its mailbox ticket."""
        return self._outbox.put(_Send(session, C.encode(msg), welcome))

    def _send_settled(self, session: _Session, msg: C.Message) -> None:
        """Send once every stage has stopped writing for the request: a PP follower may still
        be writing the step before it learns of the abort, which reaches it with the next
        step's order; decode frees the pages when this message arrives."""
        if len(self.stages) == 1:
            self._send(session, msg)
        else:
            self._unsettled.append((self.engine.steps, session, msg))

    # -- engine thread ---------------------------------------------------------------------------

    def _handle(self, session: _Session, msg: C.Message) -> None:
        if session.closed:
            return
        if isinstance(msg, C.PrefillRequest):
            self._prefill(session, msg)
        elif isinstance(msg, C.Destination):
            self._destination(session, msg)
        elif isinstance(msg, C.Abort):
            tx = self._txs.get(msg.room)
            if tx is not None and tx.peer != session.id:
                # Another session's request of the same id: not the sender's to abort; the
                # sender's own request of that room ended (or never began) here.
                self._send(session, C.Aborted(msg.room))
                return
            self._on(msg.room, F.AbortReceived(), session)
        else:
            log.warning("unexpected %s from decode session %s", type(msg).__name__, session.id)

    def _join(self, session: _Session, msg: C.Join) -> None:
        targets = C.join_targets(msg)
        why: str | None = None
        if len(self.stages) == 1 and len(targets) == 1:
            why = manifest_mismatch(self.manifest, msg.manifest)
        else:
            why = group_mismatch(self.stages, tuple(t.manifest for t in targets))
        if why is None and msg.backend != self.initiator.backend:
            why = f"transfer backend: prefill uses {self.initiator.backend}, decode {msg.backend}"
        # Its earlier sessions with this process end first: the decode gave up on them (and
        # their requests), so none of their transfers may write on. A session id of this
        # process that is not live any more is closed already.
        closed = tuple(old for old in msg.supersedes if instance_of(old) == self.instance)
        for old in closed:
            if old in self._peers and old != session.id:
                self._end_session(self._peers[old].session, f"superseded by {session.id}")
        if why is None:
            try:
                self._connect(session.id, targets)
            except TransferError as exc:
                why = f"transfer connect: {exc}"
        if why is not None:
            log.error("refused decode session %s at handshake: %s", session.id, why)
            session.closed = True
            self._send(session, C.Welcome(False, why, closed=closed))
            return
        self._peers[session.id] = _Peer(session, msg.manifest)
        # Every (prefill stage, decode stage) pair that shares layers writes each step.
        self._pairs[session.id] = [
            (s, d)
            for s, stage in enumerate(self.stages)
            for d, t in enumerate(targets)
            if shared_layers(stage, t.manifest)
        ]
        self.engine.note(ConnectNote(session.id, targets))
        self.ready = True
        log.info("decode session %s joined (manifest %s)", session.id, self.hash)
        welcome = C.Welcome(True, manifest_hash=self.hash, instance=self.instance, closed=closed)
        if closed and len(self.stages) > 1:  # after every stage stopped writing for them
            self._unsettled.append((self.engine.steps, session, welcome))
        else:
            self._send(session, welcome, welcome=True)

    def _end_session(self, session: _Session, why: str) -> None:
        """The session ends: its transfers fail (pages freed, `failed` sent while it can be),
        nothing more is written under it, and its messages are not read any more."""
        if session.id in self._peers:
            log.warning("decode session %s: %s: dropping it and its transfers", session.id, why)
            for room in [r for r, t in self._txs.items() if t.peer == session.id]:
                self._on(room, F.PeerGone(f"decode session {session.id}: {why}"))
            del self._peers[session.id]
            self._pairs.pop(session.id, None)
            self._disconnect(session.id)
            self.engine.note(DisconnectNote(session.id))
        session.closed = True

    def _session_of(self, session: _Session) -> _Peer | None:
        peer = self._peers.get(session.id)
        return peer if peer is not None and peer.session is session else None

    def _prefill(self, session: _Session, msg: C.PrefillRequest) -> None:
        if self._session_of(session) is None:
            self._send(session, C.Failed(msg.room, "no handshake from this decode worker"))
            return
        try:
            params = C.first_token_params(msg.sampling, msg.stop_token_ids)
            # The room is the request's id: its engine request's too. A second request of a
            # room in flight (another decode's client chose the same X-Request-Id) is refused.
            req = self.engine.submit(msg.prompt, params, rid=msg.room, keep_pages=True)
        except (ValueError, EngineFailed) as exc:  # failed: its PP group lost a stage
            self._send(session, C.Failed(msg.room, str(exc)))
            return
        except Exception as exc:  # a defect: this request fails alone, the session lives on
            log.exception("request %s: submitting it failed", msg.room)
            self._send(session, C.Failed(msg.room, f"internal error: {type(exc).__name__}"))
            return
        self._txs[msg.room] = F.start_tx(
            msg.room,
            session.id,
            req,
            prompt_tokens=len(req.prompt),
            geometry=self._geometry,
            timeout_s=msg.timeout_s,
            now_s=time.monotonic(),
        )
        self.engine.note(TransferNote(msg.room, session.id, msg))

    def _destination(self, session: _Session, dest: C.Destination) -> None:
        tx = self._txs.get(dest.room)
        if tx is None or tx.peer != session.id:
            return  # ended already (aborted, failed, timed out), or not this session's
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
        to: _Session | None,
    ) -> None:
        if isinstance(action, F.SendAborted):
            if to is not None:
                self._send_settled(to, C.Aborted(room))
            return
        assert tx is not None
        peer = self._peers.get(tx.peer)
        if isinstance(action, F.NoteDestination):
            assert tx.dest is not None
            self.engine.note(DestinationNote(tx.dest))
        elif isinstance(action, F.SendFailed):
            log.warning("request %s failed: %s", room, action.why)
            if peer is not None:
                self._send_settled(peer.session, C.Failed(room, action.why))
        else:
            assert peer is not None
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
            ticket = self._send(peer.session, done)
            # The last write comes next and holds the GIL for most of its preparation: let the
            # control thread send `done` first, so the first token travels meanwhile (bounded;
            # once a step: the writes' polls sleep, which lets the control thread send the rest).
            self._outbox.hand_over(ticket, DONE_HANDOFF_S, self.engine.steps)

    def wake_at_s(self, now_s: float) -> float | None:
        """When `after_step` next has something to do by the clock: a message to settle (at
        once: it goes after the next step), a session whose freshest echoed pong is about to
        be too old (`gone`), a transfer's deadline; a transfer whose session is not fresh
        waits for a ping that only the control thread sees: it looks again every
        `STALE_POLL_S`. The control thread only makes things due later (a pong echoed moves
        `fresh_s` on), except a welcome going out (`echoes` set): looked at every
        `STALE_POLL_S` too, until then."""
        if self._unsettled:
            return now_s
        hb, due = self.heartbeat, []
        for peer in self._peers.values():
            e = peer.session.echoes
            if e is None:
                due.append(now_s + STALE_POLL_S)
            elif not self._write_when_stale:
                due.append(gone_after_s(e.fresh_s, hb))
        for tx in self._txs.values():
            live = self._peers.get(tx.peer)
            e = live.session.echoes if live is not None else None
            if e is None or not (self._write_when_stale or fresh(e.fresh_s, now_s, hb)):
                due.append(now_s + STALE_POLL_S)
            else:
                due.append(tx.deadline_s)
        return wake.earliest(*due)

    def after_step(self, finished: list[Request]) -> None:
        """Send what this step computed; finish transfers whose first token is out."""
        # A step ran since these were queued: every follower has applied the abort (its order)
        # and finished writing the step before (the step's collective waits for it).
        steps = self.engine.steps
        for _, session, msg in [u for u in self._unsettled if u[0] < steps]:
            self._send(session, msg, welcome=isinstance(msg, C.Welcome) and msg.ok)
        self._unsettled = [u for u in self._unsettled if u[0] >= steps]
        hb = self.heartbeat
        for peer in list(self._peers.values()):
            e = peer.session.echoes
            if (
                e is not None
                and gone(e.fresh_s, time.monotonic(), hb)
                and not self._write_when_stale
            ):
                why = f"no fresh ping for {hb.timeout_s + hb.interval_s:g} s"
                self._end_session(peer.session, why)
        for room, tx in list(self._txs.items()):
            # Not fresh (on this process's clock): write nothing to it now, since its decode
            # may have given the pages away (this process was stopped, or its pings are late).
            live = self._peers.get(tx.peer)
            e = live.session.echoes if live is not None else None
            now = time.monotonic()
            quiet = e is None or not fresh(e.fresh_s, now, hb)
            if self._write_when_stale:
                quiet = e is None
            self._on(room, F.Stepped(self._view(tx.req), now, quiet=quiet))


class PrefillFollower(_StageWriter):
    """A later stage of a prefill group: connects to the decode peers the leader accepted and
    writes its own layers of every transfer the leader started, at the same steps. It decides
    nothing: a request ends (and its pages go) only when the leader's engine says so."""

    def __init__(
        self,
        initiator: TransferInitiator,
        manifest: Manifest,
        keys: SessionKeys,
        *,
        rank: int,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        super().__init__(initiator, manifest, keys, rank=rank, write_timeout_s=write_timeout_s)
        self.ready = False
        self.failure: str | None = None  # no thread of its own: nothing dies here
        self.on_failure: OnFailure = no_hook  # (never called)
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
        elif isinstance(note, DisconnectNote):
            self._disconnect(note.peer)
            self._failed.discard(note.peer)
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
