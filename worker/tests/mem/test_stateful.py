"""Random interleavings of every memory operation, checked against a reference model.

After every step: `check_integrity()`, no page owned twice, the reference token counts and the
window invariant. Failed allocations must change nothing; the end frees everything.
"""

from __future__ import annotations

import re
from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mem_helpers import (
    fill_random,
    memory_state,
    request_bytes,
    same_bytes,
    same_state,
    small_memory,
)

from dsv4_worker.mem.errors import InvalidArgument, OutOfPages, OwnershipError, RequestTooLong
from dsv4_worker.mem.offload import offload_request, reload_request

SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _ceil(n: int, p: int) -> int:
    return -(-n // p)


class MemoryMachine(RuleBasedStateMachine):
    preset: ClassVar[str] = "tiny"
    page: ClassVar[int] = 16
    draft: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.mem = small_memory(
            self.preset,
            page_size=self.page,
            full_pages=20,
            swa_pages=9,
            slots=5,
            max_pages=6,
            draft_tokens=self.draft,
        )
        self.a = self.mem.pages
        self.lens: dict[int, int] = {}  # reference model: open request slot -> tokens
        self.seed = 0

    # -- helpers ---------------------------------------------------------------------------------

    def _window_floor(self, n: int) -> int:
        return max(0, n - self.mem.config.retained_tokens) // self.page * self.page

    def _pick(self, data: st.DataObject) -> list[int]:
        return data.draw(st.lists(st.sampled_from(sorted(self.lens)), min_size=1, unique=True))

    def _used(self) -> tuple[int, int]:
        return self.a.full.num_used, self.a.swa.num_used

    def _try(self, op: object) -> bool:
        """Run op; on an allocation failure assert that nothing changed."""
        before = memory_state(self.mem)
        try:
            op()  # type: ignore[operator]
        except (OutOfPages, RequestTooLong):
            assert same_state(before, memory_state(self.mem))
            return False
        return True

    def _check_token_slots(self, out: torch.Tensor, slots: list[int], starts: list[int]) -> None:
        """Returned full slots are the page-table slots of the new positions."""
        want: list[int] = []
        for slot, start in zip(slots, starts, strict=True):
            for pos in range(start, self.lens[slot]):
                page = int(self.a.page_table[slot, pos // self.page])
                assert page > 0 and int(self.a.full.owner[page]) == slot
                want.append(page * self.page + pos % self.page)
        assert out.tolist() == want

    # -- rules -----------------------------------------------------------------------------------

    @rule(k=st.integers(1, 3))
    def open(self, k: int) -> None:
        free = self.mem.req_slots.num_free
        got: list[int] = []
        ok = self._try(lambda: got.extend(self.mem.open(k).tolist()))
        assert ok == (k <= free)
        for s in got:
            assert s not in self.lens
            self.lens[s] = 0

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        slots = self._pick(data)
        new = data.draw(st.lists(st.integers(0, 40), min_size=len(slots), max_size=len(slots)))
        starts = [self.lens[s] for s in slots]
        pages = sum(
            _ceil(n + k, self.page) - _ceil(n, self.page) for n, k in zip(starts, new, strict=True)
        )
        fits = all(
            n + k <= self.mem.config.max_tokens_per_request
            for n, k in zip(starts, new, strict=True)
        )
        fits = fits and pages <= self.a.full.num_free and pages <= self.a.swa.num_free
        used = self._used()
        verdict = self.a.can_extend(torch.tensor(slots), torch.tensor(new))
        assert bool(verdict) == fits
        out: list[torch.Tensor] = []
        ok = self._try(lambda: out.append(self.a.extend(torch.tensor(slots), torch.tensor(new))))
        assert ok == fits
        if ok:
            for s, k in zip(slots, new, strict=True):
                self.lens[s] += k
            self._check_token_slots(out[0], slots, starts)
            assert self._used() == (used[0] + pages, used[1] + pages)

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        slots = self._pick(data)
        starts = [self.lens[s] for s in slots]
        rollovers = sum(n % self.page == 0 for n in starts)
        fits = rollovers <= min(self.a.full.num_free, self.a.swa.num_free) and all(
            n < self.mem.config.max_tokens_per_request for n in starts
        )
        used = self._used()
        verdict = self.a.can_decode(torch.tensor(slots))
        assert bool(verdict) == fits
        out: list[torch.Tensor] = []
        ok = self._try(lambda: out.append(self.a.decode(torch.tensor(slots))))
        assert ok == fits
        if ok:
            for s in slots:
                self.lens[s] += 1
            self._check_token_slots(out[0], slots, starts)
            assert self._used() == (used[0] + rollovers, used[1] + rollovers)

    @rule(data=st.data())
    def alloc_tail(self, data: st.DataObject) -> None:
        """PD decode preallocation into a fresh slot whose recycled pages carry stale mappings."""
        if self.mem.req_slots.num_free == 0:
            return
        n = data.draw(st.integers(0, self.mem.config.max_tokens_per_request))
        before = memory_state(self.mem)
        slot_t = self.mem.open(1)
        slot = int(slot_t[0])
        full_pages = _ceil(n, self.page)
        tail_from = self._window_floor(n) // self.page
        fits = full_pages <= self.a.full.num_free and full_pages - tail_from <= self.a.swa.num_free
        recycled = self.a.full.free_units()[:full_pages]
        if fits and recycled.size:
            self.a.host.full_to_swa[recycled] = 1  # an earlier owner's leftovers (#25805)
        if not self._try(lambda: self.a.alloc_tail(slot_t, torch.tensor([n]))):
            assert not fits
            self.mem.free(slot_t)
            assert same_state(before, memory_state(self.mem))
            return
        assert fits
        self.lens[slot] = n
        full, swa = self.a.request_pages(slot)
        assert full.numel() == full_pages
        assert (swa > 0).tolist() == [c >= tail_from for c in range(full_pages)]
        assert len(set(swa[swa > 0].tolist())) == full_pages - tail_from

    @precondition(lambda self: self.lens)
    @rule(data=st.data(), everyone=st.booleans())
    def evict_window(self, data: st.DataObject, everyone: bool) -> None:
        slots = sorted(self.lens) if everyone else self._pick(data)
        start = {s: int(self.a.swa_start_tokens[s]) for s in slots}
        expected = sum(
            max(0, self._window_floor(self.lens[s]) - start[s]) // self.page for s in slots
        )
        swa_used = self.a.swa.num_used
        freed = self.a.evict_window(None if everyone else torch.tensor(slots))
        assert freed == expected and self.a.swa.num_used == swa_used - expected
        for s in slots:
            boundary = max(start[s], self._window_floor(self.lens[s])) // self.page
            _, swa = self.a.request_pages(s)
            assert (swa > 0).tolist() == [c >= boundary for c in range(swa.numel())]

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        slots = self._pick(data)
        used = self._used()
        held = [self.a.request_pages(s) for s in slots]
        self.mem.free(torch.tensor(slots))
        full = sum(f.numel() for f, _ in held)
        swa = sum(int((w > 0).sum()) for _, w in held)
        assert self._used() == (used[0] - full, used[1] - swa)
        for s in slots:
            del self.lens[s]
        with pytest.raises(OwnershipError):  # a second free of the same request
            self.mem.free(torch.tensor(slots[:1]))

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def offload_and_reload(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lens)))
        self.seed += 1
        fill_random(self.mem, self.seed)
        want = request_bytes(self.mem, slot)
        mask = (self.a.request_pages(slot)[1] > 0).tolist()
        snapshot = offload_request(self.mem, slot)
        n = self.lens.pop(slot)
        self.mem.check_integrity()
        new_slot = reload_request(self.mem, snapshot)  # the units it freed are still free
        self.lens[new_slot] = n
        assert (self.a.request_pages(new_slot)[1] > 0).tolist() == mask
        assert same_bytes(request_bytes(self.mem, new_slot), want)

    @rule()
    def operations_on_closed_slots_raise(self) -> None:
        closed = [s for s in range(1, self.mem.config.num_request_slots + 1) if s not in self.lens]
        if not closed:
            return
        before = memory_state(self.mem)
        for op in (self.a.free, self.a.decode, self.a.evict_window):
            with pytest.raises(OwnershipError):
                op(torch.tensor(closed[:1]))
        assert same_state(before, memory_state(self.mem))

    @rule(data=st.data())
    def queries_refuse_what_the_commands_refuse(self, data: st.DataObject) -> None:
        """Closed, reserved, out-of-range or repeated slots: the query says why, the command
        raises exactly that, and nothing changes."""
        limit = self.mem.config.num_request_slots
        slots = data.draw(st.lists(st.integers(-1, limit + 1), min_size=1, max_size=3))
        if all(s in self.lens for s in slots) and len(set(slots)) == len(slots):
            return  # in contract: the extend / decode rules cover it
        before = memory_state(self.mem)
        s = torch.tensor(slots)
        for query, command in (
            (lambda: self.a.can_decode(s), lambda: self.a.decode(s)),
            (
                lambda: self.a.can_extend(s, torch.ones_like(s)),
                lambda: self.a.extend(s, torch.ones_like(s)),
            ),
        ):
            refusal = query().refusal
            # A full request is refused for its length before a repeat of its slot is seen.
            assert isinstance(refusal, (InvalidArgument, OwnershipError, RequestTooLong))
            with pytest.raises(type(refusal), match=re.escape(str(refusal))):
                command()
        assert same_state(before, memory_state(self.mem))

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.mem.check_integrity()
        owned_full: list[int] = []
        owned_swa: list[int] = []
        for s, n in self.lens.items():
            assert int(self.a.num_tokens[s]) == n
            full, swa = self.a.request_pages(s)
            owned_full += full.tolist()
            owned_swa += swa[swa > 0].tolist()
            # Every token inside the window keeps its SWA row.
            keep_from = max(0, n - self.mem.config.retained_tokens) // self.page
            assert bool((swa[keep_from:] > 0).all())
        assert len(owned_full) == len(set(owned_full)) == self.a.full.num_used
        assert len(owned_swa) == len(set(owned_swa)) == self.a.swa.num_used

    def teardown(self) -> None:
        if self.lens:
            self.mem.free(torch.tensor(sorted(self.lens)))
        assert all(u.used == 0 for u in self.mem.usage())
        self.mem.check_integrity()


class TinyMachine(MemoryMachine):
    preset, page, draft = "tiny", 16, 0


class TinySpeculativeMachine(MemoryMachine):
    preset, page, draft = "tiny", 16, 2


class HybridMachine(MemoryMachine):
    preset, page, draft = "hybrid-tiny", 16, 0


class HybridOddPageMachine(MemoryMachine):
    preset, page, draft = "hybrid-tiny", 12, 0  # a page size that is not a power of two


TestTiny = TinyMachine.TestCase
TestTinySpeculative = TinySpeculativeMachine.TestCase
TestHybrid = HybridMachine.TestCase
TestHybridOddPage = HybridOddPageMachine.TestCase
TestTiny.settings = TestTinySpeculative.settings = SETTINGS
TestHybrid.settings = TestHybridOddPage.settings = SETTINGS
