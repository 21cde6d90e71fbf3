"""KV transfer bandwidth: nixl, zmq and a plain memcpy on one scattered page pattern (prints a
table; not a test).

    .venv/bin/python bench/transfer.py [--total-mib 256] [--page-kib 1024] [--device cpu|cuda]
                                       [--repeats N] [--backends nixl,zmq]
                                       [--nixl-threads 0,2,4]

A region of `--total-mib` split into pages of `--page-kib`; every source page goes to a shuffled
destination page (few blocks merge). nixl and zmq: the target (decode) runs in a spawned child,
the initiator (prefill) here; a write is timed until `write` returns (every byte landed). nixl
runs one initiator per `--nixl-threads` entry (its poster threads; the worker's default is 2)
into the same target, timed in turn within each repeat so the rows share the machine's noise.
memcpy: `index_select` of the same pages into another tensor of this process (torch's threads).
GB/s = 1e9 bytes/s: the median of `--repeats` after one warm-up, [min - max]; each ratio is to
memcpy's median. Each initiator's first write goes into a zeroed target, which then checks the
bytes against the memcpy result (sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from dsv4_worker.pd.transfer import (
    Block,
    Region,
    TransferError,
    TransferInitiator,
    make_initiator,
    make_target,
)

os.environ.setdefault("UCX_NET_DEVICES", "lo")
REGION = "kv"
WAIT_S = 120.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(-1).numpy().tobytes()).hexdigest()


def page_blocks(perm: torch.Tensor, page_bytes: int) -> list[Block]:
    """Source page i -> destination page perm[i]."""
    return [
        Block(REGION, i * page_bytes, d * page_bytes, page_bytes)
        for i, d in enumerate(perm.tolist())
    ]


def target_main(conn: Connection, backend: str, shape: tuple[int, int], device: str) -> None:
    """The decode side: a region; "zero" zeroes it, "digest" answers its sha256, "stop"."""
    torch.set_num_threads(1)
    target = make_target(backend, host="127.0.0.1")
    region = torch.zeros(shape, dtype=torch.uint8, device=device)
    target.register([Region(REGION, region)])
    conn.send(target.descriptor())
    try:
        while True:
            while not conn.poll(0.05):
                target.poll_landed()
            command = conn.recv()
            if command == "stop":
                return
            target.poll_landed()
            if command == "zero":
                region.zero_()
                _sync(region.device)
                conn.send("zeroed")
            else:
                conn.send(_digest(region))
    finally:
        target.close()


def bench_memcpy(src: torch.Tensor, perm: torch.Tensor, repeats: int) -> tuple[list[float], str]:
    """Seconds per gather of every page to its destination (`index_select` into `dst`: one
    memcpy per page; `index_copy_` is 5x slower on CPU), and the digest of the result."""
    dst = torch.zeros_like(src)
    source_of = torch.argsort(perm).to(src.device)  # dst page d <- src page source_of[d]

    def copy() -> None:
        torch.index_select(src, 0, source_of, out=dst)

    return _timed(copy, repeats, src.device), _digest(dst)


def bench_backend(
    backend: str,
    variants: Sequence[int | None],
    src: torch.Tensor,
    perm: torch.Tensor,
    repeats: int,
    want: str,
) -> list[tuple[list[float], bool]]:
    """For each variant (an initiator with that many write threads): seconds per write of every
    page to one spawned target, the variants timed in turn within each repeat; and whether its
    first write, into a zeroed target, left exactly `want`."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    shape = (src.shape[0], src.shape[1])
    proc = ctx.Process(target=target_main, args=(there, backend, shape, src.device.type))
    proc.start()
    initiators: list[TransferInitiator] = []

    def answer(waiting_for: str) -> Any:
        """The target's next message; a target that died or went silent is an error at once,
        not a wait of WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not here.poll(0.1):
            if not proc.is_alive():
                raise TransferError(
                    f"{backend}: the target process exited ({proc.exitcode}) before {waiting_for}"
                )
            if time.monotonic() > deadline:
                raise TransferError(f"{backend}: no {waiting_for} from the target in {WAIT_S}s")
        return here.recv()

    def ask(command: str) -> str:
        here.send(command)
        reply: str = answer(f"its answer to {command!r}")
        return reply

    try:
        descriptor = answer("its descriptor")
        blocks = page_blocks(perm, src.shape[1])
        count = iter(range(1 << 30))
        writes, checks = [], []
        for threads in variants:
            initiator = make_initiator(backend, name="bench", threads=threads)
            initiators.append(initiator)
            initiator.register([Region(REGION, src)])
            initiator.connect("target", descriptor)

            def write(i: TransferInitiator = initiator) -> None:
                i.write("target", blocks, f"w{next(count)}", timeout_s=WAIT_S)

            ask("zero")
            write()  # also the warm-up: page faults, connections
            checks.append(ask("digest") == want)
            writes.append(write)
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(repeats):
            for fn, spent in zip(writes, times, strict=True):
                spent.append(_time_once(fn, src.device))
        here.send("stop")
        proc.join(WAIT_S)
        return list(zip(times, checks, strict=True))
    finally:
        for initiator in initiators:
            initiator.close()
        if proc.is_alive():
            proc.kill()
            proc.join()


def _time_once(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _timed(fn: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    fn()  # warm-up: page faults
    return [_time_once(fn, device) for _ in range(repeats)]


def _versions() -> str:
    found = []
    for dist in ("nixl-cu12", "nixl-cu13", "nixl", "pyzmq"):
        try:
            found.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "  ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--page-kib", type=int, default=1024)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="nixl,zmq")
    parser.add_argument(
        "--nixl-threads",
        default="0,2,4",
        help="nixl initiators to compare, by write threads (2: the worker's default)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    page_bytes = args.page_kib << 10
    num_pages = (args.total_mib << 20) // page_bytes
    if args.page_kib < 1 or num_pages < 1:
        parser.error(f"--total-mib {args.total_mib} holds no page of --page-kib {args.page_kib}")
    nbytes = num_pages * page_bytes
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=gen)
    src = src.to(device)
    perm = torch.randperm(num_pages, generator=gen)

    print(
        f"cpus={os.cpu_count()}  torch={torch.__version__}  threads={torch.get_num_threads()}  "
        f"{_versions()}  UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}"
    )
    print(
        f"device={device}  region={nbytes >> 20} MiB  pages={num_pages} x {args.page_kib} KiB  "
        f"(GB/s: median of {args.repeats} after a warm-up, [min - max]; x memcpy)"
    )
    print(f"{'backend':<12}{'GB/s':>8}{'[min - max]':>18}{'x memcpy':>10}  check")
    memcpy_times, want = bench_memcpy(src, perm, args.repeats)
    base = _row("memcpy", memcpy_times, nbytes, None, "-")
    nixl_threads = [int(t) for t in args.nixl_threads.split(",")]
    for backend in args.backends.split(","):
        variants: list[int | None] = list(nixl_threads) if backend == "nixl" else [None]
        try:
            results = bench_backend(backend, variants, src, perm, args.repeats, want)
        except TransferError as exc:
            print(f"{backend:<12}skipped: {exc}", flush=True)
            continue
        for threads, (times, ok) in zip(variants, results, strict=True):
            name = backend if threads is None else f"{backend} t={threads}"
            _row(name, times, nbytes, base, "bytes ok" if ok else "BYTES DIFFER")


def _row(name: str, times: list[float], nbytes: int, base: float | None, check: str) -> float:
    rates = [nbytes / t / 1e9 for t in times]
    median = statistics.median(rates)
    spread = f"[{min(rates):.2f} - {max(rates):.2f}]"
    ratio = f"{median / base:.2f}" if base else "1.00"
    print(f"{name:<12}{median:>8.2f}{spread:>18}{ratio:>10}  {check}", flush=True)
    return median


if __name__ == "__main__":
    main()
