"""Which local addresses listen on a TCP port, read from /proc/net/tcp and /proc/net/tcp6
(Linux; no psutil). A socket bound to every interface shows as "0.0.0.0" or "::"."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Final

PROC_TABLES: Final = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
LISTEN: Final = "0A"  # the kernel's TCP_LISTEN state, as /proc/net/tcp prints it


def _address(hex_address: str) -> str:
    """/proc's host-order hex words -> an address string."""
    raw = bytes.fromhex(hex_address)
    # Each 32-bit word is in the host's byte order (little-endian on every machine we run on).
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_addresses(port: int) -> set[str]:
    """Every local address with a socket listening on `port` (IPv4 and IPv6)."""
    found: set[str] = set()
    for table in PROC_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_address, _, hex_port = local.partition(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.add(_address(hex_address))
    return found
