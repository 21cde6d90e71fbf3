"""Stand-in processes for the supervisor tests (`stand_ins` fixture), and the checks that they
are gone. Every wait has a deadline; teardown SIGKILLs any stand-in a failed test left."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import faultkit
import pytest
from faultkit import is_gone

from dsv4_local.plan import ProcessSpec
from dsv4_local.ports import free_ports

STAND_IN = Path(__file__).with_name("stand_in.py")
DEADLINE_S = 60.0  # generous: a loaded 2-core machine starts Python slowly


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    faultkit.wait_until(condition, what, timeout_s)


class StandIns:
    def __init__(self, pid_dir: Path) -> None:
        self.pid_dir = pid_dir
        self._used_ports: set[int] = set()
        self._replicas = 0

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
        unlive_after_s: float | None = None,
        wait_for: Path | None = None,
        api_port: int | None = None,
        role: str | None = None,
        replica: int = 0,
        pp_rank: int = 0,
    ) -> ProcessSpec:
        """`role`: by default router for the process named router, else prefill (each
        stand-in its own unit unless `role`/`replica` put several in one PP group)."""
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
        if unlive_after_s is not None:
            argv += ["--unlive-after-s", str(unlive_after_s)]
        if wait_for is not None:
            argv += ["--wait-for", str(wait_for)]
        if role is None:
            role = "router" if name == "router" else "prefill"
            replica = replica or self._next_replica()
        return ProcessSpec(
            name=name,
            role=role,
            replica=replica,
            pp_rank=pp_rank,
            argv=tuple(argv),
            env={"PYTHONUNBUFFERED": "1"},
            config_dir=self.pid_dir,
            ready_url=f"http://127.0.0.1:{status_port}/ready",
            status_url=f"http://127.0.0.1:{status_port}/status",
            api_url="" if api_port is None else f"http://127.0.0.1:{api_port}",
            live_url=f"http://127.0.0.1:{status_port}/live",
        )

    def _next_replica(self) -> int:
        self._replicas += 1
        return self._replicas

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
        """The latest PID of every stand-in and grandchild."""
        return {p.name: int(p.read_text()) for p in self.pid_dir.glob("*.pid")}

    def history(self, name: str, *, grandchild: bool = False) -> list[int]:
        """Every PID the stand-in (or its grandchild) `name` ever had, restarts included."""
        path = self.pid_dir / (f"{name}.grandchild.history" if grandchild else f"{name}.history")
        return [int(line) for line in path.read_text().split()] if path.exists() else []

    def every_pid(self) -> dict[str, list[int]]:
        return {
            p.name: [int(line) for line in p.read_text().split()]
            for p in self.pid_dir.glob("*.history")
        }

    def assert_all_gone(self) -> None:
        """Every stand-in and grandchild that ever wrote a PID, restarted ones included, is
        gone (or soon is: a grandchild's zombie waits for its new parent to reap it)."""
        pids = self.every_pid()
        assert pids, "no stand-in wrote its PID file"
        for name, history in pids.items():
            for pid in history:
                wait_until(lambda pid=pid: is_gone(pid), f"{name} ({pid}) to be gone", 10.0)


@pytest.fixture
def stand_ins(tmp_path: Path) -> Iterator[StandIns]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    helper = StandIns(pid_dir)
    yield helper
    for history in helper.every_pid().values():  # a safety net for failed tests, not a check
        for pid in history:
            if _started_here(pid, pid_dir):  # never a PID the system gave to someone else since
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)


def _started_here(pid: int, pid_dir: Path) -> bool:
    """Whether `pid` is still one of this test's stand-ins (its command line names the PID
    directory)."""
    try:
        return str(pid_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
