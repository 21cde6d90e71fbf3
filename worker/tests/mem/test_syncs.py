"""No device syncs on the allocator's hot paths (issue #38 item 5): with DSV4_EMULATE_DEVICE=1
the CPU runs the code CUDA runs, and `SyncCounter` counts every call that would make the host
wait for the device there. Each operation, given host values as the engine gives them, makes
none: decode with and without page crossings, eviction with and without pages to free, extend,
PD tail preallocation, free, and their all-or-nothing refusals. (The issue's bounds are 0 for
a steady decode and an empty eviction pass, <= 1 for the others; before this change the counts
were decode 2-5, evict 2-5, extend 4, tail prealloc 7, free 7.)"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from mem_helpers import emulating_device, memory_state, same_state

from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.errors import KVMemoryError, OutOfPages, OwnershipError, RequestTooLong
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.mem.sync_counter import SyncCounter

PAGE = 16
RUNNING = 64


def _alloc(requests: int, tokens: int, *, swa_pages: int | None = None) -> KVAllocator:
    pages = requests * (-(-tokens // PAGE) + 2) + 64
    cfg = AllocatorConfig(
        page_size=PAGE,
        num_full_pages=pages,
        num_swa_pages=pages if swa_pages is None else swa_pages,
        num_request_slots=requests,
        max_pages_per_request=-(-tokens // PAGE) + 2,
        window_tokens=128,
    )
    with emulating_device():
        a = KVAllocator(cfg)
    assert not a.tables.shared  # the device's tables apart from the host's, as on CUDA
    return a


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _syncs(op: Callable[[], object]) -> dict[str, int]:
    with SyncCounter() as counter:
        op()
    return dict(counter.counts)


def _running(lengths: list[int]) -> tuple[KVAllocator, np.ndarray]:
    a = _alloc(len(lengths), max(lengths) + 4 * PAGE)
    slots = np.arange(1, len(lengths) + 1, dtype=np.int64)
    a.open(slots)
    a.extend(slots, np.array(lengths, dtype=np.int64))
    a.evict_window()
    return a, slots


def test_a_decode_step_that_crosses_no_page_makes_no_sync() -> None:
    a, slots = _running([100 + i % 12 for i in range(RUNNING)])  # 100..111: inside page 6
    assert _syncs(lambda: a.decode(slots)) == {}
    a.check_integrity()


def test_a_decode_step_at_page_crossings_makes_no_sync() -> None:
    a, slots = _running([96 + i % 3 * 16 for i in range(RUNNING)])  # every one at a boundary
    used = a.full.num_used
    assert _syncs(lambda: a.decode(slots)) == {}
    assert a.full.num_used == used + RUNNING
    a.check_integrity()


def test_an_eviction_pass_makes_no_sync_with_or_without_pages_to_free() -> None:
    a, slots = _running([200 + i for i in range(RUNNING)])
    assert _syncs(a.evict_window) == {}  # nothing left to evict
    for _ in range(PAGE):  # every request crosses a page: each has one page to give back
        a.decode(slots)
    freed: list[int] = []
    assert _syncs(lambda: freed.append(a.evict_window())) == {}
    assert freed == [RUNNING]
    a.check_integrity()


def test_extend_tail_prealloc_and_free_make_no_sync() -> None:
    a = _alloc(2, 32768)
    a.open(_i64(1, 2))
    a.extend(_i64(1), _i64(1000))
    assert _syncs(lambda: a.extend(_i64(1), _i64(4096))) == {}
    assert _syncs(lambda: a.alloc_tail(_i64(2), _i64(20000))) == {}
    assert _syncs(lambda: a.evict_window(_i64(1))) == {}
    assert _syncs(lambda: a.free(_i64(1, 2))) == {}
    a.check_integrity()
    assert a.full.num_used == a.swa.num_used == 0


def test_a_batch_extend_and_a_sparse_allocation_make_no_sync() -> None:
    a = _alloc(8, 4096)
    slots = np.arange(1, 9, dtype=np.int64)
    a.open(slots)
    assert _syncs(lambda: a.extend(slots, np.arange(8, dtype=np.int64) * 97)) == {}
    a.free(slots[4:])
    a.open(slots[4:])
    starts = _i64(0, 0, 128, 256)
    assert _syncs(lambda: a.alloc_sparse(slots[4:], _i64(100, 300, 500, 700), starts)) == {}
    a.check_integrity()


def _refusals(a: KVAllocator) -> list[tuple[type[KVMemoryError], Callable[[], object]]]:
    return [
        (OwnershipError, lambda: a.decode(_i64(1, 1))),  # repeated
        (OwnershipError, lambda: a.free(_i64(3))),  # closed
        (OutOfPages, lambda: a.extend(_i64(1), _i64(20 * PAGE))),  # the SWA pool is short
        (RequestTooLong, lambda: a.extend(_i64(2), _i64(10**6))),
        (OwnershipError, lambda: a.alloc_tail(_i64(1), _i64(20))),  # not fresh
    ]


def test_refusals_are_decided_on_the_host_and_change_nothing() -> None:
    a = _alloc(3, 4096, swa_pages=16)
    a.open(_i64(1, 2))
    a.extend(_i64(1, 2), _i64(40, 3))
    for error, op in _refusals(a):
        before = (a.host.page_table.copy(), a.host.num_tokens.copy(), a.full.free_units())
        with SyncCounter() as counter, pytest.raises(error):
            op()
        assert counter.total == 0, (error, dict(counter.counts))
        after = (a.host.page_table, a.host.num_tokens, a.full.free_units())
        assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    a.check_integrity()


def test_memory_open_and_free_make_no_sync() -> None:
    from mem_helpers import small_memory

    mem: KVMemory = small_memory("tiny", emulate=True)
    slots: list[np.ndarray] = []
    assert _syncs(lambda: slots.append(mem.open(2))) == {}  # incl. clearing request state
    mem.pages.extend(slots[0], _i64(40, 7))
    before = memory_state(mem)
    with pytest.raises(OwnershipError):
        mem.free(_i64(int(slots[0][0]), 5))  # slot 5 was never handed out
    assert same_state(before, memory_state(mem))
    assert _syncs(lambda: mem.free(slots[0])) == {}
    mem.check_integrity()


def test_a_device_tensor_argument_is_read_back_once() -> None:
    """Tensors on the device are still accepted (tests, tools): one read-back each."""
    import torch

    a, slots = _running([100, 101])
    on_device = torch.from_numpy(slots).to(a.device)  # made before counting: a device tensor
    assert _syncs(lambda: a.decode(on_device)) == {"cpu": 1}


def test_the_switch_turns_the_host_shortcuts_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from dsv4_worker.mem.device import EMULATE_ENV, host_shortcuts

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    assert host_shortcuts(torch.device("cpu")) and not host_shortcuts(torch.device("cuda"))
    monkeypatch.setenv(EMULATE_ENV, "1")
    assert not host_shortcuts(torch.device("cpu"))


@pytest.mark.parametrize("preset", ["tiny", "hybrid-tiny"])
def test_the_emulated_path_matches_the_cpu_path_decision_for_decision(preset: str) -> None:
    """test_cuda.py's script of every operation (pools with random bytes, offload and reload
    included), on the CPU's shared tables and on separate device tables: the same results,
    state and bytes."""
    from mem_helpers import small_memory
    from test_cuda import _script

    sizes = dict(full_pages=64, swa_pages=24, slots=6, max_pages=16)
    shared = _script(small_memory(preset, **sizes))  # type: ignore[arg-type]
    emulated = _script(small_memory(preset, emulate=True, **sizes))  # type: ignore[arg-type]
    assert len(shared) == len(emulated)
    for i, (x, y) in enumerate(zip(shared, emulated, strict=True)):
        assert (x == y).all(), f"step {i} differs"
