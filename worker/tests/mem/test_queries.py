"""can_extend / can_decode agree exactly with extend / decode, on any arguments and any state.

Yes means the command succeeds; no means it raises the very error of the verdict (same type, same
message) and changes nothing; the query itself never changes anything.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mem_helpers import allocator_state, same_state, t

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.errors import KVMemoryError, OutOfPages, RequestTooLong, Verdict
from dsv4_worker.mem.kv_allocator import KVAllocator

SLOTS = 4
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ODD_DTYPES = [torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool]
ODD_VALUES = [-1, 0, SLOTS + 1, 2**40, 2**62, 2**63 - 1, -(2**63)]


def _allocator(rnd: random.Random) -> KVAllocator:
    """A small allocator with scarce pages after a random history of opens, extends, decodes
    and evictions."""
    page = rnd.choice([4, 6, 16])
    a = KVAllocator(
        AllocatorConfig(
            page_size=page,
            num_full_pages=rnd.randint(1, 10),
            num_swa_pages=rnd.randint(1, 6),
            num_request_slots=SLOTS,
            max_pages_per_request=4,
            window_tokens=rnd.randint(1, 12),
            draft_tokens=rnd.randint(0, 2),
        )
    )
    opened = rnd.sample(range(1, SLOTS + 1), rnd.randint(1, SLOTS))
    a.open(torch.tensor(opened))
    for _ in range(rnd.randint(0, 6)):
        slots = torch.tensor(rnd.sample(opened, rnd.randint(1, len(opened))))
        with contextlib.suppress(KVMemoryError):  # a refused step changes nothing
            match rnd.choice(["extend", "decode", "evict_window"]):
                case "extend":
                    a.extend(slots, torch.tensor([rnd.randint(0, 20) for _ in slots]))
                case "decode":
                    a.decode(slots)
                case _:
                    a.evict_window()
    return a


def _tensor(rnd: random.Random, values: list[int]) -> torch.Tensor:
    """Mostly an int64 vector; otherwise another dtype (some refused, some converted) or 2-D,
    or one odd value (negative, reserved, out of range, near int64's ends)."""
    if values and rnd.random() < 0.15:
        values[rnd.randrange(len(values))] = rnd.choice(ODD_VALUES)
    x = torch.tensor(values, dtype=torch.int64)
    r = rnd.random()
    if r < 0.15:
        return x.to(rnd.choice(ODD_DTYPES))
    return x.reshape(1, -1) if r < 0.2 else x


def _slots(rnd: random.Random) -> torch.Tensor:
    """Up to 4 slots, open or closed, sometimes repeated."""
    return _tensor(rnd, [rnd.randint(1, SLOTS) for _ in range(rnd.randint(0, 4))])


def _counts(rnd: random.Random, slots: torch.Tensor) -> torch.Tensor:
    n = len(slots) if slots.dim() == 1 else 1
    return _tensor(rnd, [rnd.randint(0, 40) for _ in range(n + (rnd.random() < 0.05))])


def _agree(a: KVAllocator, query: Callable[[], Verdict], command: Callable[[], object]) -> None:
    before = allocator_state(a)
    verdict = query()
    assert same_state(before, allocator_state(a)), "a query changed the allocator"
    try:
        command()
    except KVMemoryError as err:
        assert not verdict, f"the query said yes, the command raised {err!r}"
        assert type(err) is type(verdict.refusal) and str(err) == str(verdict.refusal)
        assert same_state(before, allocator_state(a)), "a refused command changed the allocator"
    else:
        assert verdict, f"the query said {verdict.refusal!r}, the command succeeded"
    a.check_integrity()


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_can_extend_agrees_with_extend(seed: int) -> None:
    rnd = random.Random(seed)  # a seed, not hypothesis' draws: they favour the ends of ranges
    a = _allocator(rnd)
    slots = _slots(rnd)
    counts = _counts(rnd, slots)
    _agree(a, lambda: a.can_extend(slots, counts), lambda: a.extend(slots, counts))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_can_decode_agrees_with_decode(seed: int) -> None:
    rnd = random.Random(seed)
    a, slots = _allocator(rnd), _slots(rnd)
    _agree(a, lambda: a.can_decode(slots), lambda: a.decode(slots))


def test_verdict_tells_the_scheduler_which_pool_is_short_or_that_the_request_is_too_long() -> None:
    a = KVAllocator(
        AllocatorConfig(
            page_size=16,
            num_full_pages=4,
            num_swa_pages=2,
            num_request_slots=2,
            max_pages_per_request=4,
            window_tokens=8,
        )
    )
    a.open(t(1, 2))
    assert a.can_extend(t(1, 2), t(16, 1))
    refusal = a.can_extend(t(1, 2), t(17, 1)).refusal
    assert isinstance(refusal, OutOfPages) and (refusal.pool, refusal.needed) == ("swa", 3)
    assert isinstance(a.can_extend(t(1), t(65)).refusal, RequestTooLong)
    a.extend(t(1, 2), t(16, 1))
    assert not a.can_decode(t(1))  # its next token starts a page: no SWA page left
    assert a.can_decode(t(2)) and a.can_decode(t()) and a.can_extend(t(), t())
