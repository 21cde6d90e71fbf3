"""Peer liveness on the PD control sockets (pure): when a side pings, when a silent peer counts
as lost, what a pong says about the prefill process behind it, and which in-flight requests
end with a lost peer. The agents own the sockets and the clocks; they ask these functions.

    decode  -> prefill  ping   every `interval_s` to every prefill it is connected to
    prefill -> decode   pong   at once, from the control thread: its process instance and
                               whether a handshake from this connection is in force

NOTE: both sides use the same `timeout_s`: decode releases a lost prefill's requests only after
`timeout_s` of silence, and prefill writes nothing to a decode it has not heard from within
`timeout_s` (so a prefill resumed after SIGSTOP does not write into pages decode gave away).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Final, TypeVar

K = TypeVar("K")

HEARTBEAT_INTERVAL_S: Final = 0.5  # decode pings each prefill this often
HEARTBEAT_TIMEOUT_S: Final = 1.5  # silence past this: the peer is lost (3 missed pongs)
RECONNECT_INTERVAL_S: Final = 1.0  # a lost prefill is handshaken again after this


@dataclass(frozen=True, slots=True)
class Heartbeat:
    interval_s: float = HEARTBEAT_INTERVAL_S
    timeout_s: float = HEARTBEAT_TIMEOUT_S
    reconnect_s: float = RECONNECT_INTERVAL_S

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < self.timeout_s:
            raise ValueError(
                f"heartbeat: interval_s {self.interval_s:g} must be above 0 and below "
                f"timeout_s {self.timeout_s:g}"
            )


class PongVerdict(Enum):
    ALIVE = "alive"  # the same prefill process, and it knows this connection
    RESTARTED = "restarted"  # another process answers at the address (new instance)
    FORGOTTEN = "forgotten"  # the same process no longer knows this connection


def ping_due(last_ping_s: float | None, now_s: float, hb: Heartbeat) -> bool:
    return last_ping_s is None or now_s - last_ping_s >= hb.interval_s


def silent(last_heard_s: float, now_s: float, hb: Heartbeat) -> bool:
    """Nothing heard from the peer for longer than the timeout."""
    return now_s - last_heard_s > hb.timeout_s


def silent_peers(last_heard_s: Mapping[K, float], now_s: float, hb: Heartbeat) -> list[K]:
    return [k for k, t in last_heard_s.items() if silent(t, now_s, hb)]


def pong_verdict(handshake_instance: str, pong_instance: str, known: bool) -> PongVerdict:
    """What a pong says about a prefill this decode completed its handshake with."""
    if handshake_instance and pong_instance != handshake_instance:
        return PongVerdict.RESTARTED
    return PongVerdict.ALIVE if known else PongVerdict.FORGOTTEN


def rooms_of(flights: Iterable[tuple[str, str]], peer: str) -> list[str]:
    """The rooms of `(room, peer)` in-flight pairs that went through `peer`: what fails with it."""
    return [room for room, p in flights if p == peer]
