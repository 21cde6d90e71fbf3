"""ReqSlotAllocator: request slots 1..num_slots (host state); clears request-scoped state when a
slot is reused.

NOTE: clearing on allocation is a property of this allocator, not of its callers: a request
never sees the HCA compressor ring of the request that held its slot before (lesson 9).
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4_common.core.layout import IndexSpace
from dsv4_worker.mem.args import check_range, host_ints, int_arg, resolve_device
from dsv4_worker.mem.device import host_shortcuts, upload
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
        self._slots = PageAllocator("req_slots", num_slots)
        self.device = resolve_device(device)
        self._shared = host_shortcuts(self.device)  # its tensors are host memory
        self.pool = pool
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def usage(self) -> PoolUsage:
        return self._slots.usage()

    def in_use(self, slots: object) -> np.ndarray:
        """Per slot (0..num_slots, any integer dtype): allocated?"""
        s = self._ints(slots, "req_slots.in_use: slots")
        check_range(s, 0, self.num_slots, "req_slots.in_use: slots")
        in_use: np.ndarray = self._slots.owner[s] != 0
        return in_use

    def alloc(self, num_slots: int) -> np.ndarray:
        """`num_slots` fresh slots (a host array) with their request-scoped state zeroed; all or
        nothing."""
        num_slots = int_arg(num_slots, "req_slots.alloc: num_slots", 0)
        if num_slots > self._slots.num_free:
            raise OutOfPages("req_slots", num_slots, self._slots.num_free)
        slots = self._slots.pop(_SLOT_OWNER, num_slots)
        if self.pool is not None and num_slots:
            self.pool.clear_units(IndexSpace.REQ_SLOT, upload(slots, self.pool.device))
        return slots

    def free(self, slots: object) -> None:
        self.free_checked(self._ints(slots, "req_slots.free: slots"))

    def free_checked(self, slots: np.ndarray) -> None:
        """`free` of an int64 host array (ranges and ownership are checked)."""
        self._slots.free(slots, np.full(slots.size, _SLOT_OWNER, dtype=np.int64))

    def check_owned(self, slots: object) -> None:
        """Raise unless `free(slots)` would succeed; changes nothing either way."""
        self.check_owned_checked(self._ints(slots, "req_slots.check_owned: slots"))

    def check_owned_checked(self, slots: np.ndarray) -> None:
        """`check_owned` of an int64 host array."""
        self._slots.check_owned(slots, np.full(slots.size, _SLOT_OWNER, dtype=np.int64))

    def _ints(self, value: object, what: str) -> np.ndarray:
        return host_ints(value, what, self.device, shared=self._shared)

    def check_integrity(self) -> None:
        self._slots.check_integrity()
