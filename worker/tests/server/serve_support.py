"""Helpers for tests that run `dsv4 serve` as a process on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from dsv4_local.ports import free_ports

START_TIMEOUT_S = 120.0
WAIT_S = 60.0
# Every hand-made PD process of a test shares this deployment secret (`--pd-secret-file`'s
# environment form): PD roles refuse to start without one.
PD_SECRET = "serve-support-pd-secret-0123456789abcdef0123456789"
ENV = {
    **os.environ,
    "UCX_NET_DEVICES": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONUNBUFFERED": "1",
    "DSV4_PD_SECRET": PD_SECRET,
}


# Every port `free_port` handed out in this test process: never handed out twice.
_HANDED_PORTS: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a process this test starts to bind later.

    It comes from below the kernel's ephemeral range (`dsv4_local.ports`): a port the kernel
    hands out by itself (bind to 0) can be taken, before the server binds it, by any outgoing
    connection on the machine (gloo, UCX, HTTP clients of the other test workers).
    """
    (port,) = free_ports(1, frozenset(_HANDED_PORTS))
    _HANDED_PORTS.add(port)
    return port


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


def serve_argv(*args: str) -> list[str]:
    """`dsv4 serve ARGS` as a subprocess argv."""
    return [sys.executable, "-m", "dsv4_cli", "serve", *args]


@dataclass
class Proc:
    name: str
    port: int
    proc: subprocess.Popen[bytes]

    def get(self, path: str) -> tuple[int, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def used_pages(self) -> int:
        """Used units of every pool, from /metrics."""
        _, text = self.get("/metrics")
        lines = [ln for ln in text.splitlines() if ln.startswith("dsv4_kv_used_pages{")]
        assert lines, f"{self.name}: no dsv4_kv_used_pages in /metrics"
        return sum(int(float(ln.rsplit(" ", 1)[1])) for ln in lines)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class Deployment:
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(
        self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None
    ) -> Proc:
        """`env`: added to ENV for this process."""
        proc = subprocess.Popen(
            argv, env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.procs[name] = Proc(name, port, proc)
        return self.procs[name]

    def ready(self) -> None:
        for p in self.procs.values():
            wait_ready(p.proc, p.port)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs.values():
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def post(port: int, body: dict[str, Any], timeout_s: float = WAIT_S) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode())
    r = c.getresponse()
    raw = r.read().decode()
    if body.get("stream") and r.status == 200:
        events = [
            json.loads(ln[6:])
            for ln in raw.splitlines()
            if ln.startswith("data: ") and ln != "data: [DONE]"
        ]
        return r.status, events
    return r.status, json.loads(raw)


def wait_until(cond: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
