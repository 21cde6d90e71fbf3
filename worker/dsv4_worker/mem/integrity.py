"""Whole-state consistency checks of a KVAllocator (slow, exhaustive; tests and idle workers).

Checked, beyond each PageAllocator's free + used == total:
  - page tables hold exactly the used full pages, each once, owned by the row's request slot
  - closed slots hold nothing; open slots hold exactly ceil(n/P) pages
  - the window invariant: column c has an SWA page iff swa_start/P <= c < ceil(n/P)
  - full_to_swa and the SWA owners form a bijection between mapped full pages and used SWA pages
  - next_slot: 0 for a closed slot; = n (mod P) for an open one, and the next token's full slot
    (page_table[r, n//P] * P + n % P) when that is inside a page it holds (n % P != 0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4_worker.mem.errors import IntegrityError
from dsv4_worker.mem.index import pages_for_tokens

if TYPE_CHECKING:
    from dsv4_worker.mem.kv_allocator import KVAllocator


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)


def check_kv_allocator(alloc: KVAllocator) -> None:
    alloc.full.check_integrity()
    alloc.swa.check_integrity()
    cfg, dev = alloc.config, alloc.device
    p_size = cfg.page_size
    n, start, table = alloc.num_tokens, alloc.swa_start_tokens, alloc.page_table
    open_ = n >= 0
    _require(not bool(open_[0]), "request slot 0 (reserved) is open")
    _require(bool((n >= -1).all()), "num_tokens below -1")
    _require(bool((n <= cfg.max_tokens_per_request).all()), "a request exceeds its page table")

    # Page tables <-> full pool.
    cols = torch.arange(cfg.max_pages_per_request, device=dev)
    live = cols[None, :] < pages_for_tokens(n.clamp(min=0), p_size)[:, None]
    _require(bool((table[~live] == 0).all()), "a page table holds a page past its request's end")
    live_pages = table[live]
    _require(bool((live_pages > 0).all()), "an open request misses a page inside its length")
    rows = torch.arange(table.shape[0], device=dev)[:, None].expand_as(table)[live]
    _require(
        bool((alloc.full.owner[live_pages] == rows).all()),
        "a page-table entry is not owned by its request slot",
    )
    _require(
        int(torch.unique(live_pages).numel()) == live_pages.numel() == alloc.full.num_used,
        "a full page is owned twice, or a used full page is in no page table",
    )

    # Window invariant.
    _require(bool((start % p_size == 0).all()), "swa_start_tokens not page-aligned")
    _require(bool((start[~open_] == 0).all()), "a closed slot has swa_start_tokens")
    _require(
        bool((start[open_] <= alloc.window_floor(n[open_])).all()),
        "swa_start_tokens past the window floor: an in-window token lost its SWA page",
    )
    in_window = live & (cols[None, :] >= torch.div(start, p_size, rounding_mode="floor")[:, None])
    f2s = alloc.full_to_swa
    _require(bool(((f2s >= 0) & (f2s <= cfg.num_swa_pages)).all()), "full_to_swa out of range")
    _require(int(f2s[0]) == 0, "the reserved full page 0 maps to an SWA page")
    _require(
        bool(((f2s[table] > 0) == in_window).all()),
        "SWA mapping disagrees with the window (missing in-window page or stale mapping)",
    )
    _require(
        bool((f2s[1:][alloc.full.owner[1:] == 0] == 0).all()),
        "a free full page still maps to an SWA page (stale mapping)",
    )

    # next_slot, the decode cache.
    nxt = alloc.next_slot
    _require(bool((nxt[~open_] == 0).all()), "a closed slot has a next_slot")
    n_open, nxt_open = n[open_], nxt[open_]
    _require(bool((nxt_open % p_size == n_open % p_size).all()), "next_slot != num_tokens mod P")
    inside = n_open % p_size != 0
    rows_open = open_.nonzero().squeeze(1)[inside]
    cols_open = torch.div(n_open[inside], p_size, rounding_mode="floor")
    _require(
        bool(
            (
                nxt_open[inside] == table[rows_open, cols_open] * p_size + n_open[inside] % p_size
            ).all()
        ),
        "next_slot is not the next token's full slot",
    )

    # full_to_swa <-> SWA owners.
    mapped = (f2s > 0).nonzero().squeeze(1)
    _require(
        bool((alloc.swa.owner[f2s[mapped]] == mapped).all()),
        "full_to_swa and SWA page owners disagree (an SWA page mapped twice?)",
    )
    _require(mapped.numel() == alloc.swa.num_used, "a used SWA page is mapped by no full page")
