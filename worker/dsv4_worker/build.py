"""Wire one stage's engine for its role: the only module that builds a PD agent and gives it
to its engine (an import-linter contract keeps it so). `wire` picks the builder of
(role, place in the PP group) from `BUILDERS`:

    colocated, any place       the engine alone (no-op events)
    prefill, single | leader   PrefillAgent: the KV control socket, every stage's manifest
    prefill, follower          PrefillFollower: writes its layers of the leader's transfers
    decode, single | leader    DecodeAgent: the transfer target (and every stage's, in a group)
    decode, follower           DecodeFollower: its target; reports landed tags to the leader

Construction order: the agent first (it owns sockets and needs nothing from the engine), then
the engine with the agent as its events (given once), the runner over the engine, and last
`attach` gives the agent its engine and the runner's `call`: once, before anything starts.
Every stage of a PP group runs the same collectives in the same order (manifests, targets).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, Protocol

import zmq

from dsv4_common.api.manifest import (
    Manifest,
    manifest_hash,
    manifest_of,
    manifest_to_dict,
    parse_manifest,
)
from dsv4_worker.engine.events import NO_EVENTS
from dsv4_worker.engine.grammar import GrammarCompiler
from dsv4_worker.engine.role import Place, Role
from dsv4_worker.options import ServeError, ServeOptions
from dsv4_worker.pd import control as C
from dsv4_worker.pd.auth import SessionKeys
from dsv4_worker.pd.channel import OnFailure
from dsv4_worker.pd.decode import DecodeAgent, DecodeFollower
from dsv4_worker.pd.prefill import WRITE_TIMEOUT_S, PrefillAgent, PrefillFollower
from dsv4_worker.pd.transfer import (
    Region,
    TransferError,
    TransferInitiator,
    make_initiator,
    make_target,
)
from dsv4_worker.pp.group import BuiltStage, stage_engine
from dsv4_worker.server.admission import AdmissionPolicy
from dsv4_worker.server.app import KVState
from dsv4_worker.server.runner import EngineRunner


class Agent(Protocol):
    """What serving does with a PD agent: run it, stop it, watch whether its thread died
    (`failure`; `on_failure` is called, from the dying thread, once it is set)."""

    on_failure: OnFailure

    @property
    def failure(self) -> str | None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RoleInputs:
    opts: ServeOptions
    stage: BuiltStage
    policy: AdmissionPolicy
    grammar: GrammarCompiler | None


@dataclass(frozen=True, slots=True)
class Wired:
    runner: EngineRunner  # its engine: `runner.engine`
    agent: Agent | None = None  # None: colocated
    kv_state: Callable[[], KVState] | None = None  # the agent's live /status view


Builder = Callable[[RoleInputs], Wired]


def wire(
    opts: ServeOptions,
    stage: BuiltStage,
    policy: AdmissionPolicy,
    grammar: GrammarCompiler | None = None,
) -> Wired:
    """The engine, runner and PD agent of `opts.role` at `stage`'s place. Raises ServeError
    (the transfer backend or a control socket cannot start)."""
    role = Role(opts.role)
    return BUILDERS[role, stage.place](RoleInputs(opts, stage, policy, grammar))


def _colocated(x: RoleInputs) -> Wired:
    engine = stage_engine(x.stage, Role.COLOCATED, NO_EVENTS, x.grammar)
    return Wired(EngineRunner(engine, x.policy))


@dataclass(frozen=True, slots=True)
class _Pools:
    """This stage's KV pools as the transfer sees them."""

    manifest: Manifest
    digest: str
    regions: list[Region]


def _pools(stage: BuiltStage) -> _Pools:
    memory = stage.memory
    pool = memory.pool
    assert pool is not None
    manifest = manifest_of(memory.layout, {str(k): v for k, v in pool.units.items()})
    # Each region names its index space: the target lets a write touch granted units only.
    regions = [
        Region(c.name, pool.buffer(c.name), str(c.index_space)) for c in memory.layout.components
    ]
    return _Pools(manifest, manifest_hash(manifest), regions)


def _keys(opts: ServeOptions) -> SessionKeys:
    assert opts.pd_secret is not None, "a PD role's options carry the secret (with_secret)"
    return SessionKeys(opts.pd_secret)


@contextmanager
def _transfer_errors(backend: str | None) -> Iterator[None]:
    try:
        yield
    except (TransferError, zmq.ZMQError) as exc:
        raise ServeError(f"kv transfer ({backend}): {exc}") from exc


def _prefill_side(x: RoleInputs, pools: _Pools) -> tuple[tuple[Manifest, ...], TransferInitiator]:
    """Every stage's manifest (for the handshake check) and this stage's registered
    initiator."""
    opts, link = x.opts, x.stage.link
    assert opts.transfer is not None
    stages: tuple[Manifest, ...] = (pools.manifest,)
    if link is not None:
        docs = link.all_gather(manifest_to_dict(pools.manifest))
        stages = tuple(parse_manifest(d) for d in docs)
    initiator = make_initiator(
        opts.transfer, name=f"prefill-{os.getpid()}", threads=opts.transfer_threads
    )
    initiator.register(pools.regions)
    return stages, initiator


def _prefill_leader(x: RoleInputs) -> Wired:
    """Takes decode's requests; in a PP group every stage writes its own layers."""
    opts, pools = x.opts, _pools(x.stage)
    with _transfer_errors(opts.transfer):
        stages, initiator = _prefill_side(x, pools)
        agent = PrefillAgent(
            initiator,
            pools.manifest,
            f"tcp://{opts.host}:{opts.kv_port}",
            _keys(opts),
            write_timeout_s=min(opts.transfer_timeout_s, WRITE_TIMEOUT_S),
            stages=stages,
        )
    engine = stage_engine(x.stage, Role.PREFILL, agent, x.grammar)
    runner = EngineRunner(engine, x.policy)
    agent.attach(engine, runner.call)
    endpoint = f"{advertise_host(opts.host)}:{agent.port}"
    print(f"dsv4 serve: KV control on {endpoint} ({opts.transfer})", flush=True)
    return Wired(runner, agent, lambda: KVState(agent.ready, pools.digest, endpoint))


def _prefill_follower(x: RoleInputs) -> Wired:
    opts, pools, link = x.opts, _pools(x.stage), x.stage.link
    assert link is not None
    with _transfer_errors(opts.transfer):
        _, initiator = _prefill_side(x, pools)
        agent = PrefillFollower(
            initiator,
            pools.manifest,
            _keys(opts),
            rank=link.rank,
            write_timeout_s=min(opts.transfer_timeout_s, WRITE_TIMEOUT_S),
        )
    engine = stage_engine(x.stage, Role.PREFILL, agent, x.grammar)
    agent.attach(engine)
    return Wired(
        EngineRunner(engine, x.policy), agent, lambda: KVState(agent.ready, pools.digest, None)
    )


def _decode_leader(x: RoleInputs) -> Wired:
    """Sends its requests to prefill; in a PP group it gathers every stage's target (each
    prefill stage writes its layers into the decode stages that hold them)."""
    opts, pools, link = x.opts, _pools(x.stage), x.stage.link
    advertise = advertise_host(opts.host)
    assert opts.transfer is not None
    keys = _keys(opts)
    with _transfer_errors(opts.transfer):
        target = make_target(opts.transfer, keys, host=advertise)
        target.register(pools.regions)
    me = C.StageTarget(C.b64(target.descriptor()), pools.manifest)
    agent = DecodeAgent(
        target,
        pools.manifest,
        keys,
        default_prefill=opts.default_prefill,
        transfer_timeout_s=opts.transfer_timeout_s,
        landed_bind=f"tcp://{opts.host}:0" if link is not None else None,
    )
    engine = stage_engine(x.stage, Role.DECODE, agent, x.grammar)
    runner = EngineRunner(engine, x.policy)
    agent.attach(engine, runner.call, runner.show_first_token)
    if link is not None:  # every stage's target, so each prefill stage writes its layers
        port = (agent.landed_endpoint or "").rsplit(":", 1)[-1]
        gathered = link.all_gather((me, f"tcp://{advertise}:{port}"))
        agent.stages = tuple(t for t, _ in gathered)
    return Wired(runner, agent, lambda: KVState(agent.kv_status()[0], pools.digest, None))


def _decode_follower(x: RoleInputs) -> Wired:
    """A later decode stage: prefill writes its layers into its target; its engine replica
    takes the decode code paths with no-op events; only the leader talks to prefill."""
    opts, pools, link = x.opts, _pools(x.stage), x.stage.link
    assert opts.transfer is not None and link is not None
    with _transfer_errors(opts.transfer):
        target = make_target(opts.transfer, _keys(opts), host=advertise_host(opts.host))
        target.register(pools.regions)
    me = C.StageTarget(C.b64(target.descriptor()), pools.manifest)
    gathered = link.all_gather((me, None))
    agent = DecodeFollower(target, gathered[0][1], pools.manifest)
    engine = stage_engine(x.stage, Role.DECODE, agent, x.grammar)
    agent.attach(engine)
    return Wired(EngineRunner(engine, x.policy), agent, lambda: KVState(True, pools.digest, None))


BUILDERS: Final[Mapping[tuple[Role, Place], Builder]] = {
    (Role.COLOCATED, Place.SINGLE): _colocated,
    (Role.COLOCATED, Place.LEADER): _colocated,
    (Role.COLOCATED, Place.FOLLOWER): _colocated,
    (Role.PREFILL, Place.SINGLE): _prefill_leader,
    (Role.PREFILL, Place.LEADER): _prefill_leader,
    (Role.PREFILL, Place.FOLLOWER): _prefill_follower,
    (Role.DECODE, Place.SINGLE): _decode_leader,
    (Role.DECODE, Place.LEADER): _decode_leader,
    (Role.DECODE, Place.FOLLOWER): _decode_follower,
}


def advertise_host(host: str) -> str:
    """The address peers reach this worker at (the pod IP in Kubernetes)."""
    env = os.environ.get("DSV4_ADVERTISE_HOST") or os.environ.get("POD_IP")
    if env:
        return env
    if host not in ("0.0.0.0", "::", ""):
        return host
    return socket.gethostbyname(socket.gethostname())
