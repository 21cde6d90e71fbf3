"""bench/weights.py end to end at a small size: both clients download the same directory from
the fake hub (their figures are positive and printed), and the operator's status writes for a
downloading CR stay within one per 2 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchjson import parse

BENCH = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_bench_runs_and_keeps_the_status_bound() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "weights.py"), "--gib", "0.03", "--runs", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    figures = parse(done.stdout)
    assert figures["fetch_MB_per_s"].value > 0 and figures["hf_download_MB_per_s"].value > 0
    assert 0 < figures["status_writes_per_s"].value <= 0.5
    assert "ratio dsv4 fetch / hf download" in done.stdout
