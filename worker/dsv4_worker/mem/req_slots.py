"""ReqSlotAllocator: request slots 1..num_slots; clears request-scoped state when a slot is reused.

NOTE: clearing on allocation is a property of this allocator, not of its callers: a request
never sees the HCA compressor ring of the request that held its slot before (lesson 9).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4_common.core.layout import IndexSpace
from dsv4_worker.mem.args import check_range, int64_vector, int_arg
from dsv4_worker.mem.errors import OutOfPages
from dsv4_worker.mem.page_allocator import PageAllocator
from dsv4_worker.mem.pool import KVPool
from dsv4_worker.mem.usage import PoolUsage

_SLOT_OWNER = 1  # request slots have no finer owner than "in use"


class ReqSlotAllocator:
    def __init__(
        self, num_slots: int, pool: KVPool | None = None, device: torch.device | str = "cpu"
    ) -> None:
        if pool is not None and pool.units[IndexSpace.REQ_SLOT] != num_slots + 1:
            raise ValueError(
                f"pool has {pool.units[IndexSpace.REQ_SLOT] - 1} request slots, not {num_slots}"
            )
        self._slots = PageAllocator("req_slots", num_slots, device)
        self._slot_owners = torch.full((1,), _SLOT_OWNER, dtype=torch.int64, device=device)
        self.pool = pool
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def usage(self) -> PoolUsage:
        return self._slots.usage()

    def in_use(self, slots: Tensor) -> Tensor:
        """Per slot (0..num_slots, any integer dtype): allocated?"""
        slots = int64_vector(slots, "req_slots.in_use: slots", self._slots.device)
        check_range(slots, 0, self.num_slots, "req_slots.in_use: slots")
        return self._slots.owner.index_select(0, slots) != 0

    def alloc(self, num_slots: int) -> Tensor:
        """`num_slots` fresh slots with their request-scoped state zeroed; all or nothing."""
        num_slots = int_arg(num_slots, "req_slots.alloc: num_slots", 0)
        if num_slots > self._slots.num_free:
            raise OutOfPages("req_slots", num_slots, self._slots.num_free)
        slots = self._slots.pop(self._slot_owners.expand(num_slots)).clone()  # clone: a view
        if self.pool is not None and num_slots:
            self.pool.clear_units(IndexSpace.REQ_SLOT, slots)
        return slots

    def free(self, slots: Tensor) -> None:
        slots = int64_vector(slots, "req_slots.free: slots", self._slots.device)
        self.free_checked(slots)

    def free_checked(self, slots: Tensor) -> None:
        """`free` of an int64 vector on this device (ranges and ownership are checked)."""
        self._slots.free_checked(slots, self._owners(slots))

    def check_owned(self, slots: Tensor) -> None:
        """Raise unless `free(slots)` would succeed; changes nothing either way."""
        slots = int64_vector(slots, "req_slots.check_owned: slots", self._slots.device)
        self.check_owned_checked(slots)

    def check_owned_checked(self, slots: Tensor) -> None:
        """`check_owned` of an int64 vector on this device."""
        self._slots.check_owned_checked(slots, self._owners(slots))

    def _owners(self, slots: Tensor) -> Tensor:
        return self._slot_owners[: slots.numel()].expand(slots.numel())

    def check_integrity(self) -> None:
        self._slots.check_integrity()
