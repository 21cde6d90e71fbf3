"""Run a PP group of engines as processes (torch.distributed needs one process per rank):
rank 0 submits the prompts, runs until idle and reports outputs; every rank reports its
realized pool bytes and its usage at the end."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from serve_support import free_port

from dsv4_common.core.presets import load_model_config
from dsv4_common.plan.inputs import PlanInputs
from dsv4_worker.engine.role import Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights, stage_weights
from dsv4_worker.pp.group import build_stage, stage_engine
from dsv4_worker.pp.spec import PPSpec

HOST = "127.0.0.1"


@dataclass(frozen=True)
class GroupRun:
    model: str = "tiny"
    pp_size: int = 2
    prompts: tuple[tuple[int, ...], ...] = ()
    params: tuple[SamplingParams, ...] = ()
    gpu_memory_bytes: int = 1 << 30
    page_size: int | None = None
    chunk_tokens: int | None = None
    max_running_requests: int | None = None
    layer_split: tuple[int, ...] | None = None
    context_len: int | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def inputs(self) -> PlanInputs:
        return PlanInputs(
            model=load_model_config(self.model),
            role="colocated",
            gpu_memory_bytes=self.gpu_memory_bytes,
            pp_size=self.pp_size,
            layer_split=self.layer_split,
            page_size=self.page_size,
            chunked_prefill_tokens=self.chunk_tokens,
            max_running_requests=self.max_running_requests,
            context_len=self.context_len,
        )


def _stage_main(run: GroupRun, rank: int, port: int, out: Any) -> None:
    # One intra-op thread per stage: stages with torch's default (every CPU each) oversubscribe
    # a 2-core machine, and OpenMP workers spinning for a core made a step 10-20x slower (the
    # memory-pressure test: 72 s instead of 12 s). Every group run here, PP=1 included, does
    # the same, so the token comparisons stay like for like.
    torch.set_num_threads(1)
    try:
        inputs = run.inputs()
        full = init_weights(inputs.model, seed=run.seed)
        built = build_stage(
            inputs,
            lambda names: stage_weights(full, names),
            torch.device("cpu"),
            PPSpec(rank, run.pp_size, HOST, port, start_timeout_s=120, timeout_s=60),
        )
        engine = stage_engine(built, Role.COLOCATED)
        _inject_forward_fault(engine, rank, run.extra.get("fail_forward"))
        outputs: list[list[int]] = []
        endings: list[tuple[str | None, str | None]] = []  # (finish reason, error code)
        logprobs: list[Any] = []  # per request: (sampled tokens', prompt tokens') entries
        retractions = 0
        if rank == 0:
            reqs = [engine.submit(p, s) for p, s in zip(run.prompts, run.params, strict=True)]
            while not engine.idle:
                engine.step()
            engine.step()  # one more order: followers apply the last tokens and go idle
            outputs = [list(r.output) for r in reqs]
            endings = [(r.finish_reason, r.error_code) for r in reqs]
            logprobs = [(list(r.logprobs), list(r.prompt_logprobs)) for r in reqs]
            retractions = sum(r.retractions for r in reqs)
            engine.close()
        else:
            while engine.has_work:
                engine.step()
            engine.close()
        assert built.memory.pool is not None
        out.put(
            (
                rank,
                {
                    "outputs": outputs,
                    "endings": endings,
                    "logprobs": logprobs,
                    "pool_bytes": built.memory.pool.nbytes,
                    "planned_bytes": built.rank.pools.kv_bytes,
                    "layers": built.rank.layers,
                    "used": [(u.pool, u.used) for u in built.memory.usage()],
                    "failure": engine.failure,
                    "retractions": retractions,
                    "layout_layers": built.memory.layout.layer_ids,
                },
            )
        )
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))


def _inject_forward_fault(engine: Any, rank: int, fault: tuple[int, int] | None) -> None:
    """`GroupRun.extra["fail_forward"] = (rank, n)`: that rank's n-th forward raises."""
    if fault is None or fault[0] != rank:
        return
    forward = engine.paged.forward_stage
    calls = [0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == fault[1]:
            raise RuntimeError(f"injected: stage {rank}'s forward broke")
        return forward(*args, **kwargs)

    engine.paged.forward_stage = broken


def run_group(run: GroupRun, timeout_s: float = 300.0) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        ctx.Process(target=_stage_main, args=(run, r, port, out), daemon=True)
        for r in range(run.pp_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, result = out.get(timeout=timeout_s)
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    assert not errors, errors
    return results
