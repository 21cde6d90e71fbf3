"""Decode step times of DeepSeek-V4-Flash-shaped layers (prints a table; not a test): the
preset's real dimensions (hidden 4096, 64 heads of 512, q/o ranks 1024, 256 routed experts of
2048, 6 per token, hc 4, the indexer's 64 heads), `--layers` layers with the release's CSA and
HCA ratios (4, 128, ...; the first hash-routed), random weights held as the release stores them
(FP8 blocks with E8M0 scales, FP4 experts, BF16 and F32 tensors: `random_stored.py`), the
model's default KV format, on one device; `--running` requests decode together.

    .venv/bin/python bench/flash_layers.py [--device cuda] [--running 1 64 256] [--steps 8]
        [--layers 2] [--prompt-tokens 256] [--experts 256] [--vocab 129280] [--dtype auto]
        [--launches] [--json]

Printed: the weight bytes held (equal to the planner's for these layers), which path block-FP8
linears took (a scaled FP8 matmul or dequantize-then-matmul: `fp8_matmul.probe_report`), and
per running count the median decode step (ms) over `--steps` steps after warm-up, with the
device synchronized around each. `--experts` and `--vocab` shrink the routed experts and the
vocabulary (a CPU dry run); the
KV format falls back to bf16 rows, said so, where this tree cannot store the default one.
`--launches` also counts, per running count, one more decode step's kernel-launching operators
(`launches.py`; on a CPU run it under DSV4_EMULATE_DEVICE=1 to count CUDA's code) and the
functions that launch the most.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchjson import Figure, emit
from launches import LaunchCounter, by_function

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import deepseek_v4_flash
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model import fp8_matmul
from dsv4_worker.model.compute import compute_dtype
from dsv4_worker.model.params import Params
from dsv4_worker.model.random_stored import random_weights
from dsv4_worker.model.weights import stage_param_names
from dsv4_worker.sched.scheduler import Phase, SchedulerConfig

PAGE = 256  # the release's page (a multiple of 128)
CHUNK_TOKENS = 8192  # prefill tokens a step
GIB = 1 << 30


def flash_layers(layers: int, experts: int, vocab: int, kv_dtype: str | None = None) -> DSV4Config:
    """Flash with `layers` layers of ratios 4, 128, 4, ... (the release's CSA/HCA alternation;
    the first hash-routed, as Flash's first three are), `experts` routed experts and a
    vocabulary of `vocab` tokens."""
    flash = deepseek_v4_flash()
    ratios = tuple(4 if i % 2 == 0 else 128 for i in range(layers))
    weights = dataclasses.replace(flash.weights, num_routed_experts=experts, vocab_size=vocab)
    model = dataclasses.replace(
        flash,
        name=f"flash-{layers}-layers",
        num_hidden_layers=layers,
        compress_ratios=(*ratios, 0),
        weights=weights,
        arch=dataclasses.replace(flash.arch, num_hash_layers=1),
    )
    if kv_dtype is not None:
        model = dataclasses.replace(
            model, kv_dtype=kv_dtype, indexer_dtype=kv_dtype, kv_page_align_bytes=1
        )  # type: ignore[arg-type]
    return model


def build(model: DSV4Config, params: Params, running: int, tokens: int, device: str) -> Engine:
    held = params.nbytes
    rank = plan(
        PlanInputs(
            model=model,
            role="colocated",
            gpu_memory_bytes=held + 8 * GIB,
            page_size=PAGE,
            chunked_prefill_tokens=CHUNK_TOKENS,
            max_running_requests=max(running, 1),
            weight_bytes_per_rank=(held,),
            context_len=tokens + 64,
        )
    ).ranks[0]
    memory = KVMemory.from_rank_plan(rank, torch.device(device))
    config = AllocatorConfig.from_rank_plan(rank)
    sched = SchedulerConfig(
        page_size=config.page_size,
        chunk_tokens=CHUNK_TOKENS,
        max_tokens_per_request=config.max_tokens_per_request,
        retained_tokens=config.retained_tokens,
    )
    return Engine(PagedModel(model, params, memory), EngineConfig(sched))


def new_tokens(running: int, prompt_tokens: int, steps: int) -> int:
    """Tokens each request may generate so that none finishes before the measured steps end:
    the first admitted decode while the others prefill (`CHUNK_TOKENS` a step), then the
    warm-up, the timed and the counted steps."""
    prefill_steps = -(-running * prompt_tokens // CHUNK_TOKENS) + 1
    return prefill_steps + steps + 4


def step_ms(
    engine: Engine,
    running: int,
    prompt_tokens: int,
    max_new_tokens: int,
    steps: int,
    sync: Callable[[], None],
    counter: LaunchCounter | None = None,
) -> list[float]:
    """The decode steps' milliseconds, every step decoding all `running` requests (each may
    generate `max_new_tokens`: `new_tokens`); `counter` counts one more step's launches."""
    gen = torch.Generator().manual_seed(running)
    vocab = engine.paged.model.weights.vocab_size
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for _ in range(running):
        engine.submit(torch.randint(2, vocab, (prompt_tokens,), generator=gen).tolist(), params)
    while any(r.phase is not Phase.DECODE for r in engine.requests.values()):
        engine.step()  # the prefill chunks, then the first decode steps
    engine.step()  # warm-up decode step
    timed = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        timed.append((time.perf_counter() - t0) * 1e3)
    if counter is not None:
        with counter:
            engine.step()
    decoding = sum(r.phase is Phase.DECODE for r in engine.requests.values())
    if decoding != running:  # the figures would be another batch's
        raise RuntimeError(f"{decoding} of {running} requests decoding at the end of the steps")
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.run_until_idle()
    return timed


def device_and_sync(device: str, dtype_name: str) -> tuple[torch.dtype, Callable[[], None]]:
    """(the compute dtype `dtype_name` means on `device`, a call that waits for `device`);
    exits naming --device where CUDA is asked for and absent."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else lambda: None
    return compute_dtype(dtype_name, device), sync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: bf16 on cuda)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256, help="routed experts (Flash: 256)")
    ap.add_argument("--vocab", type=int, default=129280, help="vocabulary (Flash: 129280)")
    ap.add_argument("--running", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--launches", action="store_true", help="count a step's kernel launches")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dtype, sync = device_and_sync(args.device, args.dtype)
    model = flash_layers(args.layers, args.experts, args.vocab)
    names = stage_param_names(model, range(args.layers), first=True, last=True)
    t0 = time.perf_counter()
    params = Params(random_weights(model, 0, names, args.device), dtype)
    sync()
    planned = plan(PlanInputs(model=model, role="colocated", gpu_memory_bytes=1 << 40)).ranks
    print(
        f"{model.name}: {params.nbytes / GIB:.2f} GiB of weights held (planned "
        f"{planned[0].weight_bytes / GIB:.2f} GiB), drawn in {time.perf_counter() - t0:.1f} s; "
        f"compute {dtype}, device {args.device}, KV {model.kv_dtype}"
    )
    figures: list[Figure] = []
    for running in args.running:
        max_new = new_tokens(running, args.prompt_tokens, args.steps)
        tokens = args.prompt_tokens + max_new + 8
        counter = LaunchCounter() if args.launches else None
        try:
            engine = build(model, params, running, tokens, args.device)
            timed = step_ms(engine, running, args.prompt_tokens, max_new, args.steps, sync, counter)
        except NotImplementedError as exc:  # this tree cannot store the default KV rows
            print(f"KV {model.kv_dtype}: {exc}; using bf16 rows")
            model = flash_layers(args.layers, args.experts, args.vocab, kv_dtype="bf16")
            engine = build(model, params, running, tokens, args.device)
            timed = step_ms(engine, running, args.prompt_tokens, max_new, args.steps, sync, counter)
        ms = statistics.median(timed)
        print(
            f"running {running:4d}: decode step {ms:9.2f} ms (min {min(timed):.2f}), "
            f"{1e3 * running / ms:9.1f} tokens/s",
            flush=True,
        )
        figures.append(Figure(f"decode step ms, {running} running", ms, "ms", "lower"))
        if counter is not None:
            top = ", ".join(f"{f} {n}" for f, n in by_function(counter.sites).most_common(4))
            print(f"  kernel launches a step: {counter.total} (most: {top})", flush=True)
            figures.append(Figure(f"launches, {running} running", counter.total, "ops", "lower"))
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for device, report in fp8_matmul.probe_report.items():
        print(f"block-FP8 linears on {device}: {report}")
    if args.json:
        emit("flash_layers", figures)


if __name__ == "__main__":
    main()
