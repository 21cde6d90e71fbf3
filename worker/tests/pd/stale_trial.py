"""The stale-write trial of issue #37 item 2, with real `dsv4 serve` processes on 127.0.0.1.

Two prefills (P1 computes slowly: 16-token chunks), one decode whose default prefill is P1:

1. request A (a long prompt) goes to P1; once decode has preallocated it, after a random
   delay inside P1's prefill, P1 is stopped (SIGSTOP), mid-prompt or inside a write;
2. decode gives up on A (its heartbeat: 1.5 s) and answers 502;
3. request B (another long prompt, greedy) goes to P2 (`X-DSV4-Prefill`, signed as the
   router signs it) and gets decode's free pages: on a decode that freed A's pages at once,
   the same ones;
4. as B's first token arrives, P1 resumes (SIGCONT): whatever it still writes for A must not
   reach B's pages. B's answer must equal its answer on the clean deployment.

Used by `test_stale_writes.py` (a few trials per backend) and `bench/fence.py` (20 each).
"""

from __future__ import annotations

import functools
import http.client
import json
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serve_support import ENV, Deployment, Proc, free_port, serve_argv, wait_until

from dsv4_common.api.pd_secret import PD_SECRET_ENV, PREFILL_AUTH_HEADER, sign_route
from dsv4_worker.pd.prefill import FAULT_ENV as PREFILL_FAULT_ENV

COMMON = ["--model", "tiny", "--gpu-memory-gib", "0.25", "--page-size", "16"]
SECRET = "stale-trial-" + "0123456789abcdef" * 3  # the deployment's PD secret (test only)
PROMPT_TOKENS = 1500
A_PROMPT = [((31 * i) % 250) + 3 for i in range(PROMPT_TOKENS)]
B_PROMPT = [((17 * i + 5) % 240) + 7 for i in range(PROMPT_TOKENS)]
B_MAX_TOKENS = 48
A_PAGES = -(-PROMPT_TOKENS // 16)  # A's full pages (16-token pages)
SETTLE_S = 90.0  # quarantine, re-handshake and frees after a trial, on a loaded machine


def _pd(backend: str) -> list[str]:
    return ["--transfer", backend, "--transfer-timeout-s", "60"]


@dataclass
class Stand:
    """P1, P2 and the decode; B's clean answer; every process's output lines."""

    deployment: Deployment
    backend: str
    p1_kv: int
    p2_kv: int
    clean_b: str = ""
    lines: dict[str, list[str]] = field(default_factory=dict)

    def count(self, name: str, needle: str) -> int:
        return sum(needle in line for line in list(self.lines.get(name, ())))

    @property
    def p1(self) -> Proc:
        return self.deployment.procs["p1"]

    @property
    def p2(self) -> Proc:
        return self.deployment.procs["p2"]

    @property
    def decode(self) -> Proc:
        return self.deployment.procs["decode"]


def start(backend: str, *, guard: bool = True) -> Stand:
    """`guard` False: P1 writes on even when its decode's liveness is stale (a test hook), so
    only the decode's fence stands between its stale writes and B's pages."""
    d = Deployment()
    env = {PD_SECRET_ENV: SECRET}
    p1_env = env if guard else {**env, PREFILL_FAULT_ENV: "write-when-stale"}
    p1, p1_kv, p2, p2_kv, dp = (free_port() for _ in range(5))
    d.start(
        "p1",
        [
            *serve_argv("--role", "prefill", *COMMON, *_pd(backend)),
            *("--port", str(p1), "--kv-port", str(p1_kv), "--chunked-prefill-size", "16"),
        ],
        p1,
        p1_env,
    )
    d.start(
        "p2",
        [
            *serve_argv("--role", "prefill", *COMMON, *_pd(backend)),
            *("--port", str(p2), "--kv-port", str(p2_kv)),
        ],
        p2,
        env,
    )
    d.start(
        "decode",
        [
            *serve_argv("--role", "decode", *COMMON, *_pd(backend)),
            *("--port", str(dp), "--prefill", f"127.0.0.1:{p1_kv}"),
        ],
        dp,
        env,
    )
    stand = Stand(d, backend, p1_kv, p2_kv)
    for name, proc in d.procs.items():  # read on: a full pipe would stall the process
        stand.lines[name] = []
        threading.Thread(target=_read, args=(proc, stand.lines[name]), daemon=True).start()
    try:
        d.ready()
    except AssertionError as exc:  # its output went to `lines`
        d.stop()
        tails = {n: "".join(lines[-20:]) for n, lines in stand.lines.items()}
        raise AssertionError(f"{exc}; output: {tails}") from exc
    status, events = stream_b(stand, on_first=lambda: None)
    assert status == 200, events
    stand.clean_b = text_of(events)
    settle(stand)
    return stand


def _read(proc: Proc, lines: list[str]) -> None:
    assert proc.proc.stdout is not None
    for raw in proc.proc.stdout:
        lines.append(raw.decode(errors="replace"))


def post(port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers or {})
    r = c.getresponse()
    return r.status, json.loads(r.read())


def signed_prefill(request_id: str, target: str) -> dict[str, str]:
    """The headers the router sends to name a prefill for request `request_id`."""
    return {
        "X-Request-Id": request_id,
        "X-DSV4-Prefill": target,
        PREFILL_AUTH_HEADER: sign_route(SECRET.encode(), request_id, target, time.time()),
    }


def stream_b(stand: Stand, on_first: Callable[[], None]) -> tuple[int, list[Any]]:
    """B to P2, streamed greedily; `on_first` runs as its first token arrives."""
    rid = f"b-{random.getrandbits(48):012x}"
    body = {"prompt": B_PROMPT, "max_tokens": B_MAX_TOKENS, "temperature": 0, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", stand.decode.port, timeout=120)
    headers = signed_prefill(rid, f"127.0.0.1:{stand.p2_kv}")
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers)
    r = c.getresponse()
    if r.status != 200:
        return r.status, [json.loads(r.read())]
    events: list[Any] = []
    while True:
        line = r.readline()
        if not line:
            break
        text = line.decode().strip()
        if not text.startswith("data: ") or text == "data: [DONE]":
            continue
        events.append(json.loads(text[6:]))
        if len(events) == 1:
            on_first()
    return 200, events


def text_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


@dataclass
class Outcome:
    trials: int = 0
    corrupted: int = 0  # B answered 200 with another text than on the clean deployment
    b_failed: int = 0  # B did not answer 200 (not a corruption; counted apart)
    a_served: int = 0  # A finished before the stop came: no trial (retried)
    held: int = 0  # decode held A's pages until P1 was provably done (NIXL)
    refused: int = 0  # writes the decode's target refused (zmq: A's revoked grant)
    dropped: int = 0  # sessions P1 dropped on resuming (no fresh ping)
    notes: list[str] = field(default_factory=list)


def trial(stand: Stand, rng: random.Random, out: Outcome) -> None:
    """One trial (retried while A finishes before the stop)."""
    p1 = stand.p1.proc
    for _ in range(10):
        result: list[tuple[int, Any]] = []
        client = threading.Thread(target=_post_a, args=(stand, result), daemon=True)
        client.start()
        wait_until(functools.partial(_in_flight, stand, result), "A to be preallocated")
        # Stop P1 at a random point of A's prompt, by the pages its chunks have taken so far
        # (a page per 16-token chunk), then a random moment within that step: half the
        # trials anywhere in the prompt, half at its end (its last step and write: the
        # window tail and the request state).
        end = rng.random() < 0.5
        pages = A_PAGES if end else rng.randint(2, A_PAGES)
        wait_until(
            functools.partial(_past, stand, result, pages), "P1 to compute part of A", SETTLE_S
        )
        time.sleep(rng.uniform(0.0, 0.1 if end else 0.05))
        p1.send_signal(signal.SIGSTOP)
        client.join(120)
        assert result, "A got no answer"
        if result[0][0] != 200:
            break
        out.a_served += 1  # A was done before the stop: resume and try again
        p1.send_signal(signal.SIGCONT)
        settle(stand)
    else:
        raise AssertionError("A always finished before P1 was stopped")
    resumed = threading.Event()

    def resume() -> None:
        p1.send_signal(signal.SIGCONT)
        resumed.set()

    try:
        status, events = stream_b(stand, on_first=resume)
    finally:
        if not resumed.is_set():
            p1.send_signal(signal.SIGCONT)
    out.trials += 1
    if status != 200:
        out.b_failed += 1
        out.notes.append(f"B: {status} {events}")
    elif text_of(events) != stand.clean_b:
        out.corrupted += 1
        out.notes.append(f"B corrupted: {text_of(events)!r} != {stand.clean_b!r}")
    settle(stand)


def _post_a(stand: Stand, out: list[tuple[int, Any]]) -> None:
    out.append(post(stand.decode.port, {"prompt": A_PROMPT}))


def _in_flight(stand: Stand, result: list[tuple[int, Any]]) -> bool:
    return stand.decode.used_pages() > 0 or bool(result)


def _past(stand: Stand, result: list[tuple[int, Any]], pages: int) -> bool:
    return stand.p1.used_pages() >= pages or bool(result)


def settle(stand: Stand) -> None:
    """Every process idle with no page used: quarantine cleared, nothing leaked."""
    for proc in (stand.decode, stand.p1, stand.p2):
        wait_until(lambda p=proc: p.used_pages() == 0, f"{proc.name} to free every page", SETTLE_S)


def run(backend: str, trials: int, seed: int = 0, *, guard: bool = True) -> Outcome:
    stand = start(backend, guard=guard)
    out = Outcome()
    rng = random.Random(seed)
    try:
        for _ in range(trials):
            trial(stand, rng, out)
    finally:
        stand.deployment.stop()
        out.held = stand.count("decode", "keep their pages until it is provably closed")
        out.refused = stand.count("decode", "refused write")
        out.dropped = stand.count("p1", "no fresh ping")
    return out


__all__ = ["ENV", "Outcome", "run"]
