"""`dsv4 serve` through HTTP on loopback: generated tokens/s and time to first token at 1 and
32 concurrent streaming clients (prints a table; not a test).

    .venv/bin/python bench/serve.py [--device cpu|cuda] [--rounds R] [--max-tokens N] [--json]

Each client sends `--requests` streaming completions one after another (a 64-byte prompt,
`--max-tokens` greedy tokens). tokens/s = all generated tokens / wall time of the round; TTFT =
time from sending a request to its first streamed event. Medians over `--rounds` rounds.

Serving overhead = 1 - served tokens/s / replayed tokens/s: the replay builds the same engine
in this process (`dsv4 serve`'s own `build`, so with the thread settings the server runs with)
and runs the same requests through it directly, `clients` at a time, while the server idles.
What the server adds (HTTP, SSE, the event loop, the threads fighting over the cores) is the
overhead.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from benchjson import Figure, emit

from dsv4_local.ports import free_ports

if TYPE_CHECKING:
    from dsv4_worker.engine.loop import Engine

K = TypeVar("K")
PROMPT = "The quick brown fox jumps over the lazy dog; DSV4 serves it. " * 1


TINY = ["--model", "tiny", "--gpu-memory-gib", "0.25"]  # the small worker the tables compare


def serve_argv(*args: str) -> list[str]:
    """`dsv4 serve ARGS` as a subprocess argv."""
    return [sys.executable, "-m", "dsv4_cli", "serve", *args]


def _free_port() -> int:
    """A port below the ephemeral range (`dsv4_local.ports`): no outgoing connection takes it
    before the server binds it."""
    (port,) = free_ports(1)
    return port


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
    if resp.status != 200:  # a refused or failed request is no figure: say so, never count 0
        raise RuntimeError(f"HTTP {resp.status} from port {port}: {resp.read()[:300]!r}")
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

    errors: list[Exception] = []

    def client() -> None:
        try:
            for _ in range(requests):
                ttft, n = _one(port, max_tokens)
                with lock:
                    ttfts.append(ttft)
                    tokens[0] += n
        except Exception as exc:  # re-raised below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
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


def tiny_engine(device: str, serve_args: Sequence[str] = ()) -> Engine:
    """The engine `dsv4 serve --model tiny --device DEVICE SERVE_ARGS` builds, in this process
    (its runner thread not started)."""
    from dsv4_cli.main import build_parser
    from dsv4_worker.options import ServeOptions
    from dsv4_worker.serve import build

    argv = ["serve", "--model", "tiny", "--device", device, "--gpu-memory-gib", "0.25"]
    flags = build_parser().parse_args([*argv, "--port", str(_free_port()), *serve_args])
    return build(ServeOptions.from_args(flags)).runner.engine


def replay_tps(
    device: str,
    rounds: int,
    clients: list[int],
    requests: int,
    max_tokens: int,
    serve_args: list[str],
) -> dict[int, float]:
    """Median tokens/s of the same workload run through the engine directly (no HTTP), per
    number of clients."""
    from dsv4_common.core.presets import tiny
    from dsv4_worker.engine.sampler import SamplingParams
    from dsv4_worker.server.tokenizer import load_tokenizer

    engine = tiny_engine(device, serve_args)
    prompt = load_tokenizer(None, tiny().weights.vocab_size).encode(PROMPT)
    params = SamplingParams(max_new_tokens=max_tokens)
    engine.submit(prompt, SamplingParams(max_new_tokens=4))  # warm-up
    engine.run_until_idle()
    out = {}
    for batch in clients:
        runs = []
        for _ in range(rounds):
            tokens, t0 = 0, time.perf_counter()
            for _ in range(requests):
                for _ in range(batch):
                    engine.submit(prompt, params)
                done = []
                while not engine.idle:
                    done += engine.step()
                tokens += sum(len(r.output) for r in done)
            runs.append(tokens / (time.perf_counter() - t0))
        out[batch] = statistics.median(runs)
    return out


def _last_model(argv: Sequence[str]) -> str:
    """The model `dsv4 serve` takes from `argv`: its last --model, as its own argparse reads
    it (a --serve-arg may override tiny)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", default="tiny")
    return str(parser.parse_known_args(list(argv))[0].model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--no-replay", action="store_true", help="skip the serving overhead")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra `dsv4 serve` argument for the server and the replay (repeat; e.g. "
        "--serve-arg=--torch-threads=2)",
    )
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    args = parser.parse_args()
    port = _free_port()
    cmd = serve_argv("--model", "tiny")
    cmd += ["--port", str(port), "--device", args.device, "--gpu-memory-gib", "0.25"]
    cmd += args.serve_arg
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, proc)
        _round(port, 1, 1, 4)  # warm-up
        print(
            f"dsv4 serve {_last_model(cmd)} over HTTP, device={args.device}, "
            f"{args.max_tokens} tokens/request"
        )
        served = {}
        for clients in args.clients:
            runs = [
                _round(port, clients, args.requests, args.max_tokens) for _ in range(args.rounds)
            ]
            served[clients] = (
                statistics.median(r[0] for r in runs),
                statistics.median(r[1] for r in runs),
            )
        replayed = {}
        if not args.no_replay:  # the server idles meanwhile
            replayed = replay_tps(
                args.device,
                args.rounds,
                args.clients,
                args.requests,
                args.max_tokens,
                args.serve_arg,
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    figures: list[Figure] = []
    print(
        f"{'clients':>8}  {'tokens/s':>9}  {'TTFT ms (median)':>17}  "
        f"{'replayed':>9}  {'overhead':>8}"
    )
    for clients, (tps, ttft) in served.items():
        line = f"{clients:>8}  {tps:>9.1f}  {ttft:>17.1f}"
        figures += [
            Figure(f"tokens/s {clients} clients", tps, "tok/s", "higher"),
            Figure(f"TTFT {clients} clients", ttft, "ms", "lower"),
        ]
        if clients in replayed:
            overhead = 100 * (1 - tps / replayed[clients])
            line += f"  {replayed[clients]:>9.1f}  {overhead:>7.1f}%"
            figures += [
                Figure(
                    f"replayed tokens/s {clients} clients", replayed[clients], "tok/s", "higher"
                ),
                Figure(f"serving overhead {clients} clients", overhead, "%", "lower"),
            ]
        print(line)
    print(f"torch threads in this process after the replay: {torch_threads()}")
    if args.json:
        emit("serve", figures)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
