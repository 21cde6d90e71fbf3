"""Whole-state consistency checks of a KVAllocator (slow, exhaustive; tests and idle workers).

Checked on the host tables, beyond each PageAllocator's free + used == total:
  - page tables hold exactly the used full pages, each once, owned by the row's request slot
  - closed slots hold nothing; open slots hold exactly ceil(n/P) pages
  - the window invariant: column c has an SWA page iff swa_start/P <= c < ceil(n/P)
  - full_to_swa and the SWA owners form a bijection between mapped full pages and used SWA pages
and then that the device's copies of the page table and full_to_swa equal the host's (one read
of each: the only device syncs, off every hot path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4_worker.mem.errors import IntegrityError
from dsv4_worker.mem.runs import pages_for

if TYPE_CHECKING:
    from dsv4_worker.mem.kv_allocator import KVAllocator


def _require(ok: bool | np.bool_, message: str) -> None:
    if not ok:
        raise IntegrityError(message)


def check_kv_allocator(alloc: KVAllocator) -> None:
    alloc.full.check_integrity()
    alloc.swa.check_integrity()
    cfg, host = alloc.config, alloc.host
    p_size = cfg.page_size
    n, start, table = host.num_tokens, host.swa_start_tokens, host.page_table
    open_ = n >= 0
    _require(not open_[0], "request slot 0 (reserved) is open")
    _require(np.all(n >= -1), "num_tokens below -1")
    _require(np.all(n <= cfg.max_tokens_per_request), "a request exceeds its page table")

    # Page tables <-> full pool.
    cols = np.arange(cfg.max_pages_per_request)
    live = cols[None, :] < pages_for(np.maximum(n, 0), p_size)[:, None]
    _require(np.all(table[~live] == 0), "a page table holds a page past its request's end")
    live_pages = table[live]
    _require(np.all(live_pages > 0), "an open request misses a page inside its length")
    _require(np.all(live_pages <= cfg.num_full_pages), "a page table holds an unknown page")
    rows = np.broadcast_to(np.arange(table.shape[0])[:, None], table.shape)[live]
    _require(
        np.array_equal(alloc.full.owner[live_pages], rows),
        "a page-table entry is not owned by its request slot",
    )
    _require(
        np.unique(live_pages).size == live_pages.size == alloc.full.num_used,
        "a full page is owned twice, or a used full page is in no page table",
    )

    # Window invariant.
    _require(np.all(start % p_size == 0), "swa_start_tokens not page-aligned")
    _require(np.all(start[~open_] == 0), "a closed slot has swa_start_tokens")
    _require(
        np.all(start[open_] <= alloc.window_floor(n[open_])),
        "swa_start_tokens past the window floor: an in-window token lost its SWA page",
    )
    in_window = live & (cols[None, :] >= (start // p_size)[:, None])
    f2s = host.full_to_swa
    _require(np.all((f2s >= 0) & (f2s <= cfg.num_swa_pages)), "full_to_swa out of range")
    _require(f2s[0] == 0, "the reserved full page 0 maps to an SWA page")
    _require(
        np.array_equal(f2s[table] > 0, in_window),
        "SWA mapping disagrees with the window (missing in-window page or stale mapping)",
    )
    _require(
        np.all(f2s[1:][alloc.full.owner[1:] == 0] == 0),
        "a free full page still maps to an SWA page (stale mapping)",
    )

    # full_to_swa <-> SWA owners.
    mapped = np.flatnonzero(f2s > 0)
    _require(
        np.array_equal(alloc.swa.owner[f2s[mapped]], mapped),
        "full_to_swa and SWA page owners disagree (an SWA page mapped twice?)",
    )
    _require(mapped.size == alloc.swa.num_used, "a used SWA page is mapped by no full page")

    # The device's copies.
    for name, device_copy, truth in (
        ("page_table", alloc.page_table, table),
        ("full_to_swa", alloc.full_to_swa, f2s),
    ):
        _require(
            torch.equal(device_copy.cpu(), torch.from_numpy(truth)),
            f"the device's {name} differs from the host's",
        )
