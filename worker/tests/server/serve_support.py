"""Helpers for tests that run `dsv4 serve` as a process on 127.0.0.1."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    proc: subprocess.Popen[bytes], port: int, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Until GET /ready on `port` answers 200; fails with the server's output if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"the server exited ({proc.returncode}): {out}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.1)
