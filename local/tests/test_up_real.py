"""`dsv4 up` with the real workers and router: the README's main job end to end (plan, start
router + prefill + decode from the rendered configs, one completion through the router, stop),
SIGTERM while serving stops every process (no orphans), and a second Ctrl-C ends the
drains of a stream in flight."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "crds" / "samples"
SAMPLE = SAMPLES / "tiny-pd.yaml"
UP = [sys.executable, "-m", "dsv4_cli", "up", str(SAMPLE), "--port", "0"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("sample", "workers"),
    [
        ("tiny-pd.yaml", ("prefill-0", "decode-0")),
        # prefill PP=2: each stage sends its own layers to the one decode stage
        ("tiny-cpu.yaml", ("prefill-0-rank-0", "prefill-0-rank-1", "decode-0")),
        # prefill PP=2 and decode PP=2: stage i sends to stage i
        (
            "tiny-pp.yaml",
            ("prefill-0-rank-0", "prefill-0-rank-1", "decode-0-rank-0", "decode-0-rank-1"),
        ),
    ],
)
def test_request_through_a_local_pd_deployment(
    tmp_path: Path, sample: str, workers: tuple[str, ...]
) -> None:
    up = [sys.executable, "-m", "dsv4_cli", "up", str(SAMPLES / sample), "--port", "0"]
    done = subprocess.run(
        [*up, "--workdir", str(tmp_path), "--request", "Hello", "--max-tokens", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith('completion: "') and done.stdout.strip().endswith('"')
    assert "completion: 5 tokens" in done.stderr
    for name in (*workers, "router"):
        assert f"{name} ready" in done.stderr
        assert (tmp_path / "logs" / f"{name}.log").exists()
    decode = next(w for w in workers if w.startswith("decode"))  # its serving rank
    assert "KV transfer handshake with prefill" in (tmp_path / "logs" / f"{decode}.log").read_text()


def start_serving(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    """`dsv4 up` in `workdir`, read until it serves (its Ctrl-C line): the process and what it
    printed so far."""
    up = subprocess.Popen(
        [*UP, "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    seen = ""
    deadline = time.monotonic() + 300
    while "Ctrl-C stops every process" not in seen:
        assert time.monotonic() < deadline and up.poll() is None, seen
        seen += up.stdout.readline()
    return up, seen


def test_sigterm_stops_every_process(tmp_path: Path) -> None:
    up, seen = start_serving(tmp_path)
    assert up.stdout is not None
    pids = [int(p) for p in re.findall(r"pid (\d+)", seen)]
    children = subprocess.run(
        ["pgrep", "-P", str(up.pid)], capture_output=True, text=True
    ).stdout.split()
    pids += [int(p) for p in children]
    assert len(pids) >= 3, seen
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=60) == 0
    for pid in pids:
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived dsv4 up"
            time.sleep(0.05)


def test_a_second_ctrl_c_with_a_stream_open_ends_the_drains(tmp_path: Path) -> None:
    """Ctrl-C with a long stream open: the workers drain (up to 20 s) and `dsv4 up` says what
    it waits for; a second Ctrl-C ends the drains: the stream gets its error event and
    `[DONE]` (it was cut short, not finished) and everything exits."""
    up, seen = start_serving(tmp_path)
    assert up.stdout is not None
    found = re.search(r"^api: +router +http://127\.0\.0\.1:(\d+)", seen, re.M)
    assert found, seen
    # Long: 8 choices of 2000 tokens each, EOS ignored (tiny's context is 2048).
    body = json.dumps(
        {"prompt": "Hello", "max_tokens": 2000, "n": 8, "stream": True, "ignore_eos": True}
    )
    stream = http.client.HTTPConnection("127.0.0.1", int(found.group(1)), timeout=120)
    stream.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = stream.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # in flight
    up.send_signal(signal.SIGINT)
    while "to drain and exit" not in seen:  # the stop says what it waits for
        line = up.stdout.readline()
        assert line, seen
        seen += line
    # The stream holds decode-0 and the router; prefill-0 finished its part with the first
    # token and may have exited within the second before the stop line.
    assert re.search(r"waiting for (prefill-0, )?decode-0, router to drain and exit", seen), seen
    up.send_signal(signal.SIGINT)
    events = response.read().decode()
    assert up.wait(timeout=60) == 0
    seen += up.stdout.read()
    assert "second signal: " in seen and "end their drains now" in seen, seen
    data = [line.removeprefix("data: ") for line in events.splitlines() if line.startswith("data:")]
    assert data[-1] == "[DONE]" and '"error"' in data[-2], data[-3:]
