"""PP groups as users run them: `dsv4 serve --pp-size N --pp-rank R` processes on 127.0.0.1.
The leader serves the API with the oracle's tokens; later stages answer the probes with their
own realized capacity; and a stage killed mid-request fails the group as a unit: the leader
turns unready within seconds, the request in flight ends with an error (no hang), new requests
get 503, and every survivor frees every page."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from serve_support import Deployment, free_port, post, serve_argv, wait_until

from dsv4_common.core.presets import tiny
from dsv4_worker.model.oracle import oracle_greedy
from dsv4_worker.model.weights import init_weights

pytestmark = pytest.mark.slow
# --seed 0: the random weights the oracle test rebuilds (not the preset's shipped ones).
COMMON = ["--model", "tiny", "--seed", "0", "--gpu-memory-gib", "0.25", "--page-size", "16"]
FAIL_WITHIN_S = 20.0  # the group's PP timeout (5 s) plus slack for a loaded machine


def group(pp_size: int, *, cuda: bool = False) -> Deployment:
    """A PP group; `cuda`: each stage on its own GPU (CUDA_VISIBLE_DEVICES=rank), so its
    activations travel over NCCL."""
    d = Deployment()
    addr = f"127.0.0.1:{free_port()}"
    for rank in range(pp_size):
        port = free_port()
        argv = serve_argv(*COMMON, "--port", str(port), "--pp-size", str(pp_size))
        argv += ["--pp-rank", str(rank), "--pp-addr", addr, "--pp-timeout-s", "5"]
        env = None
        if cuda:
            argv += ["--device", "cuda"]
            env = {"CUDA_VISIBLE_DEVICES": str(rank)}
        d.start(f"rank-{rank}", argv, port, env)
    d.ready()
    return d


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_a_cuda_pp_group_over_nccl_equals_one_stage() -> None:
    """PP=2 on two GPUs (activations over NCCL) answers token for token as one GPU does."""
    prompts = [[(7 * i + n) % 250 for i in range(n)] for n in (5, 70, 300)]
    answers = []
    for size in (1, 2):
        d = group(size, cuda=True)
        try:
            got = []
            for ids in prompts:
                body = {"prompt": ids, "max_tokens": 12, "return_token_ids": True}
                status, out = post(d.procs["rank-0"].port, body)
                assert status == 200, out
                got.append(out["choices"][0]["token_ids"])
            answers.append(got)
            for p in d.procs.values():
                wait_until(lambda p=p: p.used_pages() == 0, f"{p.name} to free every page")
        finally:
            d.stop()
    assert answers[0] == answers[1]


@pytest.fixture
def three() -> Iterator[Deployment]:
    d = group(3)
    try:
        yield d
    finally:
        d.stop()


def test_a_pp_group_serves_the_oracles_tokens(three: Deployment) -> None:
    leader = three.procs["rank-0"]
    weights = init_weights(tiny(), seed=0)
    for n in (5, 70):
        ids = [(7 * i + n) % 250 for i in range(n)]
        status, body = post(leader.port, {"prompt": ids, "max_tokens": 8, "return_token_ids": True})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == oracle_greedy(tiny(), weights, ids, 8)
    for rank in range(3):
        code, text = three.procs[f"rank-{rank}"].get("/status")
        assert code == 200
        assert json.loads(text)["pp_rank"] == rank
        held = json.loads(text)["weights"]  # each stage holds what the plan counts for it
        assert held["held_bytes"] == held["planned_bytes"] > 0, (rank, held)
    # Later stages do not serve the API: their port answers the probes only.
    code, _ = _post_raw(three.procs["rank-1"].port, {"prompt": "hi"})
    assert code == 404
    for p in three.procs.values():
        wait_until(lambda p=p: p.used_pages() == 0, f"{p.name} to free every page")


def test_a_killed_stage_fails_the_group_and_the_survivors_free_everything(
    three: Deployment,
) -> None:
    leader, victim, last = (three.procs[f"rank-{r}"] for r in range(3))
    result: list[tuple[int, Any]] = []
    body = {"prompt": [5] * 300, "max_tokens": 3000, "stream": True}
    client = threading.Thread(target=lambda: result.append(post(leader.port, body)))
    client.start()
    wait_until(lambda: all(p.used_pages() > 0 for p in (leader, last)), "the request to run")
    victim.kill()
    wait_until(lambda: leader.get("/ready")[0] == 503, "the leader to turn unready", FAIL_WITHIN_S)
    client.join(FAIL_WITHIN_S)
    assert not client.is_alive(), "the request in flight hangs"
    status, events = result[0]
    assert status == 200  # it had streamed tokens; the stream ends with an error event
    assert events and "error" in events[-1], events[-1:]
    for p in (leader, last):
        wait_until(lambda p=p: p.used_pages() == 0, f"{p.name} to free every page", FAIL_WITHIN_S)
    wait_until(
        lambda: last.get("/ready")[0] == 503, "the last stage to turn unready", FAIL_WITHIN_S
    )
    code, refused = _post_raw(leader.port, {"prompt": "hi", "max_tokens": 2})
    assert code == 503 and "PP stage" in refused["error"]["message"]
    # It can serve no more: /live fails (a supervisor restarts the group), and on SIGTERM
    # each survivor leaves without the teardown a broken gloo group can hang (exit code 1).
    assert leader.get("/live")[0] == 503 and last.get("/live")[0] == 503
    for p in (leader, last):
        p.proc.terminate()
    for p in (leader, last):
        assert p.proc.wait(timeout=FAIL_WITHIN_S) == 1


def _post_raw(port: int, body: dict[str, Any]) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode())
    r = c.getresponse()
    raw = r.read().decode()
    try:
        return r.status, json.loads(raw)
    except json.JSONDecodeError:
        return r.status, raw


def test_a_killed_leader_fails_the_followers(three: Deployment) -> None:
    """The leader (the serving rank) dies mid-request: the later stages notice within their
    PP timeout, free everything and turn unready (the operator restarts the group)."""
    leader, middle, last = (three.procs[f"rank-{r}"] for r in range(3))
    client = threading.Thread(
        target=lambda: _post_raw_or_none(leader.port, {"prompt": [9] * 200, "max_tokens": 3000})
    )
    client.start()
    wait_until(lambda: all(p.used_pages() > 0 for p in (middle, last)), "the request to run")
    leader.kill()
    for p in (middle, last):
        wait_until(
            lambda p=p: p.get("/ready")[0] == 503, f"{p.name} to turn unready", FAIL_WITHIN_S
        )
        wait_until(lambda p=p: p.used_pages() == 0, f"{p.name} to free every page", FAIL_WITHIN_S)
    client.join(FAIL_WITHIN_S)


def _post_raw_or_none(port: int, body: dict[str, Any]) -> tuple[int, Any] | None:
    try:
        return _post_raw(port, body)
    except OSError:  # the server died under the request
        return None
