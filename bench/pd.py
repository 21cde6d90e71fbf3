"""PD disaggregation figures (prints tables; not a test).

    .venv/bin/python bench/pd.py [--device cpu|cuda] [--rounds R] [--transfer nixl|zmq] [--json]

1. Serving `tiny` over HTTP on loopback, colocated (one `dsv4 serve`) vs disaggregated
   (router + prefill + decode processes), side by side in one run:
   - TTFT at low load (the PD target): `--ttft-requests` single requests per server, one at a
     time, the servers visited request by request in a shuffled order (median, p90, ratio);
   - TTFT and generated tokens/s at 1 and 32 concurrent streaming clients, each server in turn
     per round (medians over `--rounds`; `--clients` with no value skips them).
   With `--json`, a `@bench-json` line (bench/benchjson.py, for bench/compare.py) holds the
   low-load TTFT medians and each PD stack's ratio to colocated:

       .venv/bin/python bench/compare.py BASE --bench pd -- --clients --ttft-requests 40
2. Decode admission capacity for a DSV4-Pro decode plan (TP=8 on an H200, SWA ratio 0.1):
   how many 32K-token prompts one decode rank preallocates at once when it reserves SWA for the
   page-floored window tail only (this project; ref. #24036/#24857) vs for the whole prompt
   (before). Both go through the scheduler's own `plan_step`; whole-prompt preallocation is
   the same function with the retained window set past the prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve as http_bench
from benchjson import Figure, emit

from dsv4_common.core.gpus import gpu_type
from dsv4_common.core.presets import load_model_config
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.sched.scheduler import Phase, ReqView, SchedulerConfig, plan_step

try:
    from dsv4_worker.sched.budget import PoolRoom
except ImportError:  # a tree from before the rename (bench/compare.py's baseline)
    from dsv4_worker.sched.budget import Capacity as PoolRoom  # type: ignore[attr-defined,no-redef]

# Every process of a PD stack shares one deployment secret (older trees ignore it).
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "DSV4_PD_SECRET": "bench-pd-secret-" + "0" * 32}
COMMON = http_bench.TINY
serve = http_bench.serve_argv


def _start(argv: list[str], port: int, procs: list[subprocess.Popen[bytes]]) -> None:
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(proc)
    http_bench._wait_ready(port, proc)


def _pd(device: str, transfer: str, threads: int, procs: list[subprocess.Popen[bytes]]) -> int:
    free = http_bench._free_port
    pp, kv, dp, rp = free(), free(), free(), free()
    dev = ["--device", device, "--transfer", transfer]
    prefill = ("--port", str(pp), "--kv-port", str(kv), "--transfer-threads", str(threads))
    _start(serve("--role", "prefill", *COMMON, *dev, *prefill), pp, procs)
    _start(
        serve("--role", "decode", *COMMON, *dev, "--port", str(dp), "--prefill", f"127.0.0.1:{kv}"),
        dp,
        procs,
    )
    _start(
        serve(
            "--role",
            "router",
            "--port",
            str(rp),
            "--instance",
            f"prefill=127.0.0.1:{pp}:{pp}:{kv}",
            "--instance",
            f"decode=127.0.0.1:{dp}:{dp}:{dp}",
        ),
        rp,
        procs,
    )
    return rp


def serving(args: argparse.Namespace) -> list[Figure]:
    """Print the tables; the low-load TTFT figures (none when skipped)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        colo = http_bench._free_port()
        _start(
            serve(*COMMON, "--device", args.device, "--port", str(colo)),
            colo,
            procs,
        )
        ports = {"colocated": colo}
        for threads in args.transfer_threads:
            name = "disaggregated"
            if len(args.transfer_threads) > 1:
                name = f"PD threads={threads}"
            ports[name] = _pd(args.device, args.transfer, threads, procs)
        for port in ports.values():
            http_bench._round(port, 1, 2, 4)  # warm-up
        figures = low_load_ttft(ports, args)
        print(
            f"tiny over HTTP, device={args.device}, transfer={args.transfer}, "
            f"{args.max_tokens} tokens/request, {os.cpu_count()} CPUs; medians of {args.rounds}"
        )
        width = max(13, *map(len, ports))
        print(
            f"{'clients':>8}  {'mode':>{width}}  {'tokens/s':>9}  {'TTFT ms':>8}  "
            f"{'TTFT ratio':>10}"
        )
        for clients in args.clients:
            rows = http_bench.interleaved(
                ports, clients, args.requests, args.max_tokens, args.rounds
            )
            base = rows["colocated"][1]
            for name, (tps, ttft) in rows.items():
                ratio = ttft / base
                print(f"{clients:>8}  {name:>{width}}  {tps:>9.1f}  {ttft:>8.1f}  {ratio:>10.2f}")
        return figures
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def low_load_ttft(ports: dict[str, int], args: argparse.Namespace) -> list[Figure]:
    """The TTFT target's figure: one request at a time, servers visited request by request;
    returned as figures (`ttft_figures`)."""
    if args.ttft_requests <= 0:
        return []
    load_start = os.getloadavg()[0]
    ttfts = http_bench.ttft_side_by_side(ports, args.ttft_requests, args.max_tokens)
    base = statistics.median(ttfts["colocated"])
    print(
        f"TTFT at low load: {args.ttft_requests} single requests per server, one at a time, "
        f"servers interleaved request by request; {os.cpu_count()} CPUs"
    )
    width = max(13, *map(len, ports))
    print(f"  {'mode':>{width}}  {'median ms':>9}  {'p90 ms':>7}  {'ratio':>5}")
    for name, values in ttfts.items():
        median = statistics.median(values)
        p90 = http_bench.percentile(values, 0.9)
        print(f"  {name:>{width}}  {median:>9.1f}  {p90:>7.1f}  {median / base:>5.2f}")
    print(f"  load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print()
    return ttft_figures({name: statistics.median(values) for name, values in ttfts.items()})


def ttft_figures(medians: dict[str, float]) -> list[Figure]:
    """Each server's median low-load TTFT, and each PD stack's ratio to colocated (the
    target: <= 1.15)."""
    base = medians["colocated"]
    out = [Figure(f"ttft_ms.{name}", ms, "ms", "lower") for name, ms in medians.items()]
    out += [
        Figure(f"ttft_ratio.{name}", ms / base, "x", "lower")
        for name, ms in medians.items()
        if name != "colocated"
    ]
    return out


def admission(prompt_tokens: int, max_new_tokens: int) -> None:
    model = load_model_config("deepseek-v4-pro")
    inputs = PlanInputs(
        model=model,
        role="decode",
        gpu_memory_bytes=gpu_type("h200").memory_bytes,
        tp_size=8,
        swa_ratio=0.1,
    )
    rank = plan(inputs).ranks[0]
    cap, tokens = rank.pools, rank.capacity
    total = PoolRoom(cap.full_pages, cap.swa_pages, cap.request_slots)
    retained = rank.layout.window_tokens + rank.layout.draft_tokens
    views = [
        ReqView(rid, Phase.PREALLOC, prompt_tokens, max_new_tokens)
        for rid in range(cap.request_slots + 1)
    ]
    counts = {}
    for name, window in (("SWA tail", retained), ("whole prompt", 1 << 40)):
        config = SchedulerConfig(
            page_size=rank.page_size,
            chunk_tokens=inputs.resolved_chunk_tokens,
            max_tokens_per_request=tokens.max_context_tokens,
            retained_tokens=window,
        )
        step = plan_step(views, total, total, config, new_token_ratio=0.1)
        counts[name] = len(step.preallocs)
    print(
        f"\nDSV4-Pro decode rank (TP=8, H200, SWA ratio 0.1): {tokens.full_tokens:,} full tokens, "
        f"{tokens.swa_tokens:,} SWA tokens, {cap.request_slots} request slots, page "
        f"{rank.page_size}, window {rank.layout.window_tokens}"
    )
    print(f"{prompt_tokens:,}-token prompts, max_tokens {max_new_tokens}, preallocated at once:")
    for name, n in counts.items():
        print(f"  {name:>13}: {n:>4}")
    tail, whole = counts["SWA tail"], counts["whole prompt"]
    print(f"  ratio: {tail / whole:.1f}x" if whole else "  ratio: whole prompt admits none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--transfer", default="nixl", choices=("nixl", "zmq"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--transfer-threads",
        type=int,
        nargs="+",
        default=[2],
        help="prefill's nixl poster threads; several values run one PD stack each, side by side",
    )
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument(
        "--ttft-requests",
        type=int,
        default=40,
        help="single requests per server for the low-load TTFT figure (0: skip it)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--skip-serving", action="store_true", help="only the admission figures")
    parser.add_argument(
        "--json", action="store_true", help="also print a @bench-json line (low-load TTFT)"
    )
    args = parser.parse_args()
    figures = [] if args.skip_serving else serving(args)
    admission(args.prompt_tokens, args.max_tokens)
    if args.json:
        emit("pd", figures)


if __name__ == "__main__":
    main()
