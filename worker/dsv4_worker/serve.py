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

The HTTP ports are bound before the tokenizer and the weights are read: a busy port or a bad
`--host` exits 2 at once (`--port 0` takes a free port and prints it). The HTTP rules for
clients (timeouts, body size, a connection bound) are `dsv4_router.http_guard`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import zmq
from aiohttp import web
from safetensors import SafetensorError

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.http_rules import http_limits
from dsv4_common.api.lifecycle import ABORT_GRACE_S, DRAIN_S
from dsv4_common.api.manifest import (
    Manifest,
    manifest_hash,
    manifest_of,
    manifest_to_dict,
    parse_manifest,
)
from dsv4_common.api.rank_config import RankConfig, parse_rank_config
from dsv4_common.api.worker_status import Threads, WorkerStatus
from dsv4_common.core.model import DSV4Config, ModelConfig, ModelConfigError
from dsv4_common.core.presets import PRESETS, load_model_config
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanError, PlanInputs
from dsv4_router.http_guard import make_runner
from dsv4_router.http_listen import ListenError, bind, raise_fd_limit, serve_on
from dsv4_worker.engine.grammar import GrammarCompiler
from dsv4_worker.model.checkpoint import is_model_dir, load_checkpoint
from dsv4_worker.model.ops import COMPUTE
from dsv4_worker.model.weights import WeightsError, init_weights, load_weights, stage_weights
from dsv4_worker.pd import control as C
from dsv4_worker.pd.decode import DecodeAgent, DecodeFollower, new_peer_id
from dsv4_worker.pd.prefill import WRITE_TIMEOUT_S, PrefillAgent, PrefillFollower
from dsv4_worker.pd.transfer import Region, TransferError, make_initiator, make_target
from dsv4_worker.pp.group import BuiltStage, PPSpec, build_stage
from dsv4_worker.pp.link import StageLost
from dsv4_worker.pp.stage import FollowerEngine
from dsv4_worker.server.admission import AdmissionPolicy, default_policy
from dsv4_worker.server.app import KVState, ServeInfo, build_app, build_status_app
from dsv4_worker.server.drain import Drain, drain, engine_busy
from dsv4_worker.server.metrics import Metrics
from dsv4_worker.server.runner import EngineRunner
from dsv4_worker.server.tokenizer import Tokenizer, load_tokenizer
from dsv4_worker.threads import configure_threads

log = logging.getLogger(__name__)

PACKAGED_MODELS = Path(__file__).resolve().parent / "models"  # a preset's shipped weights
CPU_MEMORY_GIB = 1.0  # what a CPU worker plans with when no device size is given
WEIGHTS_FILE = "model.safetensors"


class ServeError(Exception):
    """A bad serve argument, config or environment; the message names it (exit 2)."""


@dataclass(frozen=True, slots=True)
class Built:
    runner: EngineRunner
    # (app, its listening sockets): bound before the weights load, so a busy port fails fast
    sites: tuple[tuple[web.Application, list[socket.socket]], ...]
    agent: PrefillAgent | DecodeAgent | PrefillFollower | DecodeFollower | None = None
    drain: Drain = field(default_factory=Drain)  # what the apps read; set at SIGTERM


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ServeError("--device cuda: no CUDA device is available")
    return device


def _check_model(model: ModelConfig, source: str) -> None:
    if isinstance(model, DSV4Config) and model.kv_dtype not in ("bf16", "fp32", "fp16"):
        raise ServeError(
            f"model {source}: the reference engine stores bf16/fp32 KV rows, this model uses "
            f"{model.kv_dtype} (fp8 pages need the GPU kernels)"
        )


def _weights(
    model: ModelConfig, path: str | None, seed: int, device: torch.device
) -> Callable[[set[str]], Mapping[str, torch.Tensor]]:
    """Loads the named parameters (a PP stage's slice) from `path` (a HuggingFace model
    directory, or a .safetensors file of our own), or seeded random ones."""

    def load(names: set[str]) -> Mapping[str, torch.Tensor]:
        if path is None:
            return stage_weights(init_weights(model, seed=seed, device=device), names)
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
) -> Mapping[str, torch.Tensor]:
    """A stage's parameters from a model directory: its layers (read from `names`), the
    embedding if it is the first stage, the head (and the MTP layer) if the last."""
    layer_ids = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    layers = range(layer_ids[0], layer_ids[-1] + 1) if layer_ids else range(0)
    first, last = "embed.weight" in names, "head.weight" in names
    try:
        loaded = load_checkpoint(
            root, model, layers=layers, first=first, last=last, dtype=COMPUTE, device=device
        )
    except (OSError, WeightsError, SafetensorError) as exc:
        raise ServeError(f"weights {root}: {exc}") from exc
    if set(loaded.params) != names:
        raise ServeError(f"weights {root}: the checkpoint does not hold this stage's tensors")
    if loaded.mtp:
        log.info(
            "weights %s: MTP layer loaded (%d tensors, unused until speculation)",
            root,
            len(loaded.mtp),
        )
    return loaded.params


def packaged_weights(preset: str) -> str | None:
    """The model directory shipped for a preset (dsv4_worker/models/NAME: tiny's is trained by
    scripts/train_tiny.py), or None (random weights)."""
    root = PACKAGED_MODELS / preset
    return str(root) if preset in PRESETS and is_model_dir(root) else None


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


def _quick_inputs(args: argparse.Namespace, model: ModelConfig, device: torch.device) -> PlanInputs:
    memory = _device_memory(device)
    if args.gpu_memory_gib is not None:
        memory = int(args.gpu_memory_gib * GIB)
    return PlanInputs(
        model=model,
        role=args.role,
        gpu_memory_bytes=memory or int(CPU_MEMORY_GIB * GIB),
        page_size=args.page_size,
        chunked_prefill_tokens=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        context_len=args.context_len,
        request_state=args.request_state,
        pp_size=args.pp_size,
    )


def read_rank_config(config_dir: Path, role: str, pp_rank: int) -> RankConfig:
    path = config_dir / f"{role}-rank-{pp_rank}.json"
    try:
        config = parse_rank_config(json.loads(path.read_text()))
    except OSError as exc:
        raise ServeError(f"--config-dir: cannot read {path} ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, DocumentError) as exc:
        raise ServeError(f"{path}: {exc}") from exc
    if config.role != role or config.pp_rank != pp_rank:
        raise ServeError(
            f"{path}: holds role {config.role} PP rank {config.pp_rank}, not --role {role} "
            f"PP rank {pp_rank}"
        )
    return config


def _transfer_backend(args: argparse.Namespace, config: RankConfig | None) -> str:
    backend = config.kv.transfer if config else args.transfer
    if backend not in ("nixl", "zmq"):
        where = "rank config kv.transfer" if config else "--transfer"
        raise ServeError(f"{where}: {backend} is not available in this worker; use nixl or zmq")
    return str(backend)


def _served_names(names: list[str] | None) -> tuple[str, ...]:
    """--served-model-name, checked (empty: the rank config's names, else the model's own)."""
    if not names:
        return ()
    if any(not n.strip() for n in names):
        raise ServeError("--served-model-name: a name must not be empty")
    return tuple(dict.fromkeys(names))


def _advertise_host(host: str) -> str:
    """The address peers reach this worker at (the pod IP in Kubernetes)."""
    env = os.environ.get("DSV4_ADVERTISE_HOST") or os.environ.get("POD_IP")
    if env:
        return env
    if host not in ("0.0.0.0", "::", ""):
        return host
    return socket.gethostbyname(socket.gethostname())


def _pp_spec(args: argparse.Namespace, config: RankConfig | None) -> PPSpec | None:
    """Where this stage's PP group meets (rank 0's PP port), or None for a single stage."""
    if config is not None:
        if config.pp_size == 1:
            return None
        group = os.environ.get("DSV4_GROUP", "")
        host = config.peers.host_template.format(group=group, rank=0)
        port = config.ports.pp
        return PPSpec(config.pp_rank, config.pp_size, host, port, timeout_s=args.pp_timeout_s)
    if args.pp_size == 1:
        return None
    if args.pp_rank >= args.pp_size:
        raise ServeError(f"--pp-rank {args.pp_rank}: must be below --pp-size {args.pp_size}")
    if args.pp_addr is None:
        raise ServeError("--pp-addr HOST:PORT is required with --pp-size > 1 (rank 0 listens)")
    host, _, port = args.pp_addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServeError(f"--pp-addr {args.pp_addr}: expected HOST:PORT")
    return PPSpec(args.pp_rank, args.pp_size, host, int(port), timeout_s=args.pp_timeout_s)


def build(args: argparse.Namespace) -> Built:
    device = _device(args.device)
    config: RankConfig | None = None
    if args.config_dir is not None:
        pp_rank = int(os.environ.get("DSV4_PP_RANK", "0") or 0)
        config = read_rank_config(Path(args.config_dir), args.role, pp_rank)
    pp = _pp_spec(args, config)
    # Before anything parallel runs (torch sets its inter-op pool once, before first use).
    threads = configure_threads(args.torch_threads, config.torch_threads if config else None)
    role = args.role
    backend = _transfer_backend(args, config) if role != "colocated" else None
    source = config.model.source if config else args.model
    try:
        model = load_model_config(source)
    except ModelConfigError as exc:
        raise ServeError(f"model: {exc}") from exc
    _check_model(model, source)
    host = args.host or ("0.0.0.0" if config else "127.0.0.1")
    listeners = _bind_ports(host, args, config)  # before anything slow: a busy port fails now
    if pp is not None:
        pp = replace(pp, listen_host=host)  # rank 0 hosts the rendezvous on this host only
    try:
        tok = _tokenizer(args.tokenizer, source, model.weights.vocab_size)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ServeError(f"--tokenizer: {exc}") from exc
    weights_path = config.model.weights_path if config else args.weights
    if weights_path is None and is_model_dir(source):
        weights_path = source  # `--model DIR`: the checkpoint beside its config.json
    if weights_path is None and args.seed is None:
        weights_path = packaged_weights(source)  # a preset's shipped weights (tiny's: trained)
    load = _weights(model, weights_path, args.seed or 0, device)
    try:
        if config is not None:
            inputs = config.plan_inputs(model)
            memory_bytes = _device_memory(device)
        else:
            inputs, memory_bytes = _quick_inputs(args, model, device), None
        stage = build_stage(inputs, load, device, pp, device_memory_bytes=memory_bytes)
    except PlanError as exc:
        raise ServeError(f"plan: {exc}") from exc
    except StageLost as exc:
        raise ServeError(str(exc)) from exc
    pp_rank = pp.rank if pp else 0
    rank, engine = stage.rank, stage.engine
    engine.grammar = GrammarCompiler(tok, model.weights.vocab_size)  # response_format
    engine.grammar.warm_in_background()
    runner = EngineRunner(engine, _admission_policy(args, config, rank.max_running_requests))
    agent, kv_state = _pd_agent(args, config, stage, runner, backend, host)
    status = WorkerStatus(
        role=role,
        pp_rank=pp_rank,
        full_tokens=rank.full_tokens,
        swa_tokens=rank.swa_tokens,
        max_running_requests=rank.max_running_requests,
        max_context_tokens=rank.max_context_tokens,
        kv_backend=backend,  # type: ignore[arg-type]
        threads=Threads(threads.intra_op, threads.inter_op, threads.source, threads.cpus),
    )
    info = ServeInfo(
        model_name=model.name,
        vocab_size=model.weights.vocab_size,
        max_context_tokens=min(
            stage.group.max_context_tokens, engine.config.max_tokens_per_request
        ),
        status=status,
        page_size=rank.page_size,
        kv_state=kv_state,
        served_model_names=_served_names(getattr(args, "served_model_name", None))
        or (config.model.served_model_names if config else ()),
        drain=Drain(),
    )
    metrics = Metrics(runner.snapshot, runner.queue_view, runner.policy.max_queue_requests)
    limits = http_limits(
        body_timeout_s=args.http_body_timeout_s,
        idle_timeout_s=args.http_idle_timeout_s,
        max_connections=args.max_connections,
    )
    # A prefill worker takes requests from decode workers only, and a later PP stage from its
    # leader only: their HTTP side is the probes.
    probes_only = role == "prefill" or pp_rank > 0
    app = build_status_app(runner, info, metrics, limits) if probes_only else None
    app = app or build_app(runner, tok, info, metrics, limits)
    if config is None:
        return Built(runner, ((app, listeners[0]),), agent, info.drain)
    status_app = build_status_app(runner, info, metrics, limits)
    return Built(runner, ((app, listeners[0]), (status_app, listeners[1])), agent, info.drain)


def _admission_policy(
    args: argparse.Namespace, config: RankConfig | None, max_running_requests: int
) -> AdmissionPolicy:
    """The queue's bound and deadline: the flags, else the rank config's, else derived."""
    max_queue = getattr(args, "max_queue_requests", None)
    timeout_s = getattr(args, "queue_timeout_s", None)
    if config is not None:
        max_queue = max_queue or config.max_queue_requests
        timeout_s = timeout_s or config.queue_timeout_s
    return default_policy(max_running_requests, max_queue, timeout_s)


def _bind_ports(
    host: str, args: argparse.Namespace, config: RankConfig | None
) -> list[list[socket.socket]]:
    """The listening sockets of the API (and, deployed, the status port)."""
    try:
        if config is None:
            return [bind(host, args.port, "--port")]
        ports = {"ports.http": config.ports.http, "ports.status": config.ports.status}
        return [bind(host, port, f"rank config {name}") for name, port in ports.items()]
    except ListenError as exc:
        raise ServeError(str(exc)) from exc


def _pd_agent(
    args: argparse.Namespace,
    config: RankConfig | None,
    stage: BuiltStage,
    runner: EngineRunner,
    backend: str | None,
    host: str,
) -> tuple[
    PrefillAgent | DecodeAgent | PrefillFollower | DecodeFollower | None,
    Callable[[], KVState] | None,
]:
    """The role's PD agent on `runner`'s engine (none when colocated) and its live /status
    view. In a prefill PP group the leader takes decode's requests and every stage writes its
    own layers."""
    if backend is None:
        return None, None
    engine, memory = runner.engine, stage.memory
    assert memory.pool is not None
    pool = memory.pool
    manifest = manifest_of(memory.layout, {str(k): v for k, v in pool.units.items()})
    digest = manifest_hash(manifest)
    regions = [Region(c.name, pool.buffer(c.name)) for c in memory.layout.components]
    advertise = _advertise_host(host)
    timeout_s = min(args.transfer_timeout_s, WRITE_TIMEOUT_S)
    try:
        if args.role == "prefill":
            stages: tuple[Manifest, ...] = (manifest,)
            if stage.link is not None:  # every stage's manifest, for the handshake check
                docs = stage.link.all_gather(manifest_to_dict(manifest))
                stages = tuple(parse_manifest(d) for d in docs)
            initiator = make_initiator(
                backend, name=f"prefill-{os.getpid()}", threads=args.transfer_threads
            )
            initiator.register(regions)
            if stage.link is not None and not stage.link.first:
                follower = PrefillFollower(
                    engine, initiator, manifest, rank=stage.link.rank, write_timeout_s=timeout_s
                )
                assert isinstance(engine, FollowerEngine)
                engine.on_note = follower.on_note
                runner.after_step = follower.after_step
                return follower, lambda: KVState(follower.ready, digest, None)
            kv_port = config.ports.kv if config else args.kv_port
            prefill = PrefillAgent(
                engine,
                runner.call,
                initiator,
                manifest,
                f"tcp://{host}:{kv_port}",
                write_timeout_s=timeout_s,
                stages=stages,
            )
            runner.after_step = prefill.after_step
            endpoint = f"{advertise}:{prefill.port}"
            print(f"dsv4 serve: KV control on {endpoint} ({backend})", flush=True)
            return prefill, lambda: KVState(prefill.ready, digest, endpoint)
        target = make_target(backend, host=advertise)
        target.register(regions)
    except (TransferError, zmq.ZMQError) as exc:
        raise ServeError(f"kv transfer ({backend}): {exc}") from exc
    peer_id = new_peer_id()
    me = C.StageTarget(peer_id, C.b64(target.descriptor()), manifest)
    if stage.link is not None and not stage.link.first:
        # A later decode stage: prefill writes its layers into its target; the engine replica
        # takes the leader's code paths (no-op hooks); only the leader talks to prefill.
        assert isinstance(engine, FollowerEngine)
        engine.on_prealloc = engine.on_cancel = lambda _req: None
        gathered = stage.link.all_gather((me, None))
        return DecodeFollower(target, gathered[0][1]), lambda: KVState(True, digest, None)
    default = args.prefill
    if default is None and config is not None:
        default = f"{config.role_services['prefill']}:{config.ports.kv}"
    decode = DecodeAgent(
        engine,
        runner.call,
        target,
        manifest,
        default_prefill=default,
        transfer_timeout_s=args.transfer_timeout_s,
        peer_id=peer_id,
        landed_bind=f"tcp://{host}:0" if stage.link is not None else None,
    )
    if stage.link is not None:  # every stage's target, so each prefill stage writes its layers
        port = (decode.landed_endpoint or "").rsplit(":", 1)[-1]
        gathered = stage.link.all_gather((me, f"tcp://{advertise}:{port}"))
        decode.stages = tuple(t for t, _ in gathered)
    return decode, lambda: KVState(decode.kv_status()[0], digest, None)


AGENT_WATCH_S = 0.2  # how often `_serve` looks whether the PD agent's thread died


async def _watch_agent(
    agent: PrefillAgent | DecodeAgent | PrefillFollower | DecodeFollower, stop: asyncio.Event
) -> None:
    """A PD agent whose control thread died (it failed its requests and the engine, so /ready
    answers 503): stop serving; `run` exits non-zero and a supervisor restarts the worker."""
    while agent.failure is None:
        await asyncio.sleep(AGENT_WATCH_S)
    print(f"dsv4 serve: {agent.failure}: exiting", file=sys.stderr, flush=True)
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
    watch = asyncio.ensure_future(_watch_agent(built.agent, stop)) if built.agent else None
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
    if isinstance(engine, FollowerEngine):
        return drain_timeout_s + 2 * ABORT_GRACE_S, lambda: not (engine.stopped or engine.failure)
    return drain_timeout_s, lambda: engine_busy(built.runner)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise_fd_limit()  # before the apps size their connection bound from it
    try:
        built = build(args)
    except ServeError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(built, getattr(args, "drain_timeout_s", None) or DRAIN_S))
