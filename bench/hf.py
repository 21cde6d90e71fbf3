"""Our engine vs transformers' generate on the same small DeepSeek-V4 (the `tiny` preset, the
same random weights in both), on CPU, in one run with the two interleaved round by round
after one untimed warm-up of each (prints a table; not a test).

    .venv/bin/python bench/hf.py [--rounds R] [--new-tokens N] [--ttft-tokens T]

Rows: greedy tokens/s at 1 and 16 concurrent requests (each request a different prompt of
`--prompt-tokens`; transformers gets the 16 as one batch of equal-length prompts, its best
case), and time to first token of one `--ttft-tokens`-token prompt (our chunked prefill vs
transformers' one full forward). Medians over the rounds, each engine's best in brackets.
Our engine computes in float64 (the reference path), transformers in float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv4_common.core.presets import tiny
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker" / "tests" / "model"))
from hf_support import hf_reference

SEED = 7


def _prompts(count: int, tokens: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(count * 1000 + tokens)
    return [torch.randint(2, vocab, (tokens,), generator=gen).tolist() for _ in range(count)]


def _engine(params: dict[str, torch.Tensor], chunk: int) -> Engine:
    model = tiny()
    rank = plan(
        PlanInputs(
            model=model,
            role="colocated",
            gpu_memory_bytes=GIB,
            page_size=16,
            chunked_prefill_tokens=chunk,
            max_running_requests=32,
        )
    ).ranks[0]
    memory = KVMemory.from_rank_plan(rank)
    config = AllocatorConfig.from_rank_plan(rank)
    sched = SchedulerConfig(
        page_size=config.page_size,
        chunk_tokens=chunk,
        max_tokens_per_request=config.max_tokens_per_request,
        retained_tokens=config.retained_tokens,
    )
    return Engine(PagedModel(model, params, memory), EngineConfig(sched))


def ours_tokens_per_s(params: dict[str, torch.Tensor], prompts: list[list[int]], new: int) -> float:
    eng = _engine(params, chunk=2048)
    start = time.perf_counter()
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    eng.run_until_idle(max_steps=100_000)
    elapsed = time.perf_counter() - start
    return sum(len(r.output) for r in reqs) / elapsed


def hf_tokens_per_s(model: Any, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * len(prompts) / elapsed


def ours_ttft_s(params: dict[str, torch.Tensor], prompt: list[int]) -> float:
    eng = _engine(params, chunk=512)
    start = time.perf_counter()
    req = eng.submit(prompt, SamplingParams(max_new_tokens=1))
    while not req.output:
        eng.step()
    return time.perf_counter() - start


def hf_ttft_s(model: Any, prompt: list[int]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]))
    return time.perf_counter() - start


def _cell(ours: list[float], theirs: list[float], higher_is_better: bool) -> str:
    pick = max if higher_is_better else min
    a, b = statistics.median(ours), statistics.median(theirs)
    ratio = a / b if higher_is_better else b / a
    return (
        f"ours {a:9.2f} [{pick(ours):9.2f}]   transformers {b:9.2f} [{pick(theirs):9.2f}]"
        f"   ours/transformers {ratio:6.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--ttft-tokens", type=int, default=2048)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for both engines (0: torch's default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tiny()
    params = init_weights(model, seed=SEED)
    reference = hf_reference(model, params).float().eval()
    vocab = model.weights.vocab_size
    cases: list[tuple[str, Callable[[], float], Callable[[], float], bool]] = []
    for count in (1, 16):
        prompts = _prompts(count, args.prompt_tokens, vocab)
        cases.append(
            (
                f"tokens/s, {count:2d} request(s)",
                lambda p=prompts: ours_tokens_per_s(params, p, args.new_tokens),
                lambda p=prompts: hf_tokens_per_s(reference, p, args.new_tokens),
                True,
            )
        )
    (long_prompt,) = _prompts(1, args.ttft_tokens, vocab)
    cases.append(
        (
            f"TTFT s, {args.ttft_tokens}-token prompt",
            lambda: ours_ttft_s(params, long_prompt),
            lambda: hf_ttft_s(reference, long_prompt),
            False,
        )
    )
    print(f"torch threads {torch.get_num_threads()}, {args.rounds} rounds, model tiny (CPU)")
    for name, ours, theirs, higher in cases:
        a: list[float] = []
        b: list[float] = []
        ours(), theirs()  # warm-up, not timed: first calls pay one-off costs
        for _ in range(args.rounds):  # interleaved: ours, then transformers, each round
            a.append(ours())
            b.append(theirs())
        print(f"{name:32s} {_cell(a, b, higher)}", flush=True)


if __name__ == "__main__":
    main()
