"""`dsv4 serve`: build the engine for one role and serve its HTTP API.

Quick form (colocated, this process only): `dsv4 serve --model tiny [--port P] [--device cpu]`.
Deployed form: `dsv4 serve --role R --config-dir DIR` reads the rank config the operator
renders; the prefill, decode and router roles arrive with PD disaggregation and exit 2 until
then, saying so.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from aiohttp import web

from dsv4_common.api.worker_status import WorkerStatus
from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_common.core.presets import load_model_config
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import Plan, plan
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.weights import init_weights, load_weights
from dsv4_worker.sched.scheduler import SchedulerConfig
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.runner import EngineRunner
from dsv4_worker.server.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

CPU_MEMORY_GIB = 1.0  # what a CPU worker plans with when no device size is given


class ServeError(Exception):
    """A bad serve argument or environment; the message names the flag (exit 2)."""


def _plan(args: argparse.Namespace, model: ModelConfig, device: torch.device) -> Plan:
    if args.gpu_memory_gib is not None:
        memory = int(args.gpu_memory_gib * GIB)
    elif device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = int(CPU_MEMORY_GIB * GIB)
    inputs = PlanInputs(
        model=model,
        role="colocated",
        gpu_memory_bytes=memory,
        page_size=args.page_size,
        chunked_prefill_tokens=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        context_len=args.context_len,
        request_state=args.request_state,
    )
    return plan(inputs)


def build(args: argparse.Namespace) -> tuple[web.Application, EngineRunner]:
    if args.config_dir is not None or args.role != "colocated":
        raise ServeError(
            f"--role {args.role}: only the colocated quick form runs yet; prefill, decode and "
            "router (and --config-dir) arrive with PD disaggregation"
        )
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ServeError("--device cuda: no CUDA device is available")
    model = load_model_config(args.model)
    if isinstance(model, DSV4Config) and model.kv_dtype not in ("bf16", "fp32", "fp16"):
        raise ServeError(
            f"--model {args.model}: the reference engine stores bf16/fp32 KV rows, this model "
            f"uses {model.kv_dtype} (fp8 pages need the GPU kernels)"
        )
    group = _plan(args, model, device)
    rank = group.ranks[0]
    if args.weights is not None:
        params = load_weights(Path(args.weights), model, device)
    else:
        params = init_weights(model, seed=args.seed, device=device)
    memory = KVMemory.from_rank_plan(rank, device)
    sched = SchedulerConfig(
        page_size=rank.page_size,
        chunk_tokens=group.inputs.resolved_chunk_tokens,
        max_tokens_per_request=memory.config.max_tokens_per_request,
    )
    engine = Engine(PagedModel(model, params, memory), sched)
    runner = EngineRunner(engine)
    tok = load_tokenizer(args.tokenizer, model.weights.vocab_size)
    status = WorkerStatus(
        role="colocated",
        pp_rank=0,
        full_tokens=rank.full_tokens,
        swa_tokens=rank.swa_tokens,
        max_running_requests=rank.max_running_requests,
        max_context_tokens=rank.max_context_tokens,
    )
    info = ServeInfo(
        model_name=model.name,
        vocab_size=model.weights.vocab_size,
        max_context_tokens=min(rank.max_context_tokens, memory.config.max_tokens_per_request),
        status=status,
    )
    app = build_app(runner, tok, info)

    async def on_startup(_: web.Application) -> None:
        runner.start()

    async def on_cleanup(_: web.Application) -> None:
        runner.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app, runner


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app, _ = build(args)
    except ServeError as exc:
        print(f"dsv4 serve: error: {exc}", file=sys.stderr)
        return 2
    print(f"dsv4 serve: {args.model} on http://{args.host}:{args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0
