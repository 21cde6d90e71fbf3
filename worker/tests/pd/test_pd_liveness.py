"""PD liveness (`pd.liveness`): the pure rules, then the agents on loopback. A restarted prefill
(a new process at the same address) is handshaken again and serves without restarting decode;
a prefill address that does not parse or does not answer fails requests within the heartbeat
timeout; a decode whose control thread dies fails everything and says why; a prefill drops a
decode it no longer hears from and frees what it held for it, but keeps one that pings."""

from __future__ import annotations

import time

import pytest
import zmq
from engine_helpers import engine
from hypothesis import given
from hypothesis import strategies as st
from pd_support import _manifest, _regions, drained, on_engine, pd_pair, wait_drained, wait_until
from serve_support import free_port

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import control as C
from dsv4_worker.pd.decode import FAULT_ENV
from dsv4_worker.pd.liveness import (
    HEARTBEAT_TIMEOUT_S,
    Heartbeat,
    PongVerdict,
    ping_due,
    pong_verdict,
    rooms_of,
    silent,
    silent_peers,
)
from dsv4_worker.pd.prefill import PrefillAgent
from dsv4_worker.pd.transfer import make_initiator

MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=41)
SLACK_S = 3.0  # scheduling delay allowed on a loaded 2-core machine


def make(**kw: int) -> Engine:
    return engine(MODEL, WEIGHTS, **kw)


def prompt(n: int) -> list[int]:
    return [(11 * i % 250) + 3 for i in range(n)]


# -- the pure rules --------------------------------------------------------------------------------


@given(
    interval=st.floats(0.01, 10),
    extra=st.floats(0.001, 10),
    heard=st.floats(0, 1e6),
    dt=st.floats(0, 100),
)
def test_silence_starts_only_past_the_timeout(
    interval: float, extra: float, heard: float, dt: float
) -> None:
    hb = Heartbeat(interval_s=interval, timeout_s=interval + extra)
    assert silent(heard, heard + dt, hb) == (heard + dt - heard > hb.timeout_s)
    assert silent_peers({"a": heard, "b": heard + dt}, heard + dt, hb) == (
        ["a"] if silent(heard, heard + dt, hb) else []
    )
    assert ping_due(None, heard, hb)
    assert ping_due(heard, heard + dt, hb) == (heard + dt - heard >= interval)


def test_a_heartbeat_must_ping_more_often_than_it_times_out() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(interval_s=2.0, timeout_s=1.5)


@given(handshake=st.text(max_size=4), pong=st.text(max_size=4), known=st.booleans())
def test_pong_verdict(handshake: str, pong: str, known: bool) -> None:
    verdict = pong_verdict(handshake, pong, known)
    if handshake and pong != handshake:
        assert verdict is PongVerdict.RESTARTED
    else:
        assert verdict is (PongVerdict.ALIVE if known else PongVerdict.FORGOTTEN)


@given(st.lists(st.tuples(st.text(max_size=3), st.sampled_from("pqr")), unique_by=lambda f: f[0]))
def test_a_lost_peer_takes_exactly_its_own_rooms(flights: list[tuple[str, str]]) -> None:
    lost = rooms_of(flights, "p")
    assert sorted(lost) == sorted(room for room, peer in flights if peer == "p")


# -- the agents on loopback ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_restarted_prefill_is_handshaken_again(backend: str) -> None:
    """The bug this fixes: decode kept its old handshake and every request got "no handshake"."""
    with pd_pair(backend, make, make) as pair:
        [(_, done)] = pair.generate([prompt(30)], [SamplingParams(max_new_tokens=3)])
        assert done.reason == "length"
        old = pair.prefill_agent
        old.stop()
        # A new process at the same address: a new agent, a new transfer initiator.
        initiator = make_initiator(backend, name=f"p2-{time.monotonic_ns()}")
        initiator.register(_regions(pair.prefill.mem))
        new = PrefillAgent(initiator, _manifest(pair.prefill.mem), f"tcp://{pair.address}")
        new.attach(pair.prefill, pair.prefill_runner.call)
        pair.prefill_events.to = new
        pair.prefill_agent = new  # pd_pair stops this one
        new.start()
        assert new.instance != old.instance
        restarted = time.monotonic()
        wait_until(lambda: new.ready and pair.decode_agent.kv_status()[0], "a new handshake")
        assert time.monotonic() - restarted < HEARTBEAT_TIMEOUT_S + SLACK_S
        [(tokens, done)] = pair.generate([prompt(40)], [SamplingParams(max_new_tokens=3)])
        assert done.reason == "length" and len(tokens) == 3, done
        wait_drained(pair)
    initiator.close()  # after pd_pair stopped the agent that used it


@pytest.mark.parametrize(
    ("address", "words"),
    [("nohost:notaport", "cannot connect"), (None, "no answer")],
    ids=["not-an-address", "nobody-listens"],
)
def test_an_unreachable_prefill_fails_requests_fast(address: str | None, words: str) -> None:
    with pd_pair("zmq", make, make, transfer_timeout_s=60.0) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the default prefill's handshake")
        where = address or f"127.0.0.1:{free_port()}"
        start = time.monotonic()
        [(tokens, done)] = pair.generate(
            [prompt(20)], [SamplingParams(max_new_tokens=2)], prefill=where
        )
        assert time.monotonic() - start < HEARTBEAT_TIMEOUT_S + SLACK_S
        assert tokens == [] and done.reason == "error" and done.retryable
        assert done.error is not None and words in done.error, done.error
        wait_until(lambda: drained(pair.decode_runner), "decode to free the preallocation")
        # The good prefill still serves: one bad address fails only its own requests, and
        # decode stays KV-ready for the router (its retries of the bad one change nothing).
        assert pair.decode_agent.kv_status()[0]
        [(_, done)] = pair.generate([prompt(20)], [SamplingParams(max_new_tokens=2)])
        assert done.reason == "length"
    # Leaving the block stopped every agent: a bad address does not hang the stop.


def test_a_failed_prefill_engine_fails_requests_at_once() -> None:
    """A prefill whose PP group lost a stage (its engine failed) still answers pings: each
    request sent to it must fail at once, not wait for the transfer timeout."""
    with pd_pair("zmq", make, make, transfer_timeout_s=60.0) as pair:
        on_engine(pair.prefill_runner, lambda: pair.prefill.fail_all("PP stage 1 lost"))
        start = time.monotonic()
        [(tokens, done)] = pair.generate([prompt(20)], [SamplingParams(max_new_tokens=2)])
        assert time.monotonic() - start < SLACK_S
        assert tokens == [] and done.reason == "error" and done.retryable
        assert done.error is not None and "PP stage 1 lost" in done.error, done.error
        assert pair.prefill_runner.error is None  # its engine thread still runs
        wait_until(lambda: drained(pair.decode_runner), "decode to free the preallocation")


def test_a_dead_decode_control_thread_fails_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "control-crash")
    with pd_pair("zmq", make, make) as pair:
        [(tokens, done)] = pair.generate([prompt(20)], [SamplingParams(max_new_tokens=2)])
        assert tokens == [] and done.reason == "error" and done.retryable
        failure = pair.decode_agent.failure
        assert failure is not None and "decode control thread died" in failure
        wait_until(lambda: not pair.decode_runner.alive, "the engine to stop serving")
        assert pair.decode_runner.failure == failure  # what /ready answers with its 503
        assert pair.decode_agent.kv_status() == (False, failure)
        assert drained(pair.decode_runner)


def test_prefill_drops_a_decode_that_stops_pinging() -> None:
    """A hand-driven decode connection: handshake, a request whose destination never comes
    (prefill holds its pages), pings for a while (kept), then silence (dropped and freed)."""
    with pd_pair("zmq", lambda: make(chunk=8), make) as pair:
        agent = pair.prefill_agent
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{pair.address}")
        try:

            def ask(msg: C.Message) -> C.Message:
                sock.send_multipart(C.encode(msg))
                assert sock.poll(30_000), f"no answer to {type(msg).__name__}"
                return C.decode(sock.recv_multipart())

            assert ask(C.Ping("fake")) == C.Pong(agent.instance, known=False)
            hello = C.Hello(
                "fake-decode",
                "zmq",
                _manifest(pair.decode.mem),
                C.b64(pair.decode_agent.target.descriptor()),
                protocol=C.PROTOCOL,
            )
            welcome = ask(hello)
            assert isinstance(welcome, C.Welcome) and welcome.ok, welcome
            assert welcome.instance == agent.instance
            assert ask(C.Ping("fake")) == C.Pong(agent.instance, known=True)
            sampling = C.sampling_of(SamplingParams(max_new_tokens=2))
            sock.send_multipart(
                C.encode(C.PrefillRequest("fake-decode:1", tuple(prompt(60)), sampling, (), 60.0))
            )
            held = lambda: not drained(pair.prefill_runner)  # noqa: E731
            wait_until(held, "prefill to hold the request's pages")
            until = time.monotonic() + 2 * HEARTBEAT_TIMEOUT_S
            while time.monotonic() < until:  # pinging: kept, pages held
                assert isinstance(ask(C.Ping("fake")), C.Pong)
                assert held()
                time.sleep(0.2)
            silent_from = time.monotonic()
            wait_until(lambda: drained(pair.prefill_runner), "prefill to drop the silent decode")
            assert time.monotonic() - silent_from < HEARTBEAT_TIMEOUT_S + SLACK_S
            failed = C.decode(sock.recv_multipart()) if sock.poll(5_000) else None
            assert isinstance(failed, C.Failed) and "nothing heard" in failed.message, failed
            # Forgotten: its pongs say so, so a live decode would handshake again.
            assert ask(C.Ping("fake")) == C.Pong(agent.instance, known=False)
            assert on_engine(pair.prefill_runner, lambda: "fake-decode" not in agent._peers)
        finally:
            sock.close(linger=0)
            ctx.term()


def test_a_second_handshake_ends_the_old_sessions_transfers() -> None:
    """Decode handshakes again only on a new socket after it lost this prefill, having failed
    every request of the old session: a transfer of that session still waiting for its
    destination must not hold its pages until its deadline (nor write later)."""
    with pd_pair("zmq", lambda: make(chunk=8), make) as pair:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
        try:
            for sock in socks:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{pair.address}")

            def ask(sock: zmq.Socket[bytes], msg: C.Message) -> C.Message:
                sock.send_multipart(C.encode(msg))
                assert sock.poll(30_000), f"no answer to {type(msg).__name__}"
                return C.decode(sock.recv_multipart())

            hello = C.Hello(
                "fake-decode",
                "zmq",
                _manifest(pair.decode.mem),
                C.b64(pair.decode_agent.target.descriptor()),
                protocol=C.PROTOCOL,
            )
            first = ask(socks[0], hello)
            assert isinstance(first, C.Welcome) and first.ok, first
            sampling = C.sampling_of(SamplingParams(max_new_tokens=2))
            request = C.PrefillRequest("fake-decode:1", tuple(prompt(60)), sampling, (), 600.0)
            socks[0].send_multipart(C.encode(request))
            wait_until(
                lambda: not drained(pair.prefill_runner), "prefill to hold the request's pages"
            )
            again = ask(socks[1], hello)  # the same decode, a new session
            assert isinstance(again, C.Welcome) and again.ok, again
            # The new session pings on (so nothing is dropped as silent): only the handshake
            # can end the old session's transfer, whose deadline is minutes away.
            until = time.monotonic() + 2 * HEARTBEAT_TIMEOUT_S + SLACK_S
            while not drained(pair.prefill_runner):
                assert time.monotonic() < until, "the old session's transfer still holds pages"
                assert isinstance(ask(socks[1], C.Ping("fake")), C.Pong)
                time.sleep(0.1)
            agent = pair.prefill_agent
            assert on_engine(pair.prefill_runner, lambda: not agent._txs)
        finally:
            for sock in socks:
                sock.close(linger=0)
            ctx.term()
