"""Peer liveness on the PD control sockets (pure): when a side pings, when a silent peer counts
as lost, what a pong says about the prefill process behind it, and which in-flight requests
end with a lost peer. The agents own the sockets and the clocks; they ask these functions.

    decode  -> prefill  ping   every `interval_s` to every prefill it is connected to, echoing
                               the number of the last pong it got
    prefill -> decode   pong   at once, from the control thread: its process instance, whether
                               a handshake from this connection is in force, its number

A prefill measures a decode's liveness on its own clock (`Echoes`): a session is fresh while
the last pong its decode echoed was sent within `timeout_s`. A ping that waited in a socket
queue while the prefill was stopped (SIGSTOP) echoes a pong sent before the stop: it is not
fresh, however late it is read.

NOTE: both sides use the same `timeout_s`. Decode gives up on a prefill after `timeout_s` of
hearing nothing from it, so after it last got a pong; prefill writes to a decode only while
the last echoed pong is at most `timeout_s` old (`fresh`), so only before decode can have
given up: echoed pong sent at P <= received by decode < decode gives up at > P + timeout_s.
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


class Echoes:
    """A prefill's pongs to one session (from its control thread) and the freshest one its
    decode echoed: when that was sent, on the prefill's clock (`fresh_s`)."""

    KEPT = 64  # pong send times remembered (a ping echoes one of the last few)

    def __init__(self, welcome_s: float) -> None:
        self.fresh_s = welcome_s  # the welcome counts as pong 0
        self.number = 0
        self._sent: dict[int, float] = {0: welcome_s}

    def pong(self, now_s: float) -> int:
        """A pong goes out now; its number."""
        self.number += 1
        self._sent[self.number] = now_s
        if len(self._sent) > self.KEPT:
            del self._sent[min(self._sent)]
        return self.number

    def echoed(self, number: int) -> None:
        """A ping echoed pong `number` (an unknown number changes nothing)."""
        sent = self._sent.get(number)
        if sent is not None and sent > self.fresh_s:
            self.fresh_s = sent


def fresh(fresh_s: float, now_s: float, hb: Heartbeat) -> bool:
    """The prefill may write to the session: its decode cannot have given up on it yet."""
    return now_s - fresh_s <= hb.timeout_s


def gone(fresh_s: float, now_s: float, hb: Heartbeat) -> bool:
    """The prefill drops the session: past `fresh` by one more ping interval (a ping that is
    a little late pauses writes; only a longer silence ends the session's transfers)."""
    return now_s - fresh_s > hb.timeout_s + hb.interval_s


def gone_after_s(fresh_s: float, hb: Heartbeat) -> float:
    """The instant after which `gone` holds (while `fresh_s` stays: a pong echoed later only
    moves it later), to within rounding: a thread that sleeps until it and finds `gone` not
    quite true yet looks again a moment later (`engine.wake.MIN_WAIT_S`)."""
    return fresh_s + hb.timeout_s + hb.interval_s


def ping_due(last_ping_s: float | None, now_s: float, hb: Heartbeat) -> bool:
    return last_ping_s is None or now_s - last_ping_s >= hb.interval_s


def next_ping_s(last_ping_s: float | None, now_s: float, hb: Heartbeat) -> float:
    """When `ping_due` next holds (at or before `now_s`: it does now), to within rounding."""
    return now_s if last_ping_s is None else last_ping_s + hb.interval_s


def silent(last_heard_s: float, now_s: float, hb: Heartbeat) -> bool:
    """Nothing heard from the peer for longer than the timeout."""
    return now_s - last_heard_s > hb.timeout_s


def silent_after_s(last_heard_s: float, hb: Heartbeat) -> float:
    """The instant after which `silent` holds (unless the peer is heard from again), to
    within rounding."""
    return last_heard_s + hb.timeout_s


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
