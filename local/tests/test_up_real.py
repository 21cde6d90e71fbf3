"""`dsv4 up` with the real workers and router: the README's main job end to end (plan, start
router + prefill + decode from the rendered configs, one completion through the router, stop),
and SIGTERM while serving stops every process (no orphans)."""

from __future__ import annotations

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


def test_sigterm_stops_every_process(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [*UP, "--workdir", str(tmp_path)],
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
