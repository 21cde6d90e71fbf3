"""Taking a listening port before a process does its slow start-up: `bind` (a busy port or a
bad host fails at once, naming the flag) and the open-file limit. Sockets only, no aiohttp:
`dsv4 serve` binds here before it imports torch or aiohttp (`http_listen` serves on them)."""

from __future__ import annotations

import contextlib
import resource
import socket
from typing import Final

__all__ = ["LISTEN_BACKLOG", "ListenError", "bind", "raise_fd_limit"]

LISTEN_BACKLOG: Final = 1024


class ListenError(OSError):
    """A host or port that cannot be listened on; the message names the flag."""


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one (no privilege needed); the new soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def bind(
    host: str, port: int, flag: str = "--port", *, reuse_port: bool = False
) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to, all on one port (`port` 0: a
    free one). ListenError names `--host` or `flag`. `reuse_port`: SO_REUSEPORT, so that
    more sockets can be bound to the same port (the kernel spreads connections over them)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ListenError(f"--host: cannot listen on {host!r}: {reason}") from exc
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the same free port on every address
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ListenError(f"{flag}: cannot listen on {where}: {exc.strerror or exc}") from exc
    return sockets
