"""Scheduler + allocator overhead per decode step, the model replaced by a no-op (prints a
table; not a test).

    .venv/bin/python bench/engine.py [--device cpu|cuda] [--steps N] [--rounds R]
        [--penalties] [--vocab V]

`running` requests decode together (tiny's layout, page 16); each cell is the median over
`--rounds` rounds of the median step time of `--steps` steps, the best round in brackets.
What is timed: plan_step over every request's view, the allocator's decode (with its page
rollovers), sampling bookkeeping and window eviction: everything the engine does besides the
forward. `--penalties`: every request also has the logit processors (presence, frequency and
repetition penalties, a logit_bias, min_tokens; greedy, so what is timed is the processors,
not the per-request draw of sampled requests) over logits of `--vocab` tokens (default: tiny's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from benchjson import Figure, emit

from dsv4_common.core.layout import build_layout
from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import Segment
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.sched.scheduler import SchedulerConfig

PAGE = 16
PROMPT_TOKENS = 16


class NoOpModel:
    """Stands in for PagedModel: logits that always pick token 1, built once per batch size (a
    no-op: the model's cost is not what this measures); no KV touched."""

    def __init__(self, memory: KVMemory, vocab: int) -> None:
        self.memory = memory
        self.vocab = vocab
        self._logits: dict[int, torch.Tensor] = {}

    def forward(self, segments: Sequence[Segment]) -> torch.Tensor:
        rows = len(segments)
        if rows not in self._logits:
            logits = torch.zeros(rows, self.vocab, device=self.memory.device)
            logits[:, 1] = 1.0
            self._logits[rows] = logits
        return self._logits[rows]


def build(running: int, steps: int, device: torch.device, vocab: int | None = None) -> Engine:
    model = tiny()
    tokens = PROMPT_TOKENS + steps + 8
    pages = running * (-(-tokens // PAGE) + 1) + 8
    config = AllocatorConfig(
        page_size=PAGE,
        num_full_pages=pages,
        num_swa_pages=running * 3 + 8,
        num_request_slots=running,
        max_pages_per_request=-(-tokens // PAGE) + 1,
        window_tokens=model.window_tokens,
    )
    memory = KVMemory(build_layout(model, PAGE), config, device, with_buffers=False)
    sched = SchedulerConfig(
        page_size=PAGE,
        chunk_tokens=running * PROMPT_TOKENS,
        max_tokens_per_request=config.max_tokens_per_request,
    )
    logits = NoOpModel(memory, vocab or model.weights.vocab_size)
    try:
        from dsv4_worker.engine.role import EngineConfig
    except ImportError:  # a tree from before explicit roles (bench/compare.py's baseline)
        return Engine(logits, sched)  # type: ignore[arg-type]
    return Engine(logits, EngineConfig(sched))  # type: ignore[arg-type]


def processed(i: int, steps: int, vocab: int) -> SamplingParams:
    """Request i's parameters with every logit processor on, greedy; a stop id it does not
    reach in time (penalized tokens fall below the untouched zeros, taken from token 0 up)."""
    return SamplingParams(
        max_new_tokens=steps + 4,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias=((5, 2.0), (7 + i % 8, -1.0)),
        min_tokens=4,
        stop_token_ids=(vocab - 1,),
    )


def round_median_ms(
    running: int, steps: int, device: torch.device, vocab: int | None = None
) -> float:
    eng = build(running, steps, device, vocab)
    for i in range(running):
        params = SamplingParams(max_new_tokens=steps + 4)
        if vocab is not None:
            params = processed(i, steps, vocab)
        eng.submit([2] * PROMPT_TOKENS, params)
    eng.step()  # the prefill of every request
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        eng.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    assert len(eng.requests) == running, "every request must still be decoding"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--running", type=int, nargs="*", default=[1, 64, 1024])
    parser.add_argument("--penalties", action="store_true", help="every logit processor on")
    parser.add_argument("--vocab", type=int, default=None, help="logits width (with --penalties)")
    parser.add_argument("--json", action="store_true", help="also print a @bench-json line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    vocab = (args.vocab or tiny().weights.vocab_size) if args.penalties else None
    what = f", penalties over vocab {vocab}" if vocab else ""
    print(
        f"engine step overhead (no-op model), device={device}, page={PAGE}, torch threads 1{what}"
    )
    print(f"{'running':>8}  {'ms/step (median of rounds)':>27}  {'best round':>10}")
    figures = []
    for running in args.running:
        rounds = [round_median_ms(running, args.steps, device, vocab) for _ in range(args.rounds)]
        print(f"{running:>8}  {statistics.median(rounds):>27.3f}  {min(rounds):>10.3f}")
        name = f"step, {running} running" + (" with penalties" if vocab else "")
        figures.append(Figure(name, statistics.median(rounds), "ms", "lower"))
    if args.json:
        emit("engine", figures)


if __name__ == "__main__":
    main()
