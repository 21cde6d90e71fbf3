"""The capacity solver for one PP rank: bytes -> pool sizes. Pure arithmetic on a KVLayout.

Memory model of one rank (all terms from the layout spec, nothing derived by hand):

    kv_bytes = full_pages * B_full_page + swa_pages * B_swa_page + req_slots * B_req
             + (B_full_page + B_swa_page + B_req)          # unit 0 of every space = "none"

NOTE: window-bounded components are sized by what the role keeps inside the window
(`swa_pages_needed`), never by prompt length; the longest context comes from the full pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_common.core.layout import IndexSpace, KVLayout
from dsv4_common.core.units import format_bytes
from dsv4_common.plan.inputs import PlanError, Role


@dataclass(frozen=True, slots=True)
class SwaNeed:
    """SWA pages the role needs per running request and for chunks in flight."""

    pages_per_request: int
    chunk_pages: int  # 0 for decode


def swa_need(layout: KVLayout, role: Role, chunk_tokens: int) -> SwaNeed:
    """Pages a request's window touches: the window plus the tokens written this step.

    A span of n consecutive tokens touches at most ceil((n - 1) / P) + 1 pages; a decode step
    keeps the last `window` tokens and writes 1 + draft tokens, a prefill chunk writes `chunk`
    tokens after the window that precedes it.
    """
    p, w, d = layout.page_size, layout.window_tokens, layout.draft_tokens
    per_request = pages_for_tokens(w + d, p) + 1
    chunk = 0 if role == "decode" else pages_for_tokens(chunk_tokens + w, p) + 1
    return SwaNeed(per_request, chunk)


def swa_pages_needed(need: SwaNeed, max_running: int) -> int:
    return max_running * need.pages_per_request + need.chunk_pages


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """The pools one rank's buffers hold, in pages and slots (the tokens and requests they
    make, `dsv4_common.core.capacity.RankCapacity`, are `RankPlan.capacity`)."""

    full_pages: int  # usable (excluding the reserved page 0)
    swa_pages: int
    request_slots: int  # usable (excluding slot 0) == max running requests
    kv_bytes: int  # every buffer of every component, reserved units included

    @property
    def units(self) -> dict[IndexSpace, int]:
        return units_per_space(self.full_pages, self.swa_pages, self.request_slots)


class PoolCoefficients(NamedTuple):
    """Bytes of one unit across a rank's layers: all the solver needs to know of a layout.

    NOTE: additive over layers (a unit is `unit_bytes` per layer), so a contiguous layer
    range's coefficients are prefix-sum differences (the split search relies on it)."""

    full_page: int
    swa_page: int
    request_slot: int


def coefficients(layout: KVLayout) -> PoolCoefficients:
    return PoolCoefficients(
        layout.bytes_per_full_page, layout.bytes_per_swa_page, layout.bytes_per_request_slot
    )


def units_per_space(full_pages: int, swa_pages: int, request_slots: int) -> dict[IndexSpace, int]:
    """Units per layer of each index space that buffers hold: the usable ones + reserved unit 0."""
    return {
        IndexSpace.FULL_PAGE: full_pages + 1,
        IndexSpace.SWA_PAGE: swa_pages + 1,
        IndexSpace.REQ_SLOT: request_slots + 1,
    }


def planned_bytes(layout: KVLayout, full_pages: int, swa_pages: int, request_slots: int) -> int:
    units = units_per_space(full_pages, swa_pages, request_slots)
    return sum(c.bytes_per_unit_all_layers * units[c.index_space] for c in layout.components)


def pool_pages(
    coeffs: PoolCoefficients,
    *,
    available_bytes: int,
    max_running: int,
    need: SwaNeed,
    swa_ratio: float | None,
    max_full_pages: int,
) -> tuple[int, int] | None:
    """(full pages, SWA pages) of the largest full pool next to the SWA pool and `max_running`
    request slots; None when the request slots alone do not fit. full pages < 1: none fits."""
    bf, bs, bq = coeffs
    budget = available_bytes - (bf + bs + bq * (max_running + 1))
    if budget <= 0:
        return None
    if swa_ratio is None:
        swa_pages = swa_pages_needed(need, max_running)
        full_budget = budget - swa_pages * bs
        full_pages = full_budget // bf if bf else max_full_pages
    else:
        full_pages = int(budget // (bf + swa_ratio * bs)) if bf + swa_ratio * bs else max_full_pages
        full_pages = min(full_pages, max_full_pages)
        swa_pages = int(full_pages * swa_ratio)
    return min(full_pages, max_full_pages), swa_pages


def swa_fits(swa_pages: int, need: SwaNeed) -> bool:
    """The SWA pool holds one request's window + page and one prefill chunk."""
    return swa_pages >= need.pages_per_request and swa_pages >= need.chunk_pages


def solve_rank(
    layout: KVLayout,
    *,
    pp_rank: int,
    available_bytes: int,
    max_running: int,
    need: SwaNeed,
    swa_ratio: float | None,
    max_full_pages: int,
) -> PoolSizes:
    """Largest full pool that fits next to the SWA pool and `max_running` request slots."""
    coeffs = coefficients(layout)
    pages = pool_pages(
        coeffs,
        available_bytes=available_bytes,
        max_running=max_running,
        need=need,
        swa_ratio=swa_ratio,
        max_full_pages=max_full_pages,
    )
    if pages is None:
        fixed = coeffs.full_page + coeffs.swa_page + coeffs.request_slot * (max_running + 1)
        raise PlanError(
            f"PP rank {pp_rank}: {max_running} request slots need {format_bytes(fixed)} of "
            f"request state, but only {format_bytes(available_bytes)} is left for KV after "
            "weights: lower max_running_requests, raise gpu memory / mem_fraction, or add PP ranks"
        )
    full_pages, swa_pages = pages
    if full_pages < 1:
        raise PlanError(
            f"PP rank {pp_rank}: no memory left for even one full page ({coeffs.full_page} B) "
            f"after the SWA pool ({swa_pages} pages) and {max_running} request slots: lower "
            "max_running_requests, raise gpu memory / mem_fraction, or add PP ranks"
        )
    _check_swa_fits(layout, pp_rank, swa_pages, need, swa_ratio)
    return PoolSizes(
        full_pages=full_pages,
        swa_pages=swa_pages,
        request_slots=max_running,
        kv_bytes=planned_bytes(layout, full_pages, swa_pages, max_running),
    )


def _check_swa_fits(
    layout: KVLayout, pp_rank: int, swa_pages: int, need: SwaNeed, swa_ratio: float | None
) -> None:
    p, w = layout.page_size, layout.window_tokens
    knob = f"swa_ratio={swa_ratio}" if swa_ratio is not None else "the auto SWA size"
    if swa_pages < need.pages_per_request:
        raise PlanError(
            f"PP rank {pp_rank}: SWA pool of {swa_pages * p} tokens cannot hold even one "
            f"request's window + page ({w} + {p} tokens = {need.pages_per_request} pages); "
            f"raise {knob}"
        )
    if swa_pages < need.chunk_pages:
        raise PlanError(
            f"PP rank {pp_rank}: SWA pool of {swa_pages * p} tokens cannot hold one prefill "
            f"chunk + window + page ({need.chunk_pages} pages); raise {knob} or lower "
            "chunked_prefill_tokens"
        )


def auto_max_running(
    layout: KVLayout,
    *,
    available_bytes: int,
    need: SwaNeed,
    tokens_per_request: int,
    cap: int,
) -> int:
    """Request slots such that `tokens_per_request`-token requests fill the pool, <= cap."""
    return auto_request_slots(
        coefficients(layout),
        layout.page_size,
        available_bytes=available_bytes,
        need=need,
        tokens_per_request=tokens_per_request,
        cap=cap,
    )


def auto_request_slots(
    coeffs: PoolCoefficients,
    page_size: int,
    *,
    available_bytes: int,
    need: SwaNeed,
    tokens_per_request: int,
    cap: int,
) -> int:
    """`auto_max_running` on a rank's coefficients, in [1, cap]."""
    bf, bs, bq = coeffs
    per_request = (
        bq + need.pages_per_request * bs + pages_for_tokens(tokens_per_request, page_size) * bf
    )
    budget = available_bytes - (bf + bs + bq) - need.chunk_pages * bs
    if per_request <= 0:
        return cap
    return max(1, min(cap, budget // per_request))
