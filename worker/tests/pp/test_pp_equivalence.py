"""A PP group of 2 or 3 stage processes generates exactly what one process generates, token
for token (greedy and seeded sampling; chunked prefill; retraction under memory pressure),
each stage holds only its layers in pools of exactly the planner's per-rank bytes, and every
stage ends with empty pools."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

import pytest
from hf_support import hf_reference, hf_tokens
from model_samples import tiny_hf_config
from pp_support import GroupRun, run_group

from dsv4_common.core.presets import tiny
from dsv4_common.core.units import MIB
from dsv4_common.plan.inputs import PlanError
from dsv4_common.plan.planner import Plan, split_layers
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights, stage_param_names
from dsv4_worker.pp.group import fixed_split, realized_plan

pytestmark = pytest.mark.slow

# Shorter than the window, longer than the window, across several c16 blocks (tiny).
LENGTHS = (5, 37, 90, 140)
PROMPTS = tuple(tuple((i * 31 + j * 7) % 251 for j in range(n)) for i, n in enumerate(LENGTHS))
PARAMS = (
    SamplingParams(max_new_tokens=12),
    SamplingParams(max_new_tokens=9, temperature=0.9, top_k=40, seed=7),
    SamplingParams(max_new_tokens=12),
    SamplingParams(max_new_tokens=7, temperature=1.1, top_p=0.9, seed=3),
)


@cache
def _run(model: str, pp_size: int, **kw: Any) -> dict[int, dict[str, Any]]:
    run = GroupRun(
        model=model,
        pp_size=pp_size,
        prompts=PROMPTS,
        params=PARAMS,
        gpu_memory_bytes=kw.pop("memory", 96 * MIB),
        chunk_tokens=kw.pop("chunk", 24),
        **kw,
    )
    return run_group(run)


def _check_stages(results: dict[int, dict[str, Any]], run: GroupRun) -> None:
    """Every stage: no failure, empty pools, only its own layers, and pool bytes equal to its
    rank of the plan computed here from the weights each stage holds."""
    expected = _measured_plan(run)
    covered: list[int] = []
    for rank in sorted(results):
        result, planned = results[rank], expected.ranks[rank]
        assert result["failure"] is None
        assert all(used == 0 for _, used in result["used"]), (rank, result["used"])
        assert result["pool_bytes"] == planned.pools.kv_bytes
        assert tuple(result["layers"]) == planned.layers
        assert tuple(result["layout_layers"]) == tuple(range(*planned.layers))
        covered += range(*planned.layers)
    assert covered == list(range(run.inputs().model.num_hidden_layers))


def _measured_plan(run: GroupRun) -> Plan:
    """The realized group plan: the planner's split, each stage's measured weights."""
    inputs = fixed_split(run.inputs())
    weights = init_weights(inputs.model, seed=run.seed)
    last = inputs.pp_size - 1
    ranges = split_layers(inputs.model.num_hidden_layers, inputs.pp_size, inputs.layer_split)
    per_rank = tuple(
        sum(
            weights[n].numel() * weights[n].element_size()
            for n in stage_param_names(inputs.model, layers, first=r == 0, last=r == last)
        )
        for r, layers in enumerate(ranges)
    )
    return realized_plan(inputs, per_rank)


@pytest.mark.parametrize("pp_size", [2, 3])
def test_tiny_pp_equals_one_process(pp_size: int) -> None:
    one = _run("tiny", 1)[0]["outputs"]
    results = _run("tiny", pp_size)
    assert results[0]["outputs"] == one
    assert all(len(o) > 0 for o in one)
    # The greedy requests also equal transformers' generation (an implementation no one here
    # wrote) on the same weights.
    pytest.importorskip("transformers")
    reference = hf_reference(tiny(), init_weights(tiny(), seed=0))
    for i in (0, 2):
        assert one[i] == hf_tokens(reference, list(PROMPTS[i]), PARAMS[i].max_new_tokens)
    _check_stages(results, GroupRun(pp_size=pp_size, gpu_memory_bytes=96 * MIB, chunk_tokens=24))


def test_fp8_kv_pp2_equals_one_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tiny with the release's fp8 KV rows (584-byte-style pages, fp8 indexer keys): each
    stage quantizes its own layers' rows, so PP=2 gives what one process gives."""
    doc = json.loads(tiny_hf_config())
    doc["kv_cache_dtype"] = "fp8_e4m3"
    path = tmp_path_factory.mktemp("fp8") / "config.json"
    path.write_text(json.dumps(doc))
    model = str(path)
    results = _run(model, 2)
    assert results[0]["outputs"] == _run(model, 1)[0]["outputs"]
    run = GroupRun(model=model, pp_size=2, gpu_memory_bytes=96 * MIB, chunk_tokens=24)
    assert run.inputs().model.kv_dtype == "fp8_e4m3"
    _check_stages(results, run)


def test_hybrid_tiny_pp2_equals_one_process() -> None:
    assert _run("hybrid-tiny", 2)[0]["outputs"] == _run("hybrid-tiny", 1)[0]["outputs"]


def test_pp_under_memory_pressure_retracts_and_still_matches() -> None:
    # Four requests of ~5 pages each over a bottleneck stage of 14 full pages: decoding them
    # together forces retraction (CPU offload on every stage) and resume.
    prompts = tuple(
        tuple((i * 13 + j) % 250 for j in range(n)) for i, n in enumerate((30, 28, 33, 26))
    )
    params = (SamplingParams(max_new_tokens=40),) * 4
    base = GroupRun(prompts=prompts, params=params, page_size=16, chunk_tokens=32)
    one = run_group(dataclasses.replace(base, pp_size=1))
    tight = dataclasses.replace(
        base, pp_size=2, max_running_requests=4, gpu_memory_bytes=_tight_memory(base, 14)
    )
    two = run_group(tight)
    assert two[0]["retractions"] > 0
    assert two[0]["outputs"] == one[0]["outputs"]
    _check_stages(two, tight)


def _tight_memory(run: GroupRun, full_pages: int) -> int:
    """The least memory (4 KiB steps) whose realized PP=2 plan gives the bottleneck stage
    `full_pages` full pages."""
    for memory in range(1 << 20, 8 << 20, 4 << 10):
        probe = dataclasses.replace(run, pp_size=2, max_running_requests=4, gpu_memory_bytes=memory)
        try:
            group = _measured_plan(probe)
        except PlanError:
            continue
        if min(r.pools.full_pages for r in group.ranks) >= full_pages:
            return memory
    raise AssertionError("no memory in [1, 8) MiB gives the wanted pool")


def test_an_explicit_split_is_honoured() -> None:
    results = _run("tiny", 2, layer_split=(1, 5))
    _check_stages(
        results,
        GroupRun(pp_size=2, gpu_memory_bytes=96 * MIB, chunk_tokens=24, layer_split=(1, 5)),
    )
    assert [results[r]["layers"] for r in (0, 1)] == [(0, 1), (1, 6)]
    assert results[0]["outputs"] == _run("tiny", 1)[0]["outputs"]


def test_logprobs_and_logit_processors_in_pp_equal_one_process() -> None:
    """The last stage samples with the penalties, bias and min_tokens (over the replicas'
    prompts and outputs) and computes the logprobs; the leader gets them all."""
    params = (
        SamplingParams(max_new_tokens=8, logprobs=2, prompt_logprobs=1, repetition_penalty=1.3),
        SamplingParams(
            max_new_tokens=6,
            temperature=0.9,
            seed=4,
            logprobs=0,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            logit_bias=((5, -100.0), (65, 3.0)),
        ),
        SamplingParams(max_new_tokens=6, min_tokens=4, stop_token_ids=(65,), prompt_logprobs=3),
        SamplingParams(max_new_tokens=5),
    )
    runs = [
        run_group(
            GroupRun(
                pp_size=pp_size,
                prompts=PROMPTS,
                params=params,
                gpu_memory_bytes=96 * MIB,
                chunk_tokens=24,
            )
        )[0]
        for pp_size in (1, 2)
    ]
    one, two = runs
    assert two["outputs"] == one["outputs"]
    for (lp1, plp1), (lp2, plp2), p, prompt in zip(
        one["logprobs"], two["logprobs"], params, PROMPTS, strict=True
    ):
        assert [e.token_id for e in lp2] == [e.token_id for e in lp1]
        assert [e.logprob for e in lp2] == pytest.approx([e.logprob for e in lp1], abs=1e-5)
        assert [[t for t, _ in e.top] for e in lp2] == [[t for t, _ in e.top] for e in lp1]
        if p.prompt_logprobs is not None:
            assert len(plp1) == len(prompt) - 1
        assert [e.logprob for e in plp2] == pytest.approx([e.logprob for e in plp1], abs=1e-5)
    assert len(one["logprobs"][0][0]) == 8 and len(one["logprobs"][1][0]) == 6
