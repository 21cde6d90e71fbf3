"""`dsv4 up` scaling under a real load ramp (issue #41 item 2): the tiny model's
crds/samples/tiny-autoscale.yaml (decode autoscaled 1..4 on its queue and binding KV pool)
started with `dsv4 up`, then closed-loop clients through the router, ramped 1 -> 64 and back
to 1 and held there until decode is back to its minimum.

    python bench/autoscale_ramp.py [--hold-s 20] [--max-clients 64] [--max-tokens 16]

Every answer is counted: 200, 503 with Retry-After (shed: the client waits that long, at most
1 s, and goes on) or anything else (failed: the count the issue wants at 0). Twice a second it
samples the decode groups `dsv4 up` runs (WORKDIR/autoscaling.json) and the decode instances
the router lists and finds eligible (GET /status on its status port): the router learning of
each change. Prints the timeline of changes and one line of figures (bench/benchjson.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp
from benchjson import Figure, emit

ROOT: Final = Path(__file__).resolve().parent.parent
SAMPLE: Final = ROOT / "crds" / "samples" / "tiny-autoscale.yaml"
PROMPT: Final = "Scaling a decode pool one group at a time, the router learns of it. " * 2


@dataclass
class Counts:
    ok: int = 0
    shed: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)


@dataclass
class Sample:
    t_s: float
    clients: int
    decode_groups: int | None  # what dsv4 up runs (its last decision)
    router_decodes: int  # decode instances router.json lists, as the router knows them
    router_eligible: int  # of those, eligible now


async def client(
    session: aiohttp.ClientSession, url: str, counts: Counts, stop: asyncio.Event, max_tokens: int
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                text = await resp.read()
                if resp.status == 200:
                    counts.ok += 1
                    counts.latency_s.append(time.monotonic() - t0)
                    continue
                retry = resp.headers.get("Retry-After")
                if resp.status == 503 and retry is not None:
                    counts.shed += 1
                    await asyncio.sleep(min(1.0, float(retry)))
                    continue
                counts.failed += 1
                counts.failures.append(f"{resp.status}: {text[:200]!r}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            counts.failed += 1
            counts.failures.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.2)


async def sampler(
    session: aiohttp.ClientSession,
    status_url: str,
    decisions: Path,
    clients: list[int],
    samples: list[Sample],
    t0: float,
    stop: asyncio.Event,
) -> None:
    while not stop.is_set():
        groups = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            groups = json.loads(decisions.read_text())["decode"]["replicas"]
        listed = eligible = 0
        try:
            async with session.get(status_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                doc = await resp.json()
            decodes = [i for i in doc["instances"] if i["role"] == "decode"]
            listed, eligible = len(decodes), sum(i["state"] == "eligible" for i in decodes)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            pass
        samples.append(
            Sample(round(time.monotonic() - t0, 1), clients[0], groups, listed, eligible)
        )
        await asyncio.sleep(0.5)


async def ramp(
    url: str, status_url: str, workdir: Path, args: argparse.Namespace
) -> tuple[Counts, list[Sample], float]:
    counts = Counts()
    samples: list[Sample] = []
    clients = [0]
    t0 = time.monotonic()
    stop_all = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        watch = asyncio.create_task(
            sampler(
                session, status_url, workdir / "autoscaling.json", clients, samples, t0, stop_all
            )
        )
        running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []
        every_task: list[asyncio.Task[None]] = []  # a stopped client ends its request first

        async def set_clients(n: int) -> None:
            while len(running) < n:
                stop = asyncio.Event()
                task = asyncio.create_task(client(session, url, counts, stop, args.max_tokens))
                running.append((stop, task))
                every_task.append(task)
            while len(running) > n:
                stop, task = running.pop()
                stop.set()
            clients[0] = n

        steps = [1, 2, 4, 8, 16, 32, args.max_clients]
        for n in [*steps, *reversed(steps)]:
            await set_clients(n)
            await asyncio.sleep(args.hold_s)
        # One client until decode is back at its minimum (the window, then the cooldown).
        deadline = time.monotonic() + args.settle_s
        while time.monotonic() < deadline:
            last = samples[-1] if samples else None
            if last is not None and last.decode_groups == 1 and last.router_decodes == 1:
                break
            await asyncio.sleep(1.0)
        ended_s = time.monotonic() - t0
        await set_clients(0)
        await asyncio.gather(*every_task, return_exceptions=True)
        stop_all.set()
        await watch
    return counts, samples, ended_s


def start_up(workdir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """`dsv4 up` of the sample; (process, router API URL, router status URL)."""
    out = (workdir / "up.out").open("wb")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "dsv4_cli", "up", str(SAMPLE), "--port", "0"),
            *("--workdir", str(workdir), "--timeout-s", "600"),
        ],
        stdout=out,
        stderr=log.open("wb"),
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = (workdir / "up.out").read_text()
        api = re.search(r"api:\s+router\s+(http://\S+)", text)
        status = re.search(r"status:\s+router\s+(http://\S+)", text)
        if api and status:
            return proc, api.group(1), status.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"dsv4 up exited: see {log}")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("dsv4 up was not ready in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-s", type=float, default=20.0, help="seconds at each client count")
    parser.add_argument("--max-clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=180.0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-ramp-"))
    log = workdir / "up.log"
    proc, url, status_url = start_up(workdir, log)
    try:
        counts, samples, ended_s = asyncio.run(ramp(url, status_url, workdir, args))
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    changes: list[Sample] = []
    for s in samples:
        if not changes or (s.decode_groups, s.router_decodes, s.router_eligible) != (
            changes[-1].decode_groups,
            changes[-1].router_decodes,
            changes[-1].router_eligible,
        ):
            changes.append(s)
    print("t_s  clients  decode_groups(dsv4 up)  router_decodes(listed/eligible)")
    for s in changes:
        router = f"{s.router_decodes}/{s.router_eligible}"
        print(f"{s.t_s:6.1f} {s.clients:3d}  {s.decode_groups}  {router}")
    scale_lines = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if "autoscaling:" in line or "retired" in line or " started:" in line or "stopped" in line
    ]
    print("\n".join(scale_lines))
    most = max((s.decode_groups or 0) for s in samples)
    lat = sorted(counts.latency_s)
    p50 = lat[len(lat) // 2] if lat else float("nan")
    print(
        f"ok {counts.ok}, shed (503 + Retry-After) {counts.shed}, failed {counts.failed}; "
        f"decode 1 -> {most} -> {changes[-1].decode_groups if changes else None}; "
        f"{ended_s:.0f} s; workdir {workdir}"
    )
    for failure in counts.failures[:10]:
        print(f"failed: {failure}")
    emit(
        "autoscale_ramp",
        [
            Figure("ok_requests", counts.ok, "requests", "higher"),
            Figure("shed_requests", counts.shed, "requests", "lower"),
            Figure("failed_requests", counts.failed, "requests", "lower"),
            Figure("most_decode_groups", most, "groups", "higher"),
            Figure(
                "final_decode_groups",
                (changes[-1].decode_groups or 0) if changes else 0,
                "groups",
                "lower",
            ),
            Figure("p50_latency", round(p50, 3), "s", "lower"),
        ],
    )


if __name__ == "__main__":
    main()
