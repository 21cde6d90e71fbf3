"""bench/router_choice.py runs and prints its figures (a small run: one seed, few requests);
and under either rule every request of its model gets a first token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchjson import parse
from router_choice import CAPACITY, Decode, simulate, workload

from dsv4_router.choice import decode_key, full_pool_decode_key

BENCH = Path(__file__).resolve().parents[1] / "router_choice.py"


def test_the_bench_prints_both_rules_and_their_ratio() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--seeds", "1", "--requests", "300"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    figures = parse(out)
    assert set(figures) == {"p99_ttft_before", "p99_ttft_after", "p99_ratio_after_before"}
    before, after = figures["p99_ttft_before"].value, figures["p99_ttft_after"].value
    assert figures["p99_ratio_after_before"].value == round(after / before, 4)


def test_every_request_gets_a_first_token_under_either_rule() -> None:
    requests = workload(seed=3, count=400, rate=30.0, long_share=0.15)
    for rank in (decode_key, full_pool_decode_key):
        fresh = [type(r)(r.arrival_s, r.prompt, r.output) for r in requests]
        ttft = simulate(fresh, 3, rank)
        assert len(ttft) == len(requests) and min(ttft) > 0
    idle = Decode(record=None)  # type: ignore[arg-type]
    assert (idle.free_full, idle.free_swa, idle.free_slots) == (
        CAPACITY.full_tokens,
        CAPACITY.swa_tokens,
        CAPACITY.max_running_requests,
    )
