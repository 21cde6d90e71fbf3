"""KV transfer bandwidth: nixl, zmq and a plain memcpy on one scattered page pattern (prints a
table; not a test).

    .venv/bin/python bench/transfer.py [--total-mib 256] [--page-kib 1024] [--device cpu|cuda]
                                       [--repeats N] [--backends nixl,zmq]

A region of `--total-mib` split into pages of `--page-kib`; every source page goes to a shuffled
destination page (few blocks merge). nixl and zmq: the target (decode) runs in a spawned child,
the initiator (prefill) here; a write is timed until `write` returns (every byte landed). memcpy:
`index_select` of the same pages into another tensor of this process. GB/s = 1e9 bytes/s: the
median of `--repeats` after one warm-up, [min - max]; each ratio is to memcpy's median. The
child checks the bytes it received against the memcpy result (sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from dsv4_worker.pd.transfer import Block, Region, TransferError, make_initiator, make_target

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
    """The decode side: a zeroed region; answer "digest" with its sha256, stop on "stop"."""
    torch.set_num_threads(1)
    target = make_target(backend, host="127.0.0.1")
    region = torch.zeros(shape, dtype=torch.uint8, device=device)
    target.register([Region(REGION, region)])
    conn.send(target.descriptor())
    try:
        while True:
            while not conn.poll(0.05):
                target.poll_landed()
            if conn.recv() == "stop":
                return
            target.poll_landed()
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
    backend: str, src: torch.Tensor, perm: torch.Tensor, repeats: int, want: str
) -> tuple[list[float], bool]:
    """Seconds per write of every page to a spawned target; whether its bytes matched `want`."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    shape = (src.shape[0], src.shape[1])
    proc = ctx.Process(target=target_main, args=(there, backend, shape, src.device.type))
    proc.start()
    initiator = make_initiator(backend, name="bench")
    try:
        if not here.poll(WAIT_S):
            raise TransferError(f"{backend}: the target process did not start")
        initiator.register([Region(REGION, src)])
        initiator.connect("target", here.recv())
        blocks = page_blocks(perm, src.shape[1])
        count = iter(range(1 << 30))

        def write() -> None:
            initiator.write("target", blocks, f"w{next(count)}", timeout_s=WAIT_S)

        times = _timed(write, repeats, src.device)
        here.send("digest")
        ok = here.poll(WAIT_S) and here.recv() == want
        here.send("stop")
        proc.join(WAIT_S)
        return times, ok
    finally:
        initiator.close()
        if proc.is_alive():
            proc.kill()
            proc.join()


def _timed(fn: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    fn()  # warm-up: page faults, connections
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


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
    args = parser.parse_args()
    device = torch.device(args.device)
    page_bytes = args.page_kib << 10
    num_pages = (args.total_mib << 20) // page_bytes
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
    print(f"{'backend':<10}{'GB/s':>8}{'[min - max]':>18}{'x memcpy':>10}  check")
    memcpy_times, want = bench_memcpy(src, perm, args.repeats)
    base = _row("memcpy", memcpy_times, nbytes, None, "-")
    for backend in args.backends.split(","):
        try:
            times, ok = bench_backend(backend, src, perm, args.repeats, want)
        except TransferError as exc:
            print(f"{backend:<10}skipped: {exc}", flush=True)
            continue
        _row(backend, times, nbytes, base, "bytes ok" if ok else "BYTES DIFFER")


def _row(name: str, times: list[float], nbytes: int, base: float | None, check: str) -> float:
    rates = [nbytes / t / 1e9 for t in times]
    median = statistics.median(rates)
    spread = f"[{min(rates):.2f} - {max(rates):.2f}]"
    ratio = f"{median / base:.2f}" if base else "1.00"
    print(f"{name:<10}{median:>8.2f}{spread:>18}{ratio:>10}  {check}", flush=True)
    return median


if __name__ == "__main__":
    main()
