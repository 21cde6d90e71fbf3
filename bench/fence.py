"""Issue #37 item 2's trial, many times: does a stopped-then-resumed prefill corrupt another
request's answer? Real `dsv4 serve` processes on 127.0.0.1 (two prefills, one decode), per
backend (`worker/tests/pd/stale_trial.py` has the trial).

    .venv/bin/python bench/fence.py [--trials 20] [--backend nixl zmq] [--no-guard] [--json]

Prints per backend: trials, B's answers that differ from the clean deployment's (`corrupted`:
the target is 0), B's failures (not a corruption), how often the decode held the given-up
request's pages until its writer was provably done (NIXL), how many stale writes its target
refused (zmq), and how many sessions the resumed prefill dropped. `--no-guard` runs P1 with
the test hook that makes it write on when its liveness is stale (the behaviour before #37), so
the decode's fence alone stands in the way.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchjson import Figure, emit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "worker" / "tests" / "server"), str(ROOT / "worker" / "tests" / "pd")]

import stale_trial  # noqa: E402  (a test support module: on the path just above)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--backend", nargs="+", default=["nixl", "zmq"], choices=["nixl", "zmq"])
    parser.add_argument("--no-guard", action="store_true", help="P1 writes on when stale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    guard = not args.no_guard
    figures: list[Figure] = []
    print(
        f"{'backend':8} {'trials':>6} {'corrupted':>9} {'B failed':>8} {'held':>5} "
        f"{'refused':>7} {'dropped':>7} {'minutes':>7}  ({'guard' if guard else 'no guard'})"
    )
    for backend in args.backend:
        start = time.monotonic()
        out = stale_trial.run(backend, args.trials, args.seed, guard=guard)
        minutes = (time.monotonic() - start) / 60
        print(
            f"{backend:8} {out.trials:6d} {out.corrupted:9d} {out.b_failed:8d} {out.held:5d} "
            f"{out.refused:7d} {out.dropped:7d} {minutes:7.1f}",
            flush=True,
        )
        for note in out.notes:
            print(f"    {note[:200]}")
        figures.append(Figure(f"{backend}_corrupted", out.corrupted, "answers", "lower"))
        figures.append(Figure(f"{backend}_b_failed", out.b_failed, "answers", "lower"))
    if args.json:
        emit("fence", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
