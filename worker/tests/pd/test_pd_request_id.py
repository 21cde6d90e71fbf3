"""One request id end to end in PD: the id a decode worker's caller gives is its engine
request's, the transfer's room, the prefill engine request's and the prefix of every write tag;
two decodes whose clients chose the same id at once get the second refused at the prefill with
a clear error, and neither disturbs the other."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from engine_helpers import engine
from pd_support import keys, on_engine, pd_pair, record_writes, wait_drained, wait_until

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pd import control as C
from dsv4_worker.pd.auth import TO_DECODE, TO_PREFILL, Opener, Sealer
from dsv4_worker.pd.liveness import Echoes
from dsv4_worker.pd.prefill import _Peer, _Session
from dsv4_worker.server.runner import Done

BACKENDS = ["zmq", "nixl"]
MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=23)
PROMPT = [(11 * i % 240) + 5 for i in range(40)]
PARAMS = SamplingParams(max_new_tokens=3)


def _make() -> Engine:
    return engine(MODEL, WEIGHTS)


def _record_submits(eng: Engine) -> list[str]:
    rids: list[str] = []
    real = eng.submit

    def submit(*args: Any, **kw: Any) -> Any:
        req = real(*args, **kw)
        rids.append(req.rid)
        return req

    eng.submit = submit  # type: ignore[method-assign]
    return rids


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_callers_id_is_the_room_and_both_engines_request_id(backend: str) -> None:
    with pd_pair(backend, _make, _make) as pair:
        decode_rids, prefill_rids = _record_submits(pair.decode), _record_submits(pair.prefill)
        rooms: list[str] = []
        forward = pair.decode_agent._forward

        def recording(address: str, msg: C.PrefillRequest | C.Destination, *grant: Any) -> None:
            rooms.append(msg.room)
            forward(address, msg, *grant)

        pair.decode_agent._forward = recording  # type: ignore[method-assign]
        tags = record_writes(pair)
        [(tokens, done)] = pair.generate([PROMPT], [PARAMS], rids=["trace-7"])
        assert done.reason == "length" and len(tokens) == 3
        assert decode_rids == ["trace-7"] and prefill_rids == ["trace-7"]
        assert rooms == ["trace-7", "trace-7"]  # its prefill request, then its destination
        assert tags and all(tag.startswith("trace-7:") for tag in tags)
        wait_drained(pair)


def test_the_same_id_from_another_decode_is_refused_and_cannot_abort_the_first() -> None:
    """While decode A's request "trace-8" is in flight at the prefill, decode B (a second
    handshaken peer) sends a request of the same room: the prefill answers B `Failed` naming
    the id, and B's Abort of that room is answered `Aborted` without touching A's request,
    which then completes."""
    with pd_pair("zmq", _make, _make) as pair:
        agent = pair.prefill_agent
        kept: list[Request] = []
        release = pair.decode_agent.on_prealloc
        pair.decode_agent.on_prealloc = kept.append  # type: ignore[method-assign]
        key = keys().key("b.session")
        other = _Session(
            "b.session", b"decode-b", Opener(key, TO_PREFILL), Sealer(key, TO_DECODE), 0.0
        )
        other.echoes = Echoes(time.monotonic())  # welcomed, and fresh
        sent_to_other: list[C.Message] = []
        send = agent._send

        def recording(session: _Session, msg: C.Message, *, welcome: bool = False) -> int:
            if session is other:
                sent_to_other.append(msg)
                return 0  # (a mailbox ticket that is always handled)
            return send(session, msg, welcome=welcome)

        agent._send = recording  # type: ignore[method-assign]
        out: list[tuple[list[int], Done]] = []
        worker = threading.Thread(
            target=lambda: out.extend(pair.generate([PROMPT], [PARAMS], rids=["trace-8"]))
        )
        worker.start()
        wait_until(lambda: len(kept) == 1, "decode A's preallocation (its destination kept)")
        wait_until(lambda: "trace-8" in agent._txs, "the prefill's transfer of trace-8")
        msg = C.PrefillRequest(
            room="trace-8",
            prompt=tuple(PROMPT),
            sampling=C.sampling_of(PARAMS),
            stop_token_ids=(),
            timeout_s=30.0,
        )

        def as_decode_b() -> str:
            # On the engine thread, at once: B joined and its pings are fresh (else the
            # prefill's liveness rule drops it before its messages count).
            agent._peers[other.id] = _Peer(other, agent.manifest)
            agent._handle(other, msg)
            agent._handle(other, C.Abort("trace-8"))
            return agent._txs["trace-8"].peer

        owner = on_engine(pair.prefill_runner, as_decode_b)
        assert owner != other.id  # the transfer of trace-8 is still decode A's
        assert len(sent_to_other) == 2
        failed, aborted = sent_to_other
        assert isinstance(failed, C.Failed) and failed.room == "trace-8"
        assert "'trace-8' is already in flight" in failed.message
        assert aborted == C.Aborted("trace-8")
        pair.decode_agent.on_prealloc = release  # type: ignore[method-assign]
        on_engine(pair.decode_runner, lambda: release(kept[0]))
        worker.join(60)
        [(tokens, done)] = out
        assert done.reason == "length" and len(tokens) == 3
        wait_drained(pair)
