"""bench/router.py's parts: the stub answers what both routers ask, the load generator reads
JSON and SSE answers whole and times the first event before the end, and the whole bench runs
end to end (ours only), printing its figures, the stub direct faster than through a router."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from benchjson import parse

BENCH = Path(__file__).resolve().parents[1]


@pytest.fixture
def stub() -> Iterator[dict[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "router_stub.py"), "--stream-gap-ms=20"],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_the_stub_answers_what_both_routers_ask(stub: dict[str, int]) -> None:
    from dsv4_common.api.worker_status import parse_worker_status

    for port, role in ((stub["decode_status"], "decode"), (stub["prefill_status"], "prefill")):
        status, body = _get(port, "/status")
        assert status == 200
        assert parse_worker_status(json.loads(body)).role == role
        assert _get(port, "/ready")[0] == 200
    for path in ("/health", "/server_info", "/model_info", "/v1/models"):
        assert _get(stub["api"], path)[0] == 200
    assert _get(stub["api"], "/nowhere")[0] == 404


def test_the_load_generator_reads_json_and_streams_whole(stub: dict[str, int]) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "router_load.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        results = []
        assert proc.stdin is not None and proc.stdout is not None
        for stream in (False, True):
            command = {"port": stub["api"], "path": "/v1/completions", "connections": 4}
            command |= {"stream": stream, "warmup_s": 0.1, "window_s": 0.5}
            proc.stdin.write(json.dumps(command).encode() + b"\n")
            proc.stdin.flush()
            results.append(json.loads(proc.stdout.readline()))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
    plain, streamed = results
    assert plain["bad"] == streamed["bad"] == 0
    assert plain["completed"] > 0 and streamed["completed"] > 0
    # The stub holds the rest of a stream back 20 ms: the first event comes well before it.
    assert streamed["first_event_p50_ms"] < 10 <= streamed["p50_ms"]


@pytest.mark.parametrize("busy_poll_us", [0, 50])
def test_the_bare_relay_passes_answers_through_as_they_came(
    stub: dict[str, int], busy_poll_us: int
) -> None:
    argv = [sys.executable, str(BENCH / "router_relay.py"), str(stub["api"])]
    argv.append(f"--busy-poll-us={busy_poll_us}")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        answers = {}
        for name, at in (("direct", stub["api"]), ("relayed", port)):
            conn = http.client.HTTPConnection("127.0.0.1", at, timeout=10)
            for stream in (False, True, False):  # one kept-alive connection
                body = json.dumps({"model": "stub", "prompt": "x", "stream": stream})
                conn.request("POST", "/v1/completions", body=body)
                resp = conn.getresponse()
                answers[name, stream] = (resp.status, resp.getheader("Content-Type"), resp.read())
            conn.close()
        for stream in (False, True):
            assert answers["relayed", stream] == answers["direct", stream]
            assert answers["relayed", stream][0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_the_bench_runs_end_to_end_and_prints_its_figures() -> None:
    argv = [sys.executable, str(BENCH / "router.py"), "--no-sglang", "--json", "--rounds", "1"]
    argv += ["--window-s", "0.3", "--warmup-s", "0.1", "--connections", "1,8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sglang-router comparison skipped: --no-sglang" in done.stdout
    figures = parse(done.stdout)
    for cell in ("plain.c1", "plain.c8", "stream.c1", "stream.c8"):
        assert figures[f"ours.{cell}.requests_per_s"].value > 0
        assert figures[f"direct.{cell}.requests_per_s"].value > 0
    assert figures["ours.stream.c1.added_first_event_ms"].better == "lower"
    # The stub and the load generator are not the limit: without the hop they go faster.
    direct = figures["direct.plain.c8.requests_per_s"].value
    assert direct > figures["ours.plain.c8.requests_per_s"].value
