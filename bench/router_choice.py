"""The router's decode choice on a skewed workload (issue #41 item 4): today's rule (most free
full tokens: `choice.full_pool_decode_key`) against the rule that weighs every pool and the
queue (`choice.decode_key`), side by side on the same arrivals.

    python bench/router_choice.py [--seeds 5] [--requests 4000] [--rate 40]

A discrete-event model, not a load test (the 2-core machine's noise would drown the effect):
the real `choose_pair` and `InstanceRecord` bookkeeping (the router's pending counts between
status polls every 0.5 s), in front of decode instances modelled by their three pools. A
request holds, on the decode that took it, full tokens for its prompt and output, SWA tokens
for its window and one request slot; it waits in that decode's FIFO queue until all three fit,
then runs for its output tokens. Its TTFT is that wait plus its prefill time. Mixed prompts:
most short (many requests: slots and SWA bind), some long (few requests: the full pool binds).
Prints p50/p99 TTFT per rule (the median over seeds) and their ratio.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from benchjson import Figure, emit

from dsv4_common.api import RankCapacity
from dsv4_common.api.rank_config import Instance
from dsv4_common.api.worker_status import Load, WorkerStatus
from dsv4_router.choice import (
    DecodeRank,
    InstanceRecord,
    choose_pair,
    decode_key,
    full_pool_decode_key,
)
from dsv4_router.liveness import Liveness, LivenessRule

POLL_S: Final = 0.5
RULE: Final = LivenessRule(misses=3, grace_s=30.0)
CAPACITY: Final = RankCapacity(
    full_tokens=64 * 1024, swa_tokens=48 * 128, max_running_requests=64, max_context_tokens=16384
)
WINDOW_TOKENS: Final = 128
PREFILL_TOKENS_PER_S: Final = 20_000.0
DECODE_STEP_S: Final = 0.03  # per output token


@dataclass
class Request:
    arrival_s: float
    prompt: int
    output: int
    admitted_s: float | None = None

    @property
    def full(self) -> int:
        return self.prompt + self.output

    @property
    def swa(self) -> int:
        return min(WINDOW_TOKENS, self.full)


@dataclass
class Decode:
    record: InstanceRecord
    free_full: int = CAPACITY.full_tokens
    free_swa: int = CAPACITY.swa_tokens
    free_slots: int = CAPACITY.max_running_requests
    running: int = 0
    queue: deque[Request] = field(default_factory=deque)

    def fits(self, r: Request) -> bool:
        return r.full <= self.free_full and r.swa <= self.free_swa and self.free_slots > 0

    def take(self, r: Request) -> None:
        self.free_full -= r.full
        self.free_swa -= r.swa
        self.free_slots -= 1
        self.running += 1

    def give(self, r: Request) -> None:
        self.free_full += r.full
        self.free_swa += r.swa
        self.free_slots += 1
        self.running -= 1

    def status(self, role: str = "decode") -> WorkerStatus:
        load = Load(
            self.free_full, self.free_swa, self.free_slots, self.running, len(self.queue), True
        )
        return WorkerStatus(role="decode", pp_rank=0, capacity=CAPACITY, kv_ready=True, load=load)


def workload(seed: int, count: int, rate: float, long_share: float) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(count):
        t += rng.expovariate(rate)
        long = rng.random() < long_share
        prompt = rng.randint(6000, 12000) if long else rng.randint(32, 256)
        out.append(Request(t, prompt, rng.randint(64, 256)))
    return out


def simulate(requests: list[Request], decodes_n: int, rank: DecodeRank) -> list[float]:
    """TTFT of every request under `rank`."""
    prefill = InstanceRecord("prefill", Instance("10.0.1.1", 1, 2, 3), ready=True)
    prefill.status = WorkerStatus(
        role="prefill",
        pp_rank=0,
        capacity=CAPACITY,
        kv_ready=True,
        load=Load(10**6, 10**6, 64, 0, 0, True),
    )
    decodes = [
        Decode(InstanceRecord("decode", Instance(f"10.0.0.{i + 1}", 1, 2, 3), ready=True))
        for i in range(decodes_n)
    ]
    by_record = {id(d.record): d for d in decodes}
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(at: float, kind: str, item: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, item))

    for r in requests:
        push(r.arrival_s, "arrive", r)
    push(0.0, "poll", None)
    done = 0
    ttft: list[float] = []

    def admit(d: Decode, now: float) -> None:
        while d.queue and d.fits(d.queue[0]):
            r = d.queue.popleft()
            d.take(r)
            r.admitted_s = now
            start = now + r.prompt / PREFILL_TOKENS_PER_S
            ttft.append(start - r.arrival_s)
            push(start + r.output * DECODE_STEP_S, "finish", (d, r))

    while events and done < len(requests):
        now, _, kind, item = heapq.heappop(events)
        if kind == "poll":
            for d in decodes:  # every status arrives fresh; pending resets to what came after
                d.record.status = d.status()
                d.record.status_sent_total = d.record.sent_total
                d.record.liveness = Liveness(ok_at_s=now)
            prefill.liveness = Liveness(ok_at_s=now)
            push(now + POLL_S, "poll", None)
        elif kind == "arrive":
            assert isinstance(item, Request)
            records = [prefill, *(d.record for d in decodes)]
            pair = choose_pair(records, now, RULE, decode_rank=rank)
            assert pair is not None
            d = by_record[id(pair.decode)]
            pair.decode.sent()
            d.queue.append(item)
            admit(d, now)
        else:
            d, r = item  # type: ignore[misc]
            d.give(r)
            d.record.done()
            done += 1
            admit(d, now)
    return ttft


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=26.0, help="arrivals per second")
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--long-share", type=float, default=0.15)
    args = parser.parse_args()
    rules = {"full pool (before)": full_pool_decode_key, "every pool + queue": decode_key}
    p50: dict[str, list[float]] = {k: [] for k in rules}
    p99: dict[str, list[float]] = {k: [] for k in rules}
    for seed in range(args.seeds):
        requests = workload(seed, args.requests, args.rate, args.long_share)
        for name, rank in rules.items():
            fresh = [Request(r.arrival_s, r.prompt, r.output) for r in requests]
            ttft = simulate(fresh, args.decodes, rank)
            p50[name].append(quantile(ttft, 0.5))
            p99[name].append(quantile(ttft, 0.99))
    print(
        f"{args.decodes} decodes, {args.requests} requests at {args.rate:g}/s, "
        f"{args.long_share:.0%} long prompts, median of {args.seeds} seeds:"
    )
    for name in rules:
        print(
            f"  {name:20s} TTFT p50 {statistics.median(p50[name]) * 1000:8.1f} ms   "
            f"p99 {statistics.median(p99[name]) * 1000:8.1f} ms"
        )
    before, after = (statistics.median(p99[k]) for k in rules)
    print(f"p99 TTFT after/before: {after / before:.3f}")
    emit(
        "router_choice",
        [
            Figure("p99_ttft_before", round(before, 4), "s", "lower"),
            Figure("p99_ttft_after", round(after, 4), "s", "lower"),
            Figure("p99_ratio_after_before", round(after / before, 4), "ratio", "lower"),
        ],
    )


if __name__ == "__main__":
    main()
