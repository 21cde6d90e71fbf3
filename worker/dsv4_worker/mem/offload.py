"""CPU offload / reload of one request across every component (retraction; ref. issue #33385).

What is saved, per index space of the layout:

    FULL_PAGE : rows of the request's full pages (c4/c128 KV, indexer keys, full-attn KV)
    SWA_PAGE  : rows of its mapped SWA pages only (window KV, per-page compressor rings),
                with the sparse SWA mask (which page columns had an SWA page)
    REQ_SLOT  : its request slot's state (HCA compressor rings)

NOTE: offload copies first and frees only after every copy succeeded; reload checks the snapshot
against this memory's layout, allocates (all or nothing), then writes, and reproduces the same
SWA mask, so the restored request is byte-identical in every component.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dsv4_common.core.layout import IndexSpace
from dsv4_worker.mem.device import upload
from dsv4_worker.mem.errors import (
    IntegrityError,
    InvalidArgument,
    KVMemoryError,
    RequestTooLong,
)
from dsv4_worker.mem.memory import KVMemory


@dataclass(frozen=True, slots=True)
class OffloadedRequest:
    num_tokens: int
    swa_start_tokens: int
    swa_mask: Tensor  # bool per page column: True where the column had an SWA page
    data: dict[str, Tensor]  # component -> [num_layers, num_units, ...] on CPU

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())


def _units_by_space(mem: KVMemory, slot: int) -> tuple[dict[IndexSpace, Tensor], Tensor]:
    """The units request `slot` holds in each index space (on the device: one upload), and its
    SWA mask (on CPU)."""
    full_pages, swa_pages = mem.pages.request_pages(slot)  # host copies
    mask = swa_pages > 0
    full, swa = full_pages.numpy(), swa_pages[mask].numpy()
    units = upload(np.concatenate([full, swa, np.array([slot], dtype=np.int64)]), mem.device)
    by_space = {
        IndexSpace.FULL_PAGE: units[: full.size],
        IndexSpace.SWA_PAGE: units[full.size : full.size + swa.size],
        IndexSpace.REQ_SLOT: units[full.size + swa.size :],
    }
    return by_space, mask


def offload_request(mem: KVMemory, slot: int) -> OffloadedRequest:
    """Copy request `slot` to CPU, then free its pages and slot."""
    if mem.pool is None:
        raise KVMemoryError("offload needs a KVMemory with buffers")
    units, swa_mask = _units_by_space(mem, slot)
    data = {
        c.name: mem.pool.buffer(c.name).index_select(1, units[c.index_space]).to("cpu")
        for c in mem.layout.components
    }
    snapshot = OffloadedRequest(
        num_tokens=int(mem.pages.host.num_tokens[slot]),
        swa_start_tokens=int(mem.pages.host.swa_start_tokens[slot]),
        swa_mask=swa_mask,
        data=data,
    )
    mem.free(np.array([slot], dtype=np.int64))
    return snapshot


def reload_request(mem: KVMemory, snapshot: OffloadedRequest) -> int:
    """Allocate a fresh slot and pages shaped like the snapshot, write it back; returns the slot."""
    if mem.pool is None:
        raise KVMemoryError("reload needs a KVMemory with buffers")
    _check_snapshot(mem, snapshot)
    slots = mem.open(1)
    dev = mem.device
    try:
        mem.pages.alloc_sparse(
            slots,
            np.array([snapshot.num_tokens], dtype=np.int64),
            np.array([snapshot.swa_start_tokens], dtype=np.int64),
        )
    except KVMemoryError:
        mem.free(slots)
        raise
    slot = int(slots[0])
    units, swa_mask = _units_by_space(mem, slot)
    if not torch.equal(swa_mask, snapshot.swa_mask):
        raise IntegrityError("reload: the new SWA mask differs from the offloaded one")
    for c in mem.layout.components:
        data = snapshot.data[c.name].to(dev, non_blocking=True)  # pageable: staged at once
        mem.pool.buffer(c.name).index_copy_(1, units[c.index_space], data)
    return slot


def _check_snapshot(mem: KVMemory, snapshot: OffloadedRequest) -> None:
    """Raise InvalidArgument unless `snapshot` fits this memory's layout and buffers exactly
    (a snapshot taken from another layout must fail before anything is allocated)."""
    assert mem.pool is not None
    n, start, page = snapshot.num_tokens, snapshot.swa_start_tokens, mem.config.page_size
    if n < 0:
        raise InvalidArgument(f"reload: num_tokens={n} must be >= 0")
    if n > mem.config.max_tokens_per_request:
        raise RequestTooLong(f"reload: {n} tokens exceed {mem.config.max_tokens_per_request}")
    num_pages = -(-n // page)
    want_mask = torch.arange(num_pages) >= start // page
    mask = snapshot.swa_mask
    if mask.dtype != torch.bool or mask.device.type != "cpu" or not torch.equal(mask, want_mask):
        raise InvalidArgument(f"reload: swa_mask does not match swa_start_tokens={start}")
    if set(snapshot.data) != {c.name for c in mem.layout.components}:
        raise InvalidArgument("reload: the snapshot's components differ from the layout's")
    units = {
        IndexSpace.FULL_PAGE: num_pages,
        IndexSpace.SWA_PAGE: int(mask.sum()),
        IndexSpace.REQ_SLOT: 1,
    }
    for c in mem.layout.components:
        buf, data = mem.pool.buffer(c.name), snapshot.data[c.name]
        shape = (buf.shape[0], units[c.index_space], *buf.shape[2:])
        if tuple(data.shape) != shape or data.dtype != buf.dtype:
            got = f"{tuple(data.shape)} {data.dtype}"
            raise InvalidArgument(f"reload: {c.name} is {got}, expected {shape} {buf.dtype}")
