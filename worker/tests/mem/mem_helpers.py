"""Helpers shared by the mem tests: small memories, state snapshots, request bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from dsv4_common.core.layout import IndexSpace, build_layout
from dsv4_common.core.model import ModelConfig
from dsv4_common.core.presets import load_model_config
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.device import EMULATE_ENV
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.memory import KVMemory


def small_memory(
    preset: str | ModelConfig = "tiny",
    *,
    page_size: int = 16,
    full_pages: int = 24,
    swa_pages: int = 10,
    slots: int = 5,
    max_pages: int = 8,
    draft_tokens: int = 0,
    with_buffers: bool = True,
    device: str = "cpu",
    emulate: bool = False,
) -> KVMemory:
    """`emulate`: built under DSV4_EMULATE_DEVICE=1 (device tables apart from the host's)."""
    model = load_model_config(preset) if isinstance(preset, str) else preset
    layout = build_layout(model, page_size, draft_tokens)
    config = AllocatorConfig(
        page_size=page_size,
        num_full_pages=full_pages,
        num_swa_pages=swa_pages,
        num_request_slots=slots,
        max_pages_per_request=max_pages,
        window_tokens=layout.window_tokens,
        draft_tokens=layout.draft_tokens,
    )
    with emulating_device(emulate):
        return KVMemory(layout, config, device, with_buffers=with_buffers)


@contextmanager
def emulating_device(on: bool = True) -> Iterator[None]:
    """DSV4_EMULATE_DEVICE=1 while allocators are built (they read it then): the CPU takes
    the code a CUDA device takes."""
    old = os.environ.get(EMULATE_ENV)
    if on:
        os.environ[EMULATE_ENV] = "1"
    else:
        os.environ.pop(EMULATE_ENV, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(EMULATE_ENV, None)
        else:
            os.environ[EMULATE_ENV] = old


def t(*values: int) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def h(values: np.ndarray) -> Tensor:
    """A host array as a tensor (for the state comparisons)."""
    return torch.from_numpy(values)


def allocator_state(alloc: KVAllocator) -> list[Tensor]:
    """Every piece of allocator state, copied (for all-or-nothing comparisons): the host
    tables, both pools, and the device's copies of the tables."""
    out = [torch.from_numpy(table.copy()) for table in alloc.host]
    for pages in (alloc.full, alloc.swa):
        out += [torch.from_numpy(pages.owner.copy()), h(pages.free_units()), t(pages.num_free)]
    return [*out, alloc.page_table.cpu().clone(), alloc.full_to_swa.cpu().clone()]


def memory_state(mem: KVMemory) -> list[Tensor]:
    slots = mem.req_slots._slots
    return [*allocator_state(mem.pages), h(slots.owner.copy()), t(slots.num_free)]


def same_state(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def fill_random(mem: KVMemory, seed: int) -> None:
    """Random bytes in every buffer (viewed as bytes, so float NaN patterns compare bitwise)."""
    assert mem.pool is not None
    gen = torch.Generator().manual_seed(seed)
    for c in mem.layout.components:
        raw = mem.pool.unit_bytes_view(c.name)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def request_bytes(mem: KVMemory, slot: int) -> dict[str, Tensor]:
    """The bytes of every unit a request holds, per component, in column order."""
    assert mem.pool is not None
    full, swa = mem.pages.request_pages(slot)
    units = {
        IndexSpace.FULL_PAGE: full,
        IndexSpace.SWA_PAGE: swa[swa > 0],
        IndexSpace.REQ_SLOT: t(slot),
    }
    return {
        c.name: mem.pool.unit_bytes_view(c.name).index_select(1, units[c.index_space]).clone()
        for c in mem.layout.components
    }


def same_bytes(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
