"""NIXL transfer backend (UCX; DRAM_SEG for CPU tensors, VRAM_SEG for CUDA tensors). The only
module that imports NIXL, lazily (`load_nixl`).

No NIXL listen thread and no NIXL progress thread (it spins a whole core): the target's agent
metadata and region addresses travel in its descriptor over our own control channel, and a
target thread polls notifications (every `PUMP_INTERVAL_S` while writes are due, backing off to
`PUMP_QUIET_INTERVAL_S`, and `PUMP_UNGRANTED_INTERVAL_S` while no grant is live), which also
progresses UCX (without it, writes over TCP never complete).
NOTE: after `register`, only that thread touches the target's agent (until `close`).

Authentication and fencing: a write's notification is `auth.notification` (its session, the
epoch of its grant, its tag, a MAC under the session's key); the target reports the tag
landed only when the MAC is right and the grant is live (`fence.Fence`). The bytes of a NIXL
WRITE cannot be refused by the target (`fences` is False): the decode holds the pages of a
transfer it gave up on until the writer's session is provably closed. The descriptor (agent
metadata, region addresses: what lets a peer write) travels only inside an authenticated PD
handshake.

Parallel writes: on one host UCX copies with the kernel (`process_vm_writev`, one call per
descriptor, in the thread that posts), so one posting thread holds a write to one core's copy
rate. An initiator with `threads` >= 2 keeps that many poster threads, and its agent one
shared UCX worker per poster plus one for the calling thread. NIXL binds a thread to a shared worker
at its first post (round robin), so the posters, all of which first post in the same write,
get distinct workers. A write of at least `PARALLEL_MIN_BYTES` per poster is cut into equal
byte shares that the posters post at once while the calling thread waits; the calling thread
then polls them, and sends the tag on a scratch write once every share is done. Smaller writes
go out from the calling thread as one transfer carrying the tag.
NOTE: the posters touch the agent only while the calling thread waits for all of them to have
posted (posting never waits for the peer, so this wait is as bounded as posting on the calling
thread), so at any time the agent is used by one thread, or by the posters on their own
workers; every shared worker, the posters' included, is progressed by `get_new_notifs` (see
`_progress`).
(NIXL's own thread pool, `num_threads`, splits by descriptor count, and its dedicated workers
are progressed only while they post: after a failed write, destroying them trips the UCX
assertion `_progress` avoids for shared workers.)
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from dsv4_worker.pd.auth import AuthError, SessionKeys, notification, read_notification
from dsv4_worker.pd.transfer.base import (
    Block,
    Region,
    Session,
    TransferError,
    check_blocks,
    check_regions,
    check_same_regions,
    drain,
    landed_key,
    merge_blocks,
    nothing,
    split_blocks,
)
from dsv4_worker.pd.transfer.fence import Fence, Grant

log = logging.getLogger(__name__)

BACKEND: Final = "nixl"
NIXL_MODULES: Final = ("nixl_cu12", "nixl_cu13", "nixl")
MEM_TYPES: Final = ("DRAM", "VRAM")
PUMP_INTERVAL_S: Final = 0.0002  # the target's notification poll period while busy/expecting
PUMP_IDLE_INTERVAL_S: Final = 0.002  # ... right after the owner stopped expecting
# ... and at most, while nothing is expected: it doubles up to this after the last tag (an
# owner that calls `expect` is polled at once when it does; a PP follower's target, whose
# owner does not, notices its first write after a quiet spell this late at worst, as its
# landed thread polls: pd/decode.py LANDED_POLL_S). 2 ms kept an idle decode at ~1% of a core
# in UCX progress calls (#38 item 6).
PUMP_QUIET_INTERVAL_S: Final = 0.05
# ... and while no grant is live (nothing may land; `grant` wakes the pump, which then drops
# to the quiet period): a write under a revoked grant, which UCX over TCP completes only as
# this side progresses, waits this long at worst (#38 item 6: 20 polls a second kept an idle
# decode at ~0.3% of a core).
PUMP_UNGRANTED_INTERVAL_S: Final = 0.5
# The initiator's poll period while a write is in flight. It sleeps rather than spins: the last
# write is off a stream's first token's path (decode shows it from `done`, sent before that
# write), and on a shared host a spinning prefill takes the core decode needs to send it on.
POLL_SLEEP_S: Final = 0.0001
PROGRESS_CALLS: Final = 4  # after a failed write and before close; see `_progress`
SCRATCH_NBYTES: Final = 64  # each side's scratch, for tags that travel without data
WRITE_THREADS: Final = 2  # an initiator's default poster threads (0 or 1: the calling thread)
MAX_WRITE_THREADS: Final = 64
PARALLEL_MIN_BYTES: Final = 256 << 10  # per poster: smaller writes are not worth the hand-off


@dataclass(frozen=True, slots=True)
class Nixl:
    """The imported NIXL API: `nixl_agent` and `nixl_agent_config` of `module`."""

    module: str
    agent: Any
    agent_config: Any


@functools.cache
def load_nixl() -> Nixl:
    """Import the first NIXL module that loads; TransferError when none is installed."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        return Nixl(name, api.nixl_agent, api.nixl_agent_config)
    raise TransferError(
        "kv transfer nixl: NIXL is not installed (pip install nixl-cu12); use --transfer zmq"
    )


class Segment(NamedTuple):
    """Where one region lies: base address, size, NIXL memory type and device id."""

    addr: int
    nbytes: int
    mem: str
    dev: int


def segment_of(tensor: torch.Tensor) -> Segment:
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_cuda:
        return Segment(tensor.data_ptr(), nbytes, "VRAM", tensor.device.index or 0)
    return Segment(tensor.data_ptr(), nbytes, "DRAM", 0)


class NixlTarget:
    """Receives writes into its registered regions; reports each authentic write's tag of a
    live grant once."""

    backend: str = BACKEND
    fences: bool = False

    def __init__(self, keys: SessionKeys) -> None:
        self.name = f"dsv4-kv-target-{uuid.uuid4().hex[:12]}"
        self._keys = keys
        self._fence = Fence(())
        self._lock = threading.Lock()  # the fence: the owner's grants, the pump's checks
        self._agent: Any = _new_agent(self.name)
        self._registered: list[Any] = []
        self._regions: list[Region] = []  # NOTE: keeps the registered memory alive
        self._scratch = torch.zeros(SCRATCH_NBYTES, dtype=torch.uint8)
        self._descriptor: bytes | None = None
        self._landed: deque[str] = deque()
        self._on_landed: Callable[[], None] = nothing
        self._expecting = False
        self._quiets = 0  # times the owner stopped expecting (`expect`); the pump drops to idle
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: poll now (expecting began, or closing)
        self._thread: threading.Thread | None = None

    def register(self, regions: Sequence[Region]) -> None:
        if self._agent is None or self._descriptor is not None:
            raise TransferError(f"kv transfer nixl: target {self.name} is closed or registered")
        check_regions(regions)
        segments = {r.name: segment_of(r.tensor) for r in regions}
        scratch = segment_of(self._scratch)
        self._registered = _register(self._agent, [*segments.items(), ("scratch", scratch)])
        self._regions = list(regions)
        self._fence = Fence(regions)
        metadata: bytes = self._agent.get_agent_metadata()
        self._descriptor = encode_descriptor(self.name, metadata, segments, scratch)
        self._thread = threading.Thread(target=self._pump, name="dsv4-nixl-target", daemon=True)
        self._thread.start()

    def descriptor(self) -> bytes:
        if self._descriptor is None:
            raise TransferError(f"kv transfer nixl: target {self.name}: register regions first")
        return self._descriptor

    def grant(self, grant: Grant) -> None:
        with self._lock:
            try:
                self._fence.grant(grant)
            except ValueError as exc:
                raise TransferError(f"kv transfer nixl: {exc}") from exc
        self._wake.set()  # writes are coming: leave the ungranted period (`pump_interval_s`)

    def revoke(self, epoch: int) -> None:
        with self._lock:
            self._fence.revoke(epoch)

    def poll_landed(self) -> list[str]:
        return drain(self._landed)

    def on_landed(self, callback: Callable[[], None]) -> None:
        self._on_landed = callback

    def expect(self, expecting: bool) -> None:
        if expecting and not self._expecting:
            self._wake.set()  # leave the idle interval at once
        elif self._expecting and not expecting:
            self._quiets += 1  # NOTE: only the owner's thread writes it; the pump reads it
        self._expecting = expecting

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._agent is not None:
            _deregister(self._agent, self._registered)
            self._registered, self._regions, self._agent = [], [], None

    def _pump(self) -> None:
        """Poll notifications (and so progress UCX, which the initiator's writes also wait
        for) every `pump_interval_s`; call `on_landed` after tags arrive."""
        interval_s, quiets = PUMP_INTERVAL_S, 0
        while not self._stop.is_set():
            self._wake.wait(interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
            except Exception:
                log.exception("kv transfer nixl: target %s: reading notifications", self.name)
                self._stop.wait(1.0)
                continue
            for messages in notifs.values():
                for m in messages:
                    self._notified(m)
            if notifs:
                try:
                    self._on_landed()
                except Exception:  # the owner's bug: keep receiving
                    log.exception("kv transfer nixl: target %s: on_landed", self.name)
            seen, quiets = quiets, self._quiets  # read once, before `_expecting`
            told_idle = quiets != seen
            with self._lock:  # a grant after this sets `_wake`: the next wait ends at once
                granted = self._fence.granted
            interval_s = pump_interval_s(
                interval_s,
                busy=bool(notifs),
                expecting=self._expecting,
                told_idle=told_idle,
                granted=granted,
            )

    def _notified(self, raw: bytes) -> None:
        """A write's notification: its tag lands if it is authentic and its grant is live."""
        try:
            session, epoch, tag = read_notification(self._keys, raw)
        except AuthError as exc:
            log.warning("kv transfer nixl: target %s: dropped a notification: %s", self.name, exc)
            return
        with self._lock:
            why = self._fence.refuse_tag(session, epoch, tag)
        if why is not None:
            log.warning("kv transfer nixl: target %s: ignored write %r: %s", self.name, tag, why)
            return
        self._landed.append(landed_key(epoch, tag))


def pump_interval_s(
    previous_s: float,
    *,
    busy: bool,
    expecting: bool = False,
    told_idle: bool = False,
    granted: bool = True,
) -> float:
    """A target's next poll period: PUMP_INTERVAL_S while the owner expects writes; else
    PUMP_IDLE_INTERVAL_S at once when the owner stopped expecting since the last poll (what it
    waited for landed; faster polls would take the CPU its engine and HTTP threads need to
    answer); else PUMP_INTERVAL_S while busy (a tag just arrived: an owner that never calls
    `expect` may get more), else twice the last, up to PUMP_QUIET_INTERVAL_S while some grant
    is live, PUMP_UNGRANTED_INTERVAL_S while none is (back to the quiet one at once when one
    is granted)."""
    if expecting:
        return PUMP_INTERVAL_S
    if told_idle:
        return PUMP_IDLE_INTERVAL_S
    if busy:
        return PUMP_INTERVAL_S
    ceiling_s = PUMP_QUIET_INTERVAL_S if granted else PUMP_UNGRANTED_INTERVAL_S
    return min(2 * previous_s, ceiling_s)


@dataclass(frozen=True, slots=True)
class _Peer:
    agent: str
    segments: dict[str, Segment]
    scratch: Segment
    session: Session


class _Job(NamedTuple):
    """One transfer: Nx3 (address, nbytes, device) rows on each side, each of one memory type."""

    local_mem: str
    remote_mem: str
    local: np.ndarray[Any, np.dtype[np.uint64]]
    remote: np.ndarray[Any, np.dtype[np.uint64]]


class NixlInitiator:
    """Writes blocks of its registered regions into connected targets."""

    backend: str = BACKEND

    def __init__(self, name: str, threads: int = WRITE_THREADS) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self._agent: Any = _new_agent(self.name, ucx_params(threads))
        self._posters = _Posters(self._agent, threads, self.name) if threads >= 2 else None
        self._registered: list[Any] = []
        self._regions: list[Region] = []  # NOTE: keeps the registered memory alive
        self._segments: dict[str, Segment] = {}
        self._scratch_tensor = torch.zeros(SCRATCH_NBYTES, dtype=torch.uint8)
        self._scratch = segment_of(self._scratch_tensor)
        self._peers: dict[str, _Peer] = {}
        self._agents: dict[str, int] = {}  # remote agent -> connected peers writing to it

    def register(self, regions: Sequence[Region]) -> None:
        if self._agent is None or self._segments:
            raise TransferError(f"kv transfer nixl: initiator {self.name} is closed or registered")
        check_regions(regions)
        segments = {r.name: segment_of(r.tensor) for r in regions}
        self._registered = _register(self._agent, [*segments.items(), ("scratch", self._scratch)])
        self._regions = list(regions)
        self._segments = segments

    def connect(self, peer: str, descriptor: bytes, session: Session) -> None:
        if self._agent is None or not self._segments:
            raise TransferError(f"kv transfer nixl: initiator {self.name}: register regions first")
        if peer in self._peers:
            raise TransferError(f"kv transfer nixl: peer {peer!r} is already connected")
        agent, metadata, segments, scratch = decode_descriptor(descriptor, peer)
        check_same_regions(_sizes(self._segments), _sizes(segments), peer=peer)
        if agent not in self._agents:  # a target's agent is loaded once for all its peers
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise TransferError(
                    f"kv transfer nixl: peer {peer!r}: bad agent metadata: {exc}"
                ) from exc
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != agent:
                self._remove(loaded_name)
                raise TransferError(
                    f"kv transfer nixl: peer {peer!r}: metadata is for agent {loaded_name!r}, "
                    f"the descriptor names {agent!r}"
                )
        self._agents[agent] = self._agents.get(agent, 0) + 1
        self._peers[peer] = _Peer(agent, segments, scratch, session)

    def write(
        self, peer: str, blocks: Sequence[Block], tag: str, timeout_s: float, *, epoch: int
    ) -> None:
        p = self._peer(peer)
        check_blocks(blocks, _sizes(self._segments), _sizes(p.segments), peer=peer)
        notif = notification(p.session.key, p.session.id, epoch, tag)
        deadline = time.monotonic() + timeout_s
        what = f"write {tag!r} to peer {peer!r}"
        merged = merge_blocks(blocks)
        groups = _by_mem_types(merged, self._segments, p.segments)
        posters = self._posters
        if posters is not None and sum(b.nbytes for b in merged) < (
            posters.count * PARALLEL_MIN_BYTES
        ):
            posters = None
        try:
            if posters is not None:
                self._run_shares(posters, p, groups, deadline, what, timeout_s)
            else:
                jobs = [_job(group, self._segments, p.segments) for group in groups]
                if len(jobs) == 1:  # the usual case: the tag rides on the one transfer
                    self._run(p, jobs, notif, deadline, what, timeout_s)
                    return
                self._run(p, jobs, b"", deadline, what, timeout_s)
            # In shares, or none or several memory-type pairs: the tag follows, once those are
            # done, on a 1-byte scratch write (a bare notification is not progressed without a
            # transfer)
            self._run(p, [_scratch_job(self._scratch, p.scratch)], notif, deadline, what, timeout_s)
        except Exception as exc:  # NIXL raises its own types (e.g. a remote disconnect)
            _progress(self._agent)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"kv transfer nixl: {what}: {exc!r}") from exc

    def disconnect(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is None or self._agent is None:
            return
        left = self._agents.pop(p.agent) - 1
        if left:
            self._agents[p.agent] = left  # another session's peer writes to it still
        else:
            self._remove(p.agent)

    def close(self) -> None:
        if self._posters is not None:
            self._posters.close()
            self._posters = None
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._agent is not None:
            _progress(self._agent)
            _deregister(self._agent, self._registered)
            self._registered, self._regions, self._agent = [], [], None

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None or self._agent is None:
            raise TransferError(f"kv transfer nixl: peer {peer!r} is not connected")
        return p

    def _run(
        self,
        p: _Peer,
        jobs: Sequence[_Job],
        notif: bytes,
        deadline: float,
        what: str,
        timeout_s: float,
    ) -> None:
        """Post every job, then poll until all are done; release the handles in any case."""
        handles: list[Any] = []
        try:
            for job in jobs:
                handles.append(_post(self._agent, p.agent, job, notif, what))
            self._wait(handles, deadline, what, timeout_s)
        finally:
            for h in handles:
                _release(self._agent, h)

    def _run_shares(
        self,
        posters: _Posters,
        p: _Peer,
        groups: Sequence[Sequence[Block]],
        deadline: float,
        what: str,
        timeout_s: float,
    ) -> None:
        """Each memory-type group cut into one equal share per poster; the posters post their
        shares at once, this thread polls them all until done; the handles are released in
        any case."""
        # The posters' workers are progressed only here and by polls: let them see a peer that
        # went away since (else they post into its failed endpoints and UCX keeps requests)
        self._agent.get_new_notifs()
        cut = [split_blocks(group, posters.count) for group in groups]
        shares = [
            [_job(parts[i], self._segments, p.segments) for parts in cut if parts[i]]
            for i in range(posters.count)
        ]
        handles, error = posters.post(p.agent, shares, what)
        try:
            if error is not None:
                raise error
            self._wait(handles, deadline, what, timeout_s)
        finally:
            for h in handles:
                _release(self._agent, h)

    def _wait(self, handles: Sequence[Any], deadline: float, what: str, timeout_s: float) -> None:
        pending = list(handles)
        while pending:
            states = [self._agent.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise TransferError(f"kv transfer nixl: {what} failed")
            pending = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
            if pending and time.monotonic() > deadline:
                raise TransferError(f"kv transfer nixl: {what} timed out after {timeout_s:g} s")
            if pending:
                time.sleep(POLL_SLEEP_S)

    def _remove(self, agent: str) -> None:
        try:
            self._agent.remove_remote_agent(agent)
        except Exception:
            log.warning("kv transfer nixl: removing remote agent %s", agent, exc_info=True)


class _Posters:
    """`count` threads, each posting its share of a parallel write on its own shared UCX
    worker (module docstring). NOTE: they touch the agent only between `post`'s hand-out and
    its return."""

    def __init__(self, agent: Any, count: int, name: str) -> None:
        self.count = count
        self._agent = agent
        self._inboxes: list[queue.SimpleQueue[tuple[str, list[_Job], str] | None]] = [
            queue.SimpleQueue() for _ in range(count)
        ]
        self._results: queue.SimpleQueue[tuple[list[Any], BaseException | None]] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(
                target=self._serve, args=(inbox,), name=f"{name}-poster-{i}", daemon=True
            )
            for i, inbox in enumerate(self._inboxes)
        ]
        for t in self._threads:
            t.start()

    def post(
        self, peer_agent: str, shares: Sequence[list[_Job]], what: str
    ) -> tuple[list[Any], BaseException | None]:
        """Poster i posts `shares[i]`; once every poster has answered: every handle posted,
        and the first error."""
        for inbox, jobs in zip(self._inboxes, shares, strict=True):
            inbox.put((peer_agent, jobs, what))
        handles: list[Any] = []
        error: BaseException | None = None
        for _ in shares:
            posted, failed = self._results.get()
            handles.extend(posted)
            error = error or failed
        return handles, error

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._threads:
            t.join()

    def _serve(self, inbox: queue.SimpleQueue[tuple[str, list[_Job], str] | None]) -> None:
        while (task := inbox.get()) is not None:
            peer_agent, jobs, what = task
            posted: list[Any] = []
            failed: BaseException | None = None
            try:
                for job in jobs:
                    posted.append(_post(self._agent, peer_agent, job, b"", what))
            except Exception as exc:  # NIXL raises its own types
                failed = exc
            self._results.put((posted, failed))


def encode_descriptor(
    agent: str, metadata: bytes, segments: Mapping[str, Segment], scratch: Segment
) -> bytes:
    """JSON: the agent's name and metadata (base64), each region's segment and the scratch."""
    doc = {
        "backend": BACKEND,
        "agent": agent,
        "metadata": base64.b64encode(metadata).decode("ascii"),
        "regions": {name: list(seg) for name, seg in segments.items()},
        "scratch": list(scratch),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_descriptor(
    descriptor: bytes, peer: str
) -> tuple[str, bytes, dict[str, Segment], Segment]:
    """(agent name, agent metadata, region segments, scratch segment); TransferError naming
    what is wrong."""
    try:
        doc = json.loads(descriptor)
        if doc["backend"] != BACKEND:
            raise ValueError(f"backend {doc['backend']!r}, expected {BACKEND!r}")
        agent, metadata = str(doc["agent"]), base64.b64decode(doc["metadata"], validate=True)
        segments = {str(k): _segment(v) for k, v in doc["regions"].items()}
        scratch = _segment(doc["scratch"])
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise TransferError(f"kv transfer nixl: bad descriptor from peer {peer!r}: {exc}") from exc
    return agent, metadata, segments, scratch


def _segment(raw: object) -> Segment:
    if not isinstance(raw, list) or len(raw) != 4:
        raise ValueError(f"region segment {raw!r}: expected [addr, nbytes, mem, dev]")
    addr, nbytes, mem, dev = raw
    ints_ok = all(isinstance(v, int) and v >= 0 for v in (addr, nbytes, dev))
    if not ints_ok or nbytes == 0 or mem not in MEM_TYPES:
        raise ValueError(f"region segment {raw!r}: bad address, size, memory type or device")
    return Segment(addr, nbytes, mem, dev)


def ucx_params(threads: int) -> dict[str, str]:
    """The UCX backend's parameters for `threads` posters: a shared worker for each and one
    for the calling thread (0 or 1: no posters, NIXL's defaults)."""
    if not 0 <= threads <= MAX_WRITE_THREADS:
        raise TransferError(
            f"kv transfer nixl: write threads {threads}: expected 0 to {MAX_WRITE_THREADS}"
        )
    return {"num_workers": str(threads + 1)} if threads >= 2 else {}


def _new_agent(name: str, params: Mapping[str, str] | None = None) -> Any:
    nixl = load_nixl()
    config = nixl.agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    try:
        agent = nixl.agent(name, config)
        agent.create_backend("UCX", dict(params or {}))
    except Exception as exc:
        raise TransferError(
            f"kv transfer nixl ({nixl.module}): cannot create agent {name!r} with the UCX "
            f"backend: {exc!r}"
        ) from exc
    if "UCX" not in agent.backends:
        raise TransferError(f"kv transfer nixl ({nixl.module}): the UCX plugin is missing")
    return agent


def _post(agent: Any, peer_agent: str, job: _Job, notif: bytes, what: str) -> Any:
    """Create and post one WRITE; its handle (released here when posting fails or raises)."""
    handle = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs(job.local, job.local_mem),
        agent.get_xfer_descs(job.remote, job.remote_mem),
        peer_agent,
        notif_msg=notif,
    )
    try:
        if agent.transfer(handle) == "ERR":
            raise TransferError(f"kv transfer nixl: {what}: posting failed")
    except BaseException:
        _release(agent, handle)
        raise
    return handle


def _register(agent: Any, segments: Sequence[tuple[str, Segment]]) -> list[Any]:
    registered: list[Any] = []
    for name, seg in segments:
        try:
            registered.append(
                agent.register_memory([(seg.addr, seg.nbytes, seg.dev, name)], seg.mem)
            )
        except Exception as exc:
            _deregister(agent, registered)
            raise TransferError(f"kv transfer nixl: registering region {name!r}: {exc!r}") from exc
    return registered


def _deregister(agent: Any, registered: Sequence[Any]) -> None:
    for descs in registered:
        try:
            agent.deregister_memory(descs)
        except Exception:
            log.warning("kv transfer nixl: deregistering memory", exc_info=True)


def _progress(agent: Any) -> None:
    """Progress the agent's UCX worker a few times (the initiator's notifications, if any, are
    dropped). NOTE: destroying a worker whose failed writes were never progressed trips a UCX
    assertion (`ucs_arbiter_group_is_empty`) and aborts the process."""
    for _ in range(PROGRESS_CALLS):
        try:
            agent.get_new_notifs()
        except Exception:
            log.debug("kv transfer nixl: progress after a failure", exc_info=True)


def _release(agent: Any, handle: Any) -> None:
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # still in flight and not cancellable: NIXL keeps it on its leak list
        log.warning("kv transfer nixl: releasing a transfer handle", exc_info=True)


def _sizes(segments: Mapping[str, Segment]) -> dict[str, int]:
    return {name: seg.nbytes for name, seg in segments.items()}


def _by_mem_types(
    blocks: Sequence[Block], local: Mapping[str, Segment], remote: Mapping[str, Segment]
) -> list[list[Block]]:
    """Blocks grouped by (local, remote) memory type: one transfer each."""
    groups: dict[tuple[str, str], list[Block]] = {}
    for b in blocks:
        groups.setdefault((local[b.region].mem, remote[b.region].mem), []).append(b)
    return list(groups.values())


def _job(
    blocks: Sequence[Block], local: Mapping[str, Segment], remote: Mapping[str, Segment]
) -> _Job:
    """Blocks of one memory-type pair as one transfer."""
    src, dst = local[blocks[0].region], remote[blocks[0].region]
    return _Job(
        src.mem,
        dst.mem,
        _descs([(local[b.region], b.src_offset, b.nbytes) for b in blocks]),
        _descs([(remote[b.region], b.dst_offset, b.nbytes) for b in blocks]),
    )


def _scratch_job(local: Segment, remote: Segment) -> _Job:
    return _Job(local.mem, remote.mem, _descs([(local, 0, 1)]), _descs([(remote, 0, 1)]))


def _descs(spans: Sequence[tuple[Segment, int, int]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Nx3 (address, nbytes, device) rows, as NIXL takes them."""
    rows = [(seg.addr + offset, nbytes, seg.dev) for seg, offset, nbytes in spans]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)
