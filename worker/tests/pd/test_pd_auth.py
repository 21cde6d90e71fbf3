"""The PD control channel is authenticated (#37 item 3): a connection that does not prove
the deployment's secret gets a challenge and nothing else; a replayed handshake, a forged
message and a session id it did not earn change nothing (no page written, no transfer
ended); a decode hands its transfer descriptor only to a prefill that proved the secret."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from engine_helpers import engine
from pd_support import Pair, pd_pair, wait_drained, wait_until

from dsv4_common.api.pd_secret import PDSecret
from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import control as C
from dsv4_worker.pd.auth import TO_PREFILL, Sealer, SessionKeys

WEIGHTS = init_weights(tiny(), seed=0)
STRANGER = SessionKeys(PDSecret(b"not-this-deployment-" + b"0123456789abcdef" * 2))
QUIET_MS = 500  # how long a refused message is given to (wrongly) get an answer


def make() -> Engine:
    return engine(tiny(), WEIGHTS)


def prompt(n: int) -> list[int]:
    return [((31 * i) % 250) + 3 for i in range(n)]


@contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{address}")
    try:
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


def answer(sock: zmq.Socket[bytes]) -> C.Message | None:
    """The next message within QUIET_MS (None: none came). A stranger can open no sealed one:
    getting one at all fails the test."""
    if not sock.poll(QUIET_MS):
        return None
    frames = sock.recv_multipart()
    assert len(frames) == 2, f"a sealed answer to a stranger: {frames[0]!r}"
    return C.decode(frames)


def hello(sock: zmq.Socket[bytes], nonce: str = "n" * 32) -> C.Challenge:
    sock.send_multipart(C.encode(C.Hello(C.PROTOCOL, nonce)))
    got = answer(sock)
    assert isinstance(got, C.Challenge), got
    return got


def sessions(pair: Pair) -> set[str]:
    return set(pair.prefill_agent._peers)


def a_greedy_request_in_flight(pair: Pair) -> tuple[threading.Thread, list[Any]]:
    """A long greedy request through the pair, running while the test attacks."""
    out: list[Any] = []
    params = SamplingParams(max_new_tokens=6)

    def run() -> None:
        out.extend(pair.generate([prompt(200)], [params]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_unauthenticated_and_replayed_handshakes_and_forged_messages_change_nothing(
    backend: str,
) -> None:
    """While a request is in flight: a hello is answered with a challenge only; a join that
    is not sealed, sealed with another secret, or replayed from the real decode's handshake
    is refused; forged `abort`s (unsealed, or sealed for the victim's session without its key)
    and a join that names the victim's session in `supersedes` end nothing. The request
    completes with the same tokens as alone, and both sides drain."""
    with pd_pair(backend, make, make) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        [(alone, done)] = pair.generate([prompt(200)], [SamplingParams(max_new_tokens=6)])
        assert done.reason == "length"
        victim = next(iter(sessions(pair)))
        # The real decode's join, as it went on the wire (sealed under the victim's session).
        real = pair.decode_agent._prefills[pair.address]
        join = C.Join(backend, pair.decode_agent.manifest, pair.decode_agent._descriptor)
        replayed = Sealer(pair.decode_agent.keys.key(real.session), TO_PREFILL).seal(C.encode(join))

        thread, out = a_greedy_request_in_flight(pair)
        with raw_dealer(pair.address) as sock:
            challenge = hello(sock)
            assert challenge.session != victim and challenge.instance == real.instance
            sock.send_multipart(C.encode(C.Hello(C.PROTOCOL, "m" * 32)))  # a hello again
            assert answer(sock) is None
            sock.send_multipart(C.encode(join))  # not sealed
            assert answer(sock) is None
            forged = C.Join(backend, join.manifest, join.descriptor, supersedes=(victim,))
            sock.send_multipart(
                Sealer(STRANGER.key(challenge.session), TO_PREFILL).seal(C.encode(forged))
            )
            assert answer(sock) is None
            sock.send_multipart(replayed)  # the real join: another session's seal
            assert answer(sock) is None
            sock.send_multipart(C.encode(C.Abort("any")))  # unsealed
            sock.send_multipart(
                Sealer(STRANGER.key(victim), TO_PREFILL).seal(C.encode(C.Abort("any")))
            )
            assert answer(sock) is None
        with raw_dealer(pair.address) as sock:  # a second hello from scratch: a new session
            assert hello(sock).session not in (victim, challenge.session)
        thread.join(120)
        [(tokens, done)] = out
        assert done.reason == "length" and tokens == alone
        assert victim in sessions(pair) and len(sessions(pair)) == 1
        wait_drained(pair)


def test_a_decode_tells_nothing_to_a_prefill_that_cannot_prove_the_secret() -> None:
    """A request names a 'prefill' that answers the hello with a challenge it cannot prove:
    the request fails at once naming it, and that peer never gets the join (the transfer
    descriptor: what would let it write, with NIXL, into the decode's memory)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    got: list[list[bytes]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not fake.poll(50):
                continue
            identity, *frames = fake.recv_multipart()
            got.append(frames)
            msg = C.decode(frames[:2]) if len(frames) == 2 else None
            if isinstance(msg, C.Hello):
                sid = "fake01234567.s"
                proof = STRANGER.challenge_proof(msg.nonce, sid, "fake01234567")
                reply = C.Challenge(sid, "fake01234567", proof)
                fake.send_multipart([identity, *C.encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pd_pair("zmq", make, make) as pair:
            address = f"127.0.0.1:{port}"
            [(tokens, done)] = pair.generate(
                [prompt(20)], [SamplingParams(max_new_tokens=2)], prefill=address
            )
            assert tokens == [] and done.reason == "error"
            assert done.error is not None and "failed authentication" in done.error
            wait_until(lambda: len(got) >= 1, "the hello")
            assert [f[0] for f in got] == [b"hello"], [f[0] for f in got]
            assert all(b"descriptor" not in b"".join(f) for f in got)
            wait_drained(pair)
    finally:
        stop.set()
        thread.join()
        fake.close(linger=0)
        ctx.term()


def test_a_session_assigned_by_the_prefill_is_needed_for_every_message() -> None:
    """What used to be a self-declared peer id: a connection holding no session (it never
    joined) cannot send `prefill`, `destination` or `ping` under any name; a ping there is
    answered `known: false` (so a decode that lost its session handshakes again)."""
    with pd_pair("zmq", make, make) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        victim = next(iter(sessions(pair)))
        with raw_dealer(pair.address) as sock:
            request = C.PrefillRequest(
                "stolen", tuple(prompt(8)), C.Sampling(0.0, 1.0, 0, None), (), 5.0
            )
            sock.send_multipart(C.encode(request))
            assert answer(sock) is None
            sock.send_multipart(Sealer(STRANGER.key(victim), TO_PREFILL).seal(C.encode(C.Ping(0))))
            pong = answer(sock)
            assert isinstance(pong, C.Pong) and not pong.known
        assert "stolen" not in pair.prefill.requests
        assert sessions(pair) == {victim}
        wait_drained(pair)
