"""A soak of a `dsv4 up` deployment on loopback (issue #25): find the concurrency that saturates
it (or take --concurrency), then for --duration-s drive twice that many clients, with bursts of
four times as many, 10% of requests leaving mid-request; bounded by --max-requests too.

Prints, per --bucket-s (a minute by default) of the drive: requests answered 2xx, 503, other
>= 500, other (4xx, broken, refused), client timeouts, client disconnects; the latency
percentiles of the 2xx ones; every process's RSS (psutil when importable, else /proc) and its
growth from the first bucket to the last; every worker's KV pages in use once idle.

Targets: 0 answers >= 500 other than 503, 0 client timeouts, 0 pages in use once idle, RSS
growth < 5% per process. Exits 1 when one is missed. `--json` adds an `@bench-json` line.

    .venv/bin/python bench/soak.py [--sample tiny-pd.yaml] [--duration-s 120] [--json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import faultkit
from benchjson import Figure, emit

RSS_GROWTH_TARGET = 0.05
RSS_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class DriveSettings:
    clients: int  # the steady number of clients (2x saturation)
    burst_clients: int  # during a burst (4x saturation)
    duration_s: float
    burst_every_s: float
    burst_s: float
    max_requests: int
    max_tokens: int
    leave_fraction: float  # of requests, whose client disconnects mid-request
    client_timeout_s: float
    seed: int


def active_clients(elapsed_s: float, cfg: DriveSettings) -> int:
    """How many clients send at `elapsed_s` into the drive: a burst for the first burst_s of
    every burst_every_s (from burst_every_s / 2 on, not at once)."""
    phase_s = (elapsed_s - cfg.burst_every_s / 2) % cfg.burst_every_s
    in_burst = elapsed_s >= cfg.burst_every_s / 2 and phase_s < cfg.burst_s
    return cfg.burst_clients if in_burst else cfg.clients


def classify(record: faultkit.Record) -> str:
    """The bucket column of one finished request."""
    if record.kind == "timeout":
        return "timeout"
    if record.kind == "left":
        return "left"
    if record.status == 503:
        return "503"
    if record.status >= 500:
        return "5xx"
    if record.kind == "ok":
        return "2xx"
    if record.kind == "error" and 200 <= record.status < 300:
        return "5xx"  # an error event in a 2xx stream is a server error
    return "other"


COLUMNS = ("2xx", "503", "5xx", "other", "timeout", "left")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- RSS ----------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil  # optional; /proc otherwise

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # psutil's NoSuchProcess and friends
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Every RSS_EVERY_S: the RSS of every process of the deployment, by name."""

    def __init__(self, dep: faultkit.Deployment) -> None:
        self.dep = dep
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            pids = {"dsv4 up": self.dep.popen.pid, **self.dep.pids()}
            found = {n: rss_bytes(p) for n, p in pids.items()}
            self.samples.append((time.monotonic(), {n: v for n, v in found.items() if v}))
            if self._stop.wait(RSS_EVERY_S):
                return


def rss_by_bucket(
    samples: list[tuple[float, dict[str, int]]], start_s: float, end_s: float, bucket_s: float
) -> dict[int, dict[str, float]]:
    """The mean RSS of every process in every bucket of the drive (start_s to end_s)."""
    sums: dict[int, dict[str, list[int]]] = {}
    for t, by_name in samples:
        bucket = int((t - start_s) // bucket_s)
        if not start_s <= t <= end_s:
            continue
        for name, value in by_name.items():
            sums.setdefault(bucket, {}).setdefault(name, []).append(value)
    return {b: {n: statistics.fmean(v) for n, v in d.items()} for b, d in sums.items()}


# ---- driving ------------------------------------------------------------------------------


def measure_throughput(api_url: str, clients: int, window_s: float, max_tokens: int) -> float:
    """2xx requests per second with `clients` clients for `window_s`."""
    with faultkit.Load(api_url, clients, max_tokens=max_tokens, timeout_s=60.0) as load:
        time.sleep(window_s)
        start_s = time.monotonic() - window_s
    done = [r for r in load.snapshot() if r.kind == "ok" and r.ended_s and r.ended_s >= start_s]
    return len(done) / window_s


def find_saturation(api_url: str, window_s: float, max_tokens: int, limit: int = 64) -> int:
    """Double the clients from 1 while that adds throughput: the concurrency of the best
    rate once two doublings in a row added less than 10% to it (one noisy window on a shared
    machine does not end the search)."""
    best, best_rate, misses, concurrency = 1, 0.0, 0, 1
    while concurrency <= limit and misses < 2:
        rate = measure_throughput(api_url, concurrency, window_s, max_tokens)
        print(f"saturation: {concurrency:>3} clients {rate:7.1f} requests/s", flush=True)
        if rate >= best_rate * 1.1:
            best, best_rate, misses = concurrency, rate, 0
        else:
            misses += 1
        concurrency *= 2
    return best


def drive(api_url: str, cfg: DriveSettings) -> tuple[float, list[faultkit.Record]]:
    """Run the drive; its start (monotonic) and every request."""
    records: list[faultkit.Record] = []
    lock = threading.Lock()
    start_s = time.monotonic()
    end_s = start_s + cfg.duration_s
    rng = random.Random(cfg.seed)

    def client(index: int, seed: int) -> None:
        local = random.Random(seed)
        while (now_s := time.monotonic()) < end_s:
            if index >= active_clients(now_s - start_s, cfg):
                time.sleep(0.1)
                continue
            with lock:
                if len(records) >= cfg.max_requests:
                    return
                record = faultkit.Record(now_s, stream=local.random() < 0.5)
                records.append(record)
            leave_s = local.uniform(0.05, 1.0) if local.random() < cfg.leave_fraction else None
            body = faultkit.body(cfg.max_tokens, stream=record.stream)
            faultkit.completion(api_url, body, cfg.client_timeout_s, record, leave_s)
            if record.kind not in ("ok", "left"):  # a short wait, below any Retry-After
                time.sleep(0.05 + 0.2 * local.random())

    threads = [
        threading.Thread(target=client, args=(i, rng.randrange(1 << 30)), daemon=True)
        for i in range(cfg.burst_clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return start_s, records


def buckets(
    records: Iterable[faultkit.Record], start_s: float, bucket_s: float
) -> dict[int, dict[str, int]]:
    counts: dict[int, dict[str, int]] = {}
    for r in records:
        if r.ended_s is None:
            continue
        row = counts.setdefault(int((r.ended_s - start_s) // bucket_s), dict.fromkeys(COLUMNS, 0))
        row[classify(r)] += 1
    return counts


# ---- the run ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", default="tiny-pd.yaml", help="under crds/samples")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, help="saturation; default: measured")
    parser.add_argument("--saturation-window-s", type=float, default=5.0)
    parser.add_argument("--saturation-limit", type=int, default=64, help="the search's cap")
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--burst-every-s", type=float, default=30.0)
    parser.add_argument("--burst-s", type=float, default=5.0)
    parser.add_argument("--leave-fraction", type=float, default=0.1)
    parser.add_argument("--client-timeout-s", type=float, default=60.0)
    parser.add_argument("--bucket-s", type=float, default=60.0)
    parser.add_argument("--idle-timeout-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-soak-"))
    print(f"dsv4 up {args.sample} in {workdir}", flush=True)

    with faultkit.Deployment.start(args.sample, workdir) as dep:
        api = dep.api_url
        faultkit.wait_until(lambda: faultkit.short_request_ok(api), "a first request", 60.0)
        saturation = args.concurrency or find_saturation(
            api, args.saturation_window_s, args.max_tokens, args.saturation_limit
        )
        cfg = DriveSettings(
            clients=2 * saturation,
            burst_clients=4 * saturation,
            duration_s=args.duration_s,
            burst_every_s=args.burst_every_s,
            burst_s=args.burst_s,
            max_requests=args.max_requests,
            max_tokens=args.max_tokens,
            leave_fraction=args.leave_fraction,
            client_timeout_s=args.client_timeout_s,
            seed=args.seed,
        )
        print(
            f"saturation {saturation} clients: driving {cfg.clients}, bursts of "
            f"{cfg.burst_clients} for {cfg.burst_s:g} s every {cfg.burst_every_s:g} s, "
            f"{cfg.leave_fraction:.0%} leaving, for {cfg.duration_s:g} s",
            flush=True,
        )
        with RssSampler(dep) as rss:
            start_s, records = drive(api, cfg)
        idle = faultkit.wait_idle_pages(dep, args.idle_timeout_s)
        restarts = sum(int(u["restarts"]) for u in dep.units().values())

    counts = buckets(records, start_s, args.bucket_s)
    print(f"\n{'bucket':>8} " + " ".join(f"{c:>7}" for c in COLUMNS))
    for b in sorted(counts):
        print(f"{b * args.bucket_s:>7.0f}s " + " ".join(f"{counts[b][c]:>7}" for c in COLUMNS))
    totals = {c: sum(row[c] for row in counts.values()) for c in COLUMNS}
    print(f"{'total':>8} " + " ".join(f"{totals[c]:>7}" for c in COLUMNS))

    latencies = [r.ended_s - r.started_s for r in records if r.kind == "ok" and r.ended_s]
    first = [
        r.first_byte_s - r.started_s
        for r in records
        if r.kind == "ok" and r.stream and r.first_byte_s is not None
    ]
    figures: list[Figure] = [
        Figure(f"{c} answers", totals[c], "requests", "lower") for c in COLUMNS
    ]
    figures[0] = Figure("2xx answers", totals["2xx"], "requests", "higher")
    for label, values in (("latency", latencies), ("first byte (streams)", first)):
        if values:
            p50, p90, p99 = (percentile(values, q) for q in (0.5, 0.9, 0.99))
            worst_s = max(values)
            print(
                f"{label}: p50 {p50:.3f} s, p90 {p90:.3f} s, p99 {p99:.3f} s, max {worst_s:.3f} s"
            )
            figures += [
                Figure(f"{label} p50", p50, "s", "lower"),
                Figure(f"{label} p99", p99, "s", "lower"),
            ]

    by_bucket = rss_by_bucket(rss.samples, start_s, start_s + cfg.duration_s, args.bucket_s)
    growth: dict[str, float] = {}
    if by_bucket:
        first_b, last_b = min(by_bucket), max(by_bucket)
        print(f"\nRSS MiB (mean of bucket {first_b} -> bucket {last_b}):")
        for name in sorted(by_bucket[last_b]):
            before = by_bucket[first_b].get(name)
            after = by_bucket[last_b][name]
            growth[name] = 0.0 if not before else after / before - 1
            before_text = "-" if before is None else f"{before / 2**20:.1f}"
            print(f"  {name:20} {before_text:>8} -> {after / 2**20:8.1f}  ({growth[name]:+.1%})")
            figures.append(Figure(f"{name} RSS growth", growth[name] * 100, "%", "lower"))
    print(f"KV pages in use once idle: {idle}")
    print(f"supervisor restarts during the run: {restarts}")

    missed = []
    if totals["5xx"]:
        missed.append(f"{totals['5xx']} answers >= 500 other than 503")
    if totals["timeout"]:
        missed.append(f"{totals['timeout']} client timeouts")
    if any(pools != {} for pools in idle.values()):
        missed.append(f"KV pages in use once idle: {idle}")
    missed += [f"{n}: RSS grew {g:.1%}" for n, g in growth.items() if g >= RSS_GROWTH_TARGET]
    if len(by_bucket) < 2:
        print("(one bucket only: RSS growth needs a run longer than --bucket-s)")
    print("targets: " + ("all met" if not missed else "missed: " + "; ".join(missed)))
    if args.json:
        emit("soak", figures)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
