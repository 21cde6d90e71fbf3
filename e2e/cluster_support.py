"""Helpers the opt-in cluster tests share."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator

from dsv4_local.ports import free_ports


@contextlib.contextmanager
def port_forward(kubectl: str, namespace: str, service: str, port: int) -> Iterator[int]:
    """`kubectl port-forward svc/SERVICE` to a free local port, yielded once it accepts."""
    (local,) = free_ports(1)
    proc = subprocess.Popen(
        [kubectl, "port-forward", "-n", namespace, f"svc/{service}", f"{local}:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", local), 1):
                break
            time.sleep(0.2)
        yield local
    finally:
        proc.terminate()
        proc.wait(10)
