"""Free loopback ports, found by binding (side effects: sockets).

A port found free may still be taken by another program before the process it is meant for
binds it; the process then fails to start and `dsv4 up` shows its log.
"""

from __future__ import annotations

import contextlib
import socket

from dsv4_local.plan import HOST

__all__ = ["free_ports", "port_is_free"]


def free_ports(count: int, exclude: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """`count` distinct ports that are free on 127.0.0.1 now, none of them in `exclude`.

    Every socket stays bound until all are found, so the kernel cannot return one port twice.
    """
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
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
