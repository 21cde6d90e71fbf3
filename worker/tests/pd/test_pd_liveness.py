"""PD liveness (`pd.liveness`): the pure rules, then the agents on loopback. A restarted prefill
(a new process at the same address) is handshaken again and serves without restarting decode;
a prefill address that does not parse or does not answer fails requests within the heartbeat
timeout; a decode whose control thread dies fails everything and says why; a prefill drops a
decode it no longer hears from and frees what it held for it, but keeps one that pings."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq
from engine_helpers import engine
from hypothesis import given
from hypothesis import strategies as st
from pd_support import (
    _manifest,
    _regions,
    drained,
    keys,
    on_engine,
    pd_pair,
    wait_drained,
    wait_until,
)
from serve_support import free_port

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import control as C
from dsv4_worker.pd.auth import TO_DECODE, TO_PREFILL, Opener, Sealer
from dsv4_worker.pd.decode import FAULT_ENV
from dsv4_worker.pd.liveness import (
    HEARTBEAT_TIMEOUT_S,
    Echoes,
    Heartbeat,
    PongVerdict,
    fresh,
    gone,
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


@given(
    sent=st.lists(st.floats(0, 100), min_size=1, max_size=20).map(sorted),
    echoes=st.lists(st.integers(-2, 25), max_size=20),
)
def test_a_session_is_only_as_fresh_as_the_newest_pong_its_decode_echoed(
    sent: list[float], echoes: list[int]
) -> None:
    """Whatever pings arrive, in whatever order (late, repeated, echoing unknown numbers),
    `fresh_s` is the send time of the newest pong echoed, never a receive time."""
    e = Echoes(welcome_s=0.0)
    numbers = [e.pong(t) for t in sent]
    assert numbers == list(range(1, len(sent) + 1))
    for n in echoes:
        e.echoed(n)
    times = {0: 0.0, **dict(zip(numbers, sent, strict=True))}
    want = max([times[n] for n in echoes if n in times], default=0.0)
    assert e.fresh_s == want


@given(fresh_s=st.floats(0, 1e6), dt=st.floats(0, 10))
def test_a_prefill_writes_only_while_fresh_and_drops_a_session_one_interval_later(
    fresh_s: float, dt: float
) -> None:
    hb = Heartbeat()
    now = fresh_s + dt
    assert fresh(fresh_s, now, hb) == (now - fresh_s <= hb.timeout_s)
    assert gone(fresh_s, now, hb) == (now - fresh_s > hb.timeout_s + hb.interval_s)
    assert not (fresh(fresh_s, now, hb) and gone(fresh_s, now, hb))


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
        new = PrefillAgent(initiator, _manifest(pair.prefill.mem), f"tcp://{pair.address}", keys())
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


class FakeDecode:
    """A hand-driven decode connection that knows the deployment's secret: the handshake,
    then sealed messages both ways."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")
        self.session = ""
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None

    def recv(self, timeout_ms: int = 30_000) -> C.Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        if len(frames) == 3:
            assert self.opener is not None
            frames = self.opener.open(frames)
        return C.decode(frames)

    def send(self, msg: C.Message) -> None:
        frames = C.encode(msg)
        self.sock.send_multipart(self.sealer.seal(frames) if self.sealer else frames)

    def ask(self, msg: C.Message) -> C.Message:
        self.send(msg)
        got = self.recv()
        assert got is not None, f"no answer to {type(msg).__name__}"
        return got

    def join(self, pair: Any, supersedes: tuple[str, ...] = ()) -> C.Welcome:
        nonce = "f" * 32
        challenge = self.ask(C.Hello(C.PROTOCOL, nonce))
        assert isinstance(challenge, C.Challenge)
        k = keys()
        assert k.check_challenge(nonce, challenge.session, challenge.instance, challenge.proof)
        self.session = challenge.session
        key = k.key(challenge.session)
        self.sealer, self.opener = Sealer(key, TO_PREFILL), Opener(key, TO_DECODE)
        join = C.Join(
            "zmq",
            _manifest(pair.decode.mem),
            C.b64(pair.decode_agent.target.descriptor()),
            supersedes=supersedes,
        )
        welcome = self.ask(join)
        assert isinstance(welcome, C.Welcome) and welcome.ok, welcome
        return welcome

    def close(self) -> None:
        self.sock.close(linger=0)


def test_prefill_drops_a_decode_that_stops_pinging() -> None:
    """A hand-driven decode connection: a ping before any session is answered `known: false`;
    then the handshake, a request whose destination never comes (prefill holds its pages),
    pings echoing the last pong for a while (kept), then silence (dropped and freed within
    the heartbeat timeout plus one interval, `failed` sent)."""
    with pd_pair("zmq", lambda: make(chunk=8), make) as pair:
        agent = pair.prefill_agent
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        fake = FakeDecode(ctx, pair.address)
        try:
            assert fake.ask(C.Ping(0)) == C.Pong(agent.instance, known=False)
            welcome = fake.join(pair)
            assert welcome.instance == agent.instance
            pong = fake.ask(C.Ping(0))
            assert isinstance(pong, C.Pong) and pong.known and pong.number == 1
            sampling = C.sampling_of(SamplingParams(max_new_tokens=2))
            fake.send(C.PrefillRequest("fake:1", tuple(prompt(60)), sampling, (), 60.0))
            held = lambda: not drained(pair.prefill_runner)  # noqa: E731
            wait_until(held, "prefill to hold the request's pages")
            until = time.monotonic() + 2 * HEARTBEAT_TIMEOUT_S
            while time.monotonic() < until:  # pinging: kept, pages held
                pong = fake.ask(C.Ping(pong.number))
                assert isinstance(pong, C.Pong) and pong.known
                assert held()
                time.sleep(0.2)
            silent_from = time.monotonic()
            wait_until(lambda: drained(pair.prefill_runner), "prefill to drop the silent decode")
            assert time.monotonic() - silent_from < HEARTBEAT_TIMEOUT_S + 0.5 + SLACK_S
            failed = fake.recv(5_000)
            assert isinstance(failed, C.Failed) and "no fresh ping" in failed.message, failed
            # Forgotten: a ping is answered `known: false`, so a live decode handshakes again.
            fake.sealer = None
            assert fake.ask(C.Ping(0)) == C.Pong(agent.instance, known=False)
            assert on_engine(pair.prefill_runner, lambda: fake.session not in agent._peers)
        finally:
            fake.close()
            ctx.term()


def test_pings_that_echo_an_old_pong_do_not_keep_a_session() -> None:
    """The bug this fixes (#37): a prefill resumed after SIGSTOP read the pings queued while
    it was stopped and counted them as fresh, writing on for a decode that had given its
    pages away. Pings that keep coming but echo only a pong older than the heartbeat timeout
    (what a queue of stale pings looks like) neither let it write nor keep the session."""
    with pd_pair("zmq", lambda: make(chunk=8), make) as pair:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        fake = FakeDecode(ctx, pair.address)
        try:
            fake.join(pair)
            before_pong = time.monotonic()  # pong 1 leaves after this
            first = fake.ask(C.Ping(0))
            assert isinstance(first, C.Pong)
            sampling = C.sampling_of(SamplingParams(max_new_tokens=2))
            fake.send(C.PrefillRequest("fake:1", tuple(prompt(60)), sampling, (), 60.0))
            wait_until(lambda: not drained(pair.prefill_runner), "prefill to hold the pages")
            while not drained(pair.prefill_runner):  # pinging all along, echoing pong 1
                assert time.monotonic() - before_pong < 2 * HEARTBEAT_TIMEOUT_S + SLACK_S
                assert isinstance(fake.ask(C.Ping(first.number)), C.Pong)
                time.sleep(0.1)
            # Not before it was due: pong 1 stays fresh for the heartbeat timeout.
            assert time.monotonic() - before_pong > HEARTBEAT_TIMEOUT_S
        finally:
            fake.close()
            ctx.term()


def test_a_second_handshake_ends_the_old_sessions_transfers() -> None:
    """Decode handshakes again on a new socket after it lost this prefill, having failed every
    request of the old session; naming that session in its join (`supersedes`) ends its
    transfers at once (a transfer still waiting for its destination must not hold its pages
    until its deadline, nor write later), `failed` goes out on the old session, and the
    welcome confirms it closed. A session id of another process is never confirmed."""
    with pd_pair("zmq", lambda: make(chunk=8), make) as pair:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        old, new = FakeDecode(ctx, pair.address), FakeDecode(ctx, pair.address)
        try:
            old.join(pair)
            sampling = C.sampling_of(SamplingParams(max_new_tokens=2))
            old.send(C.PrefillRequest("fake:1", tuple(prompt(60)), sampling, (), 600.0))
            wait_until(
                lambda: not drained(pair.prefill_runner), "prefill to hold the request's pages"
            )
            other = "0123456789ab.deadbeef"  # not this prefill's instance
            welcome = new.join(pair, supersedes=(old.session, other))
            assert welcome.closed == (old.session,)
            # Only the handshake can end the old session's transfer now (the new session
            # pings on; the old one's deadline is minutes away and it is not yet silent).
            wait_until(lambda: drained(pair.prefill_runner), "the old session's pages to go")
            failed = old.recv(5_000)
            assert isinstance(failed, C.Failed) and "superseded" in failed.message, failed
            agent = pair.prefill_agent
            assert on_engine(pair.prefill_runner, lambda: not agent._txs)
            peers = on_engine(pair.prefill_runner, lambda: set(agent._peers))
            assert isinstance(peers, set) and new.session in peers and old.session not in peers
        finally:
            old.close()
            new.close()
            ctx.term()
