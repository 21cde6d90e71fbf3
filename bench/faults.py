"""Issue #25's fault matrix as a benchmark: for each case (kill -9, or SIGSTOP for --stop-s then
SIGCONT, of the router, the prefill, the decode, a non-leader PP stage of each role, `dsv4 up`
itself) a fresh `dsv4 up` deployment on loopback, --clients streaming clients, the fault, and:

    error_s      fault -> the first error answer of a client in flight or sent during the fault
    silence_s    the longest any client then heard nothing, counted from the fault's end
    ready_s      kill -> the supervisor's status file says the unit is ready again
    recovery_s   fault -> the first new request (sent after the fault ended) answered 2xx
    target_s     recovery target: the supervisor's backoff + the deployment's start-up time
                 (restarts), or --stop-s + 2 s (a stop)

Targets: every error_s <= 2 s, recovery_s <= target_s, no rule of the matrix broken (the same
rules as local/tests/test_fault_matrix.py: faultkit.CaseResult.problems). Exits 1 when one is
missed. `--json` adds an `@bench-json` line (benchjson.py).

    .venv/bin/python bench/faults.py [--case decode-0-kill ...] [--stop-s 6] [--json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import faultkit
from benchjson import Figure, emit

ERROR_TARGET_S = 2.0
STOP_RECOVERY_SLACK_S = 2.0


def recovery_target_s(result: faultkit.CaseResult, stop_s: float) -> float | None:
    if result.fault.restarts:
        return result.backoff_s + result.startup_s
    if result.fault.action == "stop":
        return stop_s + STOP_RECOVERY_SLACK_S
    return None


def missed(result: faultkit.CaseResult, stop_s: float) -> list[str]:
    """The targets this case missed, one line each."""
    found = list(result.problems())
    error_s = result.verdict.error_after_s
    if error_s is not None and error_s > ERROR_TARGET_S:
        found.append(f"time to error {error_s:.2f} s > {ERROR_TARGET_S:g} s")
    target_s = recovery_target_s(result, stop_s)
    recovery_s = result.recovery_after_s
    if target_s is not None and recovery_s is not None and recovery_s > target_s:
        found.append(f"recovery {recovery_s:.2f} s > target {target_s:.2f} s")
    return found


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case", action="append", choices=sorted(faultkit.FAULTS), help="default: all"
    )
    parser.add_argument("--stop-s", type=float, default=6.0, help="how long a stop lasts")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--recover-timeout-s", type=float, default=60.0)
    parser.add_argument("--client-timeout-s", type=float, default=15.0)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = faultkit.CaseSettings(
        stop_s=args.stop_s,
        clients=args.clients,
        max_tokens=args.max_tokens,
        client_timeout_s=args.client_timeout_s,
        recover_timeout_s=args.recover_timeout_s,
    )
    names = args.case or list(faultkit.FAULTS)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-faults-"))
    print(f"stop faults last {args.stop_s:g} s; workdirs under {root}")
    header = (
        f"{'case':24} {'in-flight':>9} {'error_s':>8} {'silence_s':>9} {'ready_s':>8} "
        f"{'recovery_s':>10} {'target_s':>8} {'backoff_s':>9} {'gone_s':>7}  outcomes"
    )
    print(header, flush=True)
    figures: list[Figure] = []
    failures: dict[str, list[str]] = {}
    for name in names:
        result = faultkit.run_case(faultkit.FAULTS[name], root / name, settings)
        v = result.verdict
        target_s = recovery_target_s(result, args.stop_s)
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(v.kinds.items()))
        print(
            f"{name:24} {v.in_flight:>9} {_s(v.error_after_s):>8} {v.longest_silence_s:>9.2f} "
            f"{_s(result.ready_again_after_s):>8} {_s(result.recovery_after_s):>10} "
            f"{_s(target_s):>8} {result.backoff_s if result.fault.restarts else 0:>9.1f} "
            f"{_s(result.gone_after_s):>7}  {kinds}",
            flush=True,
        )
        if found := missed(result, args.stop_s):
            failures[name] = found
        figures.append(Figure(f"{name} silence", v.longest_silence_s, "s", "lower"))
        for label, value in (
            ("time to error", v.error_after_s),
            ("recovery", result.recovery_after_s),
            ("gone", result.gone_after_s),
        ):
            if value is not None:
                figures.append(Figure(f"{name} {label}", value, "s", "lower"))
    for name, found in failures.items():
        print(f"{name}: missed:")
        for line in found[:10]:
            print(f"    {line}")
        if len(found) > 10:
            print(f"    ... and {len(found) - 10} more")
    print(f"{len(names) - len(failures)} of {len(names)} cases met every target")
    if args.json:
        emit("faults", figures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
