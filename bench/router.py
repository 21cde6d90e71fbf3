"""The router hop: `dsv4 serve --role router` and sglang-router side by side in front of a stub
backend that answers at once (prints a table; not a test).

    .venv/bin/python bench/router.py [--rounds 3] [--window-s 1.5] [--json]
        [--sglang-python /tmp/sglr/bin/python | --no-sglang] [--variant NAME=PYTHONPATH ...]
        [--api-key KEY]

Processes, all on 127.0.0.1: the stub (`router_stub.py`: completions as JSON or SSE, the
/status and /ready our router polls, the /health and info paths sglang-router asks), our
router and sglang-router in front of it, and the load generator (`router_load.py`:
closed-loop clients on kept-alive connections). Each cell (1 and 64 connections, plain and
streaming) is measured against the stub directly and through each router, in an order that
rotates every round so they share the machine's noise; figures are medians over rounds.

- requests/s: completions answered in the window (the 64-connection figure is the peak).
  The direct figure is the check that the stub and load generator are not the limit.
- added p50/p99 ms: the router's latency percentile minus the direct one of the same round.
- first event ms (streaming): from sending to the first whole SSE event; the stub sends it at
  once and the rest `--stream-gap-ms` later, so a relay that holds the first event back (say,
  Nagle's algorithm meeting a delayed ACK on a kept-alive connection) shows here. Added =
  minus direct.
- cpu us/req: the router's user+system CPU time per answered request, warm-up included
  (/proc/PID/stat of the process and its child processes; sglang-router's threads included):
  what a request costs, less sensitive to a shared machine than requests/s. Ours runs
  `--router-processes` processes (default: one per CPU, at most 4; `--processes N` adds a
  target with N); sglang-router's runtime has several threads. Ours busy-polls 50 us after
  its writes by default (`--router-busy-poll-us`); `--busy-poll-us US` adds a target with US
  (`--busy-poll-us 0`: ours without it, in the same rounds). `--relay` adds a bare relay
  (`router_relay.py`: bytes both ways, nothing else), with and without busy polling.
  `--api-key KEY` sends `Authorization: Bearer KEY` with every request and adds ours_key, our
  router checking it (`dsv4_common.api.api_key`): ours_key / ours is what the check costs.

Then ours / each other router, per round and medians. `--variant NAME=PYTHONPATH` adds our
router run from another tree's package directories (e.g. the last commit's, extracted with
`git archive`: bench/README.md), measured in the same rounds: before/after in one run.

sglang-router is launched as `python -m sglang_router.launch_router --worker-urls URL
--policy round_robin` from the venv `--sglang-python` names (install recipe: bench/README.md);
without it the table shows ours alone and says why.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchjson import Figure, emit

from dsv4_local.ports import free_ports

BENCH_DIR: Final = Path(__file__).resolve().parent
DEFAULT_SGLANG_PYTHON: Final = "/tmp/sglr/bin/python"
HOST: Final = "127.0.0.1"
PATH: Final = "/v1/completions"
START_TIMEOUT_S: Final = 60.0
TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK")
DIRECT: Final = "direct"


@dataclass(frozen=True, slots=True)
class Cell:
    connections: int
    stream: bool

    @property
    def name(self) -> str:
        return f"{'stream' if self.stream else 'plain'}.c{self.connections}"


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # "direct", "ours", "sglang"
    port: int
    pid: int | None  # the process whose CPU time is counted (None: the stub itself)


def _free_port() -> int:
    """A port below the ephemeral range (`dsv4_local.ports`): no outgoing connection takes it
    before the server binds it."""
    (port,) = free_ports(1)
    return port


AUTHORIZATION: dict[str, str] = {}  # `--api-key`: every request's Authorization header


def _post_ok(port: int) -> bool:
    body = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 1})
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=5)
        headers = {"Content-Type": "application/json", **AUTHORIZATION}
        conn.request("POST", PATH, body=body, headers=headers)
        return conn.getresponse().status == 200
    except OSError:
        return False


def _wait_serving(port: int, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while not _post_ok(port):
        if proc.poll() is not None or time.monotonic() > deadline_s:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{what} did not start answering completions:\n{tail}")
        time.sleep(0.2)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its running child processes (a router of
    several processes), threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    own = (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    return own + sum(_cpu_s(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


class Procs:
    """The bench's processes; all terminated on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], **kw: Any) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stderr=out, stdout=kw.pop("stdout", out), **kw)
        self.procs.append(proc)
        return proc, log

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_stub(procs: Procs, stream_gap_ms: float) -> dict[str, int]:
    argv = [sys.executable, str(BENCH_DIR / "router_stub.py"), f"--stream-gap-ms={stream_gap_ms}"]
    proc, _ = procs.start("stub", argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ports: dict[str, int] = json.loads(proc.stdout.readline())
    return ports


def start_ours(
    procs: Procs,
    ports: dict[str, int],
    name: str = "ours",
    pythonpath: str | None = None,
    processes: int | None = None,
    busy_poll_us: int | None = None,
    api_key: str | None = None,
) -> Target:
    """`dsv4 serve --role router` in front of the stub; `pythonpath` first on its path (a
    variant: another tree's package directories); `processes`: its --router-processes (None:
    its default)."""
    port = _free_port()
    api = ports["api"]
    argv = [sys.executable, "-m", "dsv4_cli", "serve", "--role", "router"]
    argv += ["--host", HOST, "--port", str(port)]
    if processes is not None:
        argv += ["--router-processes", str(processes)]
    if busy_poll_us is not None:
        argv += ["--router-busy-poll-us", str(busy_poll_us)]
    if api_key is not None:
        argv += ["--api-key", api_key]
    argv += ["--instance", f"prefill={HOST}:{api}:{ports['prefill_status']}:1"]
    argv += ["--instance", f"decode={HOST}:{api}:{ports['decode_status']}:1"]
    env = {**os.environ, "DSV4_PD_SECRET": "bench-pd-secret-" + "0" * 32}  # routers need one
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    proc, log = procs.start(name, argv, env=env)
    _wait_serving(port, proc, log, f"dsv4 serve --role router ({name})")
    return Target(name, port, proc.pid)


def parse_variant(text: str) -> tuple[str, str]:
    """`NAME=PATH[:PATH...]` -> (NAME, PATHS); NAME must not clash with the fixed targets."""
    name, sep, paths = text.partition("=")
    if not sep or not name.isidentifier() or name in (DIRECT, "ours", "sglang") or not paths:
        raise argparse.ArgumentTypeError(f"expected NAME=PYTHONPATH, got {text!r}")
    return name, paths


def sglang_missing(python: str | None) -> str | None:
    """Why sglang-router cannot run (None: it can)."""
    if python is None:
        return "--no-sglang"
    if not Path(python).exists():
        return f"{python} does not exist (install recipe: bench/README.md)"
    probe = subprocess.run(
        [python, "-c", "import sglang_router.launch_router"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"{python} cannot import sglang_router: {probe.stderr.decode()[-300:].strip()}"
    return None


def start_relay(procs: Procs, ports: dict[str, int], busy_poll_us: int) -> Target:
    """The bare relay (`router_relay.py`) in front of the stub: what any relay costs here."""
    name = "relay" if not busy_poll_us else f"relay_bp{busy_poll_us}"
    argv = [sys.executable, str(BENCH_DIR / "router_relay.py"), str(ports["api"])]
    argv += ["--busy-poll-us", str(busy_poll_us)]
    proc, log = procs.start(name, argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the relay did not start: {log.read_text()[-2000:]}")
    port: int = json.loads(line)["port"]
    _wait_serving(port, proc, log, name)
    return Target(name, port, proc.pid)


def start_sglang(procs: Procs, python: str, ports: dict[str, int]) -> Target:
    port = _free_port()
    argv = [python, "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port)]
    argv += ["--worker-urls", f"http://{HOST}:{ports['api']}", "--policy", "round_robin"]
    argv += ["--log-level", "warn"]
    proc, log = procs.start("sglang", argv)
    _wait_serving(port, proc, log, "sglang-router")
    return Target("sglang", port, proc.pid)


class Load:
    """The load generator process: one JSON command in, one JSON result out."""

    def __init__(self, procs: Procs) -> None:
        argv = [sys.executable, str(BENCH_DIR / "router_load.py")]
        self.proc, self.log = procs.start(
            "load", argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def measure(
        self, target: Target, cell: Cell, warmup_s: float, window_s: float
    ) -> dict[str, Any]:
        command = {"port": target.port, "path": PATH, "connections": cell.connections}
        command |= {"stream": cell.stream, "warmup_s": warmup_s, "window_s": window_s}
        command["authorization"] = AUTHORIZATION.get("Authorization")
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        cpu_before_s = _cpu_s(target.pid) if target.pid is not None else 0.0
        stdin.write(json.dumps(command).encode() + b"\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator died: {self.log.read_text()[-2000:]}")
        result: dict[str, Any] = json.loads(line)
        if "error" in result:
            raise RuntimeError(f"{target.name} {cell.name}: {result['error']}")
        if target.pid is not None:
            # The CPU counted covers the warm-up too: divide by every request it answered.
            requests = result["requests_per_s"] * (warmup_s + window_s)
            cpu_s = _cpu_s(target.pid) - cpu_before_s
            result["cpu_us_per_request"] = cpu_s / max(1.0, requests) * 1e6
        return result


def rotated(items: list[Target], k: int) -> list[Target]:
    k %= len(items)
    return items[k:] + items[:k]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


Results = dict[tuple[str, str], list[dict[str, Any]]]  # (target, cell) -> one per round


def run_rounds(
    load: Load,
    targets: list[Target],
    cells: list[Cell],
    rounds: int,
    warmup_s: float,
    window_s: float,
) -> Results:
    results: Results = {}
    for r in range(rounds):
        for cell in cells:
            for target in rotated(targets, r):
                result = load.measure(target, cell, warmup_s, window_s)
                results.setdefault((target.name, cell.name), []).append(result)
    return results


def added(results: Results, target: str, cell: str, key: str) -> float:
    """Median over rounds of (target's figure - direct's figure of the same round)."""
    pairs = zip(results[(target, cell)], results[(DIRECT, cell)], strict=True)
    return median([mine[key] - direct[key] for mine, direct in pairs])


def figure(results: Results, target: str, cell: str, key: str) -> float:
    return median([r[key] for r in results[(target, cell)]])


def table(results: Results, targets: list[str], cells: list[Cell]) -> list[str]:
    head = f"{'cell':<11}{'target':<8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
    head += (
        f"{'+p50 ms':>9}{'+p99 ms':>9}{'1st ev ms':>10}{'+1st ev':>9}{'cpu us/req':>11}{'bad':>5}"
    )
    lines = [head]
    for cell in cells:
        for target in targets:
            name = cell.name if target == targets[0] else ""
            row = f"{name:<11}{target:<8}"
            row += f"{figure(results, target, cell.name, 'requests_per_s'):>9.0f}"
            row += f"{figure(results, target, cell.name, 'p50_ms'):>9.3f}"
            row += f"{figure(results, target, cell.name, 'p99_ms'):>9.3f}"
            if target == DIRECT:
                row += f"{'':>9}{'':>9}"
            else:
                row += f"{added(results, target, cell.name, 'p50_ms'):>9.3f}"
                row += f"{added(results, target, cell.name, 'p99_ms'):>9.3f}"
            if cell.stream:
                row += f"{figure(results, target, cell.name, 'first_event_p50_ms'):>10.3f}"
                extra = (
                    ""
                    if target == DIRECT
                    else (f"{added(results, target, cell.name, 'first_event_p50_ms'):.3f}")
                )
                row += f"{extra:>9}"
            else:
                row += f"{'':>10}{'':>9}"
            cpu = (
                ""
                if target == DIRECT
                else f"{figure(results, target, cell.name, 'cpu_us_per_request'):.0f}"
            )
            bad = sum(r["bad"] for r in results[(target, cell.name)])
            lines.append(row + f"{cpu:>11}{bad:>5}")
    return lines


def ratio_lines(results: Results, cells: list[Cell], others: list[str]) -> list[str]:
    """ours against each other router, per round then medians: requests/s ours/other (>= 0.8
    against sglang is the target), added p50 and (streaming) added first event of both."""
    lines = []
    for other in others:
        for cell in cells:
            pairs = zip(results[("ours", cell.name)], results[(other, cell.name)], strict=True)
            rps = median([o["requests_per_s"] / x["requests_per_s"] for o, x in pairs])
            line = f"{cell.name:<11} req/s ours/{other} {rps:5.2f}   added p50 ms"
            line += f" ours {added(results, 'ours', cell.name, 'p50_ms'):.3f}"
            line += f" {other} {added(results, other, cell.name, 'p50_ms'):.3f}"
            if cell.stream:
                key = "first_event_p50_ms"
                line += f"   added first event ms ours {added(results, 'ours', cell.name, key):.3f}"
                line += f" {other} {added(results, other, cell.name, key):.3f}"
            lines.append(line)
    return lines


def figures(results: Results, targets: list[str], cells: list[Cell]) -> list[Figure]:
    out = []
    for target in targets:
        for cell in cells:
            base = f"{target}.{cell.name}"
            out.append(
                Figure(
                    f"{base}.requests_per_s",
                    figure(results, target, cell.name, "requests_per_s"),
                    "1/s",
                    "higher",
                )
            )
            if target == DIRECT:
                continue
            out.append(
                Figure(
                    f"{base}.added_p50_ms",
                    added(results, target, cell.name, "p50_ms"),
                    "ms",
                    "lower",
                )
            )
            out.append(
                Figure(
                    f"{base}.added_p99_ms",
                    added(results, target, cell.name, "p99_ms"),
                    "ms",
                    "lower",
                )
            )
            out.append(
                Figure(
                    f"{base}.cpu_us_per_request",
                    figure(results, target, cell.name, "cpu_us_per_request"),
                    "us",
                    "lower",
                )
            )
            if cell.stream:
                out.append(
                    Figure(
                        f"{base}.added_first_event_ms",
                        added(results, target, cell.name, "first_event_p50_ms"),
                        "ms",
                        "lower",
                    )
                )
    return out


def _cells(connections: list[int], modes: list[str]) -> list[Cell]:
    return [Cell(c, mode == "stream") for mode in modes for c in connections]


@contextlib.contextmanager
def _processes() -> Iterator[Procs]:
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        procs = Procs(Path(tmp))
        try:
            yield procs
        finally:
            procs.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=0.3)
    parser.add_argument("--window-s", type=float, default=1.5)
    parser.add_argument("--connections", default="1,64", help="comma-separated counts")
    parser.add_argument("--modes", default="plain,stream", help="plain, stream or both")
    parser.add_argument("--stream-gap-ms", type=float, default=2.0)
    parser.add_argument(
        "--sglang-python", default=os.environ.get("SGLANG_ROUTER_PYTHON", DEFAULT_SGLANG_PYTHON)
    )
    parser.add_argument("--no-sglang", action="store_true")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME=PYTHONPATH",
        help="also our router from another tree (its package directories), e.g. the commit "
        "before (bench/README.md)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="also our router with --router-processes N, as target ours_pN (repeatable)",
    )
    parser.add_argument(
        "--busy-poll-us",
        type=int,
        action="append",
        default=[],
        metavar="US",
        help="also our router with --router-busy-poll-us US, as target ours_bpUS (repeatable; "
        "0: without busy polling)",
    )
    parser.add_argument(
        "--relay",
        action="store_true",
        help="also a bare relay (router_relay.py), as targets relay and relay_bp50 (busy "
        "polling 50 us): what any asyncio relay costs here",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="every request (to every target) carries `Authorization: Bearer KEY`, and target "
        "ours_key is our router with --api-key KEY: what checking the key costs",
    )
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    args = parser.parse_args()
    if args.api_key is not None:
        AUTHORIZATION["Authorization"] = f"Bearer {args.api_key}"
    cells = _cells([int(c) for c in args.connections.split(",")], args.modes.split(","))
    missing = sglang_missing(None if args.no_sglang else args.sglang_python)
    print(f"load average at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    with _processes() as procs:
        ports = start_stub(procs, args.stream_gap_ms)
        targets = [Target(DIRECT, ports["api"], None), start_ours(procs, ports)]
        targets += [start_ours(procs, ports, name, paths) for name, paths in args.variant]
        targets += [start_ours(procs, ports, f"ours_p{n}", processes=n) for n in args.processes]
        targets += [
            start_ours(procs, ports, f"ours_bp{us}", busy_poll_us=us) for us in args.busy_poll_us
        ]
        if args.api_key is not None:
            targets.append(start_ours(procs, ports, "ours_key", api_key=args.api_key))
        if args.relay:
            targets += [start_relay(procs, ports, us) for us in (0, 50)]
        if missing is None:
            targets.append(start_sglang(procs, args.sglang_python, ports))
        load = Load(procs)
        results = run_rounds(load, targets, cells, args.rounds, args.warmup_s, args.window_s)
    names = [t.name for t in targets]
    print(f"medians of {args.rounds} rounds, {args.window_s:g} s windows; + = minus direct")
    print("\n".join(table(results, names, cells)))
    print("\n".join(ratio_lines(results, cells, names[2:])))
    if missing is not None:
        print(f"sglang-router comparison skipped: {missing}")
    print(f"load average at end: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    if args.json:
        emit("router", figures(results, names, cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
