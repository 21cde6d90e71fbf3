"""The supervisor and `launch` on stand-in processes (local/tests/stand_in.py): ready, early
exit with the log's tail, timeout, SIGKILL after the grace period, a stop or a failure half-way
through starting, one --request; and while serving, a process that exits (or is killed) is
restarted with backoff (a PP group as a whole) until its budget is spent, while the others
keep serving. After every test no stand-in and no grandchild, restarted ones included, is
left running."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dsv4_local.plan import LaunchPlan, ProcessSpec
from dsv4_local.probe import is_ready
from dsv4_local.signals import StopSignals
from dsv4_local.supervise import LivenessPolicy, RestartPolicy
from dsv4_local.supervisor import Outcome, Supervisor, tail_lines
from dsv4_local.up import CompletionRequest, launch

if TYPE_CHECKING:
    from conftest import StandIns  # the fixture's type (local/tests/conftest.py)

DEADLINE_S = 60.0
# Fast restarts for the tests: 0.05 s doubling to 0.2 s, at most 2 per unit.
FAST = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, budget=2, window_s=600.0)


def supervisor(specs: list[ProcessSpec], tmp_path: Path, out: io.StringIO, **kw: Any) -> Supervisor:
    return Supervisor(specs, tmp_path / "logs", out=out, poll_interval_s=0.05, **kw)


def test_all_ready_reports_each_process_then_stop_leaves_nothing(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    out = io.StringIO()
    specs = [
        stand_ins.spec("prefill-0", "ready", delay_s=0.3, grandchild=True),
        stand_ins.spec("decode-0", "ready"),
        stand_ins.spec("router", "ready", delay_s=0.1),
    ]
    with supervisor(specs, tmp_path, out) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        assert set(sup.pids) == {"prefill-0", "decode-0", "router"}
        stand_ins.wait_pid("prefill-0", grandchild=True)
    for name in ("prefill-0", "decode-0", "router"):
        assert re.search(rf"^dsv4 up: {name} ready \(\d+\.\d s\)$", out.getvalue(), re.M)
        assert (tmp_path / "logs" / f"{name}.log").read_text().startswith("# dsv4 up: ")
    stand_ins.assert_all_gone()


def test_early_exit_prints_the_log_tail_and_stops_the_others(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    out = io.StringIO()
    never = stand_ins.spec("decode-0", "never", grandchild=True)
    # Fails only once the other one runs and has started its own child (nothing left to chance).
    fail = stand_ins.spec(
        "prefill-0", "fail", wait_for=stand_ins.pid_file("decode-0", grandchild=True)
    )
    with supervisor([never, fail], tmp_path, out) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.FAILED
    text = out.getvalue()
    assert "dsv4 up: prefill-0 exited (exit code 3) before it was ready\n" in text
    assert f"last 30 lines of {tmp_path / 'logs' / 'prefill-0.log'}:" in text
    assert "    line 20\n" in text and "    line 49\n" in text
    assert "    line 19\n" not in text
    assert {"decode-0.pid", "decode-0.grandchild.pid", "prefill-0.pid"} <= set(stand_ins.all_pids())
    stand_ins.assert_all_gone()


def test_timeout_names_what_is_not_ready_and_stops_everything(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    out = io.StringIO()
    specs = [stand_ins.spec("router", "ready"), stand_ins.spec("decode-0", "never")]
    with supervisor(specs, tmp_path, out, progress_interval_s=0.2) as sup:
        assert sup.start()
        started_s = time.monotonic()
        assert sup.wait_ready(2.0) is Outcome.FAILED
        assert time.monotonic() - started_s >= 2.0
        stand_ins.wait_pid("decode-0")
    text = out.getvalue()
    assert re.search(r"^dsv4 up: not ready after 2 s: (router, )?decode-0 \(logs: ", text, re.M)
    assert re.search(r"^dsv4 up: waiting for: .*decode-0 \(\d+ s\)$", text, re.M)
    stand_ins.assert_all_gone()


def test_an_exit_while_serving_restarts_until_the_budget_is_spent(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    """decode-0 exits 0.3 s after each time it is ready: restarted twice (0.05 s, then 0.1 s
    later), then given up on; the router keeps serving with the same process throughout."""
    out = io.StringIO()
    decode = stand_ins.spec("decode-0", "ready", exit_after_s=0.3, role="decode")
    router = stand_ins.spec("router", "ready")
    status = tmp_path / "status.json"
    with supervisor([decode, router], tmp_path, out, policy=FAST, status_path=status) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        router_pid = sup.pids["router"]
        gave_up = sup.serve(until=lambda: "giving up" in out.getvalue())
        assert gave_up is Outcome.DONE
        assert is_ready(router.ready_url) and sup.pids == {"router": router_pid}
        doc = json.loads(status.read_text())
    lines = [line for line in out.getvalue().splitlines() if "decode-0" in line]
    events = [line for line in lines if " ready (" not in line]
    assert events == [
        "dsv4 up: decode-0 exited with code 4; restarting in 0.05 s (restart 1 of 2)",
        f"dsv4 up: decode-0 restarted (restart 1): decode-0 pid {stand_ins.history('decode-0')[1]}",
        events[2],
        "dsv4 up: decode-0 exited with code 4; restarting in 0.1 s (restart 2 of 2)",
        f"dsv4 up: decode-0 restarted (restart 2): decode-0 pid {stand_ins.history('decode-0')[2]}",
        events[5],
        "dsv4 up: decode-0 exited with code 4; giving up on it after 2 restarts in 600 s; "
        "the other processes keep serving",
        f"dsv4 up: decode-0: what it printed is in {tmp_path / 'logs' / 'decode-0.log'}",
    ]
    for i in (2, 5):
        assert re.fullmatch(
            r"dsv4 up: decode-0 ready again \(\d+\.\d s after the exit\)", events[i]
        )
    log = (tmp_path / "logs" / "decode-0.log").read_text()
    assert log.count("# dsv4 up: restart ") == 2  # appended, one marker per restart
    units = {u["name"]: u for u in doc["units"]}
    assert units["decode-0"]["state"] == "gave_up" and units["decode-0"]["restarts"] == 2
    assert units["decode-0"]["last_exit"] == "decode-0 exited with code 4"
    assert units["router"] == {
        "name": "router",
        "members": ["router"],
        "state": "ready",
        "pids": {"router": router_pid},
        "restarts": 0,
        "last_exit": None,
        "restart_in_s": None,
    }
    assert len(stand_ins.history("decode-0")) == 3
    stand_ins.assert_all_gone()


def test_a_process_whose_live_fails_is_restarted_and_one_that_answers_200_is_not(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    """decode-0 keeps running but its /live answers 503 0.3 s after it is ready (a worker
    whose engine thread died): after three 503s in a row it is stopped and restarted as if it
    had exited; the router, live throughout, keeps its process (issue #37 item 1)."""
    out = io.StringIO()
    decode = stand_ins.spec("decode-0", "ready", unlive_after_s=0.3, role="decode")
    router = stand_ins.spec("router", "ready")
    status = tmp_path / "status.json"
    quick = LivenessPolicy(period_s=0.05, failure_threshold=3, timeout_s=2.0)
    with supervisor(
        [decode, router], tmp_path, out, policy=FAST, status_path=status, liveness=quick
    ) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        router_pid = sup.pids["router"]
        first = sup.pids["decode-0"]
        assert sup.serve(until=lambda: "ready again" in out.getvalue()) is Outcome.DONE
        assert sup.pids["router"] == router_pid and sup.pids["decode-0"] != first
        doc = json.loads(status.read_text())
    assert (
        "dsv4 up: decode-0 is not live (its /live answered 503 3 times in a row); "
        "restarting in 0.05 s (restart 1 of 2)"
    ) in out.getvalue()
    units = {u["name"]: u for u in doc["units"]}
    assert units["decode-0"]["restarts"] == 1
    assert units["decode-0"]["last_exit"] == (
        "decode-0 was not live: its /live answered 503 3 times in a row"
    )
    assert units["router"]["restarts"] == 0
    stand_ins.assert_all_gone()


def test_a_killed_pp_stage_restarts_its_whole_group_only(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    """kill -9 of rank 1 of decode-0: both ranks (and their grandchildren) are replaced; the
    prefill group and the router keep their processes."""
    out = io.StringIO()
    specs = [
        stand_ins.spec("prefill-0", "ready", role="prefill"),
        *(
            stand_ins.spec(f"decode-0-rank-{r}", "ready", role="decode", pp_rank=r, grandchild=True)
            for r in range(2)
        ),
        stand_ins.spec("router", "ready"),
    ]
    with supervisor(specs, tmp_path, out, policy=FAST) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        before = sup.pids
        old_grandchild = stand_ins.wait_pid("decode-0-rank-0", grandchild=True)
        os.kill(before["decode-0-rank-1"], signal.SIGKILL)
        outcome = sup.serve(until=lambda: "decode-0 ready again" in out.getvalue())
        assert outcome is Outcome.DONE
        after = sup.pids
        for name in ("prefill-0", "router"):
            assert after[name] == before[name]
        for name in ("decode-0-rank-0", "decode-0-rank-1"):
            assert after[name] != before[name]
            assert stand_ins.is_gone(before[name])
        stand_ins.wait_until(lambda: stand_ins.is_gone(old_grandchild), "the old grandchild")
    assert (
        "dsv4 up: decode-0-rank-1 exited with code -9 (SIGKILL); restarting its PP group "
        "decode-0 (2 processes) in 0.05 s (restart 1 of 2)\n"
    ) in out.getvalue()
    stand_ins.assert_all_gone()


def test_when_every_unit_gave_up_serving_fails(stand_ins: StandIns, tmp_path: Path) -> None:
    out = io.StringIO()
    no_restarts = dataclasses.replace(FAST, budget=0)
    specs = [stand_ins.spec("router", "ready", exit_after_s=0.2)]
    with supervisor(specs, tmp_path, out, policy=no_restarts) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        assert sup.serve() is Outcome.FAILED
    text = out.getvalue()
    assert "dsv4 up: router exited with code 4; giving up on it after 0 restarts" in text
    assert text.endswith("dsv4 up: every process gave up; nothing is left to serve\n")
    stand_ins.assert_all_gone()


def test_a_process_ignoring_sigterm_gets_sigkill_after_the_grace_period(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    out = io.StringIO()
    specs = [stand_ins.spec("router", "stubborn", grandchild=True)]
    with supervisor(specs, tmp_path, out, stop_grace_s=0.5) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        stand_ins.wait_pid("router", grandchild=True)
        stop_started_s = time.monotonic()
    assert time.monotonic() - stop_started_s >= 0.5  # it waited, then killed
    stand_ins.assert_all_gone()


def test_a_second_stop_signal_ends_the_drains_and_the_wait_is_said(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    """A server drains after SIGTERM (here: until a second one). The stop says what it waits
    for; a second Ctrl-C sends every living group a second SIGTERM, which ends its drain (the
    stand-in logs it and exits), long before the grace runs out."""
    out = io.StringIO()
    signals = [1]  # the first stop signal already arrived
    specs = [stand_ins.spec("router", "drainer"), stand_ins.spec("decode-0", "drainer")]
    with supervisor(
        specs, tmp_path, out, stop_grace_s=DEADLINE_S, stop_signals=lambda: signals[0]
    ) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        stopper = threading.Thread(target=sup.stop)
        stopper.start()
        stand_ins.wait_until(lambda: "waiting for router, decode-0" in out.getvalue(), "a note")
        signals[0] = 2  # the second Ctrl-C
        stopper.join(timeout=DEADLINE_S)
        assert not stopper.is_alive()
        logs = [sup.log_path(spec.name).read_text() for spec in specs]
    assert all("SIGTERM 1" in log and "SIGTERM 2" in log for log in logs), logs
    text = out.getvalue()
    waiting = r"dsv4 up: waiting for router, decode-0 to drain and exit \(\d+ s; SIGKILL at 60 s"
    assert re.search(waiting, text), text
    assert "dsv4 up: second signal: router, decode-0 end their drains now (SIGKILL in" in text
    stand_ins.assert_all_gone()


def test_stop_signals_are_counted() -> None:
    with StopSignals() as signals:
        assert (signals.count, signals.requested) == (0, False)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline_s = time.monotonic() + DEADLINE_S
        while signals.count < 2 and time.monotonic() < deadline_s:
            time.sleep(0.01)  # the handlers run in this (the main) thread, between bytecodes
        assert (signals.count, signals.received) == (2, signal.SIGINT)


def test_a_stop_requested_while_starting_starts_nothing_more(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    out = io.StringIO()
    specs = [stand_ins.spec("prefill-0", "never"), stand_ins.spec("decode-0", "never")]
    asked: list[bool] = []

    def stop_requested() -> bool:  # False before the first start, True before the second
        asked.append(True)
        return len(asked) > 1

    with Supervisor(specs, tmp_path / "logs", out=out, stop_requested=stop_requested) as sup:
        assert not sup.start()
        assert set(sup.pids) == {"prefill-0"}
        stand_ins.wait_pid("prefill-0")
        assert sup.wait_ready(DEADLINE_S) is Outcome.STOPPED
    stand_ins.assert_all_gone()


def test_a_start_failing_half_way_stops_what_started(stand_ins: StandIns, tmp_path: Path) -> None:
    started = stand_ins.spec("prefill-0", "never")
    missing = dataclasses.replace(
        started, name="decode-0", argv=(str(tmp_path / "no-such-program"),)
    )
    pids: dict[str, int] = {}
    with (
        pytest.raises(FileNotFoundError),
        supervisor([started, missing], tmp_path, io.StringIO()) as sup,
    ):
        try:
            sup.start()
        finally:
            pids = sup.pids
    assert set(pids) == {"prefill-0"}
    stand_ins.wait_until(lambda: stand_ins.is_gone(pids["prefill-0"]), "prefill-0 to be gone")


def test_launch_reports_a_failed_start_and_exits_1(stand_ins: StandIns, tmp_path: Path) -> None:
    started = stand_ins.spec("prefill-0", "never")
    missing = dataclasses.replace(
        started, name="decode-0", argv=(str(tmp_path / "no-such-program"),)
    )
    plan = LaunchPlan(tmp_path, (started, missing), {}, "http://127.0.0.1:1")
    err = io.StringIO()
    assert launch(plan, timeout_s=DEADLINE_S, out=io.StringIO(), err=err) == 1
    assert "dsv4 up: cannot start a process: [Errno 2] No such file" in err.getvalue()
    assert err.getvalue().endswith("dsv4 up: stopping\ndsv4 up: stopped\n")


def test_request_prints_the_completion_and_the_urls_then_stops(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    api_port = stand_ins.port()
    specs = (
        stand_ins.spec("prefill-0", "ready", grandchild=True),
        stand_ins.spec("router", "ready", api_port=api_port),
    )
    plan = LaunchPlan(tmp_path, specs, {}, f"http://127.0.0.1:{api_port}")
    out, err = io.StringIO(), io.StringIO()
    code = launch(plan, timeout_s=DEADLINE_S, request=CompletionRequest("hi", 4), out=out, err=err)
    assert code == 0, err.getvalue()
    assert out.getvalue() == 'completion: " stand-in text"\n'  # JSON-quoted
    text = err.getvalue()
    assert f"api:    router     http://127.0.0.1:{api_port}  (POST " in text
    for spec in specs:
        assert re.search(rf"^status: {spec.name} +{re.escape(spec.status_url)}$", text, re.M)
    assert f"logs: {tmp_path / 'logs'}" in text
    assert f"supervisor status: {tmp_path / 'status.json'}" in text
    assert "dsv4 up: completion: 3 tokens in " in text
    assert text.endswith("dsv4 up: stopped\n")
    stand_ins.assert_all_gone()


def test_a_failed_request_exits_1_and_stops(stand_ins: StandIns, tmp_path: Path) -> None:
    nobody = stand_ins.port()  # the router's API port answers nothing
    plan = LaunchPlan(
        tmp_path, (stand_ins.spec("router", "ready"),), {}, f"http://127.0.0.1:{nobody}"
    )
    err = io.StringIO()
    code = launch(plan, timeout_s=DEADLINE_S, request=CompletionRequest("hi", 4), err=err)
    assert code == 1
    assert "dsv4 up: request failed: http://127.0.0.1:" in err.getvalue()
    stand_ins.assert_all_gone()


def test_tail_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"{i}\n" for i in range(100)))
    assert tail_lines(log, 3) == ["97", "98", "99"]
    assert tail_lines(tmp_path / "missing.log", 3) == []


def test_a_unit_added_while_serving_gets_ready_and_a_retired_one_drains_and_goes(
    stand_ins: StandIns, tmp_path: Path
) -> None:
    """What the autoscaler asks of the supervisor: start a group while serving (`add_unit`),
    tended like the others until ready; SIGTERM a group (`retire_unit`), which is gone once its
    processes exited, its grandchildren with them."""
    out = io.StringIO()
    specs = [
        stand_ins.spec("decode-0", "ready", role="decode", replica=0),
        stand_ins.spec("router", "ready"),
    ]
    with supervisor(specs, tmp_path, out) as sup:
        assert sup.start()
        assert sup.wait_ready(DEADLINE_S) is Outcome.READY
        added = stand_ins.spec("decode-1", "ready", grandchild=True, role="decode", replica=1)
        sup.add_unit("decode-1", [added])
        assert sup.unit_states()["decode-1"] == "starting"
        deadline = time.monotonic() + DEADLINE_S
        outcome = sup.serve(
            until=lambda: (
                sup.unit_states().get("decode-1") == "ready" or time.monotonic() > deadline
            )
        )
        assert outcome is Outcome.DONE and sup.unit_states()["decode-1"] == "ready"
        stand_ins.wait_pid("decode-1", grandchild=True)
        sup.retire_unit("decode-1")
        assert sup.unit_states()["decode-1"] == "stopping"
        sup.serve(until=lambda: "decode-1" not in sup.unit_states() or time.monotonic() > deadline)
        assert set(sup.unit_states()) == {"decode-0", "router"}
        assert set(sup.pids) == {"decode-0", "router"}
    text = out.getvalue()
    assert re.search(r"^dsv4 up: decode-1 ready \(\d+\.\d s after its start\)$", text, re.M)
    assert "dsv4 up: decode-1 retired: draining" in text and "dsv4 up: decode-1 stopped" in text
    stand_ins.assert_all_gone()
