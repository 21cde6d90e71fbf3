"""HostTables and DeviceTables: a KVAllocator's index state on the host (the truth: every
decision and check reads it) and the device's copies of the two tables the paged forward
reads, written from changes the host decided.

    host (numpy int64)                          device (torch int64)
    page_table[r, c]  full page of column c     page_table           same values
    full_to_swa[f]    SWA page of full page f   full_to_swa          same values
    num_tokens[r], swa_start_tokens[r]          (host only: nothing on the device reads them)

NOTE: with host shortcuts (a CPU, DSV4_EMULATE_DEVICE unset) the device tables ARE the host
arrays (torch views of the same memory), so writing the host writes them. Otherwise each
`apply` makes one upload (every index, value and the op's output, packed) and one index_copy_
or index_fill_ per changed table: never a device sync. `check_integrity` compares the copies.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dsv4_worker.mem.device import upload

Change = tuple[np.ndarray, np.ndarray | None]  # (flat index, values); None: write zeros


class HostTables(NamedTuple):
    page_table: np.ndarray  # [request slots + 1, max pages per request]
    full_to_swa: np.ndarray  # [full pages + 1]
    num_tokens: np.ndarray  # [request slots + 1]; -1: closed
    swa_start_tokens: np.ndarray  # [request slots + 1]; page-aligned


class DeviceTables:
    def __init__(self, host: HostTables, device: torch.device, *, shared: bool) -> None:
        self.device = device
        self.shared = shared
        if shared:
            self.page_table = torch.from_numpy(host.page_table)
            self.full_to_swa = torch.from_numpy(host.full_to_swa)
        else:  # the host tables start as zeros too
            self.page_table = torch.zeros(host.page_table.shape, dtype=torch.int64, device=device)
            self.full_to_swa = torch.zeros(host.full_to_swa.shape, dtype=torch.int64, device=device)
        self._table_flat = self.page_table.view(-1)
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)

    def apply(
        self,
        table: Change | None = None,
        full_to_swa: Change | None = None,
        out: np.ndarray | None = None,
    ) -> Tensor:
        """Write the host's changes to the device copies (flat page-table indices) and return
        `out` (an array the caller built for this call) on the device; empty when None."""
        if self.shared:
            return self._empty if out is None else torch.from_numpy(out)
        changes = [
            (target, change)
            for target, change in ((self._table_flat, table), (self.full_to_swa, full_to_swa))
            if change is not None and change[0].size
        ]
        parts = [a for _, change in changes for a in change if a is not None]
        if out is not None:
            parts.append(out)
        if not parts:
            return self._empty
        packed = upload(np.concatenate(parts), self.device)
        pos = 0
        for target, (index, values) in changes:
            n = index.size
            where = packed[pos : pos + n]
            pos += n
            if values is None:
                target.index_fill_(0, where, 0)
            else:
                target.index_copy_(0, where, packed[pos : pos + n])
                pos += n
        return packed[pos:]
