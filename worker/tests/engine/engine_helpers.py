"""The engine builder shared by the engine and PD tests: small pools, one scheduler config."""

from __future__ import annotations

import torch
from mem_helpers import small_memory

from dsv4_common.core.model import ModelConfig
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.sched.scheduler import SchedulerConfig


def engine(
    model: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    full_pages: int = 64,
    swa_pages: int = 32,
    slots: int = 8,
    chunk: int = 24,
    page: int = 16,
    device: str = "cpu",
) -> Engine:
    """`weights` must be on `device` (the pools' device)."""
    memory = small_memory(
        model,
        page_size=page,
        full_pages=full_pages,
        swa_pages=swa_pages,
        slots=slots,
        max_pages=full_pages,
        device=device,
    )
    sched = SchedulerConfig(
        page_size=page,
        chunk_tokens=chunk,
        max_tokens_per_request=memory.config.max_tokens_per_request,
        retained_tokens=memory.config.retained_tokens,
    )
    return Engine(PagedModel(model, weights, memory), EngineConfig(sched))
