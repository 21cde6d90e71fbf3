"""No device syncs on a real CUDA device (lent GPU only): the allocator's operations run under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any call that waits for the device,
and an engine step's syncs, as CUDA itself reports them, equal what `SyncCounter` counts for
the same step under DSV4_EMULATE_DEVICE=1 on a CPU (the model behind the CI tests)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from engine_helpers import engine as make_engine
from mem_helpers import emulating_device

from dsv4_common.core.presets import hybrid_tiny
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.alloc_config import AllocatorConfig
from dsv4_worker.mem.kv_allocator import KVAllocator
from dsv4_worker.mem.sync_counter import SyncCounter
from dsv4_worker.model.weights import init_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16


@contextmanager
def _sync_mode(mode: str) -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_every_allocator_operation_runs_without_a_sync_on_cuda() -> None:
    cfg = AllocatorConfig(
        page_size=PAGE,
        num_full_pages=8192,
        num_swa_pages=8192,
        num_request_slots=64,
        max_pages_per_request=2100,
        window_tokens=128,
    )
    a = KVAllocator(cfg, "cuda")
    slots = np.arange(1, 65, dtype=np.int64)
    ops: list[Callable[[], object]] = [
        lambda: a.open(slots),
        lambda: a.extend(slots, np.full(64, 100, dtype=np.int64)),
        lambda: a.evict_window(),
        *[lambda: a.decode(slots) for _ in range(40)],  # crosses pages 6 -> 7 -> 8
        lambda: a.evict_window(),
        lambda: a.free(slots[32:]),
        lambda: a.open(_i64(40)),
        lambda: a.alloc_tail(_i64(40), _i64(32768)),
        lambda: a.extend(slots[:1], _i64(4096)),
        lambda: a.free(_i64(40)),
    ]
    with _sync_mode("error"):  # any sync raises RuntimeError
        for op in ops:
            op()
    a.check_integrity()


def _steps(device: str) -> Iterator[int]:
    """The syncs of each of 10 steps of hybrid-tiny (its forward has no data-dependent
    dispatch): on CUDA, the warnings of its sync debug mode; on the CPU, under
    DSV4_EMULATE_DEVICE=1, what the counter counts."""
    model = hybrid_tiny()
    with emulating_device(device == "cpu"):
        eng = make_engine(
            model, init_weights(model, seed=5, device=device), swa_pages=64, device=device
        )
    for i in range(6):
        eng.submit([(7 * i + j) % 200 + 3 for j in range(6 + 5 * i)], SamplingParams(24))
    for _ in range(10):
        if device == "cuda":
            with warnings.catch_warnings(record=True) as caught, _sync_mode("warn"):
                warnings.simplefilter("always")
                eng.step()
            yield sum("synchroniz" in str(w.message) for w in caught)
        else:
            with emulating_device(), SyncCounter() as counter:
                eng.step()
            yield counter.total


def test_cuda_reports_the_syncs_the_emulated_counter_counts() -> None:
    emulated = list(_steps("cpu"))
    assert emulated == list(_steps("cuda"))
    assert all(n <= 1 for n in emulated)
