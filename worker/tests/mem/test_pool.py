"""Pool buffers: the bytes equal the planner's planned bytes exactly, for every preset."""

from __future__ import annotations

import pytest
import torch

from dsv4_common.core.layout import IndexSpace
from dsv4_common.core.presets import load_model_config
from dsv4_common.plan.capacity import planned_bytes
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.mem.pool import KVPool

MIB = 1 << 20

# (preset, pp_size, page size, gpu bytes, max running, draft tokens): tiny-scaled memory so the
# production shapes (one SWA page of flash is ~7 MiB over all layers) stay small on CPU.
CASES = [
    ("tiny", 1, 16, 8 * MIB, 8, 0),
    ("tiny", 2, 16, 8 * MIB, 8, 2),
    ("hybrid-tiny", 1, 16, 8 * MIB, 8, 0),
    ("hybrid-tiny", 2, 16, 8 * MIB, 8, 0),
    ("deepseek-v4-flash", 1, 128, 64 * MIB, 1, 0),
    ("deepseek-v4-flash", 2, 128, 64 * MIB, 1, 2),
    ("deepseek-v4-pro", 1, 128, 64 * MIB, 1, 0),
    ("deepseek-v4-pro", 2, 128, 64 * MIB, 1, 2),
]


@pytest.mark.parametrize(("preset", "pp", "page", "gpu_bytes", "running", "draft"), CASES)
def test_pool_bytes_equal_planned_bytes_on_every_rank(
    preset: str, pp: int, page: int, gpu_bytes: int, running: int, draft: int
) -> None:
    result = plan(
        PlanInputs(
            model=load_model_config(preset),
            role="decode",
            gpu_memory_bytes=gpu_bytes,
            pp_size=pp,
            page_size=page,
            max_running_requests=running,
            speculative_draft_tokens=draft,
            weight_bytes_per_rank=(0,) * pp,
        )
    )
    for rank in result.ranks:
        pool = KVPool.from_rank_plan(rank)
        assert pool.nbytes == rank.pools.kv_bytes
        cap = rank.pools
        assert pool.nbytes == planned_bytes(
            rank.layout, cap.full_pages, cap.swa_pages, cap.request_slots
        )
        for c in rank.layout.components:
            buf = pool.buffer(c.name)
            assert buf.shape[0] == c.num_layers
            assert buf.shape[1] == rank.component_units()[c.name]
            assert buf[0, 0].numel() * buf.element_size() == c.unit_bytes


def test_pp_ranks_split_the_layers_without_overlap() -> None:
    result = plan(
        PlanInputs(
            model=load_model_config("deepseek-v4-flash"),
            role="decode",
            gpu_memory_bytes=64 * MIB,
            pp_size=2,
            page_size=128,
            max_running_requests=1,
            weight_bytes_per_rank=(0,) * 2,
        )
    )
    seen: dict[str, set[int]] = {}
    for rank in result.ranks:
        pool = KVPool.from_rank_plan(rank)
        for c in rank.layout.components:
            ids = set(c.layer_ids)
            assert not ids & seen.setdefault(c.name, set())
            seen[c.name] |= ids
            for lid in c.layer_ids:
                assert pool.layer(c.name, lid).is_contiguous()


def test_fp8_pages_are_raw_aligned_bytes() -> None:
    result = plan(
        PlanInputs(
            model=load_model_config("deepseek-v4-flash"),
            role="decode",
            gpu_memory_bytes=64 * MIB,
            page_size=128,
            max_running_requests=1,
            weight_bytes_per_rank=(0,),
        )
    )
    rank = result.ranks[0]
    pool = KVPool.from_rank_plan(rank)
    swa = rank.layout.component("swa_kv")
    assert swa.unit_bytes % 576 == 0 and swa.unit_bytes > swa.rows_per_unit * swa.row_bytes
    assert pool.buffer("swa_kv").dtype == torch.uint8
    assert pool.buffer("swa_kv").shape[2] == swa.unit_bytes


def test_memory_from_rank_plan_matches_capacity() -> None:
    result = plan(
        PlanInputs(
            model=load_model_config("tiny"),
            role="colocated",
            gpu_memory_bytes=8 * MIB,
            max_running_requests=8,
            weight_bytes_per_rank=(0,),
        )
    )
    rank = result.ranks[0]
    mem = KVMemory.from_rank_plan(rank)
    assert mem.pool is not None and mem.pool.nbytes == rank.pools.kv_bytes
    usage = {u.pool: u for u in mem.usage()}
    assert usage["full"].total == rank.pools.full_pages
    assert usage["swa"].total == rank.pools.swa_pages
    assert usage["req_slots"].total == rank.pools.request_slots
    assert all(u.used == 0 for u in usage.values())
    max_pages = min(rank.pools.full_pages, -(-rank.capacity.max_context_tokens // rank.page_size))
    assert mem.config.max_pages_per_request == max_pages
    assert mem.config.window_tokens == 8 and mem.config.retained_tokens == 8
    assert mem.pool.units[IndexSpace.REQ_SLOT] == rank.pools.request_slots + 1
