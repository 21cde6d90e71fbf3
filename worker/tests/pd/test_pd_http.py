"""PD as users run it: real `dsv4 serve` processes on 127.0.0.1 (prefill, decode, router) next
to a colocated worker. Through the router, greedy output (streamed and not) equals the
colocated worker's, token for token. Failures lose nothing, checked through `/metrics` on every
surviving worker: a client that disconnects mid-stream, a decode worker killed while its KV is
being written, a prefill worker killed after decode preallocated."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serve_support import PD_SECRET, WAIT_S, Deployment, free_port, post, serve_argv, wait_until

from dsv4_common.api.pd_secret import PREFILL_AUTH_HEADER, PREFILL_HEADER, sign_route

pytestmark = pytest.mark.slow
COMMON = ["--model", "tiny", "--gpu-memory-gib", "0.25", "--page-size", "16"]


def pd(backend: str, *, timeout_s: float = 60.0, prefill_chunk: int = 256) -> Deployment:
    d = Deployment()
    pp, kv, dp, rp = free_port(), free_port(), free_port(), free_port()
    pd_args = ["--transfer", backend, "--transfer-timeout-s", str(timeout_s)]
    d.start(
        "prefill",
        [
            *serve_argv(
                "--role", "prefill", *COMMON, *pd_args, "--port", str(pp), "--kv-port", str(kv)
            ),
            "--chunked-prefill-size",
            str(prefill_chunk),
        ],
        pp,
    )
    d.start(
        "decode",
        [
            *serve_argv("--role", "decode", *COMMON, *pd_args, "--port", str(dp)),
            "--prefill",
            f"127.0.0.1:{kv}",
        ],
        dp,
    )
    d.start(
        "router",
        [
            *serve_argv("--role", "router", "--port", str(rp)),
            "--instance",
            f"prefill=127.0.0.1:{pp}:{pp}:{kv}",
            "--instance",
            f"decode=127.0.0.1:{dp}:{dp}:{dp}",
        ],  # decode has no KV port
        rp,
    )
    d.ready()
    return d


def prompt(n: int, salt: int) -> list[int]:
    return [((31 * i + 7 * salt) % 250) + 3 for i in range(n)]


@pytest.fixture(scope="module", params=["nixl", "zmq"])
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    d = pd(request.param)
    colocated_port = free_port()
    d.start("colocated", serve_argv(*COMMON, "--port", str(colocated_port)), colocated_port)
    d.ready()
    try:
        yield d
    finally:
        d.stop()


def test_router_output_equals_colocated(deployment: Deployment) -> None:
    router, colo = deployment.procs["router"], deployment.procs["colocated"]
    for i, n in enumerate((5, 40, 150, 300)):
        body = {"prompt": prompt(n, i), "max_tokens": 12, "return_token_ids": True}
        s1, want = post(colo.port, body)
        s2, got = post(router.port, body)
        assert (s1, s2) == (200, 200), (want, got)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        s3, events = post(router.port, {**body, "stream": True})
        assert s3 == 200
        assert events[-1]["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    for name in ("prefill", "decode"):
        p = deployment.procs[name]
        wait_until(lambda p=p: p.used_pages() == 0, f"{name} to free every page")
    _, status = deployment.procs["decode"].get("/status")
    assert json.loads(status)["kv_transfer"]["ready"] is True


def _post_with_id(port: int, request_id: str | None, stream: bool) -> tuple[str, str]:
    """(the X-Request-Id header, the completion's id) of one answer."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    body = {"prompt": prompt(20, 3), "max_tokens": 3, "stream": stream}
    headers = {"X-Request-Id": request_id} if request_id is not None else {}
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers)
        r = c.getresponse()
        raw = r.read().decode()
        assert r.status == 200, raw
        first = raw.removeprefix("data: ").split("\n", 1)[0] if stream else raw
        return r.getheader("X-Request-Id") or "", json.loads(first)["id"]
    finally:
        c.close()


def test_one_request_id_from_the_client_through_the_router_and_both_workers(
    deployment: Deployment,
) -> None:
    """The client's X-Request-Id names the answer through the router (the decode answered it
    under the router's first attempt, which is the id itself); without one the router names
    the request. (In-process tests show the decode and prefill engines and every transfer tag
    use it: worker/tests/pd/test_pd_request_id.py.)"""
    router = deployment.procs["router"].port
    for stream in (False, True):
        header, completion_id = _post_with_id(router, f"client-7.{stream}", stream)
        assert (header, completion_id) == (f"client-7.{stream}", f"cmpl-client-7.{stream}")
        header, completion_id = _post_with_id(router, None, stream)
        assert len(header) == 32 and completion_id == f"cmpl-{header}"
    for name in ("prefill", "decode"):
        p = deployment.procs[name]
        wait_until(lambda p=p: p.used_pages() == 0, f"{name} to free every page")


def _post_to_decode(port: int, headers: dict[str, str]) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        body = json.dumps({"prompt": prompt(20, 3), "max_tokens": 2}).encode()
        c.request("POST", "/v1/completions", body=body, headers=headers)
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def test_a_client_cannot_make_a_decode_dial_a_prefill_of_its_choosing(
    deployment: Deployment,
) -> None:
    """#37: a decode dialed whatever prefill a client named in X-DSV4-Prefill and sent it its
    transfer descriptor. Now the header counts only with the router's signature over the
    request id, that address and an expiry: without it, forged, for another request or
    another address, or expired, the answer is a 403 naming the header and nothing is dialed.
    The router's own requests (test_router_output_equals_colocated) pass."""
    decode = deployment.procs["decode"]
    kv = deployment.procs["prefill"]
    key = PD_SECRET.encode()
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.setblocking(False)
        target = f"127.0.0.1:{trap.getsockname()[1]}"
        now = time.time()
        cases = {
            "unsigned": {},
            "forged": {PREFILL_AUTH_HEADER: f"{int(now) + 60}.{'0' * 64}"},
            "another request": {PREFILL_AUTH_HEADER: sign_route(key, "other", target, now)},
            "another address": {
                PREFILL_AUTH_HEADER: sign_route(key, "mine", f"127.0.0.1:{kv.port}", now)
            },
            "expired": {PREFILL_AUTH_HEADER: sign_route(key, "mine", target, now - 3600)},
        }
        for name, extra in cases.items():
            headers = {"X-Request-Id": "mine", PREFILL_HEADER: target, **extra}
            status, body = _post_to_decode(decode.port, headers)
            assert status == 403, (name, body)
            assert body["error"]["param"] == PREFILL_HEADER, (name, body)
            assert body["error"]["code"] == "unsigned_prefill", (name, body)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody dialed it
    wait_until(lambda: decode.used_pages() == 0, "decode to hold nothing")


def test_disconnect_mid_stream_frees_both_sides(deployment: Deployment) -> None:
    router = deployment.procs["router"]
    c = http.client.HTTPConnection("127.0.0.1", router.port, timeout=WAIT_S)
    body = {"prompt": prompt(200, 9), "max_tokens": 400, "stream": True}
    c.request("POST", "/v1/completions", body=json.dumps(body).encode())
    r = c.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # the first token arrived
    c.close()  # the client goes away mid-stream
    for name in ("prefill", "decode"):
        p = deployment.procs[name]
        wait_until(lambda p=p: p.used_pages() == 0, f"{name} to free every page")


@pytest.mark.parametrize("backend", ["nixl", "zmq"])
@pytest.mark.parametrize(
    ("victim", "survivor"),
    [("decode", "prefill"), ("prefill", "decode")],
    ids=["decode-killed-mid-transfer", "prefill-killed-after-preallocation"],
)
def test_a_killed_worker_leaves_nothing_on_the_survivor(
    backend: str, victim: str, survivor: str
) -> None:
    """The survivor holds the request's pages (prefill computing a long prompt in small chunks,
    or decode's preallocation); the other side is killed; the survivor frees everything within
    its transfer timeout and the client gets an error, not a hang."""
    d = pd(backend, timeout_s=3.0, prefill_chunk=16)
    try:
        alive, dead, router = (d.procs[n] for n in (survivor, victim, "router"))
        result: list[tuple[int, Any]] = []
        body = {"prompt": prompt(1500, 3), "max_tokens": 4}
        client = threading.Thread(target=lambda: result.append(post(router.port, body)))
        client.start()
        wait_until(lambda: alive.used_pages() > 0, f"{survivor} to hold the request's pages")
        dead.kill()
        wait_until(lambda: alive.used_pages() == 0, f"{survivor} to free everything")
        client.join(WAIT_S)
        assert result and result[0][0] >= 500, result
    finally:
        d.stop()
