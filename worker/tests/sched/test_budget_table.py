"""`sched/budget.py` as tables: what an extend and a decode step take from each pool, and the
one admission function's verdict (now, later, never, and the reason it gives)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sched_helpers import Pools

from dsv4_worker.sched.budget import Admission, Fit, Need, admit, decode_need, extend_need

P = 4

EXTENDS = [  # (tokens already in the pools, new tokens) -> pages of each pool
    ("first chunk inside one page", 0, 3, Need(1, 1)),
    ("first chunk filling one page exactly", 0, 4, Need(1, 1)),
    ("first chunk spilling into a second page", 0, 5, Need(2, 2)),
    ("chunk continuing a partial page", 3, 1, Need(0, 0)),
    ("chunk crossing from a partial page", 3, 6, Need(2, 2)),
    ("chunk starting on a page boundary", 8, 8, Need(2, 2)),
    ("nothing new", 5, 0, Need(0, 0)),
]


@pytest.mark.parametrize(
    ("name", "num_tokens", "num_new", "want"), EXTENDS, ids=[e[0] for e in EXTENDS]
)
def test_extend_need(name: str, num_tokens: int, num_new: int, want: Need) -> None:
    assert extend_need(num_tokens, num_new, P) == want


@pytest.mark.parametrize(
    ("num_tokens", "want"), [(0, Need(1, 1)), (4, Need(1, 1)), (5, Need()), (7, Need())]
)
def test_decode_need_opens_a_page_on_a_boundary(num_tokens: int, want: Need) -> None:
    assert decode_need(num_tokens, P) == want


@given(n=st.integers(0, 500), a=st.integers(0, 100), b=st.integers(0, 100), page=st.integers(1, 64))
def test_extend_needs_add_up_and_a_decode_is_a_one_token_extend(
    n: int, a: int, b: int, page: int
) -> None:
    assert extend_need(n, a, page) + extend_need(n + a, b, page) == extend_need(n, a + b, page)
    assert decode_need(n, page) == extend_need(n, 1, page)


TOTAL = Pools(10, 6, 2)
ADMITS = [  # (need, free, reserved) -> verdict
    ("fits every pool", Need(3, 2, 1), Pools(3, 2, 1), Need(), Admission(Fit.NOW)),
    ("nothing needed", Need(), Pools(0, 0, 0), Need(), Admission(Fit.NOW)),
    (
        "full pool short now",
        Need(4, 1, 1),
        Pools(3, 6, 2),
        Need(),
        Admission(Fit.LATER, "waits for 4 full pages (have 3)"),
    ),
    (
        "reserved headroom counts against free pages",
        Need(2, 1, 1),
        Pools(5, 6, 2),
        Need(4),
        Admission(Fit.LATER, "waits for 2 full pages (have 1)"),
    ),
    (
        "every pool short names every pool",
        Need(4, 3, 2),
        Pools(1, 1, 1),
        Need(),
        Admission(
            Fit.LATER,
            "waits for 4 full pages (have 1), 3 SWA pages (have 1), 2 request slots (have 1)",
        ),
    ),
    (
        "larger than the SWA pool itself",
        Need(1, 7, 1),
        Pools(10, 6, 2),
        Need(),
        Admission(Fit.NEVER, "needs 7 SWA pages (have 6) in total"),
    ),
    (
        "never beats later: the total is checked first",
        Need(11, 1, 1),
        Pools(0, 0, 0),
        Need(),
        Admission(Fit.NEVER, "needs 11 full pages (have 10) in total"),
    ),
]


@pytest.mark.parametrize(
    ("name", "need", "free", "reserved", "want"), ADMITS, ids=[a[0] for a in ADMITS]
)
def test_admit(name: str, need: Need, free: Pools, reserved: Need, want: Admission) -> None:
    assert admit(need, free, TOTAL, reserved) == want
