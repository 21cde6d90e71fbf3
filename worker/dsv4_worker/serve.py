"""`dsv4 serve`: build the engine for one role and serve its HTTP API.

Quick form (everything on one port): `dsv4 serve --model tiny [--port P]` (colocated), or
`--role prefill [--kv-port K]` / `--role decode [--prefill HOST:K]` for a hand-made PD pair.
Deployed form: `dsv4 serve --role R --config-dir DIR` reads `{R}-rank-{DSV4_PP_RANK}.json`
(the rank config), serves the API on its `ports.http` and `/live`, `/ready`, `/status`,
`/metrics` on `ports.status`, and sizes the pools with the planner from the weights it
actually loaded (planned vs realized capacity is what `/status` lets the operator compare).
A prefill worker also binds its KV control socket (`ports.kv`); a decode worker connects to
prefill instances there (the router names one per request). The router role is
`dsv4_router` (no torch); the CLI dispatches it before this module is imported.

Before torch is imported, `start` runs `precheck` (the model, the device, the files, the
prefill address, the plan, the ports: a mistake exits 2 at once naming its flag) and binds the
HTTP ports (`--port 0` takes a free port and prints it); `build` takes what it decided. The
HTTP rules for clients (timeouts, body size, a connection bound) are `dsv4_router.http_guard`'s;
with an API key (`--api-key-file`, the rank config's api_key_file) every path but the probes
wants it (`dsv4_common.api.api_key`), and a worker listening beyond loopback without one says
so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web
from safetensors import SafetensorError

from dsv4_common.api.api_key import exposed_without_key
from dsv4_common.api.lifecycle import ABORT_GRACE_S, DRAIN_S
from dsv4_common.api.worker_status import Threads, WeightsHeld, WorkerStatus
from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_common.plan.inputs import PlanError, PlanInputs
from dsv4_common.plan.weights import estimate_weight_bytes
from dsv4_router.http_auth import require_api_key
from dsv4_router.http_guard import make_runner
from dsv4_router.http_listen import serve_on, stop_accepting
from dsv4_worker.build import Agent, wire
from dsv4_worker.engine.grammar import GrammarCompiler
from dsv4_worker.engine.role import Place
from dsv4_worker.model.checkpoint import is_model_dir, load_checkpoint
from dsv4_worker.model.compute import compute_dtype, dtype_name
from dsv4_worker.model.files import SINGLE
from dsv4_worker.model.kv_quant import check_kv_formats
from dsv4_worker.model.random_stored import random_weights
from dsv4_worker.model.stored import Stored
from dsv4_worker.model.weights import WeightsError, load_weights
from dsv4_worker.options import ServeError, ServeOptions
from dsv4_worker.pp.group import BuiltStage, build_stage
from dsv4_worker.pp.link import StageLost
from dsv4_worker.precheck import Prechecked, precheck
from dsv4_worker.server.admission import AdmissionPolicy, default_policy
from dsv4_worker.server.app import ServeInfo, build_app, build_status_app
from dsv4_worker.server.drain import Drain, drain, engine_busy
from dsv4_worker.server.metrics import Metrics
from dsv4_worker.server.runner import EngineRunner, Health
from dsv4_worker.server.tokenizer import Tokenizer, load_tokenizer
from dsv4_worker.threads import configure_threads

log = logging.getLogger(__name__)

WEIGHTS_FILE = SINGLE  # what a --weights directory without an index holds


@dataclass(frozen=True, slots=True)
class Built:
    runner: EngineRunner
    # (app, its listening sockets): bound before the weights load, so a busy port fails fast
    sites: tuple[tuple[web.Application, list[socket.socket]], ...]
    agent: Agent | None = None  # the role's PD agent (`dsv4_worker.build`)
    drain: Drain = field(default_factory=Drain)  # what the apps read; set at SIGTERM


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ServeError("--device cuda: no CUDA device is available")
    return device


def _check_model(model: ModelConfig, source: str) -> None:
    try:
        check_kv_formats(model)
    except ValueError as exc:
        raise ServeError(f"model {source}: {exc}") from exc


def _weights(
    model: ModelConfig, path: str | None, seed: int, device: torch.device
) -> Callable[[set[str]], Mapping[str, Stored]]:
    """Loads the named parameters (a PP stage's slice, with the MTP layers when the plan
    counts them) as stored, from `path` (a HuggingFace model directory, or a .safetensors
    file of our own), or seeded random ones in the planner's storage formats."""

    def load(names: set[str]) -> Mapping[str, Stored]:
        if path is None:
            return random_weights(model, seed, names, device)
        if isinstance(model, DSV4Config) and is_model_dir(path):
            return _load_model_dir(model, Path(path), names, device)
        file = Path(path)
        if file.is_dir():
            file = file / WEIGHTS_FILE
        try:
            return load_weights(file, model, device, names)
        except (OSError, WeightsError, SafetensorError) as exc:
            raise ServeError(f"weights {file}: {exc}") from exc

    return load


def _load_model_dir(
    model: DSV4Config, root: Path, names: set[str], device: torch.device
) -> Mapping[str, Stored]:
    """A stage's parameters from a model directory, as stored: its layers (read from
    `names`), the embedding if it is the first stage (or speculates), the head if the last,
    and the MTP layers exactly when `names` holds them (the plan counts them)."""
    layer_ids = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    layers = range(layer_ids[0], layer_ids[-1] + 1) if layer_ids else range(0)
    first, last = "embed.weight" in names, "head.weight" in names
    mtp = any(n.startswith("mtp.") for n in names)
    try:
        loaded = load_checkpoint(
            root, model, layers=layers, first=first, last=last, mtp=mtp, device=device
        )
    except (OSError, WeightsError, SafetensorError) as exc:
        raise ServeError(f"weights {root}: {exc}") from exc
    held = {**loaded.params, **loaded.mtp}
    if set(held) != names:
        missing = sorted(names - set(held))[:5]
        raise ServeError(
            f"weights {root}: the checkpoint does not hold this stage's tensors {missing}"
            + (" (the plan speculates: it needs the MTP layers)" if mtp else "")
        )
    return held


def _tokenizer(path: str | None, model_source: str, vocab_size: int) -> Tokenizer:
    """--tokenizer, else the model directory's tokenizer.json (the byte tokenizer for a
    directory without one, and for presets)."""
    if path is not None:
        return load_tokenizer(path, vocab_size)
    if Path(model_source).is_dir():
        return load_tokenizer(model_source, vocab_size, byte_fallback=True)
    return load_tokenizer(None, vocab_size)


def _device_memory(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def build(opts: ServeOptions, checked: Prechecked | None = None) -> Built:
    """The worker of `opts`; `checked`: what `precheck` decided (run here when not given)."""
    checked = checked or precheck(opts)
    device = _device(opts.device)
    pp = opts.pp
    # Before anything parallel runs (torch sets its inter-op pool once, before first use).
    threads = configure_threads(opts.torch_threads, opts.configured_torch_threads)
    role = opts.role
    backend = opts.transfer
    source = opts.model_source
    model = checked.model
    _check_model(model, source)
    listeners = checked.listeners
    try:
        tok = _tokenizer(opts.tokenizer, source, model.weights.vocab_size)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ServeError(f"--tokenizer: {exc}") from exc
    load = _weights(model, checked.weights_path, opts.seed or 0, device)
    dtype = compute_dtype(opts.dtype, device)
    try:
        inputs, memory_bytes = opts.sizing.plan(model, _device_memory(device))
        stage = build_stage(inputs, load, device, pp, device_memory_bytes=memory_bytes, dtype=dtype)
    except PlanError as exc:
        raise ServeError(f"plan: {exc}") from exc
    except StageLost as exc:
        raise ServeError(str(exc)) from exc
    pp_rank = pp.rank if pp else 0
    rank = stage.rank
    weights = _weights_held(stage, inputs)
    log.info(
        "weights: %d bytes held (planned %d), computing in %s",
        weights.held_bytes,
        weights.planned_bytes,
        weights.compute_dtype,
    )
    grammar = GrammarCompiler(tok, model.weights.vocab_size)  # response_format
    grammar.warm_in_background()
    policy = _admission_policy(opts, rank.capacity.max_running_requests)
    wired = wire(opts, stage, policy, grammar)  # the role's engine, runner and PD agent
    runner, agent, engine = wired.runner, wired.agent, wired.runner.engine
    status = WorkerStatus(
        role=role,
        pp_rank=pp_rank,
        capacity=rank.capacity,
        kv_backend=backend,  # type: ignore[arg-type]
        threads=Threads(threads.intra_op, threads.inter_op, threads.source, threads.cpus),
        weights=weights,
    )
    info = ServeInfo(
        model_name=model.name,
        vocab_size=model.weights.vocab_size,
        max_context_tokens=min(
            stage.group.max_context_tokens, engine.config.scheduler.max_tokens_per_request
        ),
        status=status,
        page_size=rank.page_size,
        kv_state=wired.kv_state,
        served_model_names=opts.served_model_names,
        drain=Drain(),
        api=opts.api,
        route_key=opts.pd_secret.key if role == "decode" and opts.pd_secret else None,
    )
    metrics = Metrics(
        runner.snapshot,
        runner.queue_view,
        runner.policy.max_queue_requests,
        health=lambda: _health(runner, agent),
        model_name=(opts.served_model_names or (model.name,))[0],
        page_size=rank.page_size,
    )
    limits = opts.http
    # A prefill worker takes requests from decode workers only, and a later PP stage from its
    # leader only: their HTTP side is the probes.
    probes_only = role == "prefill" or pp_rank > 0
    app = build_status_app(runner, info, metrics, limits) if probes_only else None
    app = app or build_app(runner, tok, info, metrics, limits)
    # The quick form's one port is its status port too (`dsv4_common.api.api_key`).
    require_api_key(app, opts.auth, status_port=len(listeners) == 1)
    if (warning := exposed_without_key(opts.host, opts.auth)) is not None:
        log.warning("%s", warning)
    if len(listeners) == 1:  # the quick form: the probes are on the API port
        return Built(runner, ((app, listeners[0]),), agent, info.drain)
    status_app = build_status_app(runner, info, metrics, limits)
    require_api_key(status_app, opts.auth, status_port=True)
    return Built(runner, ((app, listeners[0]), (status_app, listeners[1])), agent, info.drain)


def _health(runner: EngineRunner, agent: Agent | None) -> Health:
    """The engine thread's health, and the PD agent's control thread's deaths."""
    health = runner.health()
    if agent is None:
        return health
    died = ("pd_control", int(agent.failure is not None))
    return dataclasses.replace(health, deaths=(*health.deaths, died))


def _weights_held(stage: BuiltStage, inputs: PlanInputs) -> WeightsHeld:
    """The bytes this stage's weights hold, the planner's figure for them, the compute dtype."""
    paged = stage.paged
    s = paged.stage
    planned = estimate_weight_bytes(
        inputs.model,
        s.layers,
        first=s.first,
        last=s.last,
        with_draft=inputs.speculative_draft_tokens > 0,
        tp_size=inputs.tp_size,
    )
    return WeightsHeld(paged.p.nbytes, planned, dtype_name(paged.dtype))


def _admission_policy(opts: ServeOptions, max_running_requests: int) -> AdmissionPolicy:
    """The queue's bound and deadline: the options' (flags, else the rank config's), else
    derived from the request slots."""
    return default_policy(max_running_requests, opts.max_queue_requests, opts.queue_timeout_s)


# After a PD agent's thread died: how long its failed requests may take to reach their handlers
# (the engine thread fails them) before the drain aborts whatever is still in flight.
AGENT_FAILED_SETTLE_S = 2.0
SETTLE_POLL_S = 0.01


async def _watch_agent(agent: Agent, drain_state: Drain, stop: asyncio.Event) -> None:
    """A PD agent whose control thread died (it failed its requests and the engine, so /ready
    answers 503): stop serving; `run` exits non-zero and a supervisor restarts the worker.
    The dying thread wakes this (`on_failure`): nothing polls while it lives. The requests it
    failed get that error, not the drain's: the drain starts once their handlers have
    answered (bounded: `AGENT_FAILED_SETTLE_S`)."""
    loop = asyncio.get_running_loop()
    died = asyncio.Event()

    def wake(_why: str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: serving is over
            loop.call_soon_threadsafe(died.set)

    agent.on_failure = wake
    if agent.failure is None:  # (after the hook: a death in between is seen by one of them)
        await died.wait()
    print(f"dsv4 serve: {agent.failure}: exiting", file=sys.stderr, flush=True)
    settled_s = loop.time() + AGENT_FAILED_SETTLE_S
    while drain_state.in_flight and loop.time() < settled_s:
        await asyncio.sleep(SETTLE_POLL_S)
    stop.set()


async def _serve(built: Built, drain_timeout_s: float = DRAIN_S) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the PD agent's thread dies (1). Then drain
    (`server.drain`): unready at once, the requests in flight get `drain_timeout_s` (after a
    second signal or the agent's death: no more), the rest are aborted with an error."""
    runners = []
    built.runner.start()
    if built.agent is not None:
        built.agent.start()
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            hurry.set()
        built.drain.start()  # /ready answers 503 from here on
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    watch = (
        asyncio.ensure_future(_watch_agent(built.agent, built.drain, stop)) if built.agent else None
    )
    try:
        for app, sockets in built.sites:
            # Past the drain every handler has answered: closing needs no long wait.
            app_runner = make_runner(app, shutdown_timeout_s=ABORT_GRACE_S)
            await app_runner.setup()
            runners.append(app_runner)
            port = await serve_on(app_runner, sockets)
            host = sockets[0].getsockname()[0]
            print(f"dsv4 serve: listening on http://{host}:{port}", flush=True)
        await stop.wait()
        if not built.drain.draining:  # the agent died: what is in flight cannot finish
            built.drain.start()
            hurry.set()
        timeout_s, busy = _drain_rule(built, drain_timeout_s)
        print(f"dsv4 serve: draining (up to {timeout_s:g} s)", flush=True)
        aborted = await drain(
            built.drain, built.runner, timeout_s=timeout_s, hurried=hurry, busy=busy
        )
        print(f"dsv4 serve: drained ({aborted} requests aborted); stopping", flush=True)
        if not hurry.is_set():
            await stop_accepting(runners)
    finally:
        if watch is not None:
            watch.cancel()
        for app_runner in runners:
            await app_runner.cleanup()
        built.runner.stop()
        if built.agent is not None:
            built.agent.stop()
    return 1 if built.agent is not None and built.agent.failure is not None else 0


def _drain_rule(built: Built, drain_timeout_s: float) -> tuple[float, Callable[[], bool]]:
    """How long this worker drains and while what it waits. A later PP stage follows its
    leader: it steps while the leader drains and waits for its stop order, past the leader's
    drain and abort (a stage that left first would fail the leader's last requests)."""
    engine = built.runner.engine
    if engine.config.place is Place.FOLLOWER:  # it steps until the stop order or a failure
        return drain_timeout_s + 2 * ABORT_GRACE_S, lambda: engine.has_work
    return drain_timeout_s, lambda: engine_busy(built.runner)


def run(opts: ServeOptions, checked: Prechecked) -> int:
    """Build the worker and serve (`start.run` checked what it could before torch)."""
    try:
        built = build(opts, checked)
    except ServeError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    code = asyncio.run(_serve(built, opts.drain_timeout_s))
    if built.runner.failure is not None:
        _exit_now(1)  # the engine was broken: its teardown may hang (`_exit_now`)
    return code


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown. A worker whose engine broke (its PP group
    lost a stage, its thread died) holds native state that may wait forever on the dead peer
    at exit (gloo's process groups: the survivor of a killed stage hung until SIGKILL, 5 s);
    everything was drained and answered by now, and the supervisor restarts the group."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
