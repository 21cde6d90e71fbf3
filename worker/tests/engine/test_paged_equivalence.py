"""The paged forward equals the naive oracle, token for token: prompts shorter and longer than
the window and than several c16 blocks, across chunk and page sizes, alone and batched, for
tiny (DSV4) and hybrid-tiny; the online c16 state and fp8 KV rows (tiny-fp8) too. Pools are
empty afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import tiny_moe
from paged_helpers import generate, make
from release_support import fp8_kv

from dsv4_common.core.model import ModelConfig
from dsv4_common.core.presets import hybrid_tiny, tiny
from dsv4_common.core.units import MIB
from dsv4_common.plan.inputs import PlanInputs
from dsv4_common.plan.planner import plan
from dsv4_worker.engine.paged import PagedModel
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.model.oracle import oracle_greedy
from dsv4_worker.model.weights import init_weights

TINY_FP8 = fp8_kv(dataclasses.replace(tiny(), name="tiny-fp8"))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [((31 * i + 7 * salt) % 250) + 3 for i in range(n)]


@pytest.mark.parametrize("model", [tiny(), hybrid_tiny()], ids=lambda m: m.name)
@pytest.mark.parametrize(
    ("length", "chunk", "page"),
    [(5, 64, 16), (20, 7, 16), (53, 16, 16), (70, 13, 32), (40, 40, 48)],
)
def test_paged_greedy_equals_the_oracle(
    model: ModelConfig, length: int, chunk: int, page: int
) -> None:
    if model.name == "hybrid-tiny" and page == 48:
        page = 32
    pm = make(model, page)
    p = prompt(length)
    (got,) = generate(pm, [p], chunk, 12)
    assert got == oracle_greedy(model, pm.p, p, 12)


@pytest.mark.parametrize("model", [tiny(), hybrid_tiny(), TINY_FP8], ids=lambda m: m.name)
def test_batched_requests_equal_the_oracle_one_by_one(model: ModelConfig) -> None:
    pm = make(model, 16)
    prompts = [prompt(3, 1), prompt(29, 2), prompt(66, 3), prompt(17, 4)]
    got = generate(pm, prompts, 11, 10)
    assert got == [oracle_greedy(model, pm.p, p, 10) for p in prompts]


def test_online_c16_state_paged_equals_the_oracle() -> None:
    pm = make(tiny(), 16, "online")
    prompts = [prompt(47, 5), prompt(64, 6)]
    got = generate(pm, prompts, 9, 12)
    assert got == [oracle_greedy(tiny(), pm.p, p, 12, request_state="online") for p in prompts]


def test_moe_model_paged_equals_the_oracle() -> None:
    model = tiny_moe(3)
    pm = make(model, 16)
    prompts = [prompt(37, 7), prompt(12, 8)]
    assert generate(pm, prompts, 10, 8) == [oracle_greedy(model, pm.p, p, 8) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", [tiny(), hybrid_tiny(), TINY_FP8], ids=lambda m: m.name)
def test_cuda_paged_equals_the_cpu_oracle(model: ModelConfig) -> None:
    """On CUDA too (tiny-fp8: the release's fp8 rows, quantized and dequantized by the same
    torch code on the device)."""
    rank = plan(
        PlanInputs(
            model=model,
            role="colocated",
            gpu_memory_bytes=64 * MIB,
            page_size=16,
            max_running_requests=8,
        )
    ).ranks[0]
    params = init_weights(model, seed=21, device="cuda")
    pm = PagedModel(model, params, KVMemory.from_rank_plan(rank, "cuda"))
    prompts = [prompt(45, 9), prompt(8, 10)]
    cpu = init_weights(model, seed=21)
    assert generate(pm, prompts, 12, 10) == [oracle_greedy(model, cpu, p, 10) for p in prompts]
