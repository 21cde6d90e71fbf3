"""The router as several processes on one port (issue #26 item 3, `processes`): requests
spread over them, `/metrics` counts the whole router from any of them, SIGTERM stops all
(exit 0, none left), a process that dies takes the others down (exit 1), a busy port is exit
2 at once; the shared counters and the default process count."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serve_support import free_port
from test_starvation import stub_process

from dsv4_common.api.http_rules import HttpLimits
from dsv4_router.config import MAX_DEFAULT_PROCESSES, default_processes
from dsv4_router.liveness import LivenessRule
from dsv4_router.metrics import FIRST_BYTE_BUCKETS_S, RouterMetrics, SharedCounts
from dsv4_router.serve import per_process_limits

pytestmark = pytest.mark.slow
DEADLINE_S: Final = 30.0
BODY: Final = json.dumps({"prompt": "hi", "max_tokens": 2})
RULE: Final = LivenessRule(misses=3, grace_s=10.0)


def _call(port: int, method: str, path: str, body: str | None = None) -> tuple[int, bytes]:
    """One request on a connection of its own (the kernel picks the process per connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _wait(what: str, condition: object) -> None:
    deadline_s = time.monotonic() + DEADLINE_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline_s, f"timed out waiting: {what}"
        time.sleep(0.05)


def _ready_everywhere(port: int) -> bool:
    """/ready is 200 on 8 fresh connections in a row (every process polled the stubs)."""
    try:
        return all(_call(port, "GET", "/ready")[0] == 200 for _ in range(8))
    except OSError:
        return False


def _ok_total(port: int) -> float:
    _, text = _call(port, "GET", "/metrics")
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == "dsv4_router_requests_total" and sample.labels == {"outcome": "ok"}:
                return sample.value
    raise AssertionError("no dsv4_router_requests_total{outcome=ok}")


@contextmanager
def _router(
    processes: int, decode_mode: str = "json"
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A router of `processes` processes (its own process group) in front of stub workers."""
    with ExitStack() as stack:
        _, prefill = stack.enter_context(stub_process("prefill"))
        _, decode = stack.enter_context(stub_process("decode", decode_mode))
        port = free_port()
        argv = [sys.executable, "-m", "dsv4_cli", "serve", "--role", "router"]
        argv += ["--port", str(port), "--router-processes", str(processes)]
        for role, inst in (("prefill", prefill), ("decode", decode)):
            argv += [
                "--instance",
                f"{role}={inst.host}:{inst.http_port}:{inst.status_port}:{inst.kv_port}",
            ]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc, port
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=DEADLINE_S)


def test_requests_spread_over_the_processes_and_metrics_count_them_all() -> None:
    with _router(2) as (proc, port):
        _wait("every process ready", lambda: _ready_everywhere(port))
        children = _children(proc.pid)
        assert len(children) == 2
        # The kernel spreads connections over the processes: both answer /status.
        seen = set()
        for _ in range(64):
            _, doc = _call(port, "GET", "/status")
            seen.add(json.loads(doc)["process"])
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        assert json.loads(doc)["settings"]["processes"] == 2
        for _ in range(60):
            status, _ = _call(port, "POST", "/v1/completions", BODY)
            assert status == 200
        # Any process answers the scrape, and each says the whole router's count.
        assert {_ok_total(port) for _ in range(8)} == {60.0}
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0, out
        assert f"router listening on http://127.0.0.1:{port}" in out.decode()
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)


def test_a_process_that_dies_takes_the_router_down_with_exit_1() -> None:
    with _router(2) as (proc, port):
        _wait("every process ready", lambda: _ready_everywhere(port))
        children = _children(proc.pid)
        os.kill(children[0], signal.SIGKILL)
        proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 1
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)


def test_a_signal_to_the_whole_group_counts_once_the_second_ends_the_drain() -> None:
    """`dsv4 up` and a terminal signal the router's process group: the processes must see one
    stop (drain: the open stream stays, /ready says draining), not a second that cuts it."""
    with _router(2, decode_mode="hang_mid") as (proc, port):
        _wait("every process ready", lambda: _ready_everywhere(port))
        stream = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
        stream.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while b"Hel" not in got:  # the first event: the stream is open
            got += stream.recv(65536)
        os.killpg(proc.pid, signal.SIGTERM)
        _wait("both processes draining", lambda: _draining_everywhere(port))
        assert proc.poll() is None  # the open stream holds the drain
        stream.settimeout(0.5)
        with pytest.raises(TimeoutError):
            stream.recv(65536)  # not cut: nothing more arrives
        os.killpg(proc.pid, signal.SIGTERM)  # a second: the drain ends at once
        stream.settimeout(DEADLINE_S)
        rest = b""
        while b"[DONE]" not in rest:
            chunk = stream.recv(65536)
            assert chunk, rest
            rest += chunk
        assert b"error" in rest
        stream.close()
        proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0


def _draining_everywhere(port: int) -> bool:
    try:
        answers = [_call(port, "GET", "/ready") for _ in range(8)]
    except OSError:
        return False
    return all(status == 503 and b"draining" in body for status, body in answers)


def test_a_parent_killed_alone_leaves_no_process_holding_the_port() -> None:
    with _router(2) as (proc, port):
        _wait("every process ready", lambda: _ready_everywhere(port))
        children = _children(proc.pid)
        proc.kill()
        proc.communicate(timeout=DEADLINE_S)
        _wait(
            "the processes end with their parent",
            lambda: not any(Path(f"/proc/{pid}").exists() for pid in children),
        )


def test_a_busy_port_is_exit_2_before_any_process_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "dsv4_cli", "serve", "--role", "router"]
        argv += ["--port", str(port), "--router-processes", "3"]
        argv += ["--instance", "prefill=127.0.0.1:1:2:3", "--instance", "decode=127.0.0.1:4:5:6"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 2
    assert f"--port: cannot listen on 127.0.0.1:{port}" in done.stderr


def _write_row(counts: SharedCounts) -> None:
    metrics = RouterMetrics(lambda: ([], 0.0), RULE, counts=counts, process=1)
    for _ in range(3):
        metrics.count("ok")
    metrics.retries.inc()
    metrics.first_byte_s.observe(0.2)


def test_counts_written_by_a_forked_process_are_in_every_scrape() -> None:
    counts = SharedCounts(2)
    here = RouterMetrics(lambda: ([], 0.0), RULE, counts=counts, process=0)
    here.count("ok")
    child = multiprocessing.get_context("fork").Process(target=_write_row, args=(counts,))
    child.start()
    child.join(DEADLINE_S)
    assert child.exitcode == 0
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(here.render().decode())
        for s in f.samples
    }
    assert samples[("dsv4_router_requests_total", (("outcome", "ok"),))] == 4
    assert samples[("dsv4_router_retries_total", ())] == 1
    assert samples[("dsv4_router_upstream_first_byte_seconds_count", ())] == 1


def _note_ready(counts: SharedCounts) -> None:
    RouterMetrics(lambda: ([], 0.0), RULE, counts=counts, process=1).note_ready(True)


def test_ready_only_once_every_process_saw_a_pair() -> None:
    """/ready's shared rule: a connection may land on any process, so one process's view is
    not enough (the first request after /ready 200 could meet a process yet to see a pair)."""
    counts = SharedCounts(2)
    here = RouterMetrics(lambda: ([], 0.0), RULE, counts=counts, process=0)
    assert not here.every_process_ready()  # no round yet anywhere
    here.note_ready(True)
    assert not here.every_process_ready()  # process 1 has not seen a pair
    child = multiprocessing.get_context("fork").Process(target=_note_ready, args=(counts,))
    child.start()
    child.join(DEADLINE_S)
    assert child.exitcode == 0
    assert here.every_process_ready()
    here.note_ready(False)
    assert not here.every_process_ready()
    assert sum(counts.totals()) == 0  # readiness is not a counter


@given(st.lists(st.floats(0, 1000, allow_nan=False), max_size=30))
def test_the_first_byte_histogram_renders_as_prometheus_own(values: list[float]) -> None:
    ours = RouterMetrics(lambda: ([], 0.0), RULE)
    registry = CollectorRegistry()
    theirs = Histogram(
        "dsv4_router_upstream_first_byte_seconds",
        "From sending a request to a decode instance to its response headers",
        buckets=FIRST_BYTE_BUCKETS_S,
        registry=registry,
    )
    for value in values:
        ours.first_byte_s.observe(value)
        theirs.observe(value)

    def histogram(text: bytes) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for f in text_string_to_metric_families(text.decode())
            if f.name == "dsv4_router_upstream_first_byte_seconds"
            for s in f.samples
            if not s.name.endswith("_created")
        }

    got, want = histogram(ours.render()), histogram(generate_latest(registry))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value)


@given(st.floats(0.01, 512, allow_nan=False))
def test_default_processes_is_one_per_whole_cpu_within_bounds(cpus: float) -> None:
    got = default_processes(cpus)
    assert 1 <= got <= MAX_DEFAULT_PROCESSES
    assert got == min(MAX_DEFAULT_PROCESSES, max(1, int(cpus)))


@given(st.integers(1, 10_000), st.integers(1, 8))
def test_a_set_connection_bound_is_shared_out_among_the_processes(bound: int, count: int) -> None:
    share = per_process_limits(HttpLimits(max_connections=bound), count).max_connections
    assert share is not None and share * count >= bound > (share - 1) * count
    assert per_process_limits(HttpLimits(), count).max_connections is None
