"""PD fail-fast and healing with real `dsv4 serve` processes on 127.0.0.1 (#25 item 2).

- A prefill killed (-9) or stopped (SIGSTOP) while decode holds a request's preallocation: the
  client gets a 502/503 with Retry-After within 2 s (the decode's heartbeat), not after the
  transfer timeout; decode's pages go back to 0.
- The prefill restarted at the same address (or resumed): new requests succeed again without
  restarting decode (decode handshakes with the new process).
- A decode whose `--prefill` is not an address answers within 2 s, and SIGINT stops it.
- A decode whose control thread dies (test hook) fails the request and exits non-zero.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from serve_support import Deployment, Proc, free_port, serve_argv, wait_until

from dsv4_worker.pd.decode import FAULT_ENV

pytestmark = pytest.mark.slow
COMMON = ["--model", "tiny", "--gpu-memory-gib", "0.25", "--page-size", "16"]
TIME_TO_ERROR_S = 2.0  # the brief's bound, from the fault to the client's answer
HEAL_S = 60.0  # from the restarted prefill's /ready to a served request (router probes incl.)
LONG = {"prompt": [((31 * i) % 250) + 3 for i in range(1500)], "max_tokens": 4}
ATTEMPTS = 5
SHORT = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 2}


def post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, str], Any, float]:
    """(status, headers, JSON body, when the answer came: time.monotonic())."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode())
    r = c.getresponse()
    raw = r.read()
    return r.status, dict(r.getheaders()), json.loads(raw), time.monotonic()


def prefill_argv(backend: str, port: int, kv: int) -> list[str]:
    pd = ["--transfer", backend, "--transfer-timeout-s", "60"]
    return [
        *serve_argv("--role", "prefill", *COMMON, *pd, "--port", str(port), "--kv-port", str(kv)),
        "--chunked-prefill-size",
        "16",  # a long prompt takes many steps: the request is in flight when the fault comes
    ]


def decode_argv(backend: str, port: int, prefill: str) -> list[str]:
    pd = ["--transfer", backend, "--transfer-timeout-s", "60"]
    return [
        *serve_argv("--role", "decode", *COMMON, *pd, "--port", str(port)),
        "--prefill",
        prefill,
    ]


def deploy(backend: str) -> tuple[Deployment, int]:
    """prefill + decode + router; returns the deployment and the prefill's KV port."""
    d = Deployment()
    pp, kv, dp, rp = free_port(), free_port(), free_port(), free_port()
    d.start("prefill", prefill_argv(backend, pp, kv), pp)
    d.start("decode", decode_argv(backend, dp, f"127.0.0.1:{kv}"), dp)
    router = [
        *serve_argv("--role", "router", "--port", str(rp)),
        *("--instance", f"prefill=127.0.0.1:{pp}:{pp}:{kv}"),
        *("--instance", f"decode=127.0.0.1:{dp}:{dp}:{dp}"),
    ]
    d.start("router", router, rp)
    d.ready()
    return d, kv


def _post_into(out: list[tuple[int, dict[str, str], Any, float]], port: int, body: Any) -> None:
    out.append(post(port, body))


def _in_flight(decode: Proc, result: list[Any]) -> Any:
    return lambda: decode.used_pages() > 0 or bool(result)


def fault_during_request(d: Deployment, fault: Any) -> tuple[int, dict[str, str], Any, float]:
    """Start LONG through the router, apply `fault` once decode preallocated it; (status,
    headers, body, seconds from the fault to the answer)."""
    decode, router = d.procs["decode"], d.procs["router"]
    for _ in range(ATTEMPTS):  # an idle machine may serve LONG between two /metrics reads
        result: list[tuple[int, dict[str, str], Any, float]] = []
        client = threading.Thread(target=_post_into, args=(result, router.port, LONG))
        client.start()
        wait_until(_in_flight(decode, result), "decode to preallocate")
        if not result:
            break
        client.join()
        assert result[0][0] == 200, result
    else:
        pytest.fail(f"LONG never stayed in flight long enough in {ATTEMPTS} attempts")
    fault_s = time.monotonic()
    fault()
    client.join(60)
    assert result, "no answer"
    status, headers, body, at = result[0]
    return status, headers, body, at - fault_s


def served_again(router: Proc, timeout_s: float) -> float:
    """Seconds until a request through the router succeeds (retrying 5xx)."""
    start = time.monotonic()
    while True:
        status, _, body, _ = post(router.port, SHORT)
        if status == 200:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, (status, body)
        time.sleep(0.2)


def assert_retryable(status: int, headers: dict[str, str], body: Any) -> None:
    assert status in (502, 503), (status, body)
    assert headers.get("Retry-After") == "1", headers


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_killed_prefill_fails_fast_and_a_restarted_one_serves(backend: str) -> None:
    d, kv = deploy(backend)
    try:
        prefill, decode, router = (d.procs[n] for n in ("prefill", "decode", "router"))
        served_again(router, HEAL_S)  # warm (each router process must see decode ready)
        status, headers, body, took_s = fault_during_request(d, prefill.kill)
        assert_retryable(status, headers, body)
        assert took_s < TIME_TO_ERROR_S, f"the answer came {took_s:.2f} s after the kill"
        wait_until(lambda: decode.used_pages() == 0, "decode to free the preallocation")
        # The same address, a new process: decode was not restarted.
        d.start("prefill", prefill_argv(backend, prefill.port, kv), prefill.port)
        d.ready()
        print(f"@liveness {backend} kill: error after {took_s:.2f} s", flush=True)
        healed_s = served_again(router, HEAL_S)
        print(f"@liveness {backend} restart: served {healed_s:.2f} s after ready", flush=True)
        wait_until(lambda: decode.used_pages() == 0, "decode to be idle")
        wait_until(lambda: d.procs["prefill"].used_pages() == 0, "the new prefill to be idle")
    finally:
        d.stop()


def test_stopped_prefill_fails_fast_and_heals_when_resumed() -> None:
    d, _ = deploy("zmq")
    try:
        prefill, decode, router = (d.procs[n] for n in ("prefill", "decode", "router"))
        served_again(router, HEAL_S)  # warm (each router process must see decode ready)
        stop = lambda: prefill.proc.send_signal(signal.SIGSTOP)  # noqa: E731
        try:
            status, headers, body, took_s = fault_during_request(d, stop)
            assert_retryable(status, headers, body)
            assert took_s < TIME_TO_ERROR_S, f"the answer came {took_s:.2f} s after SIGSTOP"
            wait_until(lambda: decode.used_pages() == 0, "decode to free the preallocation")
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        print(f"@liveness zmq sigstop: error after {took_s:.2f} s", flush=True)
        healed_s = served_again(router, HEAL_S)
        print(f"@liveness zmq sigcont: served {healed_s:.2f} s after SIGCONT", flush=True)
        # The resumed prefill dropped the request it held (decode was silent to it).
        wait_until(lambda: prefill.used_pages() == 0, "the resumed prefill to free everything")
        wait_until(lambda: decode.used_pages() == 0, "decode to be idle")
    finally:
        d.stop()


def test_a_decode_with_a_bad_prefill_address_answers_and_stops_on_sigint() -> None:
    d = Deployment()
    dp = free_port()
    decode = d.start("decode", decode_argv("zmq", dp, "nohost.invalid:9"), dp)
    try:
        d.ready()
        start = time.monotonic()
        status, headers, body, at = post(dp, SHORT)
        assert_retryable(status, headers, body)
        # An unresolvable name (a malformed address is refused at start, exit 2): zmq keeps
        # retrying it, so the handshake's deadline answers, naming the prefill.
        message = body["error"]["message"]
        assert "prefill nohost.invalid:9" in message, body
        assert "cannot connect" in message or "no answer" in message, body
        assert at - start < TIME_TO_ERROR_S
        decode.proc.send_signal(signal.SIGINT)
        assert decode.proc.wait(timeout=30) == 0
    finally:
        d.stop()


def test_a_dead_decode_control_thread_exits_non_zero() -> None:
    d = Deployment()
    pp, kv, dp = free_port(), free_port(), free_port()
    d.start("prefill", prefill_argv("zmq", pp, kv), pp)
    decode = d.start(
        "decode", decode_argv("zmq", dp, f"127.0.0.1:{kv}"), dp, env={FAULT_ENV: "control-crash"}
    )
    try:
        d.ready()
        status, headers, body, _ = post(dp, SHORT)
        assert_retryable(status, headers, body)
        assert "control thread died" in body["error"]["message"], body
        assert decode.proc.wait(timeout=30) == 1
        out = decode.proc.stdout.read().decode() if decode.proc.stdout else ""
        assert "decode control thread died" in out and "exiting" in out, out[-2000:]
    except subprocess.TimeoutExpired:
        pytest.fail("the decode did not exit after its control thread died")
    finally:
        d.stop()
