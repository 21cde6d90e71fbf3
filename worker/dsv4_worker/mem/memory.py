"""KVMemory: one PP stage's KV memory = pool buffers + request slots + the page allocator.

Sized from a planner `RankPlan`, so the buffers' bytes are exactly what the planner counted.
The hot allocation paths live on `pages` (a KVAllocator); this class owns request lifecycles.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_common.core.layout import KVLayout
from dsv4_common.plan.capacity import units_per_space
from dsv4_common.plan.planner import RankPlan
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.args import check_range, host_ints, resolve_device
from dsv4_worker.mem.errors import IntegrityError, KVMemoryError
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.pool import KVPool
from dsv4_worker.mem.req_slots import ReqSlotAllocator
from dsv4_worker.mem.usage import PoolUsage


class KVMemory:
    def __init__(
        self,
        layout: KVLayout,
        config: AllocatorConfig,
        device: torch.device | str = "cpu",
        *,
        with_buffers: bool = True,
    ) -> None:
        if layout.page_size != config.page_size:
            raise ValueError(f"layout page {layout.page_size} != allocator {config.page_size}")
        self.layout = layout
        self.config = config
        self.device = resolve_device(device)
        units = units_per_space(
            config.num_full_pages, config.num_swa_pages, config.num_request_slots
        )
        self.pool = KVPool(layout, units, self.device) if with_buffers else None
        self.req_slots = ReqSlotAllocator(config.num_request_slots, self.pool, self.device)
        self.pages = KVAllocator(config, self.device)

    @classmethod
    def from_rank_plan(
        cls,
        rank: RankPlan,
        device: torch.device | str = "cpu",
        *,
        max_context_tokens: int | None = None,
        with_buffers: bool = True,
    ) -> KVMemory:
        config = AllocatorConfig.from_rank_plan(rank, max_context_tokens)
        return cls(rank.layout, config, device, with_buffers=with_buffers)

    def open(self, num_requests: int) -> np.ndarray:
        """Allocate and open `num_requests` request slots (state cleared); all or nothing.
        Returns the slots as a host array."""
        slots = self.req_slots.alloc(num_requests)
        try:
            self.pages.open(slots)
        except KVMemoryError:
            self.req_slots.free(slots)
            raise
        return slots

    def free(self, slots: object) -> None:
        """End requests: free their pages, then their slots; all or nothing."""
        slots = host_ints(slots, "free: slots", self.device, shared=self.pages.tables.shared)
        if slots.size == 0:
            return
        check_range(slots, 1, self.config.num_request_slots, "free: request slots")
        self.req_slots.check_owned_checked(slots)  # so the second free cannot fail
        self.pages.free_checked(slots)
        self.req_slots.free_checked(slots)

    def usage(self) -> tuple[PoolUsage, ...]:
        return (*self.pages.usage(), self.req_slots.usage())

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        self.req_slots.check_integrity()
        open_ = self.pages.open_slots()
        if not np.all(self.req_slots.in_use(open_)) or open_.size != (
            self.req_slots.num_slots - self.req_slots.num_free
        ):
            raise IntegrityError("open page-table rows and used request slots disagree")
