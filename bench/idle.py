"""CPU an idle worker burns, per role (prints a table; not a test).

    .venv/bin/python bench/idle.py [--window-s 30] [--transfer nixl|zmq] [--threads]

Starts a colocated `dsv4 serve` and a PD stack (router, prefill, decode: bench/pd.py's), sends
one request through each (so the PD handshake and the transfer engines are up), then reads
utime + stime of every process from /proc/<pid>/stat at the start and the end of a quiet
`--window-s` window: the share of one core each used while nothing was asked of it (target:
<= 0.5% for every role, #38 item 6). `--threads` also lists each process's busiest threads
(/proc/<pid>/task/<tid>/stat) to find a polling loop.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pd as pd_bench
import serve as http_bench

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int, tid: int | None = None) -> int:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)


def thread_ticks(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = cpu_ticks(pid, int(task.name))
        except (OSError, IndexError):
            continue
    return out


def _complete(port: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = c.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"a request through port {port}: HTTP {response.status}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--transfer", choices=("nixl", "zmq"), default="nixl")
    ap.add_argument("--threads", action="store_true", help="list the busiest threads too")
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = http_bench._free_port()
        colocated = ["--port", str(port)]
        pd_bench._start(http_bench.serve_argv(*http_bench.TINY, *colocated), port, procs)
        _complete(port)
        router = pd_bench._pd("cpu", args.transfer, 1, procs)
        _complete(router)
        names = ["colocated", "prefill", "decode", "router"]
        time.sleep(2.0)  # let the request's aftermath (idle checks, pump back-off) settle
        start = {p.pid: cpu_ticks(p.pid) for p in procs}
        threads = {p.pid: thread_ticks(p.pid) for p in procs} if args.threads else {}
        t0 = time.monotonic()
        time.sleep(args.window_s)
        elapsed_s = time.monotonic() - t0
        print(f"idle CPU over {elapsed_s:.1f} s (load {os.getloadavg()[0]:.1f}), {args.transfer}")
        print(f"{'process':<10} {'% of a core':>12}")
        for name, p in zip(names, procs, strict=True):
            used_s = (cpu_ticks(p.pid) - start[p.pid]) / TICKS_PER_S
            print(f"{name:<10} {100 * used_s / elapsed_s:>11.2f}%   (pid {p.pid})")
            if args.threads:
                now = thread_ticks(p.pid)
                busy = sorted(((now[t] - threads[p.pid].get(t, 0), t) for t in now), reverse=True)[
                    :4
                ]
                for ticks, tid in busy:
                    comm = Path(f"/proc/{p.pid}/task/{tid}/comm").read_text().strip()
                    share = 100 * ticks / TICKS_PER_S / elapsed_s
                    print(f"    thread {tid} ({comm}): {share:.2f}%")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
