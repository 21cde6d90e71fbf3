"""Microbenchmark of the KV allocator's hot operations (prints a table; not a test).

    .venv/bin/python bench/alloc.py [--device cpu|cuda] [--repeats N]

Microseconds per call, one torch thread, page sizes 256 and 16. Each cell is the median of
`--rounds` round medians (each over `--repeats` calls), the best round in brackets: shared CPUs
here add bursts of noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.kv_allocator import KVAllocator

MAX_CONTEXT_TOKENS = 65536
WINDOW_TOKENS = 128


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter_ns()
    fn()
    _sync(device)
    return (time.perf_counter_ns() - t0) / 1e3


def _allocator(
    page: int, requests: int, tokens_per_request: int, device: torch.device
) -> KVAllocator:
    pages = requests * (-(-tokens_per_request // page) + 2) + 64
    cfg = AllocatorConfig(
        page_size=page,
        num_full_pages=pages,
        num_swa_pages=pages,
        num_request_slots=requests,
        max_pages_per_request=MAX_CONTEXT_TOKENS // page,
        window_tokens=WINDOW_TOKENS,
    )
    return KVAllocator(cfg, device)


def bench_decode(page: int, running: int, repeats: int, device: torch.device) -> float:
    steps = max(repeats, 2 * page)  # every request rolls over at least once
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 1024, (running,), generator=gen).to(device)
    alloc = _allocator(page, running, 1024 + steps + 1, device)
    slots = torch.arange(1, running + 1, device=device)
    alloc.open(slots)
    alloc.extend(slots, prompt)
    return statistics.median(_timed(lambda: alloc.decode(slots), device) for _ in range(steps))


def bench_extend(page: int, chunk_tokens: int, repeats: int, device: torch.device) -> float:
    alloc = _allocator(page, 1, 1000 + chunk_tokens, device)
    slots = torch.tensor([1], device=device)
    prefix, chunk = torch.tensor([1000], device=device), torch.tensor([chunk_tokens], device=device)
    times = []
    for _ in range(repeats):
        alloc.open(slots)
        alloc.extend(slots, prefix)
        times.append(_timed(lambda: alloc.extend(slots, chunk), device))
        alloc.free(slots)
    return statistics.median(times)


def bench_free(page: int, tokens: int, repeats: int, device: torch.device) -> float:
    alloc = _allocator(page, 1, tokens, device)
    slots, n = torch.tensor([1], device=device), torch.tensor([tokens], device=device)
    times = []
    for _ in range(repeats):
        alloc.open(slots)
        alloc.extend(slots, n)
        alloc.evict_window(slots)
        times.append(_timed(lambda: alloc.free(slots), device))
    return statistics.median(times)


def bench_evict(
    page: int, running: int, repeats: int, device: torch.device, *, steady: bool
) -> float:
    """steady: one pass per decode step (0-1 page per request); else: right after prefill."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(512, 2048, (running,), generator=gen).to(device)
    alloc = _allocator(page, running, 2048 + repeats + 1, device)
    slots = torch.arange(1, running + 1, device=device)
    times = []
    if steady:
        alloc.open(slots)
        alloc.extend(slots, prompt)
        alloc.evict_window()
        for _ in range(max(repeats, page)):
            alloc.decode(slots)
            times.append(_timed(alloc.evict_window, device))
        return statistics.median(times)
    for _ in range(repeats):
        alloc.open(slots)
        alloc.extend(slots, prompt)
        times.append(_timed(alloc.evict_window, device))
        alloc.free(slots)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device, r = torch.device(args.device), args.repeats
    rows: list[tuple[str, Callable[[int], float]]] = [
        *[
            (f"decode step, {n} running", lambda p, n=n: bench_decode(p, n, r, device))
            for n in (1, 64, 1024, 4096)
        ],
        ("extend 4096-token chunk", lambda p: bench_extend(p, 4096, r, device)),
        ("free 32K-token request", lambda p: bench_free(p, 32768, r, device)),
        ("evict pass, 1024 req (decode)", lambda p: bench_evict(p, 1024, r, device, steady=True)),
        (
            "evict pass, 1024 req (prefill)",
            lambda p: bench_evict(p, 1024, 10, device, steady=False),
        ),
    ]
    threads = torch.get_num_threads()
    print(
        f"device={device}  torch={torch.__version__}  threads={threads}  "
        f"(us per call: median of {args.rounds} round medians, best round in brackets)"
    )
    print(f"{'operation':<34}{'page 256':>20}{'page 16':>20}")
    for name, fn in rows:
        cells = []
        for page in (256, 16):
            medians = [fn(page) for _ in range(args.rounds)]
            cells.append(f"{statistics.median(medians):.1f} [{min(medians):.1f}]")
        print(f"{name:<34}{cells[0]:>20}{cells[1]:>20}", flush=True)


if __name__ == "__main__":
    main()
