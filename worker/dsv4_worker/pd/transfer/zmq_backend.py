"""pyzmq transfer backend: the portable fallback (TCP, CPU or CUDA regions through host copies).

A write is one or more messages DEALER -> ROUTER, each a JSON header (session, writer, seq,
part, epoch, tag, last, blocks), the header's MAC under the session's key (`auth.write_mac`),
and one data frame per block, at most `MESSAGE_NBYTES` of data each, so the target scatters
while the rest is on the wire. The target's receiver thread owns its socket: it drops a
message whose MAC is wrong or whose (seq, part) is not above the writer's last one (a replay),
checks the write against its fence (`fence.Fence`: a live grant of the epoch, for that
session, the tag's room, every block in granted units) and only then scatters, under the lock
`revoke` takes: once `revoke` returns, nothing of that grant lands. It records the tag as
landed after the last message, then acks, so a returned write has its tag ready on the target.
A refused write is answered with the reason (the initiator raises it). A failed write leaves
the initiator with a fresh socket (late replies and unsent data of that write are dropped).
NOTE: the data frames are not MACed (a per-byte MAC would halve this backend's throughput): an
attacker that can rewrite TCP payloads between the pods is out of scope (use a mesh with mTLS).
NOTE: an initiator's sockets are created and used by the thread that calls `connect`/`write`.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import zmq

from dsv4_worker.pd.auth import AuthError, SessionKeys, write_mac
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
    region_bytes,
)
from dsv4_worker.pd.transfer.fence import Fence, Grant

log = logging.getLogger(__name__)

BACKEND: Final = "zmq"
MESSAGE_NBYTES: Final = 16 << 20


@dataclass(frozen=True, slots=True)
class Header:
    """One write message: `blocks` are (region, dst_offset, nbytes), one data frame each."""

    session: str
    writer: str  # the initiator (its seq counts its writes)
    seq: int  # the write
    part: int  # the message within the write
    epoch: int  # the grant it writes under
    tag: str
    last: bool
    blocks: tuple[tuple[str, int, int], ...]

    def encode(self) -> bytes:
        doc = {
            "session": self.session,
            "writer": self.writer,
            "seq": self.seq,
            "part": self.part,
            "epoch": self.epoch,
            "tag": self.tag,
            "last": self.last,
            "blocks": self.blocks,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> Header:
        doc = json.loads(raw)
        blocks = tuple((str(r), int(o), int(n)) for r, o, n in doc["blocks"])
        return Header(
            str(doc["session"]),
            str(doc["writer"]),
            int(doc["seq"]),
            int(doc["part"]),
            int(doc["epoch"]),
            str(doc["tag"]),
            bool(doc["last"]),
            blocks,
        )


def split_messages(blocks: Sequence[Block], max_nbytes: int) -> list[list[Block]]:
    """Blocks cut to at most `max_nbytes` each, packed in order into messages of at most
    `max_nbytes` of data; always at least one (possibly empty) message."""
    messages: list[list[Block]] = [[]]
    used = 0
    for b in blocks:
        for start in range(0, b.nbytes, max_nbytes):
            n = min(max_nbytes, b.nbytes - start)
            if used + n > max_nbytes and messages[-1]:
                messages.append([])
                used = 0
            messages[-1].append(Block(b.region, b.src_offset + start, b.dst_offset + start, n))
            used += n
    return messages


class ZmqTarget:
    """Binds a ROUTER on `tcp://{host}:0`; `host` is also the address initiators dial. Serves
    writes authenticated with a session key derived from `keys`' secret."""

    backend: str = BACKEND
    fences: bool = True

    def __init__(self, keys: SessionKeys, host: str = "127.0.0.1") -> None:
        self.host = host
        self._keys = keys
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()
        self._regions: dict[str, torch.Tensor] = {}  # name -> flat uint8 view
        self._fence = Fence(())
        # Held while a message is checked and scattered, and by grant/revoke.
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[int, int]] = {}  # (session, writer) -> (seq, part)
        self._descriptor: bytes | None = None
        self._landed: deque[str] = deque()
        self._on_landed: Callable[[], None] = nothing
        self._thread: threading.Thread | None = None
        self._failed: dict[bytes, tuple[int, str]] = {}  # identity -> (seq, error); thread only

    def register(self, regions: Sequence[Region]) -> None:
        if self._ctx is None or self._descriptor is not None:
            raise TransferError("kv transfer zmq: target is closed or registered")
        sizes = check_regions(regions)
        self._regions = {r.name: region_bytes(r.tensor) for r in regions}
        self._fence = Fence(regions)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://{self.host}:0")
        except zmq.ZMQError as exc:
            sock.close()
            raise TransferError(f"kv transfer zmq: cannot bind on {self.host}: {exc}") from exc
        port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        endpoint = f"tcp://{self.host}:{port}"
        doc = {"backend": BACKEND, "endpoint": endpoint, "regions": sizes}
        self._descriptor = json.dumps(doc, separators=(",", ":")).encode()
        # NOTE: from here on the receiver thread owns `sock` (start() is the memory barrier).
        self._thread = threading.Thread(
            target=self._receive, args=(sock,), name="dsv4-zmq-target", daemon=True
        )
        self._thread.start()

    def descriptor(self) -> bytes:
        if self._descriptor is None:
            raise TransferError("kv transfer zmq: target: register regions first")
        return self._descriptor

    def grant(self, grant: Grant) -> None:
        with self._lock:
            try:
                self._fence.grant(grant)
            except ValueError as exc:
                raise TransferError(f"kv transfer zmq: {exc}") from exc

    def revoke(self, epoch: int) -> None:
        with self._lock:  # waits for a message of it being scattered now
            self._fence.revoke(epoch)

    def poll_landed(self) -> list[str]:
        return drain(self._landed)

    def on_landed(self, callback: Callable[[], None]) -> None:
        self._on_landed = callback

    def expect(self, expecting: bool) -> None:
        del expecting  # the receiver thread wakes on each message

    def close(self) -> None:
        if self._ctx is not None:
            # Interrupts the receiver thread's blocking receive (ETERM), and returns once it
            # closed its socket: the thread needs no timer to notice.
            self._ctx.term()
            self._ctx = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while True:
                frames = sock.recv_multipart(copy=False)  # blocks: `close` interrupts it
                try:
                    with self._lock:
                        self._handle(sock, frames[0].bytes, frames[1:])
                except zmq.ContextTerminated:
                    raise
                except Exception:  # keep serving the other writes; this one times out
                    log.exception("kv transfer zmq: target: handling a message")
        except zmq.ContextTerminated:
            return  # closed
        finally:
            sock.close(linger=0)

    def _handle(
        self, sock: zmq.Socket[bytes], identity: bytes, frames: Sequence[zmq.Frame]
    ) -> None:
        try:
            raw = frames[0].bytes
            header = Header.decode(raw)
            self._authenticate(header, raw, frames[1].bytes)
        except (ValueError, KeyError, TypeError, IndexError, AuthError) as exc:
            log.warning("kv transfer zmq: dropped a message: %s", exc)  # no reply: not a peer
            return
        failed = self._failed.get(identity)
        error = failed[1] if failed is not None and failed[0] == header.seq else None
        if error is None:
            error = self._fence.refuse_tag(header.session, header.epoch, header.tag)
            if error is None:
                blocks = [Block(r, 0, o, n) for r, o, n in header.blocks]
                error = self._fence.refuse_blocks(header.epoch, blocks)
            if error is None:
                try:
                    self._scatter(header, frames[2:])
                except (TransferError, RuntimeError, ValueError) as exc:
                    error = str(exc)
            if error is not None:
                log.warning("kv transfer zmq: refused write %r: %s", header.tag, error)
                self._failed[identity] = (header.seq, error)
        if not header.last:
            return
        self._failed.pop(identity, None)
        if error is None:
            self._sync_cuda()
            self._landed.append(landed_key(header.epoch, header.tag))
            self._on_landed()
        reply = {"seq": header.seq, "error": error}
        sock.send_multipart([identity, json.dumps(reply).encode()])

    def _authenticate(self, header: Header, raw: bytes, mac: bytes) -> None:
        """AuthError unless the header is MACed with its session's key and comes after the
        writer's last message (a replayed message, even an authentic one, is refused)."""
        if not hmac.compare_digest(mac, write_mac(self._keys.key(header.session), raw)):
            raise AuthError(f"write {header.tag!r}: bad MAC for session {header.session}")
        key, at = (header.session, header.writer), (header.seq, header.part)
        if at <= self._last.get(key, (0, -1)):
            raise AuthError(f"write {header.tag!r}: replayed ({at} after {self._last[key]})")
        self._last[key] = at

    def _scatter(self, header: Header, data: Sequence[zmq.Frame]) -> None:
        if len(data) != len(header.blocks):
            raise TransferError(f"{len(header.blocks)} blocks but {len(data)} data frames")
        for (name, dst_offset, nbytes), frame in zip(header.blocks, data, strict=True):
            dst = self._regions.get(name)
            bad_range = dst_offset < 0 or dst is None or dst_offset + nbytes > dst.numel()
            if bad_range or nbytes <= 0 or len(frame.buffer) != nbytes:
                raise TransferError(
                    f"bad block (region {name!r}, dst_offset {dst_offset}, nbytes {nbytes}, "
                    f"{len(frame.buffer)} bytes sent) for tag {header.tag!r}"
                )
            assert dst is not None
            src = torch.frombuffer(frame.buffer, dtype=torch.uint8)
            dst[dst_offset : dst_offset + nbytes].copy_(src)

    def _sync_cuda(self) -> None:
        for dev in {t.device for t in self._regions.values() if t.is_cuda}:
            torch.cuda.synchronize(dev)


@dataclass(slots=True)
class _Peer:
    endpoint: str
    sizes: dict[str, int]
    sock: zmq.Socket[bytes]
    session: Session


class ZmqInitiator:
    """Sends blocks of its registered regions to connected targets, one DEALER per peer."""

    backend: str = BACKEND

    def __init__(self, name: str) -> None:
        self.name = name
        self._writer = f"{name}-{secrets.token_hex(6)}"  # its seq numbers its writes
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()
        self._sources: dict[str, torch.Tensor] = {}  # name -> flat uint8 view
        self._sizes: dict[str, int] = {}
        self._peers: dict[str, _Peer] = {}
        self._seq = 0

    def register(self, regions: Sequence[Region]) -> None:
        if self._ctx is None or self._sizes:
            raise TransferError(f"kv transfer zmq: initiator {self.name} is closed or registered")
        self._sizes = check_regions(regions)
        self._sources = {r.name: region_bytes(r.tensor) for r in regions}

    def connect(self, peer: str, descriptor: bytes, session: Session) -> None:
        if self._ctx is None or not self._sizes:
            raise TransferError(f"kv transfer zmq: initiator {self.name}: register regions first")
        if peer in self._peers:
            raise TransferError(f"kv transfer zmq: peer {peer!r} is already connected")
        endpoint, sizes = decode_descriptor(descriptor, peer)
        check_same_regions(self._sizes, sizes, peer=peer)
        self._peers[peer] = _Peer(endpoint, sizes, self._socket(endpoint), session)

    def write(
        self, peer: str, blocks: Sequence[Block], tag: str, timeout_s: float, *, epoch: int
    ) -> None:
        p = self._peer(peer)
        check_blocks(blocks, self._sizes, p.sizes, peer=peer)
        deadline = time.monotonic() + timeout_s
        self._seq += 1
        what = f"kv transfer zmq: write {tag!r} to peer {peer!r} ({p.endpoint})"
        try:
            messages = split_messages(merge_blocks(blocks), MESSAGE_NBYTES)
            for i, group in enumerate(messages):
                header = Header(
                    p.session.id,
                    self._writer,
                    self._seq,
                    i,
                    epoch,
                    tag,
                    i == len(messages) - 1,
                    _header_blocks(group),
                )
                self._send(p, header, group, deadline)
            error = self._await_reply(p, self._seq, deadline)
        except (zmq.Again, TimeoutError) as exc:
            self._reset(p)
            raise TransferError(f"{what} timed out after {timeout_s:g} s") from exc
        except (zmq.ZMQError, ValueError, AttributeError) as exc:  # incl. a garbled reply
            self._reset(p)
            raise TransferError(f"{what}: {exc!r}") from exc
        if error is not None:
            raise TransferError(f"{what}: refused by the target: {error}")

    def disconnect(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is not None:
            p.sock.close(linger=0)

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"kv transfer zmq: peer {peer!r} is not connected")
        return p

    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def _reset(self, p: _Peer) -> None:
        p.sock.close(linger=0)
        p.sock = self._socket(p.endpoint)

    def _send(self, p: _Peer, header: Header, blocks: Sequence[Block], deadline: float) -> None:
        raw = header.encode()
        frames: list[Any] = [raw, write_mac(p.session.key, raw)]
        frames += [self._source(b) for b in blocks]
        p.sock.setsockopt(zmq.SNDTIMEO, _remaining_ms(deadline))
        p.sock.send_multipart(frames, copy=False)

    def _source(self, b: Block) -> Any:
        """The block's bytes as a buffer: a view of a CPU region, a host copy of a CUDA one."""
        view = self._sources[b.region][b.src_offset : b.src_offset + b.nbytes]
        return (view.cpu() if view.is_cuda else view).numpy()

    def _await_reply(self, p: _Peer, seq: int, deadline: float) -> str | None:
        """The target's error for write `seq`, None when it landed. TimeoutError at `deadline`."""
        while p.sock.poll(_remaining_ms(deadline), zmq.POLLIN):
            reply = json.loads(p.sock.recv())
            if reply.get("seq") == seq:
                error = reply.get("error")
                return None if error is None else str(error)
        raise TimeoutError


def decode_descriptor(descriptor: bytes, peer: str) -> tuple[str, dict[str, int]]:
    """(endpoint, region sizes); TransferError naming what is wrong."""
    try:
        doc = json.loads(descriptor)
        if doc["backend"] != BACKEND:
            raise ValueError(f"backend {doc['backend']!r}, expected {BACKEND!r}")
        endpoint = doc["endpoint"]
        sizes = {str(k): v for k, v in doc["regions"].items()}
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise ValueError(f"endpoint {endpoint!r}")
        if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
            raise ValueError(f"region sizes {sizes}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TransferError(f"kv transfer zmq: bad descriptor from peer {peer!r}: {exc}") from exc
    return endpoint, sizes


def _header_blocks(blocks: Sequence[Block]) -> tuple[tuple[str, int, int], ...]:
    return tuple((b.region, b.dst_offset, b.nbytes) for b in blocks)


def _remaining_ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))
