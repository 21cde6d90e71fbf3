"""PD authentication with the deployment's secret (`dsv4_common.api.pd_secret`): the control
handshake's proofs, session keys, sealed control messages, and the MACs that bind every KV
write to its session. Pure (stdlib hmac and secrets; no sockets).

    decode -> prefill   hello      protocol, a fresh nonce (nothing secret)
    prefill -> decode   challenge  a session id the prefill assigns (its instance, then random),
                                   and proof = MAC(secret, nonce | session | instance): decode
                                   sends its transfer descriptor only to a prefill that proves
                                   it holds the secret and answers this nonce
    decode -> prefill   join       sealed with the session's key: the decode holds the secret
                                   and answers this session (fresh: a replayed hello or join
                                   meets another session id, or an established one, and fails)
    then every message both ways is sealed: seq | MAC(key, direction | seq | type | body);
    a seq not above the last one seen from that side is a replay and is refused

The session key is MAC(secret, session id): every holder of the secret (the deployment's own
pods: the decode's PP stages check writes with it) can derive it, nobody else can. The key
binds messages and writes to the handshake that made the session; the secret is the trust
root (a holder of it is trusted as a member of the deployment).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Final

from dsv4_common.api.pd_secret import PDSecret

MAC_BYTES: Final = 16
SEQ_BYTES: Final = 8
_SESSION_DOMAIN: Final = b"dsv4-pd-session-v1\0"
_CHALLENGE_DOMAIN: Final = b"dsv4-pd-challenge-v1\0"
TO_PREFILL: Final = b"d>p"  # the direction of a sealed control message
TO_DECODE: Final = b"p>d"
MAX_KEYS: Final = 4096  # cached session keys (a session lives as long as a connection)


class AuthError(ValueError):
    """A message or write that is not authentic (bad or missing MAC, a replay)."""


def new_nonce() -> str:
    return secrets.token_hex(16)


def new_session_id(instance: str) -> str:
    """A session id, assigned by the prefill that accepts the connection: its instance first,
    so a decode knows which process a session belongs to."""
    return f"{instance}.{secrets.token_hex(12)}"


def instance_of(session: str) -> str:
    return session.partition(".")[0]


def mac(key: bytes, *parts: bytes) -> bytes:
    """MAC_BYTES of HMAC-SHA256 over the parts (length-prefixed: no two part lists collide)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()[:MAC_BYTES]


@dataclass(slots=True)
class SessionKeys:
    """Each session's key from the deployment secret, derived once (a bounded cache)."""

    secret: PDSecret
    _cache: dict[str, bytes] = field(default_factory=dict)

    def key(self, session: str) -> bytes:
        key = self._cache.get(session)
        if key is None:
            if len(self._cache) >= MAX_KEYS:
                self._cache.clear()
            key = hmac.new(
                self.secret.key, _SESSION_DOMAIN + session.encode(), hashlib.sha256
            ).digest()
            self._cache[session] = key
        return key

    def challenge_proof(self, nonce: str, session: str, instance: str) -> str:
        return mac(
            self.secret.key, _CHALLENGE_DOMAIN, *(s.encode() for s in (nonce, session, instance))
        ).hex()

    def check_challenge(self, nonce: str, session: str, instance: str, proof: str) -> bool:
        """The prefill's challenge answers `nonce` and it holds the secret (constant time)."""
        want = self.challenge_proof(nonce, session, instance)
        return hmac.compare_digest(want, proof) and instance_of(session) == instance


class Sealer:
    """Seals one side's control messages of a session: a third frame, seq | MAC."""

    def __init__(self, key: bytes, direction: bytes) -> None:
        self._key, self._direction, self.seq = key, direction, 0

    def seal(self, frames: list[bytes]) -> list[bytes]:
        self.seq += 1
        seq = self.seq.to_bytes(SEQ_BYTES, "big")
        return [*frames, seq + mac(self._key, self._direction, seq, *frames)]


class Opener:
    """Checks the other side's sealed messages of a session; refuses replays."""

    def __init__(self, key: bytes, direction: bytes) -> None:
        self._key, self._direction, self.last_seq = key, direction, 0

    def open(self, frames: list[bytes]) -> list[bytes]:
        """The message's two frames; AuthError when the seal is missing, wrong or replayed."""
        if len(frames) != 3 or len(frames[2]) != SEQ_BYTES + MAC_BYTES:
            raise AuthError("control message: not sealed with the session's key")
        seal = frames[2]
        seq = seal[:SEQ_BYTES]
        if not hmac.compare_digest(
            seal[SEQ_BYTES:], mac(self._key, self._direction, seq, *frames[:2])
        ):
            raise AuthError("control message: bad MAC (not this session's key)")
        n = int.from_bytes(seq, "big")
        if n <= self.last_seq:
            raise AuthError(f"control message: replayed (seq {n}, last {self.last_seq})")
        self.last_seq = n
        return frames[:2]


def write_mac(key: bytes, header: bytes) -> bytes:
    """The MAC of a zmq write message's header (session, writer, seq, epoch, tag, blocks)."""
    return mac(key, b"write", header)


def notification(key: bytes, session: str, epoch: int, tag: str) -> bytes:
    """A NIXL write's notification: `session|epoch|tag|mac` (the target reports the tag
    landed only for a live grant and a good MAC)."""
    body = f"{session}|{epoch}|{tag}"
    return f"{body}|{mac(key, b'notif', body.encode()).hex()}".encode()


def read_notification(keys: SessionKeys, raw: bytes) -> tuple[str, int, str]:
    """(session, epoch, tag) of an authentic notification; AuthError otherwise."""
    try:
        text = raw.decode()
        body, _, sig = text.rpartition("|")
        session, epoch, tag = body.split("|", 2)
        epoch_n = int(epoch)
    except (UnicodeDecodeError, ValueError) as exc:
        raise AuthError(f"notification: malformed ({exc})") from exc
    want = mac(keys.key(session), b"notif", body.encode()).hex()
    if not hmac.compare_digest(want, sig):
        raise AuthError(f"notification for session {session}: bad MAC")
    return session, epoch_n, tag
