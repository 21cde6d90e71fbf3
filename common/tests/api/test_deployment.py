"""The memory plan: per-role per-rank plans from the one planner, ContextFits with the largest
context that fits, and plan errors that name the spec field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dsv4_common.api.deployment import (
    CPU_MODE_MEMORY_BYTES,
    MemoryPlanError,
    plan_inputs,
    plan_memory,
)
from dsv4_common.api.spec import DeploymentSpec, parse_spec
from dsv4_common.core.presets import load_model_config
from dsv4_common.core.units import GIB, MIB
from dsv4_common.plan.planner import plan


def spec_of(**spec: Any) -> DeploymentSpec:
    return parse_spec({"metadata": {"name": "t"}, "spec": spec})


def flash_tp8(memory_gib: float, context: int) -> DeploymentSpec:
    return spec_of(
        model={"preset": "deepseek-v4-flash"},
        maxContextTokens=context,
        gpu={"memoryGiB": memory_gib, "perPod": 8},
        prefill={"tensorParallel": 8},
        decode={"tensorParallel": 8, "maxRunningRequests": 8},
    )


def test_cpu_mode_plans_each_role_with_the_fixed_cpu_budget() -> None:
    spec = spec_of(model={"preset": "tiny"}, maxContextTokens=4096, prefill={"pipelineParallel": 2})
    memory = plan_memory(spec)
    assert memory.prefill.inputs.gpu_memory_bytes == CPU_MODE_MEMORY_BYTES
    assert [r.pp_rank for r in memory.prefill.ranks] == [0, 1]
    assert len(memory.decode.ranks) == 1
    assert memory.context_fits and memory.max_context_tokens == 4096


def test_role_plans_are_exactly_what_the_planner_gives_the_workers() -> None:
    spec = flash_tp8(79.6, 131072)
    memory = plan_memory(spec)
    model = load_model_config("deepseek-v4-flash")
    for role in ("prefill", "decode"):
        inputs = plan_inputs(spec, role, model)
        assert inputs.gpu_memory_bytes == int(79.6 * GIB) and inputs.tp_size == 8
        assert memory.role(role) == plan(inputs)


@pytest.mark.parametrize(
    ("gpu", "memory_bytes"),
    [
        ({"type": "h200", "perPod": 8}, 143_771 * MIB),
        ({"type": "h100-80gb", "perPod": 8}, 81_559 * MIB),
        ({"type": "h200", "memoryGiB": 120, "perPod": 8}, 120 * GIB),  # explicit override
        ({"memoryGiB": 60.5, "perPod": 8}, int(60.5 * GIB)),  # a device without a type
    ],
)
def test_gpu_memory_comes_from_the_type_unless_overridden(
    gpu: dict[str, object], memory_bytes: int
) -> None:
    spec = spec_of(
        model={"preset": "deepseek-v4-flash"},
        maxContextTokens=4096,
        gpu=gpu,
        prefill={"tensorParallel": 8},
        decode={"tensorParallel": 8},
    )
    assert plan_inputs(spec, "decode", load_model_config("deepseek-v4-flash")).gpu_memory_bytes == (
        memory_bytes
    )


def test_context_that_does_not_fit_reports_the_largest_that_does() -> None:
    memory = plan_memory(flash_tp8(24, 1_048_576))
    assert not memory.context_fits
    largest = memory.max_context_tokens
    assert 0 < largest < 1_048_576
    message = memory.context_message()
    assert f"largest context that fits is {largest}" in message and "1048576" in message
    # The reported largest fit really fits, and one page more would not.
    assert plan_memory(flash_tp8(24, largest)).context_fits
    page = memory.prefill.inputs.resolved_page_size
    assert not plan_memory(flash_tp8(24, largest + page)).context_fits


def test_more_memory_per_rank_makes_the_same_context_fit() -> None:
    assert not plan_memory(flash_tp8(24, 1_048_576)).context_fits
    assert plan_memory(flash_tp8(40, 1_048_576)).context_fits


def test_context_beyond_the_model_is_reported_with_the_model_limit() -> None:
    memory = plan_memory(spec_of(model={"preset": "tiny"}, maxContextTokens=8192))
    assert not memory.context_fits
    assert memory.max_context_tokens == memory.model_context_tokens == 4096
    assert "the model's context is 4096 tokens" in memory.context_message()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (flash_tp8(10, 4096), "spec.prefill: PP rank 0: weights need"),
        (
            spec_of(model={"preset": "tiny"}, maxContextTokens=4096, kv={"pageSize": 3}),
            "spec.kv.pageSize: page_size=3 must be divisible",
        ),
        (
            spec_of(model={"preset": "tiny"}, maxContextTokens=64, decode={"pipelineParallel": 16}),
            "spec.decode.pipelineParallel: pp_size=16 exceeds",
        ),
        (
            spec_of(
                model={"preset": "tiny"},
                maxContextTokens=64,
                gpu={"type": "h100-80gb", "perPod": 16},
                prefill={"tensorParallel": 16},
                decode={"tensorParallel": 16},
            ),
            "spec.prefill.tensorParallel: tp_size=16 must divide the model's 4 attention heads",
        ),
    ],
    ids=["weights-do-not-fit", "page-size-not-divisible", "more-pp-ranks-than-layers", "tp-16"],
)
def test_plan_errors_name_the_spec_field(spec: DeploymentSpec, field: str) -> None:
    with pytest.raises(MemoryPlanError) as info:
        plan_memory(spec)
    assert str(info.value).startswith(field), str(info.value)


def test_unreadable_config_path_names_the_field() -> None:
    spec = flash_tp8(80, 4096)
    spec = dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, preset=None, config_path="/nope/config.json")
    )
    with pytest.raises(MemoryPlanError, match=r"^spec\.model\.configPath: "):
        plan_memory(spec)


def test_bottleneck_names_the_role_and_rank_that_limit_context() -> None:
    memory = plan_memory(flash_tp8(24, 1_048_576))
    role, rank = memory.bottleneck
    assert memory.role(role).ranks[rank].capacity.max_context_tokens == memory.max_context_tokens


# --- the layer split: balanced by default, fixed by spec.<role>.layerSplit ---------------------


def pro_pp3(**decode: Any) -> DeploymentSpec:
    """DSV4-Pro on H100 at TP=4: the even split of a PP=3 decode group is unbalanced."""
    return spec_of(
        model={"preset": "deepseek-v4-pro"},
        maxContextTokens=131072,
        gpu={"type": "h100-80gb", "perPod": 4},
        prefill={"tensorParallel": 4, "pipelineParallel": 3},
        decode={"tensorParallel": 4, "pipelineParallel": 3, **decode},
    )


def test_roles_get_the_balanced_split_and_workers_get_it_fixed() -> None:
    memory = plan_memory(pro_pp3())
    decode = memory.decode
    assert decode.split.mode == "balanced"
    assert decode.split.layers_per_rank == (20, 21, 20) != decode.split.even
    assert decode.split.even_key is not None and decode.bottleneck_key > decode.split.even_key
    # the workers replan with the chosen split fixed and get the same plan
    inputs = dataclasses.replace(decode.inputs, layer_split=decode.split.layers_per_rank)
    assert plan(inputs).ranks == decode.ranks


def test_layer_split_of_the_spec_is_planned_exactly() -> None:
    memory = plan_memory(pro_pp3(layerSplit=[21, 20, 20]))
    assert memory.decode.split.mode == "fixed"
    assert [r.layers for r in memory.decode.ranks] == [(0, 21), (21, 41), (41, 61)]
    assert memory.prefill.split.mode == "balanced"  # set per role


def test_layer_split_that_does_not_cover_the_model_names_the_field() -> None:
    with pytest.raises(MemoryPlanError) as info:
        plan_memory(pro_pp3(layerSplit=[20, 20, 20]))
    assert str(info.value) == (
        "spec.decode.layerSplit: layer_split=[20, 20, 20] sums to 60, the model has 61 layers"
    )
