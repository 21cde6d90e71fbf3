"""bench/soak.py and bench/faults.py, and the judging they share with the fault-matrix test
(faultkit): a client's silence is the longest gap with nothing heard after the fault's end;
a request alive at the fault that stays silent past the limit, ends in a kind the fault does
not allow, or answers 502/503 without Retry-After is reported; the soak's bursts and columns;
both benches end to end on tiny-pd in seconds, printing their figures."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import faultkit
import pytest
import soak
from benchjson import parse
from faultkit import Record, Window, judge
from hypothesis import given
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[1]


@given(
    start=st.floats(0, 10),
    gaps=st.lists(st.floats(0.01, 10), max_size=8),
    since=st.floats(0, 30),
)
def test_silence_is_the_longest_gap_after_since(
    start: float, gaps: list[float], since: float
) -> None:
    times = [start]
    for gap in gaps:
        times.append(times[-1] + gap)
    record = Record(start, stream=True, byte_times_s=times[1:-1] if gaps else [])
    record.ended_s = times[-1] if gaps else None
    now = times[-1] + 1.0
    # Every moment something was heard (or now, while in flight), clipped to `since`: the
    # silence is the widest step between neighbours.
    clipped = [max(t, since) for t in [*times, *([] if gaps else [now])]]
    expected = max(b - a for a, b in itertools.pairwise(clipped))
    assert record.longest_silence_s(since, now) == pytest.approx(expected)
    assert record.longest_silence_s(since, now) <= max(gaps, default=now - start) + 1e-9


def _record(started: float, ended: float | None, kind: str, status: int = 200) -> Record:
    r = Record(started, stream=True, byte_times_s=[started + 0.1])
    r.ended_s, r.kind, r.status = ended, kind, status  # type: ignore[assignment]
    return r


def test_judge_reports_silence_bad_kinds_and_missing_retry_after() -> None:
    window = Window(fault_s=10.0, end_s=13.0)  # a 3 s stop
    records = [
        _record(1.0, 2.0, "ok"),  # over before the fault: not judged
        _record(9.0, 14.0, "ok"),  # in flight, answered 1 s after SIGCONT
        _record(9.5, 13.5, "error", 502),  # an error status with no Retry-After
        _record(11.0, 20.0, "timeout", 0),  # silent for 7 s after the fault's end
        _record(12.0, 12.5, "reset", 0),  # a broken connection: not allowed here
        _record(14.0, 15.0, "ok"),  # the first success after the fault
    ]
    verdict = judge(
        records,
        window,
        allowed=faultkit.allowed_kinds(faultkit.FAULTS["decode-0-stop"]),
        silence_limit_s=5.0,
        now_s=30.0,
    )
    assert verdict.in_flight == 2
    assert verdict.error_after_s == pytest.approx(2.5)  # the reset at 12.5
    assert verdict.recovery_after_s == pytest.approx(5.0)
    assert verdict.longest_silence_s == pytest.approx(7.0)
    assert len(verdict.bad) == 4, verdict.bad
    assert any("without Retry-After" in b for b in verdict.bad)
    assert any("nothing heard for 7.0 s" in b for b in verdict.bad)
    router = faultkit.allowed_kinds(faultkit.FAULTS["router-kill"])
    assert {"reset", "refused"} <= router and "reset" not in faultkit.allowed_kinds(
        faultkit.FAULTS["router-stop"]
    )


def test_the_matrix_has_both_faults_of_every_target() -> None:
    targets = {f.target for f in faultkit.FAULTS.values()}
    assert targets == {
        "router",
        "prefill-0",
        "decode-0",
        "prefill-0-rank-1",
        "decode-0-rank-1",
        faultkit.PARENT,
    }
    assert len(faultkit.FAULTS) == 2 * len(targets)


def test_bursts_and_columns() -> None:
    cfg = soak.DriveSettings(
        clients=4,
        burst_clients=8,
        duration_s=100,
        burst_every_s=30,
        burst_s=5,
        max_requests=10,
        max_tokens=4,
        leave_fraction=0.1,
        client_timeout_s=5,
        seed=0,
    )
    assert [soak.active_clients(t, cfg) for t in (0, 14.9, 15, 19.9, 20, 45, 50)] == [
        4,
        4,
        8,
        8,
        4,
        8,
        4,
    ]
    cases = [("ok", 200, "2xx"), ("error", 503, "503"), ("error", 502, "5xx")]
    cases += [("error", 200, "5xx"), ("error", 400, "other"), ("timeout", 0, "timeout")]
    cases += [("left", 200, "left"), ("reset", 0, "other")]
    for kind, status, column in cases:
        assert soak.classify(_record(0, 1, kind, status)) == column, (kind, status)


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout_s, check=False
    )


@pytest.mark.slow
def test_soak_runs_end_to_end(tmp_path: Path) -> None:
    args = ["--duration-s", "10", "--concurrency", "2", "--bucket-s", "5", "--max-tokens", "8"]
    proc = _run([str(BENCH / "soak.py"), *args, "--workdir", str(tmp_path), "--json"], 240)
    assert "KV pages in use once idle" in proc.stdout, proc.stdout + proc.stderr
    figures = parse(proc.stdout)
    assert figures["2xx answers"].value > 0
    assert figures["timeout answers"].value == 0 and figures["5xx answers"].value == 0
    assert "decode-0 RSS growth" in figures
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_faults_runs_one_case(tmp_path: Path) -> None:
    argv = [str(BENCH / "faults.py"), "--case", "decode-0-kill", "--workdir", str(tmp_path)]
    proc = _run([*argv, "--json"], 240)
    assert "decode-0-kill" in proc.stdout, proc.stdout + proc.stderr
    figures = parse(proc.stdout)
    assert figures["decode-0-kill recovery"].value > 0
    assert figures["decode-0-kill silence"].value < 5
    # Exit 1 is the bench reporting a missed speed target (recovery 4.00 s against 3.94 s once
    # in CI): a figure, not this test's business; anything else is a crash.
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert proc.returncode == 0 or "missed:" in proc.stdout, proc.stdout + proc.stderr
