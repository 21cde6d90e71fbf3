"""Decode sends a request to prefill as soon as its plan admits it (`prefill`) and where to
write once the pages exist on every stage (`destination`). Prefill computes in between and
writes nothing before the destination; then what it held back goes at once and the output is
colocated's. A destination that never comes, or has the wrong size, fails the request on both
sides with nothing leaked; a decode speaking another control protocol is refused at handshake."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import zmq
from engine_helpers import engine
from pd_support import (
    Pair,
    as_role,
    on_engine,
    pd_pair,
    record_writes,
    wait_drained,
    wait_until,
)

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, Phase, Request
from dsv4_worker.engine.role import Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import control as C
from dsv4_worker.pd.decode import DecodeAgent
from dsv4_worker.server.runner import Done

BACKENDS = ["zmq", "nixl"]
MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=21)
PROMPT = [(13 * i % 240) + 5 for i in range(70)]  # 3 chunks of 24, 5 pages of 16
PARAMS = SamplingParams(max_new_tokens=4)


def _make() -> Engine:
    return engine(MODEL, WEIGHTS)


def _colocated(prompt: Sequence[int]) -> list[int]:
    eng = _make()
    req = eng.submit(list(prompt), PARAMS)
    eng.run_until_idle()
    return req.output


def _withhold_destinations(pair: Pair) -> list[Request]:
    """Keep every destination on the decode side; returns where the requests are kept."""
    kept: list[Request] = []
    pair.decode_agent.on_prealloc = kept.append  # type: ignore[method-assign]
    return kept


def _generate_in_background(pair: Pair) -> tuple[threading.Thread, list[tuple[list[int], Done]]]:
    out: list[tuple[list[int], Done]] = []
    thread = threading.Thread(target=lambda: out.extend(pair.generate([PROMPT], [PARAMS])))
    thread.start()
    return thread, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_computes_before_the_destination_and_writes_only_after_it(backend: str) -> None:
    with pd_pair(backend, _make, _make) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        kept, writes = _withhold_destinations(pair), record_writes(pair)
        thread, out = _generate_in_background(pair)
        # Every chunk ran and the first token was sampled: the request holds its pages.
        wait_until(
            lambda: bool(on_engine(pair.prefill_runner, lambda: len(pair.prefill.held) == 1)),
            "prefill to finish the prompt without a destination",
        )
        assert writes == [] and len(kept) == 1
        assert on_engine(pair.decode_runner, lambda: kept[0].phase) is Phase.TRANSFER
        on_engine(pair.decode_runner, lambda: DecodeAgent.on_prealloc(pair.decode_agent, kept[0]))
        thread.join(60)
        assert not thread.is_alive()
        [(tokens, done)] = out
        assert (done.reason, done.error) == ("length", None)
        assert tokens == _colocated(PROMPT)
        assert writes  # the held-back columns and the last step went once it arrived
        wait_drained(pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_destination_that_never_comes_frees_the_prefill_side(backend: str) -> None:
    with pd_pair(backend, _make, _make, transfer_timeout_s=1.0) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        kept, writes = _withhold_destinations(pair), record_writes(pair)
        pair.decode_agent._expire = lambda now: None  # type: ignore[method-assign]
        [(tokens, done)] = pair.generate([PROMPT], [PARAMS])  # prefill's own timeout ends it
        assert tokens == [] and done.reason == "error" and done.retryable
        assert done.error is not None
        assert "did not get its destination from decode within 1 s" in done.error
        assert writes == [] and len(kept) == 1
        wait_drained(pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_destination_of_the_wrong_size_is_refused(backend: str) -> None:
    with pd_pair(backend, _make, _make) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        writes = record_writes(pair)
        agent = pair.decode_agent
        real = agent._forward

        def short(address: str, msg: C.PrefillRequest | C.Destination, *grant: Any) -> None:
            if isinstance(msg, C.Destination):
                msg = dataclasses.replace(msg, dst_full_pages=msg.dst_full_pages[:-1])
            real(address, msg, *grant)

        agent._forward = short  # type: ignore[method-assign]
        [(tokens, done)] = pair.generate([PROMPT], [PARAMS])
        assert tokens == [] and done.reason == "error"
        assert done.error is not None
        assert "destination: 4 full / 2 SWA pages for a 70-token prompt, expected 5 / 2" in (
            done.error
        )
        assert writes == []
        wait_drained(pair)


def test_a_decode_speaking_another_protocol_is_refused_at_handshake() -> None:
    with pd_pair("zmq", _make, _make) as pair:
        body = C.encode(C.Hello(C.PROTOCOL - 1, "n" * 32))  # an older decode's first word
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{pair.address}")
            sock.send_multipart(body)
            assert sock.poll(30_000), "no answer to the handshake"
            answer = C.decode(sock.recv_multipart())
        finally:
            sock.close()
            ctx.term()
        assert isinstance(answer, C.Welcome) and not answer.ok  # before any session: unsealed
        want = f"control protocol: prefill speaks {C.PROTOCOL}, decode {C.PROTOCOL - 1}"
        assert answer.message == want


def test_the_prompt_goes_out_before_the_step_allocates_and_runs_its_batch() -> None:
    """Under load a decode step runs a batch: the admitted request's prompt goes before it (and
    before its allocation), its destination after it (a PP group's stages have all allocated
    by then)."""
    events: list[tuple[str, int | None]] = []

    class Events(EngineEvents):
        def on_admit(self, req: Request) -> None:
            events.append(("admit", req.slot))

        def on_prealloc(self, req: Request) -> None:
            events.append(("destination", req.slot))

    eng = as_role(_make(), Role.DECODE, Events())
    real_batch = eng.run_batch

    def run_batch(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("batch", None))
        return real_batch(*args, **kwargs)

    eng.run_batch = run_batch  # type: ignore[method-assign]
    first = eng.submit(PROMPT, PARAMS, prefill="p")
    eng.step()
    assert [e for e, _ in events] == ["admit", "destination"]  # nothing to run yet
    eng.complete_transfer(first.rid, 7)  # it decodes from now on
    events.clear()
    second = eng.submit(PROMPT, PARAMS, prefill="p")
    eng.step()
    assert events[0] == ("admit", None)  # before its slot and pages exist
    assert [e for e, _ in events] == ["admit", "batch", "destination"]
    assert events[2][1] == second.slot is not None
