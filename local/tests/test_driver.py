"""Signals to a `dsv4 up`-like driver process (local/tests/driver.py running `launch` on
stand-ins): SIGTERM while serving and SIGINT while waiting stop every child and grandchild and
exit 0, also after a restart (the restarted processes and the ones they replaced); a driver
killed outright still takes its children along (Linux)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dsv4_local.plan import ProcessSpec

if TYPE_CHECKING:
    from conftest import StandIns  # the fixture's type (local/tests/conftest.py)

DRIVER = Path(__file__).with_name("driver.py")
DEADLINE_S = 60.0


@dataclass(frozen=True)
class Driver:
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()


@contextlib.contextmanager
def driver(
    tmp_path: Path,
    specs: list[ProcessSpec],
    router_url: str = "http://127.0.0.1:1",
    policy: dict[str, float] | None = None,
) -> Iterator[Driver]:
    plan = tmp_path / "plan.json"
    processes = [{**dataclasses.asdict(s), "config_dir": str(s.config_dir)} for s in specs]
    doc: dict[str, object] = {
        "workdir": str(tmp_path),
        "router_url": router_url,
        "timeout_s": DEADLINE_S,
        "stop_grace_s": 10.0,
        "processes": processes,
    }
    if policy is not None:
        doc["policy"] = policy
    plan.write_text(json.dumps(doc))
    stdout_path, stderr_path = tmp_path / "driver.out", tmp_path / "driver.err"
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        popen = subprocess.Popen([sys.executable, str(DRIVER), str(plan)], stdout=out, stderr=err)
    try:
        yield Driver(popen, stdout_path, stderr_path)
    finally:
        if popen.poll() is None:
            popen.kill()
        popen.wait()


def test_sigterm_while_serving_stops_every_child(stand_ins: StandIns, tmp_path: Path) -> None:
    api_port = stand_ins.port()
    specs = [
        stand_ins.spec("prefill-0", "ready", grandchild=True),
        stand_ins.spec("decode-0", "ready", delay_s=0.2),
        stand_ins.spec("router", "ready", api_port=api_port),
    ]
    with driver(tmp_path, specs, f"http://127.0.0.1:{api_port}") as d:
        stand_ins.wait_until(lambda: "logs: " in d.stdout(), "the ready summary")
        stand_ins.wait_pid("prefill-0", grandchild=True)
        d.popen.send_signal(signal.SIGTERM)
        assert d.popen.wait(timeout=DEADLINE_S) == 0, d.stderr()
    out = d.stdout()
    assert f"api:    router     http://127.0.0.1:{api_port}  (POST " in out
    for spec in specs:
        assert re.search(rf"^status: {spec.name} +{re.escape(spec.status_url)}$", out, re.M)
    assert f"logs: {tmp_path / 'logs'}\n" in out
    assert d.stderr().endswith("dsv4 up: stopping (SIGTERM)\ndsv4 up: stopped\n")
    assert len(stand_ins.all_pids()) == 4
    stand_ins.assert_all_gone()


def test_sigint_while_waiting_stops_every_child(stand_ins: StandIns, tmp_path: Path) -> None:
    specs = [
        stand_ins.spec("prefill-0", "never", grandchild=True),
        stand_ins.spec("router", "never", grandchild=True),
    ]
    with driver(tmp_path, specs) as d:
        for name in ("prefill-0", "router"):
            stand_ins.wait_pid(name, grandchild=True)
        d.popen.send_signal(signal.SIGINT)
        assert d.popen.wait(timeout=DEADLINE_S) == 0, d.stderr()
    assert "dsv4 up: ready" not in d.stderr()
    assert d.stderr().endswith("dsv4 up: stopping (SIGINT)\ndsv4 up: stopped\n")
    assert len(stand_ins.all_pids()) == 4
    stand_ins.assert_all_gone()


def test_sigterm_after_a_restart_leaves_no_process(stand_ins: StandIns, tmp_path: Path) -> None:
    """kill -9 of decode-0 (which started a grandchild): restarted; then SIGTERM to the
    driver stops the new decode-0, its new grandchild and the others; the killed one's
    grandchild went with the restart. Checked by every PID each stand-in ever had."""
    specs = [
        stand_ins.spec("decode-0", "ready", role="decode", grandchild=True),
        stand_ins.spec("router", "ready"),
    ]
    fast = {"initial_backoff_s": 0.05, "max_backoff_s": 0.1, "budget": 2, "window_s": 600.0}
    with driver(tmp_path, specs, policy=fast) as d:
        stand_ins.wait_until(lambda: "logs: " in d.stdout(), "the ready summary")
        first = stand_ins.wait_pid("decode-0")
        stand_ins.wait_pid("decode-0", grandchild=True)
        os.kill(first, signal.SIGKILL)
        stand_ins.wait_until(lambda: "decode-0 ready again" in d.stderr(), "the restart")
        stand_ins.wait_until(
            lambda: len(stand_ins.history("decode-0", grandchild=True)) == 2,
            "the restarted decode-0's grandchild",
        )
        assert len(stand_ins.history("decode-0")) == 2
        d.popen.send_signal(signal.SIGTERM)
        assert d.popen.wait(timeout=DEADLINE_S) == 0, d.stderr()
    assert "dsv4 up: decode-0 exited with code -9 (SIGKILL); restarting in 0.05 s" in d.stderr()
    assert d.stderr().endswith("dsv4 up: stopping (SIGTERM)\ndsv4 up: stopped\n")
    stand_ins.assert_all_gone()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_driver_takes_its_children_along(stand_ins: StandIns, tmp_path: Path) -> None:
    # No grandchildren here: a child that dies of SIGTERM stops only itself (its children
    # are the worker's own business once dsv4 up is gone).
    specs = [stand_ins.spec("prefill-0", "ready"), stand_ins.spec("router", "ready")]
    with driver(tmp_path, specs) as d:
        stand_ins.wait_until(lambda: "logs: " in d.stdout(), "the ready summary")
        d.popen.kill()
        d.popen.wait(timeout=DEADLINE_S)
    assert len(stand_ins.all_pids()) == 2
    stand_ins.assert_all_gone()
