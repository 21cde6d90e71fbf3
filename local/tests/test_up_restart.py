"""`dsv4 up` supervising the real workers and router (issue #25 items 5 and 6), on the tiny
samples: kill -9 of the decode worker restarts it while the prefill and the router keep their
processes and keep answering (requests meanwhile get 200 or a quick 503 + Retry-After, never a
hang), and new requests succeed once it is back; kill -9 of one decode PP stage restarts the
whole group; the router's printed status URL serves /status; the PP rendezvous listens on
127.0.0.1 only; SIGTERM or SIGINT then stops every process, the killed and restarted ones'
successors included. The budget running out is shown on stand-ins (test_supervisor.py)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from faultkit import Deployment, is_gone, wait_until
from listeners import listening_addresses

pytestmark = pytest.mark.slow
RECOVER_S = 180.0
BODY = {"prompt": "This License applies to", "max_tokens": 4, "temperature": 0}


def request(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> tuple[int, str]:
    """(status, body); status 0 when the connection failed. No proxy, loopback only."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, parts.path or "/", body=data)
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace")
        retry_after = resp.getheader("Retry-After")
        return resp.status, text if retry_after is None else f"{text} Retry-After={retry_after}"
    except (OSError, http.client.HTTPException):
        return 0, ""
    finally:
        conn.close()


def stop_and_check_no_orphans(handle: Deployment, signum: signal.Signals) -> None:
    handle.units()  # every PID it has run
    handle.popen.send_signal(signum)
    assert handle.popen.wait(timeout=120) == 0, handle.err()
    for pid in handle.seen_pids:
        wait_until(lambda pid=pid: is_gone(pid), f"process {pid} to be gone", 30.0)


class Sampler:
    """Polls URLs in a thread until stopped; keeps every (url, status, body)."""

    def __init__(self, calls: list[tuple[str, str, dict[str, Any] | None]]) -> None:
        self.calls = calls
        self.results: list[tuple[str, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.is_set():
            for url, method, body in self.calls:
                status, text = request(url, method, body)
                self.results.append((url, status, text))
            self._stop.wait(0.2)


def recovered(router_api: str) -> Callable[[], bool]:
    return lambda: request(f"{router_api}/v1/completions", "POST", BODY)[0] == 200


def test_a_killed_decode_is_restarted_while_the_others_keep_serving(tmp_path: Path) -> None:
    with Deployment.start("tiny-pd.yaml", tmp_path) as handle:
        api = handle.url("api", "router")
        status, text = request(handle.url("status", "router"))  # the printed URL answers
        assert status == 200 and json.loads(text)["ready"] is True
        assert request(f"{api}/v1/completions", "POST", BODY)[0] == 200
        before = handle.pids()

        probes = [(handle.url("status", n), "GET", None) for n in ("prefill-0", "router")]
        completions = [(f"{api}/v1/completions", "POST", BODY)]
        with Sampler(probes) as others, Sampler(completions) as clients:
            os.kill(before["decode-0"], signal.SIGKILL)
            wait_until(lambda: "decode-0 ready again" in handle.err(), "the restart", RECOVER_S)
            wait_until(recovered(api), "a request to succeed again", RECOVER_S)

        assert others.results and {s for _, s, _ in others.results} == {200}
        outcomes = {s for _, s, _ in clients.results}
        assert outcomes <= {200, 503}, clients.results
        assert all("Retry-After=1" in t for _, s, t in clients.results if s == 503)
        assert (
            "dsv4 up: decode-0 exited with code -9 (SIGKILL); restarting in 1 s (restart 1 of 5)"
            in handle.err()
        )
        after = handle.pids()
        assert after["prefill-0"] == before["prefill-0"] and after["router"] == before["router"]
        assert after["decode-0"] != before["decode-0"]
        units = handle.units()
        assert units["decode-0"]["restarts"] == 1 and units["decode-0"]["state"] == "ready"
        assert "code -9" in units["decode-0"]["last_exit"]
        stop_and_check_no_orphans(handle, signal.SIGTERM)


def test_a_killed_prefill_is_restarted_and_the_running_decode_serves_it(tmp_path: Path) -> None:
    """#25 item 2: the decode, not restarted, handshakes with the new prefill process (before,
    every request through it got 502 "no handshake" until the decode itself restarted)."""
    with Deployment.start("tiny-pd.yaml", tmp_path) as handle:
        api = handle.url("api", "router")
        assert request(f"{api}/v1/completions", "POST", BODY)[0] == 200
        before = handle.pids()
        completions = [(f"{api}/v1/completions", "POST", BODY)]
        with Sampler(completions) as clients:
            os.kill(before["prefill-0"], signal.SIGKILL)
            wait_until(lambda: "prefill-0 ready again" in handle.err(), "the restart", RECOVER_S)
            wait_until(recovered(api), "a request to succeed again", RECOVER_S)
        assert all("Retry-After=1" in t for _, s, t in clients.results if s in (502, 503)), (
            clients.results
        )
        assert {s for _, s, _ in clients.results} <= {200, 502, 503}, clients.results
        after = handle.pids()
        assert after["prefill-0"] != before["prefill-0"]
        assert after["decode-0"] == before["decode-0"] and after["router"] == before["router"]
        stop_and_check_no_orphans(handle, signal.SIGTERM)


def test_a_killed_pp_stage_restarts_its_whole_group(tmp_path: Path) -> None:
    with Deployment.start("tiny-pp.yaml", tmp_path) as handle:
        api = handle.url("api", "router")
        for role in ("prefill", "decode"):  # item 6: the rendezvous on 127.0.0.1 only
            config = json.loads((tmp_path / f"{role}-0" / f"{role}-rank-0.json").read_text())
            assert listening_addresses(config["ports"]["pp"]) == {"127.0.0.1"}
        assert request(f"{api}/v1/completions", "POST", BODY)[0] == 200
        before = handle.pids()

        os.kill(before["decode-0-rank-1"], signal.SIGKILL)
        wait_until(lambda: "decode-0 ready again" in handle.err(), "the restart", RECOVER_S)
        wait_until(recovered(api), "a request to succeed again", RECOVER_S)

        assert (
            "dsv4 up: decode-0-rank-1 exited with code -9 (SIGKILL); restarting its PP group "
            "decode-0 (2 processes) in 1 s (restart 1 of 5)"
        ) in handle.err()
        after = handle.pids()
        for name in ("decode-0-rank-0", "decode-0-rank-1"):
            assert after[name] != before[name]
        for name in ("prefill-0-rank-0", "prefill-0-rank-1", "router"):
            assert after[name] == before[name]
        stop_and_check_no_orphans(handle, signal.SIGINT)
