"""Our engine vs transformers' generate on the same DeepSeek-V4 (the same random weights in
both), on CPU, in one run with the two interleaved round by round after one untimed warm-up of
each (prints a table; not a test).

    .venv/bin/python bench/hf.py [--config tiny|medium|PATH] [--dtype float32|float64]
                                 [--threads N] [--rounds R] [--new-tokens N] [--ttft-tokens T]

`--config`: `tiny` (the preset), `medium` (below: hidden 1024, 4 layers whose compress ratios
are the release's first four, 0 0 4 128, every other part at a size where arithmetic, not op
dispatch, takes the time), or a config.json / model directory (its shape; random weights).
Both engines compute in `--dtype` (float32 by default: transformers' CPU dtype, ours on CPU)
with the same `--threads` (0: torch's default), and our KV rows are float32.

Rows: greedy tokens/s at 1 and 16 concurrent requests (each request a different prompt of
`--prompt-tokens`), against transformers twice: the 16 as one batch of equal-length prompts
(its best case, which no server of it gives DeepSeek-V4), and the 16 one `generate` after
another ("in turn": what `transformers serve` 5.24 does with concurrent requests by default,
one `generate` at a time on its inference thread; its continuous batching is opt-in, and #38
found it refuses DeepSeek-V4); then time to first token of one `--ttft-tokens`-token prompt
(our chunked prefill vs transformers' one full forward). Medians over the rounds, each
engine's best in brackets; the ratio is the median of the rounds' ratios (each round runs
ours, then transformers, back to back). `--ttft-tokens 0` skips the TTFT row. With `--json`,
a `@bench-json` line (bench/benchjson.py, for bench/compare.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchjson import Figure, emit

from dsv4_common.core.model import DSV4Arch, DSV4Config, WeightShape, YarnScaling
from dsv4_common.core.presets import load_model_config, tiny
from dsv4_common.core.units import GIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.params import Params
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker" / "tests" / "model"))
from hf_support import hf_reference

SEED = 7
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def medium() -> DSV4Config:
    """A DeepSeek-V4 at hidden 1024: the release's first four layers' ratios (window only,
    window only, CSA, HCA), its window, hc_mult, Sinkhorn iterations and routing; heads, ranks,
    experts and vocabulary scaled down so that one CPU holds it (~75M parameters)."""
    return DSV4Config(
        name="medium",
        num_hidden_layers=4,
        compress_ratios=(0, 0, 4, 128, 0),
        num_nextn_predict_layers=1,
        window_tokens=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        index_head_dim=64,
        index_n_heads=16,
        index_topk=64,
        kv_dtype="fp32",
        indexer_dtype="fp32",
        state_dtype="fp32",
        weights=WeightShape(
            hidden_size=1024,
            vocab_size=8192,
            num_attention_heads=16,
            intermediate_size=0,
            num_routed_experts=8,
            num_shared_experts=1,
            moe_intermediate_size=512,
            num_experts_per_token=2,
            q_lora_rank=256,
            o_lora_rank=256,
        ),
        max_position_embeddings=8192,
        arch=DSV4Arch(
            hc_mult=4,
            o_groups=4,
            num_hash_layers=1,
            routed_scaling_factor=1.5,
            rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=2048),
        ),
        weight_dtype="fp32",
    )


def model_of(name: str) -> DSV4Config:
    if name == "tiny":
        return tiny()
    if name == "medium":
        return medium()
    model = load_model_config(name)
    if not isinstance(model, DSV4Config):
        raise SystemExit(f"--config {name}: transformers runs DeepSeek-V4 configs only")
    # Unquantized float32 storage and float32 KV rows: transformers gets the same floats.
    return dataclasses.replace(
        model,
        quantization=None,
        weight_dtype="fp32",
        kv_dtype="fp32",
        indexer_dtype="fp32",
        state_dtype="fp32",
        kv_page_align_bytes=1,
    )


def _prompts(count: int, tokens: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(count * 1000 + tokens)
    return [torch.randint(2, vocab, (tokens,), generator=gen).tolist() for _ in range(count)]


def _engine(model: DSV4Config, params: Params, chunk: int) -> Engine:
    """Built once per case, outside the timed runs (its pools are allocated here); every run
    leaves it idle with its pages free."""
    page = 128 if max(model.compress_ratios) >= 128 else 16
    rank = plan(
        PlanInputs(
            model=model,
            role="colocated",
            gpu_memory_bytes=params.nbytes + GIB // 2,
            page_size=page,
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


def ours_tokens_per_s(eng: Engine, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    eng.run_until_idle(max_steps=100_000)
    elapsed = time.perf_counter() - start
    return sum(len(r.output) for r in reqs) / elapsed


def _greedy(reference: Any, prompts: list[list[int]], new: int) -> int:
    """One `generate` over `prompts` as one batch (equal lengths); the tokens it generated."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    return int(out.shape[1] - ids.shape[1]) * len(prompts)


def hf_tokens_per_s(reference: Any, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    tokens = _greedy(reference, prompts, new)
    return tokens / (time.perf_counter() - start)


def hf_in_turn_tokens_per_s(reference: Any, prompts: list[list[int]], new: int) -> float:
    """The requests one `generate` after another, as `transformers serve` runs concurrent
    requests by default (its `GenerateManager`)."""
    start = time.perf_counter()
    tokens = sum(_greedy(reference, [prompt], new) for prompt in prompts)
    return tokens / (time.perf_counter() - start)


def ours_ttft_s(eng: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    req = eng.submit(prompt, SamplingParams(max_new_tokens=1))
    while not req.output:
        eng.step()
    return time.perf_counter() - start


def hf_ttft_s(reference: Any, prompt: list[int]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        reference(input_ids=torch.tensor([prompt]))
    return time.perf_counter() - start


def _cell(ours: list[float], theirs: list[float], higher_is_better: bool) -> tuple[str, float]:
    pick = max if higher_is_better else min
    a, b = statistics.median(ours), statistics.median(theirs)
    # the ratio of each round's pair (run back to back), then their median: a slow drift of
    # the machine's speed between rounds moves both of a pair, not their ratio
    pairs = [x / y if higher_is_better else y / x for x, y in zip(ours, theirs, strict=True)]
    ratio = statistics.median(pairs)
    text = (
        f"ours {a:9.2f} [{pick(ours):9.2f}]   transformers {b:9.2f} [{pick(theirs):9.2f}]"
        f"   ours/transformers {ratio:6.2f}x"
    )
    return text, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="tiny, medium, or a config path")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--ttft-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for both engines (0: torch's default)"
    )
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    model = model_of(args.config)
    values = init_weights(model, seed=SEED, dtype=dtype)
    reference = hf_reference(model, values).to(dtype).eval()
    params = Params.of(values, dtype)
    vocab = model.weights.vocab_size
    decoding, prefilling = _engine(model, params, chunk=2048), _engine(model, params, chunk=512)
    cases: list[tuple[str, Callable[[], float], Callable[[], float], bool]] = []
    for count in args.requests:
        prompts = _prompts(count, args.prompt_tokens, vocab)
        cases.append(
            (
                f"tokens/s, {count:2d} request(s)",
                lambda p=prompts: ours_tokens_per_s(decoding, p, args.new_tokens),
                lambda p=prompts: hf_tokens_per_s(reference, p, args.new_tokens),
                True,
            )
        )
        if count > 1:
            cases.append(
                (
                    f"tokens/s, {count:2d}, hf in turn",
                    lambda p=prompts: ours_tokens_per_s(decoding, p, args.new_tokens),
                    lambda p=prompts: hf_in_turn_tokens_per_s(reference, p, args.new_tokens),
                    True,
                )
            )
    if args.ttft_tokens:
        (long_prompt,) = _prompts(1, args.ttft_tokens, vocab)
        cases.append(
            (
                f"TTFT s, {args.ttft_tokens}-token prompt",
                lambda: ours_ttft_s(prefilling, long_prompt),
                lambda: hf_ttft_s(reference, long_prompt),
                False,
            )
        )
    print(
        f"model {model.name} ({args.config}), {args.dtype} both sides, torch threads "
        f"{torch.get_num_threads()}, {args.rounds} rounds, load {os.getloadavg()[0]:.1f} (CPU)"
    )
    figures: list[Figure] = []
    for name, ours, theirs, higher in cases:
        a: list[float] = []
        b: list[float] = []
        ours(), theirs()  # warm-up, not timed: first calls pay one-off costs
        for _ in range(args.rounds):  # interleaved: ours, then transformers, each round
            a.append(ours())
            b.append(theirs())
        text, ratio = _cell(a, b, higher)
        print(f"{name:32s} {text}", flush=True)
        unit = "tok/s" if higher else "s"
        better = "higher" if higher else "lower"
        figures += [
            Figure(f"ours {name}", statistics.median(a), unit, better),
            Figure(f"ours/transformers {name}", ratio, "x", "higher"),
        ]
    if args.json:
        emit("hf", figures)


if __name__ == "__main__":
    main()
