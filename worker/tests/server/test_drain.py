"""Draining on SIGTERM (issue #25 item 4), on real `dsv4 serve --model tiny` processes: /ready
turns 503 at once, new completions get 503 + Retry-After (code `draining`), requests in flight
finish if they fit the drain and are aborted with an error otherwise (a stream's last event,
then `[DONE]`; a non-stream's 503), a second signal ends the drain at once, and the process
exits 0 without a traceback. The decision itself (`next_move`) is checked on its own."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from serve_support import Deployment, Proc, free_port, serve_argv, wait_until

from dsv4_common.api.lifecycle import ABORT_GRACE_S, DRAIN_CODE, Move, next_move
from dsv4_worker.server.drain import Drain
from dsv4_worker.server.runner import Done, Handle

READY_503_S = 0.5  # /ready answers 503 this soon after SIGTERM
EXIT_S = 60.0
LONG = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True}  # minutes on CPU
SHORT = {"prompt": "hi", "max_tokens": 48, "ignore_eos": True}  # seconds on CPU


# -- the decision -------------------------------------------------------------------------------

times = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


@given(now_s=times, deadline_s=times, in_flight=st.integers(0, 5), busy=st.booleans())
def test_before_the_abort_it_waits_for_work_until_the_deadline(
    now_s: float, deadline_s: float, in_flight: int, busy: bool
) -> None:
    move = next_move(
        now_s,
        deadline_s=deadline_s,
        aborted_at_s=None,
        in_flight=in_flight,
        engine_busy=busy,
        hurried=False,
    )
    if in_flight == 0 and not busy:
        assert move is Move.EXIT
    else:
        assert move is (Move.ABORT if now_s >= deadline_s else Move.WAIT)


@given(now_s=times, in_flight=st.integers(1, 5), busy=st.booleans())
def test_a_second_signal_aborts_what_is_left_at_once(
    now_s: float, in_flight: int, busy: bool
) -> None:
    move = next_move(
        now_s,
        deadline_s=now_s + 100.0,
        aborted_at_s=None,
        in_flight=in_flight,
        engine_busy=busy,
        hurried=True,
    )
    assert move is Move.ABORT


@given(aborted_at_s=times, waited_s=st.floats(0.0, 10.0), in_flight=st.integers(0, 5))
def test_after_the_abort_it_waits_at_most_the_abort_grace(
    aborted_at_s: float, waited_s: float, in_flight: int
) -> None:
    move = next_move(
        aborted_at_s + waited_s,
        deadline_s=aborted_at_s,
        aborted_at_s=aborted_at_s,
        in_flight=in_flight,
        engine_busy=True,  # an aborted request's pages are freed after its answer: no wait
        hurried=True,
    )
    late = aborted_at_s + waited_s >= aborted_at_s + ABORT_GRACE_S
    assert move is (Move.EXIT if in_flight == 0 or late else Move.WAIT)


def test_abort_all_ends_each_request_with_the_drain_error_and_aborts_it() -> None:
    async def go() -> None:
        drain, aborted = Drain(), []
        one = (Handle(1, asyncio.Queue(), 0.0),)
        two = (Handle(2, asyncio.Queue(), 0.0), Handle(3, asyncio.Queue(), 0.0))
        with drain.track(one), drain.track(two):
            assert drain.in_flight == 2
            assert drain.abort_all(lambda h: aborted.append(h.rid)) == 2
        assert drain.in_flight == 0 and sorted(aborted) == [1, 2, 3]
        for h in (*one, *two):
            done = h.events.get_nowait()
            assert isinstance(done, Done) and done.reason == "error"
            assert done.code == DRAIN_CODE

    asyncio.run(go())


# -- real processes -----------------------------------------------------------------------------


@dataclass
class Stream:
    """A streaming completion read on its own thread: its `data:` payloads as they come."""

    port: int
    body: dict[str, Any]
    events: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    status: int | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=EXIT_S)
            c.request("POST", "/v1/completions", body=json.dumps({**self.body, "stream": True}))
            r = c.getresponse()
            self.status = r.status
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def finish(self) -> list[str]:
        self.thread.join(EXIT_S)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None and self.status == 200, (self.status, self.error)
        return self.events


@dataclass
class Call:
    """A non-streaming completion sent on its own thread."""

    port: int
    body: dict[str, Any]
    result: tuple[int, dict[str, str], Any] | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        self.result = _post(self.port, self.body)

    def finish(self) -> tuple[int, dict[str, str], Any]:
        self.thread.join(EXIT_S)
        assert self.result is not None, "the request got no answer"
        return self.result


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=EXIT_S)
    c.request("POST", "/v1/completions", body=json.dumps(body))
    r = c.getresponse()
    return r.status, dict(r.getheaders()), json.loads(r.read())


def _status(proc: Proc) -> dict[str, Any]:
    code, text = proc.get("/status")
    assert code == 200, text
    doc: dict[str, Any] = json.loads(text)
    return doc


def _in_flight(proc: Proc) -> int:
    load = _status(proc)["load"]
    return int(load["running"] + load["waiting"])


@pytest.fixture
def worker(request: pytest.FixtureRequest) -> Iterator[Proc]:
    """`dsv4 serve --model tiny` with the test's extra flags (indirect parameters)."""
    flags: tuple[str, ...] = getattr(request, "param", ())
    port, deployment = free_port(), Deployment()
    proc = deployment.start("w", serve_argv("--model", "tiny", "--port", str(port), *flags), port)
    try:
        deployment.ready()
        yield proc
    finally:
        deployment.stop()


def _terminate(proc: Proc) -> float:
    """SIGTERM; how long /ready took to answer 503 `draining` after it."""
    sent_s = time.monotonic()
    os.kill(proc.proc.pid, signal.SIGTERM)
    while (answer := proc.get("/ready")) != (503, DRAIN_CODE):
        assert answer[0] == 200 and time.monotonic() - sent_s < EXIT_S, answer
    return time.monotonic() - sent_s


def _exit_output(proc: Proc) -> str:
    """The process's exit (it must be 0) and its whole output, which has no traceback."""
    code = proc.proc.wait(timeout=EXIT_S)
    out = proc.proc.stdout.read().decode() if proc.proc.stdout else ""
    assert code == 0, out
    assert "Traceback" not in out, out
    return out


def _refused_while_draining(proc: Proc) -> None:
    code, headers, doc = _post(proc.port, SHORT)
    assert code == 503 and headers.get("Retry-After") == "1", (code, headers, doc)
    assert doc["error"]["code"] == DRAIN_CODE, doc
    load = _status(proc)["load"]
    assert load["draining"] is True and load["accepting"] is False, load


@pytest.mark.slow
@pytest.mark.parametrize("worker", [("--drain-timeout-s", "120")], indirect=True)
def test_requests_in_flight_finish_and_new_ones_are_refused(worker: Proc) -> None:
    stream, call = Stream(worker.port, SHORT), Call(worker.port, SHORT)
    wait_until(lambda: stream.started.is_set() and _in_flight(worker) >= 2, "both in flight")
    assert _terminate(worker) < READY_503_S
    _refused_while_draining(worker)
    events = stream.finish()
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length", last
    code, _, doc = call.finish()
    assert code == 200 and doc["choices"][0]["finish_reason"] == "length", doc
    assert "0 requests aborted" in _exit_output(worker)


@pytest.mark.slow
@pytest.mark.parametrize("worker", [("--drain-timeout-s", "1")], indirect=True)
def test_past_the_drain_a_stream_ends_with_an_error_event_and_a_call_with_503(
    worker: Proc,
) -> None:
    stream, call = Stream(worker.port, LONG), Call(worker.port, LONG)
    wait_until(lambda: stream.started.is_set() and _in_flight(worker) >= 2, "both in flight")
    assert _terminate(worker) < READY_503_S
    _refused_while_draining(worker)
    events = stream.finish()
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["error"]["message"] and last["choices"][0]["finish_reason"] == "error", last
    assert last["error"]["code"] == DRAIN_CODE and last["error"]["type"] == "server_error", last
    code, headers, doc = call.finish()
    assert code == 503 and headers.get("Retry-After") == "1", (code, doc)
    assert doc["error"]["code"] == DRAIN_CODE, doc
    assert "2 requests aborted" in _exit_output(worker)


@pytest.mark.slow
def test_a_second_signal_ends_the_drain_at_once(worker: Proc) -> None:
    stream = Stream(worker.port, LONG)
    wait_until(stream.started.is_set, "the stream's first event")
    _terminate(worker)  # the default drain: 20 s
    second_s = time.monotonic()
    os.kill(worker.proc.pid, signal.SIGTERM)
    events = stream.finish()
    assert time.monotonic() - second_s < 2 * ABORT_GRACE_S + 1.0
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    _exit_output(worker)


def _accepted(port: int, body: dict[str, Any]) -> Stream:
    """A stream that has its first event, sent again while the router answers 503 (a
    starved machine can make it think its workers stale for a moment: not what this tests)."""
    deadline_s = time.monotonic() + EXIT_S
    while True:
        stream = Stream(port, body)
        stream.started.wait(EXIT_S)
        if stream.status != 503:
            assert stream.events, (stream.status, stream.error)
            return stream
        assert time.monotonic() < deadline_s, "the router kept answering 503"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_pd_deployment_drains_as_one_on_sigterm() -> None:
    """Prefill, decode and router get SIGTERM at once (as `dsv4 up` stops them): the router
    turns unready and refuses new requests; through it, a stream that fits decode's drain
    finishes, one that does not ends with decode's error event and `[DONE]` (the router
    outlasts the workers' drain), and all exit 0."""
    common = ["--model", "tiny", "--gpu-memory-gib", "0.25", "--transfer", "zmq"]
    pp, kv, dp, rp = free_port(), free_port(), free_port(), free_port()
    d = Deployment()
    prefill = serve_argv("--role", "prefill", *common, "--port", str(pp), "--kv-port", str(kv))
    decode = serve_argv(
        "--role", "decode", *common, "--port", str(dp), "--prefill", f"127.0.0.1:{kv}"
    )
    router = serve_argv("--role", "router", "--port", str(rp))
    router += ["--instance", f"prefill=127.0.0.1:{pp}:{pp}:{kv}"]
    router += ["--instance", f"decode=127.0.0.1:{dp}:{dp}:{dp}"]
    d.start("prefill", prefill, pp)
    d.start("decode", [*decode, "--drain-timeout-s", "10"], dp)
    d.start("router", router, rp)
    try:
        d.ready()
        long, short = _accepted(rp, LONG), _accepted(rp, SHORT)
        for p in d.procs.values():
            os.kill(p.proc.pid, signal.SIGTERM)
        # The router keeps listening while it drains: unready, and it refuses new requests.
        router_ready = d.procs["router"].get
        wait_until(lambda: router_ready("/ready") == (503, f"{DRAIN_CODE}\n"), "router draining")
        code, headers, doc = _post(rp, SHORT)
        assert code == 503 and headers.get("Retry-After") == "1", (code, doc)
        # `draining` is the router's code, or (a router process that has not had its signal
        # yet) the draining decode's reason in the router's message.
        assert "draining" in doc["error"]["message"], doc
        events = short.finish()
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        events = long.finish()
        assert events[-1] == "[DONE]", events[-3:]
        assert "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
        for p in d.procs.values():
            _exit_output(p)
    finally:
        d.stop()


@pytest.mark.slow
def test_a_pp_stage_follows_its_leader_through_the_drain() -> None:
    """A PP group gets SIGTERM on every stage at once (`dsv4 up` signals the group): the later
    stage keeps stepping while its leader drains, so a stream that fits the drain finishes
    and one that does not ends with the drain's error event; both stages exit 0."""
    d, addr = Deployment(), f"127.0.0.1:{free_port()}"
    for rank in range(2):
        port = free_port()
        argv = serve_argv("--model", "tiny", "--port", str(port), "--pp-size", "2")
        argv += ["--pp-rank", str(rank), "--pp-addr", addr, "--drain-timeout-s", "10"]
        d.start(f"rank-{rank}", argv, port)
    try:
        d.ready()
        leader = d.procs["rank-0"]
        long = Stream(leader.port, LONG)
        wait_until(long.started.is_set, "the long stream's first event")
        short = Stream(leader.port, SHORT)
        wait_until(short.started.is_set, "the short stream's first event")
        for p in d.procs.values():
            os.kill(p.proc.pid, signal.SIGTERM)
        events = short.finish()
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        events = long.finish()
        assert events[-1] == "[DONE]", events[-3:]
        assert "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
        for p in d.procs.values():
            _exit_output(p)
    finally:
        d.stop()
