"""PP x PD as users run it: a prefill group of two stage processes (each sends its own layers)
and a decode group of one stage (every prefill stage writes into it) or two (stage i into
stage i), next to a colocated worker. Decode's output equals the colocated worker's, token for
token (greedy and seeded), over NIXL and pyzmq, and every pool of every process is empty
afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from serve_support import Deployment, free_port, post, serve_argv, wait_until

pytestmark = pytest.mark.slow
COMMON = ["--model", "tiny", "--gpu-memory-gib", "0.25", "--page-size", "16"]


@pytest.fixture(
    scope="module",
    params=[("nixl", 1), ("zmq", 1), ("nixl", 2), ("zmq", 2)],
    ids=lambda p: f"{p[0]}-decode-pp{p[1]}",
)
def pp_pd(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    backend, decode_pp = request.param
    d = Deployment()
    pd_args = ["--transfer", backend, "--chunked-prefill-size", "32"]
    addr, kv = f"127.0.0.1:{free_port()}", free_port()
    for rank in range(2):
        port = free_port()
        argv = serve_argv(*COMMON, *pd_args, "--role", "prefill", "--port", str(port))
        argv += ["--pp-size", "2", "--pp-rank", str(rank), "--pp-addr", addr, "--kv-port", str(kv)]
        d.start(f"prefill-{rank}", argv, port)
    decode_addr = f"127.0.0.1:{free_port()}"
    for rank in range(decode_pp):
        port = free_port()
        argv = serve_argv(*COMMON, *pd_args, "--role", "decode", "--port", str(port))
        argv += ["--prefill", f"127.0.0.1:{kv}"]
        if decode_pp > 1:
            argv += ["--pp-size", str(decode_pp), "--pp-rank", str(rank), "--pp-addr", decode_addr]
        d.start("decode" if rank == 0 else f"decode-{rank}", argv, port)
    port = free_port()
    d.start("colocated", serve_argv(*COMMON, "--port", str(port)), port)
    d.ready()
    try:
        yield d
    finally:
        d.stop()


def test_decode_output_equals_colocated(pp_pd: Deployment) -> None:
    decode, colo = pp_pd.procs["decode"], pp_pd.procs["colocated"]
    for i, n in enumerate((5, 40, 150)):
        ids = [(31 * j + 7 * i) % 250 + 3 for j in range(n)]
        body = {"prompt": ids, "max_tokens": 10, "return_token_ids": True}
        if i == 1:
            body |= {"temperature": 0.9, "top_k": 30, "seed": 11}
        s1, want = post(colo.port, body)
        s2, got = post(decode.port, body)
        assert (s1, s2) == (200, 200), (want, got)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    for name, p in pp_pd.procs.items():
        wait_until(lambda p=p: p.used_pages() == 0, f"{name} to free every page")
    for name in ("prefill-1", "decode"):
        _, status = pp_pd.procs[name].get("/status")
        assert json.loads(status)["kv_transfer"]["ready"] is True
