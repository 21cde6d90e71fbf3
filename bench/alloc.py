"""Microbenchmark of the KV allocator's hot operations (prints a table; not a test).

    .venv/bin/python bench/alloc.py [--device cpu|cuda] [--repeats N] [--rounds R] [--json]
        [--emulated] [--syncs]
    /tmp/sgl/bin/python bench/alloc.py --vs-sglang      # PYTHONPATH=worker:common (README)

Microseconds per call, one torch thread, page sizes 256 and 16. Each cell is the median of
`--rounds` round medians (each over `--repeats` calls): shared CPUs here add bursts of noise.
Arguments are host arrays, as the engine passes them (a tree whose allocator predates host
arguments gets tensors on the device: `bench/compare.py` runs this script on old trees too).

`--emulated` adds a column per page size for the same allocator built under
DSV4_EMULATE_DEVICE=1 on a CPU (the code CUDA runs: device tables apart from the host's,
written by uploads) beside the plain CPU path; `--syncs` adds the calls that would sync on
CUDA per operation (the most over its calls, counted on the emulated path by `SyncCounter`).

`--vs-sglang` runs SGLang's own `SWATokenToKVPoolAllocator` through the same scenarios in the
same process, round for round after ours, and prints ours / SGLang (below 1: ours is faster).
What SGLang is timed doing, per row (its tensors are built before the clock starts, as ours):
  decode        `alloc_decode(seq_lens, seq_lens_cpu, last_loc)`
  extend        `alloc_extend` of a 4096-token chunk after a 1000-token prefix
  tail prealloc `alloc_extend_swa_tail` of a 32K-token prompt (PD decode preallocation)
  free          a 32K-token request whose out-of-window SWA pages were freed: its segment
                frees, `free_full_segment` of the evicted part and `free_segment` of the rest
  evict         one free group over every request, `free_swa_segment` of each request's tokens
                that left the window since its last eviction (`maybe_evict_swa`'s loop)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from benchjson import Figure, emit

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.kv_allocator import KVAllocator

try:  # host arguments and the emulated device (issue #38); absent from older trees
    from dsv4_worker.mem.device import EMULATE_ENV
    from dsv4_worker.mem.sync_counter import SyncCounter

    HOST_ARGS = True
except ImportError:
    HOST_ARGS = False

MAX_CONTEXT_TOKENS = 65536
WINDOW_TOKENS = 128
LONG_TOKENS = 32768  # the free and tail-prealloc requests
EVICT_REQUESTS = 1024

Timer = Callable[..., tuple[float, Any]]


def _timer(device: torch.device) -> Timer:
    """timed(fn, *args): (microseconds, fn(*args))."""

    def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        out = fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter_ns() - t0) / 1e3, out

    return timed


def _sync_counter() -> Timer:
    """timed(fn, *args): (the calls in fn(*args) that would sync on CUDA, fn(*args))."""

    def counted(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        with SyncCounter() as counter:
            out = fn(*args)
        return float(counter.total), out

    return counted


def _pages(page: int, requests: int, tokens_per_request: int) -> int:
    return requests * (-(-tokens_per_request // page) + 2) + 64


def _window_floor(n: int, page: int) -> int:
    return max(0, n - WINDOW_TOKENS) // page * page


def _prompts(running: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (running,), generator=gen).tolist()


# -- ours ------------------------------------------------------------------------------------------


class Ours:
    """The scenarios on our KVAllocator: each returns the microseconds of its timed calls.
    `emulated`: built under DSV4_EMULATE_DEVICE=1; `syncs`: counts syncs instead of timing."""

    def __init__(self, device: torch.device, *, emulated: bool = False, syncs: bool = False):
        self.device = device
        self.emulated = emulated
        self.name = "syncs" if syncs else "emulated" if emulated else "ours"
        self.timed = _sync_counter() if syncs else _timer(device)

    def _alloc(self, page: int, requests: int, tokens_per_request: int) -> KVAllocator:
        pages = _pages(page, requests, tokens_per_request)
        cfg = AllocatorConfig(
            page_size=page,
            num_full_pages=pages,
            num_swa_pages=pages,
            num_request_slots=requests,
            max_pages_per_request=MAX_CONTEXT_TOKENS // page,
            window_tokens=WINDOW_TOKENS,
        )
        if not self.emulated:
            return KVAllocator(cfg, self.device)
        old = os.environ.get(EMULATE_ENV)
        os.environ[EMULATE_ENV] = "1"
        try:
            return KVAllocator(cfg, self.device)
        finally:
            if old is None:
                del os.environ[EMULATE_ENV]
            else:
                os.environ[EMULATE_ENV] = old

    def _tensor(self, values: list[int]) -> Any:
        """Host values as the engine passes them (an old tree: a tensor on the device)."""
        if HOST_ARGS:
            return np.array(values, dtype=np.int64)
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _slots(self, running: int) -> Any:
        return self._tensor(list(range(1, running + 1)))

    def decode(self, page: int, running: int, steps: int) -> list[float]:
        prompt = _prompts(running, 1, 1024, 0)
        alloc = self._alloc(page, running, 1024 + steps + 1)
        slots = self._slots(running)
        alloc.open(slots)
        alloc.extend(slots, self._tensor(prompt))
        return [self.timed(alloc.decode, slots)[0] for _ in range(steps)]

    def extend(self, page: int, chunk: int, repeats: int) -> list[float]:
        alloc = self._alloc(page, 1, 1000 + chunk)
        slots = self._tensor([1])
        prefix, more = self._tensor([1000]), self._tensor([chunk])
        times = []
        for _ in range(repeats):
            alloc.open(slots)
            alloc.extend(slots, prefix)
            times.append(self.timed(alloc.extend, slots, more)[0])
            alloc.free(slots)
        return times

    def tail(self, page: int, tokens: int, repeats: int) -> list[float]:
        alloc = self._alloc(page, 1, tokens)
        slots, n = self._tensor([1]), self._tensor([tokens])
        times = []
        for _ in range(repeats):
            alloc.open(slots)
            times.append(self.timed(alloc.alloc_tail, slots, n)[0])
            alloc.free(slots)
        return times

    def free(self, page: int, tokens: int, repeats: int) -> list[float]:
        alloc = self._alloc(page, 1, tokens)
        slots, n = self._tensor([1]), self._tensor([tokens])
        times = []
        for _ in range(repeats):
            alloc.open(slots)
            alloc.extend(slots, n)
            alloc.evict_window(slots)
            times.append(self.timed(alloc.free, slots)[0])
        return times

    def evict(self, page: int, running: int, repeats: int, *, steady: bool) -> list[float]:
        """steady: one pass per decode step (0-1 page per request); else right after prefill."""
        prompt = self._tensor(_prompts(running, 512, 2048, 1))
        alloc = self._alloc(page, running, 2048 + max(repeats, page) + 1)
        slots = self._slots(running)
        times = []
        if steady:
            alloc.open(slots)
            alloc.extend(slots, prompt)
            alloc.evict_window()
            for _ in range(max(repeats, page)):
                alloc.decode(slots)
                times.append(self.timed(alloc.evict_window)[0])
            return times
        for _ in range(repeats):
            alloc.open(slots)
            alloc.extend(slots, prompt)
            times.append(self.timed(alloc.evict_window)[0])
            alloc.free(slots)
        return times


# -- SGLang --------------------------------------------------------------------------------------


def load_sglang() -> tuple[Any, Any] | str:
    """(SWATokenToKVPoolAllocator, BaseSWAKVPool) of SGLang, or why they do not import."""
    try:
        import logging
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
            from sglang.version import __version__

            logging.disable(logging.NOTSET)
    except Exception as exc:  # any import failure means "not installed here"
        return f"{type(exc).__name__}: {exc}"
    print(f"sglang {__version__} from {sys.modules['sglang'].__file__}")
    return SWATokenToKVPoolAllocator, BaseSWAKVPool


@dataclass
class _Req:
    """One SGLang request's bookkeeping (the scheduler's, not timed)."""

    locs: torch.Tensor  # full-pool token index of each position (req_to_token row)
    evicted: int = 0  # tokens whose SWA rows were freed


class SGLang:
    """The same scenarios on SGLang's SWATokenToKVPoolAllocator (its allocator only: a stub KV
    pool holds no bytes, as ours holds none)."""

    name = "sglang"

    def __init__(self, device: torch.device, classes: tuple[Any, Any]) -> None:
        self.device = device
        self.timed = _timer(device)
        self.cls, base = classes

        class _Pool(base):  # type: ignore[misc, valid-type]
            """The SWA KV pool contract, without buffers."""

            def __init__(self) -> None:
                self.full_to_swa_index_mapping: torch.Tensor | None = None

            def register_mapping(self, mapping: torch.Tensor) -> None:
                self.full_to_swa_index_mapping = mapping

            def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
                assert self.full_to_swa_index_mapping is not None
                return self.full_to_swa_index_mapping[kv_indices]

            def get_state_buf_infos(self) -> Any:
                return [], [], []

            def get_key_buffer(self, layer_id: int) -> Any:
                raise NotImplementedError

            get_value_buffer = get_kv_buffer = set_kv_buffer = get_key_buffer

        self.pool = _Pool

    def _alloc(self, page: int, requests: int, tokens_per_request: int) -> Any:
        tokens = _pages(page, requests, tokens_per_request) * page
        return self.cls(
            tokens, tokens, page, torch.bfloat16, str(self.device), self.pool(), need_sort=False
        )

    def _t(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _prefill(self, alloc: Any, lens: list[int]) -> list[_Req]:
        out = alloc.alloc_extend(
            self._t([0] * len(lens)),
            torch.zeros(len(lens), dtype=torch.int64),
            self._t(lens),
            torch.tensor(lens, dtype=torch.int64),
            self._t([-1] * len(lens)),
            sum(lens),
        )
        assert out is not None, "sglang: out of pages in the setup"
        return [_Req(locs) for locs in out.split(lens)]

    def decode(self, page: int, running: int, steps: int) -> list[float]:
        lens = _prompts(running, 1, 1024, 0)
        alloc = self._alloc(page, running, 1024 + steps + 1)
        reqs = self._prefill(alloc, lens)
        last_loc = torch.stack([r.locs[-1] for r in reqs])
        seq_lens = self._t(lens)
        times = []
        for _ in range(steps):
            seq_lens += 1
            seq_cpu = seq_lens.cpu()
            us, last_loc = self.timed(alloc.alloc_decode, seq_lens, seq_cpu, last_loc)
            assert last_loc is not None
            times.append(us)
        return times

    def extend(self, page: int, chunk: int, repeats: int) -> list[float]:
        alloc = self._alloc(page, 1, 1000 + chunk)
        prefix, seq = self._t([1000]), self._t([1000 + chunk])
        prefix_cpu, seq_cpu = prefix.cpu(), seq.cpu()
        times = []
        for _ in range(repeats):
            (req,) = self._prefill(alloc, [1000])
            last = req.locs[-1:].clone()
            us, out = self.timed(alloc.alloc_extend, prefix, prefix_cpu, seq, seq_cpu, last, chunk)
            times.append(us)
            self._free_request(alloc, torch.cat([req.locs, out]), 0)
        return times

    def tail(self, page: int, tokens: int, repeats: int) -> list[float]:
        alloc = self._alloc(page, 1, tokens)
        zero, seq, last = self._t([0]), self._t([tokens]), self._t([-1])
        zero_cpu, seq_cpu = zero.cpu(), seq.cpu()
        tail = tokens - _window_floor(tokens, page)
        times = []
        for _ in range(repeats):
            us, out = self.timed(
                alloc.alloc_extend_swa_tail, zero, zero_cpu, seq, seq_cpu, last, tokens, tail
            )
            times.append(us)
            self._free_request(alloc, out, tokens - tail)
        return times

    def free(self, page: int, tokens: int, repeats: int) -> list[float]:
        alloc = self._alloc(page, 1, tokens)
        floor = _window_floor(tokens, page)
        times = []
        for _ in range(repeats):
            (req,) = self._prefill(alloc, [tokens])
            alloc.free_swa_segment(req.locs[:floor], start_pos=0)
            times.append(self.timed(self._free_request, alloc, req.locs, floor)[0])
        return times

    @staticmethod
    def _free_request(alloc: Any, locs: torch.Tensor, evicted: int) -> None:
        """A request's segment frees: full pages only where its SWA pages are gone already."""
        alloc.free_full_segment(locs[:evicted], start_pos=0)
        alloc.free_segment(locs[evicted:], start_pos=evicted)

    def _evict_pass(self, alloc: Any, reqs: list[_Req], lens: list[int], page: int) -> None:
        alloc.free_group_begin()
        for req, n in zip(reqs, lens, strict=True):
            new = _window_floor(n, page)
            if new > req.evicted:
                alloc.free_swa_segment(req.locs[req.evicted : new], start_pos=req.evicted)
                req.evicted = new
        alloc.free_group_end()

    def evict(self, page: int, running: int, repeats: int, *, steady: bool) -> list[float]:
        lens = _prompts(running, 512, 2048, 1)
        alloc = self._alloc(page, running, 2048 + max(repeats, page) + 1)
        times = []
        if steady:
            reqs = self._prefill(alloc, lens)
            self._evict_pass(alloc, reqs, lens, page)
            last_loc = torch.stack([r.locs[-1] for r in reqs])
            for _ in range(max(repeats, page)):
                lens = [n + 1 for n in lens]
                seq = self._t(lens)
                last_loc = alloc.alloc_decode(seq, seq.cpu(), last_loc)
                for req, loc in zip(reqs, last_loc.tolist(), strict=True):
                    req.locs = torch.cat([req.locs, self._t([loc])])
                times.append(self.timed(self._evict_pass, alloc, reqs, lens, page)[0])
            return times
        for _ in range(repeats):
            reqs = self._prefill(alloc, lens)
            times.append(self.timed(self._evict_pass, alloc, reqs, lens, page)[0])
            for r in reqs:
                self._free_request(alloc, r.locs, r.evicted)
        return times


# -- the table -----------------------------------------------------------------------------------

Scenario = Callable[[Any, int], list[float]]


def scenarios(repeats: int) -> list[tuple[str, Scenario]]:
    r = repeats
    rows: list[tuple[str, Scenario]] = [
        (f"decode step, {n} running", lambda s, p, n=n: s.decode(p, n, max(r, 2 * p)))
        for n in (1, 64, 1024)
    ]
    rows += [
        ("extend 4096-token chunk", lambda s, p: s.extend(p, 4096, r)),
        ("tail prealloc, 32K prompt", lambda s, p: s.tail(p, LONG_TOKENS, r)),
        ("free 32K-token request", lambda s, p: s.free(p, LONG_TOKENS, r)),
        ("evict pass, 1024 req (decode)", lambda s, p: s.evict(p, EVICT_REQUESTS, r, steady=True)),
        (
            "evict pass, 1024 req (prefill)",
            lambda s, p: s.evict(p, EVICT_REQUESTS, min(r, 10), steady=False),
        ),
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pages", type=int, nargs="*", default=[256, 16])
    parser.add_argument("--only", default="", help="rows whose name contains this text")
    parser.add_argument(
        "--vs-sglang", action="store_true", help="time SGLang's SWA allocator beside ours"
    )
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    parser.add_argument(
        "--emulated", action="store_true", help="also the CUDA code path on a CPU (see above)"
    )
    parser.add_argument("--syncs", action="store_true", help="also count syncs per operation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    systems: list[Any] = [Ours(device)]
    if (args.emulated or args.syncs) and not HOST_ARGS:
        parser.error("--emulated and --syncs need an allocator with host arguments (issue #38)")
    if args.emulated:
        if device.type != "cpu":
            parser.error("--emulated emulates a CUDA device on a CPU: use it with --device cpu")
        systems.append(Ours(device, emulated=True))
    if args.syncs:
        systems.append(Ours(device, emulated=device.type == "cpu", syncs=True))
    if args.vs_sglang:
        loaded = load_sglang()
        if isinstance(loaded, str):
            print(
                f"SGLang comparison skipped: sglang does not import ({loaded}); see bench/README.md"
            )
        else:
            systems.append(SGLang(device, loaded))
    print(
        f"device={device}  torch={torch.__version__}  threads={torch.get_num_threads()}  "
        f"(us per call: median of {args.rounds} round medians)"
    )
    heads = [f"{s.name} p{p}" for p in args.pages for s in systems]
    vs_sglang = any(s.name == "sglang" for s in systems)
    if vs_sglang:
        heads = [h for p in args.pages for h in (f"ours p{p}", f"sglang p{p}", f"ratio p{p}")]
    print(f"{'operation':<32}" + "".join(f"{h:>14}" for h in heads))
    figures: list[Figure] = []
    for name, run in scenarios(args.repeats):
        if args.only not in name:
            continue
        cells = []
        for page in args.pages:
            medians: dict[str, list[float]] = {s.name: [] for s in systems}
            for _ in range(args.rounds):  # systems alternate within each round
                for system in systems:
                    if system.name == "syncs":  # deterministic: the most over the calls
                        medians[system.name].append(max(run(system, page)))
                    else:
                        medians[system.name].append(statistics.median(run(system, page)))
            us = {k: statistics.median(v) for k, v in medians.items()}
            for system in systems:
                cells.append(f"{us[system.name]:.{0 if system.name == 'syncs' else 1}f}")
                unit = "syncs" if system.name == "syncs" else "us"
                figures.append(
                    Figure(f"{name} p{page} {system.name}", us[system.name], unit, "lower")
                )
            if vs_sglang:
                ratio = us["ours"] / us["sglang"]
                cells.append(f"{ratio:.2f}x")
                figures.append(Figure(f"{name} p{page} ours/sglang", ratio, "x", "lower"))
        print(f"{name:<32}" + "".join(f"{c:>14}" for c in cells), flush=True)
    if args.json:
        emit("alloc", figures)


if __name__ == "__main__":
    main()
