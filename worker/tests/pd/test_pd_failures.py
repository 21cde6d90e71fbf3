"""PD failures lose nothing: a manifest mismatch is refused at handshake naming the field; a
dead prefill fails the request (retryable) and decode frees its preallocation within the
heartbeat timeout; a dead decode makes prefill free everything; a client abort frees both sides."""

from __future__ import annotations

import time

import pytest
from engine_helpers import engine
from pd_support import drained, on_engine, pd_pair, wait_drained, wait_until

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd.liveness import HEARTBEAT_TIMEOUT_S

BACKENDS = ["zmq", "nixl"]
MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=33)


def make(**kw: int) -> Engine:
    return engine(MODEL, WEIGHTS, **kw)


def prompt(n: int) -> list[int]:
    return [(7 * i % 250) + 3 for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_manifest_mismatch_is_refused_at_handshake(backend: str) -> None:
    with pd_pair(backend, lambda: make(page=16), lambda: make(page=32)) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[1] is not None, "the handshake")
        ready, error = pair.decode_agent.kv_status()
        assert not ready
        assert error is not None and "manifest page_size" in error, error
        assert not pair.prefill_agent.ready
        [(tokens, done)] = pair.generate([prompt(20)], [SamplingParams(max_new_tokens=4)])
        assert tokens == [] and done.reason == "error"
        assert done.error is not None and "page_size" in done.error
        wait_drained(pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_prefill_fails_the_request_and_decode_frees(backend: str) -> None:
    """The heartbeat, not the 60 s transfer timeout, ends the request."""
    with pd_pair(backend, make, make, transfer_timeout_s=60.0) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        pair.prefill_agent.stop()  # the prefill side goes away (its socket closes)
        start = time.monotonic()
        [(tokens, done)] = pair.generate([prompt(40)], [SamplingParams(max_new_tokens=4)])
        assert time.monotonic() - start < HEARTBEAT_TIMEOUT_S + 3.0  # slack: a loaded machine
        assert tokens == [] and done.reason == "error" and done.retryable
        assert done.error is not None and "no answer" in done.error
        wait_until(lambda: drained(pair.decode_runner), "decode to free the preallocation")
        pair.prefill_agent.stop = lambda: None  # type: ignore[method-assign]


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_abort_frees_both_sides(backend: str) -> None:
    with pd_pair(backend, make, make) as pair:
        [(_, done)] = pair.generate([prompt(30)], [SamplingParams(max_new_tokens=2)])
        assert done.reason == "length"
        # Abort requests at every stage: right away, and after some tokens.
        import asyncio

        async def abort_some() -> None:
            loop = asyncio.get_running_loop()
            runner = pair.decode_runner
            handles = [
                runner.submit(tuple(prompt(n)), SamplingParams(max_new_tokens=50), loop)
                for n in (20, 60, 90, 140)
            ]
            runner.abort(handles[0])
            await asyncio.wait_for(handles[1].events.get(), 60)  # one token, then abort
            for h in handles[1:]:
                runner.abort(h)

        asyncio.run(abort_some())
        wait_drained(pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_decode_makes_prefill_free_everything(backend: str) -> None:
    with pd_pair(backend, lambda: make(chunk=8), make) as pair:
        pair.prefill_agent.write_timeout_s = 2.0
        [(_, done)] = pair.generate([prompt(20)], [SamplingParams(max_new_tokens=2)])
        assert done.reason == "length"
        # Freeze the decode side's receiving end, then start a long prompt: its writes fail.
        pair.decode_agent.target.close()
        import asyncio

        async def start() -> None:
            pair.decode_runner.submit(
                tuple(prompt(120)), SamplingParams(max_new_tokens=4), asyncio.get_running_loop()
            )

        asyncio.run(start())
        wait_until(
            lambda: bool(on_engine(pair.prefill_runner, lambda: bool(pair.prefill.requests))),
            "prefill to take the request",
        )
        wait_until(lambda: drained(pair.prefill_runner), "prefill to free everything")
