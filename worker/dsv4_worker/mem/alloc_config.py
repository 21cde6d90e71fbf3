"""AllocatorConfig: the geometry a KVAllocator is built with (frozen), from a planner RankPlan."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_common.core.index_space import pages_for_tokens
from dsv4_common.plan.planner import RankPlan

CLOSED = -1  # num_tokens of a request slot that is not open


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    page_size: int  # tokens per full page == tokens per SWA page
    num_full_pages: int  # usable, page 0 excluded
    num_swa_pages: int
    num_request_slots: int
    max_pages_per_request: int  # columns of the page table
    window_tokens: int
    draft_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("page_size", "max_pages_per_request", "window_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("num_full_pages", "num_swa_pages", "num_request_slots", "draft_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    @property
    def retained_tokens(self) -> int:
        """Trailing tokens that keep SWA rows: the window plus this step's draft tokens."""
        return self.window_tokens + self.draft_tokens

    @property
    def max_tokens_per_request(self) -> int:
        return self.max_pages_per_request * self.page_size

    @classmethod
    def from_rank_plan(
        cls, rank: RankPlan, max_context_tokens: int | None = None
    ) -> AllocatorConfig:
        cap, layout = rank.pools, rank.layout
        context = (
            rank.capacity.max_context_tokens if max_context_tokens is None else max_context_tokens
        )
        return cls(
            page_size=layout.page_size,
            num_full_pages=cap.full_pages,
            num_swa_pages=cap.swa_pages,
            num_request_slots=cap.request_slots,
            max_pages_per_request=min(cap.full_pages, pages_for_tokens(context, layout.page_size)),
            window_tokens=layout.window_tokens,
            draft_tokens=layout.draft_tokens,
        )
