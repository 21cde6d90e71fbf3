"""Free loopback ports, found by binding (side effects: sockets).

Ports come from below the kernel's ephemeral range (`ip_local_port_range`): the outgoing
connections of the processes `dsv4 up` starts (gloo, UCX, HTTP clients) take ephemeral ports,
and one of them could otherwise take a port planned for a server that has not bound it yet.
A port found free may still be taken by another program that binds it explicitly; the process
it was meant for then fails to start and `dsv4 up` shows its log.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path
from typing import Final

from dsv4_local.plan import HOST

__all__ = ["free_ports", "port_is_free"]

EPHEMERAL_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW: Final = 32768  # Linux's default; elsewhere the range is not read
LOWEST_PORT: Final = 10000  # well above the registered services most hosts run
MIN_CANDIDATES: Final = 1000  # fewer ports below the ephemeral range: let the kernel choose


def ephemeral_low(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port the kernel hands out for outgoing connections."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_ports(count: int, exclude: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """`count` distinct ports that are free on 127.0.0.1 now, none of them in `exclude`,
    below the ephemeral range when it leaves room.

    Every socket stays bound until all are found, so no port is returned twice.
    """
    low = ephemeral_low()
    candidates = list(range(LOWEST_PORT, low))
    random.SystemRandom().shuffle(candidates)
    below = len(candidates) >= MIN_CANDIDATES
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            if below and candidates:
                try:
                    sock.bind((HOST, candidates.pop()))
                except OSError:
                    continue  # taken: try the next one
            else:
                sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
            if port not in exclude:
                ports.append(port)
    return tuple(ports)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (as servers do: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True
