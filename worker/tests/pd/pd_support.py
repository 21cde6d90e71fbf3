"""A prefill and a decode worker in one process, on 127.0.0.1: real engines, real control
sockets (pyzmq), a real transfer backend (NIXL or zmq); only HTTP is left out. Tests submit to
the decode side as its HTTP handler would and compare with a colocated engine."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import pytest

from dsv4_common.api.manifest import manifest_of
from dsv4_common.api.pd_secret import PDSecret
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.role import Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.pd.auth import SessionKeys
from dsv4_worker.pd.decode import DecodeAgent
from dsv4_worker.pd.liveness import Heartbeat
from dsv4_worker.pd.prefill import PrefillAgent
from dsv4_worker.pd.transfer import Block, Region, make_initiator, make_target
from dsv4_worker.pd.transfer.nixl_backend import NixlTarget
from dsv4_worker.pd.transfer.zmq_backend import ZmqTarget
from dsv4_worker.server.runner import Done, EngineRunner, Token

os.environ.setdefault("UCX_NET_DEVICES", "lo")
WAIT_S = 120.0
SECRET = PDSecret(b"pd-support-secret-" + b"0123456789abcdef" * 2)  # the pairs' deployment secret


def keys() -> SessionKeys:
    return SessionKeys(SECRET)


def _regions(mem: KVMemory) -> list[Region]:
    assert mem.pool is not None
    return [
        Region(c.name, mem.pool.buffer(c.name), str(c.index_space)) for c in mem.layout.components
    ]


def _manifest(mem: KVMemory):  # type: ignore[no-untyped-def]
    assert mem.pool is not None
    return manifest_of(mem.layout, {str(k): v for k, v in mem.pool.units.items()})


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    prefill_runner: EngineRunner
    decode_runner: EngineRunner
    prefill_agent: PrefillAgent
    decode_agent: DecodeAgent
    address: str  # the prefill's control address
    prefill_events: Relay  # the prefill engine's events: its agent (a test may swap it)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        prefill: str | None = None,
        rids: Sequence[str] | None = None,
    ) -> list[tuple[list[int], Done]]:
        """`rids`: the requests' ids (None: the runner names them)."""
        names = rids if rids is not None else [None] * len(prompts)
        return asyncio.run(self._generate(prompts, params, prefill or self.address, names))

    async def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        prefill: str,
        rids: Sequence[str | None],
    ) -> list[tuple[list[int], Done]]:
        loop = asyncio.get_running_loop()
        handles = [
            self.decode_runner.submit(tuple(p), sp, loop, prefill=prefill, rid=rid)
            for p, sp, rid in zip(prompts, params, rids, strict=True)
        ]
        out = []
        for h in handles:
            tokens: list[int] = []
            while True:
                event = await asyncio.wait_for(h.events.get(), WAIT_S)
                if isinstance(event, Token):
                    tokens.append(event.token_id)
                else:
                    out.append((tokens, event))
                    break
        return out


def as_role(made: Engine, role: Role, events: EngineEvents) -> Engine:
    """A factory's (colocated, unused) engine rebuilt for `role` with `events`: the same
    model, pools, scheduler config and grammar."""
    config = replace(made.config, role=role)
    return Engine(made.paged, config, events=events, grammar=made.grammar)


class Relay(EngineEvents):
    """Forwards a prefill engine's events to its agent, which a test may replace (a restarted
    prefill process at the same address, on the same engine)."""

    def __init__(self, to: EngineEvents) -> None:
        self.to = to

    def on_admit(self, req: Request) -> None:
        self.to.on_admit(req)

    def on_allocated(self, req: Request) -> None:
        self.to.on_allocated(req)

    def on_prealloc(self, req: Request) -> None:
        self.to.on_prealloc(req)

    def on_cancel(self, req: Request) -> None:
        self.to.on_cancel(req)

    def on_transfer_end(self, req: Request) -> None:
        self.to.on_transfer_end(req)

    def on_note(self, payload: object) -> None:
        self.to.on_note(payload)

    def after_step(self, finished: list[Request]) -> None:
        self.to.after_step(finished)

    def wake_at_s(self, now_s: float) -> float | None:
        return self.to.wake_at_s(now_s)


@contextmanager
def pd_pair(
    backend: str,
    make_prefill: Callable[[], Engine],
    make_decode: Callable[[], Engine],
    *,
    transfer_timeout_s: float = 60.0,
    heartbeat: Heartbeat | None = None,
) -> Iterator[Pair]:
    made_p, made_d = make_prefill(), make_decode()
    initiator = make_initiator(backend, name=f"p-{time.monotonic_ns()}")
    initiator.register(_regions(made_p.mem))
    target = make_target(backend, keys(), host="127.0.0.1")
    target.register(_regions(made_d.mem))
    # Agents first, then each side's engine with its agent as events (as `dsv4_worker.build`).
    pa = PrefillAgent(
        initiator, _manifest(made_p.mem), "tcp://127.0.0.1:0", keys(), heartbeat=heartbeat
    )
    address = f"127.0.0.1:{pa.port}"
    da = DecodeAgent(
        target,
        _manifest(made_d.mem),
        keys(),
        default_prefill=address,
        transfer_timeout_s=transfer_timeout_s,
        heartbeat=heartbeat,
    )
    relay = Relay(pa)
    pe, de = as_role(made_p, Role.PREFILL, relay), as_role(made_d, Role.DECODE, da)
    pr, dr = EngineRunner(pe), EngineRunner(de)
    pa.attach(pe, pr.call)
    da.attach(de, dr.call, dr.show_first_token)
    for part in (pr, pa, dr, da):
        part.start()
    try:
        yield Pair(pe, de, pr, dr, pa, da, address, relay)
    finally:
        for part in (da, dr, pa, pr):
            part.stop()
        initiator.close()
        target.close()


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def on_engine(runner: EngineRunner, fn: Callable[[], object]) -> object:
    """Run `fn` on the runner's engine thread and return its result."""
    box: list[object] = []
    done = threading.Event()

    def call() -> None:
        box.append(fn())
        done.set()

    runner.call(call)
    assert done.wait(WAIT_S), "the engine thread did not run the call"
    return box[0]


def drained(runner: EngineRunner) -> bool:
    """No request left and every pool back to zero used units (checked on the engine thread,
    with `check_integrity`)."""
    eng = runner.engine

    def check() -> bool:
        if eng.requests or eng.held or any(u.used for u in eng.mem.usage()):
            return False
        eng.mem.check_integrity()
        return True

    return bool(on_engine(runner, check))


def wait_drained(pair: Pair) -> None:
    """Wait until both sides hold no request and every pool is back to zero (`drained`)."""
    wait_until(lambda: drained(pair.prefill_runner), "the prefill side to drain")
    wait_until(lambda: drained(pair.decode_runner), "the decode side to drain")


def record_writes(pair: Pair) -> list[str]:
    """The tag of every write the prefill side makes from now on, in order (the writes go on)."""
    tags: list[str] = []
    initiator = pair.prefill_agent.initiator
    real = initiator.write

    def write(
        peer: str, blocks: Sequence[Block], tag: str, timeout_s: float, *, epoch: int
    ) -> None:
        tags.append(tag)
        real(peer, blocks, tag, timeout_s, epoch=epoch)

    initiator.write = write  # type: ignore[method-assign]
    return tags


@dataclass
class Gate:
    """Landed tags kept from decode (`held`) until `open` is set (`withheld_landings`)."""

    open: threading.Event = field(default_factory=threading.Event)
    held: list[str] = field(default_factory=list)


@contextmanager
def withheld_landings(backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Decode's target reports no landed tag until the gate opens; then every one held back."""
    cls = NixlTarget if backend == "nixl" else ZmqTarget
    real_poll = cls.poll_landed
    gate = Gate()

    def poll(self: ZmqTarget | NixlTarget) -> list[str]:
        landed = real_poll(self)  # type: ignore[arg-type]
        if not gate.open.is_set():
            gate.held.extend(landed)
            return []
        out = [*gate.held, *landed]
        gate.held.clear()
        return out

    monkeypatch.setattr(cls, "poll_landed", poll)
    yield gate
