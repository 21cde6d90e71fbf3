"""Stand-in processes for the supervisor tests (`stand_ins` fixture), and the checks that they
are gone. Every wait has a deadline; teardown SIGKILLs any stand-in a failed test left."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsv4_local.plan import ProcessSpec
from dsv4_local.ports import free_ports

STAND_IN = Path(__file__).with_name("stand_in.py")
DEADLINE_S = 60.0  # generous: a loaded 2-core machine starts Python slowly


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


def is_gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, not yet reaped by its new parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


class StandIns:
    def __init__(self, pid_dir: Path) -> None:
        self.pid_dir = pid_dir
        self._used_ports: set[int] = set()

    def port(self) -> int:
        """A free port no other stand-in of this test was given."""
        (port,) = free_ports(1, frozenset(self._used_ports))
        self._used_ports.add(port)
        return port

    def spec(
        self,
        name: str,
        mode: str,
        *,
        delay_s: float = 0.0,
        grandchild: bool = False,
        exit_after_s: float | None = None,
        wait_for: Path | None = None,
        api_port: int | None = None,
    ) -> ProcessSpec:
        status_port = self.port()
        argv = [sys.executable, str(STAND_IN), "--pid-dir", str(self.pid_dir)]
        argv += ["--name", name, "--mode", mode, "--port", str(status_port)]
        argv += ["--delay-s", str(delay_s)]
        if api_port is not None:
            argv += ["--port", str(api_port)]
        if grandchild:
            argv.append("--grandchild")
        if exit_after_s is not None:
            argv += ["--exit-after-s", str(exit_after_s)]
        if wait_for is not None:
            argv += ["--wait-for", str(wait_for)]
        return ProcessSpec(
            name=name,
            role="router" if name == "router" else "prefill",
            replica=0,
            pp_rank=0,
            argv=tuple(argv),
            env={"PYTHONUNBUFFERED": "1"},
            config_dir=self.pid_dir,
            ready_url=f"http://127.0.0.1:{status_port}/ready",
            status_url=f"http://127.0.0.1:{status_port}/status",
        )

    # The module's helpers, for the tests (a test module cannot import this conftest).
    wait_until = staticmethod(wait_until)
    is_gone = staticmethod(is_gone)

    def pid_file(self, name: str, *, grandchild: bool = False) -> Path:
        return self.pid_dir / (f"{name}.grandchild.pid" if grandchild else f"{name}.pid")

    def wait_pid(self, name: str, *, grandchild: bool = False) -> int:
        path = self.pid_file(name, grandchild=grandchild)
        wait_until(path.exists, f"{path.name}")
        return int(path.read_text())

    def all_pids(self) -> dict[str, int]:
        return {p.name: int(p.read_text()) for p in self.pid_dir.glob("*.pid")}

    def assert_all_gone(self) -> None:
        """Every stand-in and grandchild that wrote a PID file is gone (or soon is: a
        grandchild's zombie waits for its new parent to reap it)."""
        pids = self.all_pids()
        assert pids, "no stand-in wrote its PID file"
        for name, pid in pids.items():
            wait_until(lambda pid=pid: is_gone(pid), f"{name} ({pid}) to be gone", 10.0)


@pytest.fixture
def stand_ins(tmp_path: Path) -> Iterator[StandIns]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    helper = StandIns(pid_dir)
    yield helper
    for pid in helper.all_pids().values():  # a safety net for failed tests, not a check
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
