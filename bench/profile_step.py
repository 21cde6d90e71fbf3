"""Where one decode step of `dsv4 serve --model tiny` spends its time (prints a table; not a
test): the engine is built as `dsv4 serve` builds it, one request decodes under torch's
profiler, and the table lists the top operators by self CPU time with calls per step, then the
counts that bound an eager step on a GPU (kernel launches, host-device copies, synchronizations).

    .venv/bin/python bench/profile_step.py [--device cpu|cuda] [--steps 16] [--running 1]

ms/step comes from the same steps timed without the profiler (median). `--json` adds a
`@bench-json` line (ms/step; for bench/compare.py, e.g. float64 before #38 vs float32 after).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from benchjson import Figure, emit
from serve import tiny_engine
from torch.profiler import ProfilerActivity, profile

from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.sched.scheduler import Phase

# What a GPU step's eager cost is made of (names as the profiler reports them).
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
COPY_EVENTS = ("cudaMemcpyAsync", "cudaMemcpy")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled and timed")
    parser.add_argument("--running", type=int, default=1, help="requests decoding together")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    args = parser.parse_args()
    if args.steps < 1 or args.running < 1:
        parser.error("--steps and --running must be >= 1")

    engine = tiny_engine(args.device)
    sync: Callable[[], None] = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    prompt = list(range(1, 33))
    long_enough = SamplingParams(max_new_tokens=3 * args.steps + 8)

    def start_decoding() -> None:
        for _ in range(args.running):
            engine.submit(prompt, long_enough)
        while any(r.phase is not Phase.DECODE for r in engine.requests.values()):
            engine.step()

    def stop_decoding() -> None:
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.run_until_idle()

    engine.submit(prompt, SamplingParams(max_new_tokens=4))  # warm-up
    engine.run_until_idle()

    start_decoding()
    timed = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        timed.append(time.perf_counter() - t0)
    stop_decoding()

    start_decoding()
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    stop_decoding()

    events = prof.key_averages()
    per_step = {e.key: e.count / args.steps for e in events}
    aten_calls = sum(c for k, c in per_step.items() if k.startswith("aten::"))
    print(
        f"tiny decode step, device={args.device}, running={args.running}, torch "
        f"{torch.__version__}, threads {torch.get_num_threads()}: "
        f"{1e3 * statistics.median(timed):.2f} ms/step (median of {args.steps}, no profiler)"
    )
    print(f"aten calls per step (all levels): {aten_calls:.0f}")
    for label, names in (
        ("launches", LAUNCH_EVENTS),
        ("copies", COPY_EVENTS),
        ("syncs", SYNC_EVENTS),
    ):
        print(f"{label} per step: {sum(per_step.get(n, 0.0) for n in names):.1f}")
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    print(f"\n{'operator':<44}{'calls/step':>11}{'self CPU us/step':>18}")
    for e in rows:
        calls, self_us = e.count / args.steps, e.self_cpu_time_total / args.steps
        print(f"{e.key[:43]:<44}{calls:>11.1f}{self_us:>18.1f}")
    if args.json:
        step_ms = 1e3 * statistics.median(timed)
        emit(
            "profile_step", [Figure(f"decode step, {args.running} running", step_ms, "ms", "lower")]
        )


if __name__ == "__main__":
    main()
