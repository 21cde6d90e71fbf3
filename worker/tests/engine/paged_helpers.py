"""Drive a PagedModel by hand: chunked prefill of several requests in one batch, then greedy
decode together (`import paged_helpers`), for the equivalence tests against the oracles."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4_common.core.model import ModelConfig
from dsv4_common.core.units import MIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.engine.paged import PagedModel, Segment
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.weights import init_weights


def make(
    model: ModelConfig,
    page_size: int,
    request_state: str = "ring",
    weights: dict[str, torch.Tensor] | None = None,
) -> PagedModel:
    rank = plan(
        PlanInputs(
            model=model,
            role="colocated",
            gpu_memory_bytes=64 * MIB,
            page_size=page_size,
            max_running_requests=8,
            request_state=request_state,  # type: ignore[arg-type]
        )
    ).ranks[0]
    params = weights if weights is not None else init_weights(model, seed=21)
    return PagedModel(model, params, KVMemory.from_rank_plan(rank))


def generate(
    pm: PagedModel,
    prompts: Sequence[Sequence[int]],
    chunk: int,
    new: int,
    logits_out: list[list[torch.Tensor]] | None = None,
) -> list[list[int]]:
    """Chunked prefill of every prompt in one batch per step, then greedy decode together.
    `logits_out` (one list per prompt) collects the logits each chosen token came from."""
    mem = pm.memory
    dev = mem.device
    slots = mem.open(len(prompts)).tolist()
    done = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]

    def take(i: int, row: torch.Tensor) -> None:
        out[i].append(int(row.argmax()))
        if logits_out is not None:
            logits_out[i].append(row.detach().cpu())

    while True:  # chunked prefill, all prompts advancing together
        segs, idx = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = min(chunk, len(p) - done[i])
                mem.pages.extend(
                    torch.tensor([slots[i]], device=dev), torch.tensor([n], device=dev)
                )
                segs.append(Segment(slots[i], done[i], tuple(p[done[i] : done[i] + n])))
                idx.append(i)
                done[i] += n
        if not segs:
            break
        logits = pm.forward(segs)
        for j, i in enumerate(idx):
            if done[i] == len(prompts[i]):
                take(i, logits[j])
        mem.pages.evict_window()
    for _ in range(new - 1):
        mem.pages.decode(torch.tensor(slots, device=dev))
        segs = [
            Segment(slots[i], len(seqs[i]) + len(out[i]) - 1, (out[i][-1],))
            for i in range(len(prompts))
        ]
        logits = pm.forward(segs)
        for i in range(len(prompts)):
            take(i, logits[i])
        mem.pages.evict_window()
    mem.free(torch.tensor(slots, device=dev))
    mem.check_integrity()
    assert all(u.used == 0 for u in mem.usage()), mem.usage()
    return out
