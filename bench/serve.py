"""`dsv4 serve` through HTTP on loopback: generated tokens/s and time to first token at 1 and
32 concurrent streaming clients (prints a table; not a test).

    .venv/bin/python bench/serve.py [--device cpu|cuda] [--rounds R] [--max-tokens N]

Each client sends `--requests` streaming completions one after another (a 64-byte prompt,
`--max-tokens` greedy tokens). tokens/s = all generated tokens / wall time of the round; TTFT =
time from sending a request to its first streamed event. Medians over `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import TypeVar

K = TypeVar("K")
PROMPT = "The quick brown fox jumps over the lazy dog; DSV4 serves it. " * 1


TINY = ["--model", "tiny", "--gpu-memory-gib", "0.25"]  # the small worker the tables compare


def serve_argv(*args: str) -> list[str]:
    """`dsv4 serve ARGS` as a subprocess argv."""
    return [sys.executable, "-m", "dsv4_common.cli", "serve", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def _one(port: int, max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, tokens) of one streaming request."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = c.getresponse()
    ttft, tokens = None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if ttft is None:
            ttft = time.perf_counter() - t0
        choice = json.loads(line[6:])["choices"][0]
        if choice.get("finish_reason"):
            tokens = len(choice.get("token_ids", []))
    c.close()
    return (ttft or 0.0), tokens


def _round(port: int, clients: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """(tokens/s, median TTFT ms) of one round."""
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client() -> None:
        for _ in range(requests):
            ttft, n = _one(port, max_tokens)
            with lock:
                ttfts.append(ttft)
                tokens[0] += n

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return tokens[0] / wall, statistics.median(ttfts) * 1e3


def interleaved(
    ports: dict[K, int], clients: int, requests: int, max_tokens: int, rounds: int
) -> dict[K, tuple[float, float]]:
    """(median tokens/s, median TTFT ms) per server over `rounds`; each round runs every
    server once, in turn, so they share the machine's noise."""
    runs: dict[K, list[tuple[float, float]]] = {k: [] for k in ports}
    for _ in range(rounds):
        for key, port in ports.items():
            runs[key].append(_round(port, clients, requests, max_tokens))
    return {
        k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
        for k, v in runs.items()
    }


def ttft_side_by_side(
    ports: dict[K, int], requests: int, max_tokens: int, seed: int = 0
) -> dict[K, list[float]]:
    """TTFT ms of `requests` single requests per server at low load (one at a time), visiting
    every server once per cycle in a shuffled order, so each pair of figures shares the
    machine's noise of the same moment."""
    order, rng = list(ports), random.Random(seed)
    ttfts: dict[K, list[float]] = {k: [] for k in ports}
    for _ in range(requests):
        rng.shuffle(order)
        for key in order:
            ttfts[key].append(_one(ports[key], max_tokens)[0] * 1e3)
    return ttfts


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-quantile (0 < q <= 1)."""
    ranked = sorted(values)
    return ranked[max(0, min(len(ranked) - 1, round(q * len(ranked)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 32])
    args = parser.parse_args()
    port = _free_port()
    cmd = serve_argv("--model", "tiny")
    cmd += ["--port", str(port), "--device", args.device, "--gpu-memory-gib", "0.25"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, proc)
        _round(port, 1, 1, 4)  # warm-up
        print(f"dsv4 serve tiny over HTTP, device={args.device}, {args.max_tokens} tokens/request")
        print(f"{'clients':>8}  {'tokens/s':>9}  {'TTFT ms (median)':>17}")
        for clients in args.clients:
            runs = [
                _round(port, clients, args.requests, args.max_tokens) for _ in range(args.rounds)
            ]
            tps = statistics.median(r[0] for r in runs)
            ttft = statistics.median(r[1] for r in runs)
            print(f"{clients:>8}  {tps:>9.1f}  {ttft:>17.1f}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
