"""The per-rank planner: hand-computed plans, PP slicing, SWA never caps context, fail-fast."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_variants import tiny_bf16

from dsv4_common.core.gpus import GPU_TYPES
from dsv4_common.core.presets import deepseek_v4_flash, deepseek_v4_pro, hybrid_tiny
from dsv4_common.core.units import GIB, MIB
from dsv4_common.plan.inputs import PlanError, PlanInputs, Role
from dsv4_common.plan.planner import plan, split_layers

# tiny, page 16 (see common/tests/core/test_layout.py for the unit arithmetic)
TINY_BF = 1280  # bytes per full page, 6 layers
TINY_BS = 24_576  # bytes per SWA page
TINY_BQ = 8192  # bytes per request slot
# tiny with a 16K context, so the full pool (not the model's 4K) binds in the hand-computed plans.
TINY_16K = dataclasses.replace(tiny_bf16(), max_position_embeddings=16_384)
H200 = GPU_TYPES["h200"].memory_bytes
# Pro, page 256
PRO_BF = 30 * 37_440 + 31 * 1_728 + 30 * 8_448
PRO_BS = 61 * 149_760 + 30 * (65_536 + 16_384)
PRO_BQ = 31 * 524_288


def tiny_inputs(role: Role, **kw: object) -> PlanInputs:
    base: dict[str, object] = dict(
        model=TINY_16K,
        role=role,
        gpu_memory_bytes=MIB,
        mem_fraction=1.0,
        max_running_requests=4,
        chunked_prefill_tokens=64,
        context_len=16_384,
        weight_bytes_per_rank=(0,),
    )
    base.update(kw)
    return PlanInputs(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# Hand-computed plans


def test_tiny_colocated_pp1_hand_computed() -> None:
    p = plan(tiny_inputs("colocated"))
    (r,) = p.ranks
    # SWA: 4 requests x (ceil(8 / 16) + 1 = 2 pages) + one chunk (ceil((64 + 8) / 16) + 1 = 6)
    assert r.pools.swa_pages == 4 * 2 + 6 == 14
    fixed = TINY_BF + TINY_BS + TINY_BQ * (4 + 1)  # reserved page 0 of each space + 5 slots
    full_pages = (MIB - fixed - 14 * TINY_BS) // TINY_BF
    assert full_pages == 498
    assert r.pools.full_pages == full_pages
    assert r.capacity.full_tokens == 498 * 16 == 7968
    assert r.capacity.max_context_tokens == 7968  # the full pool, below context_len=16384
    assert r.pools.kv_bytes == 499 * TINY_BF + 15 * TINY_BS + 5 * TINY_BQ <= MIB


def test_tiny_decode_pp1_hand_computed_has_no_chunk_in_flight() -> None:
    (r,) = plan(tiny_inputs("decode")).ranks
    assert r.pools.swa_pages == 4 * 2
    fixed = TINY_BF + TINY_BS + TINY_BQ * 5
    assert r.pools.full_pages == (MIB - fixed - 8 * TINY_BS) // TINY_BF == 613


def test_tiny_prefill_pp2_hand_computed_and_bottleneck() -> None:
    p = plan(tiny_inputs("prefill", pp_size=2, weight_bytes_per_rank=(0, 0)))
    r0, r1 = p.ranks
    assert (r0.layers, r1.layers) == ((0, 3), (3, 6))
    # rank 0: layers 0-2 -> c4 layer 1, c16 layer 2; rank 1: layers 3-5 -> c4 3, 5; c16 4
    bf0, bs0, bq0 = 256 + 128 + 64, 3 * 1024 + 4096 + 2048, 4096
    bf1, bs1, bq1 = 2 * (256 + 128) + 64, 3 * 1024 + 2 * (4096 + 2048), 4096
    assert (r0.layout.bytes_per_full_page, r0.layout.bytes_per_swa_page) == (bf0, bs0)
    assert (r1.layout.bytes_per_full_page, r1.layout.bytes_per_swa_page) == (bf1, bs1)
    assert bf0 + bf1 == TINY_BF and bs0 + bs1 == TINY_BS and bq0 + bq1 == TINY_BQ
    assert r0.pools.full_pages == (MIB - (bf0 + bs0 + 5 * bq0) - 14 * bs0) // bf0 == 1985
    assert r1.pools.full_pages == (MIB - (bf1 + bs1 + 5 * bq1) - 14 * bs1) // bf1 == 957
    assert r0.capacity.max_context_tokens == 16_384  # context_len binds on rank 0
    assert r1.capacity.max_context_tokens == 957 * 16
    assert p.bottleneck_rank == 1
    assert p.max_context_tokens == 957 * 16


def test_pro_decode_pp1_hand_computed() -> None:
    gpu = H200  # 143,771 MiB, as nvidia-smi reports it
    weights = 100 * GIB
    p = plan(
        PlanInputs(
            model=deepseek_v4_pro(),
            role="decode",
            gpu_memory_bytes=gpu,
            tp_size=8,
            max_running_requests=64,
            weight_bytes_per_rank=(weights,),
        )
    )
    (r,) = p.ranks
    available = int(gpu * 0.9) - weights
    assert r.available_bytes == available
    swa_pages = 64 * 2  # window 128 + page 256 -> ceil(128 / 256) + 1 = 2 pages per request
    fixed = PRO_BF + PRO_BS + PRO_BQ * 65
    full_pages = (available - fixed - swa_pages * PRO_BS) // PRO_BF
    assert (r.pools.swa_pages, r.pools.full_pages) == (swa_pages, full_pages)
    assert full_pages == 18_005
    assert r.layout.bytes_per_full_token == pytest.approx(5586.75)
    assert r.capacity.max_context_tokens == min(1_048_576, full_pages * 256)


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_flash_pp4_ranks_price_only_their_layers(role: Role) -> None:
    p = plan(
        PlanInputs(
            model=deepseek_v4_flash(),
            role=role,
            gpu_memory_bytes=GPU_TYPES["h100-80gb"].memory_bytes,
            tp_size=4,
            pp_size=4,
            max_running_requests=32,
        )
    )
    assert [r.layers for r in p.ranks] == [(0, 11), (11, 22), (22, 33), (33, 43)]
    # (c4, c128) layers per rank: 2-10 even / 3-9 odd; 12-20 / 11-21; 22-32 / 23-31; 34-42 / 33-41
    counts = [(5, 4), (5, 6), (6, 5), (5, 5)]
    for r, (n4, n128) in zip(p.ranks, counts, strict=True):
        assert r.layout.bytes_per_full_page == n4 * (37_440 + 8_448) + n128 * 1_728
        assert r.layout.bytes_per_swa_page == (r.layers[1] - r.layers[0]) * 149_760 + n4 * (
            65_536 + 16_384
        )
        assert r.layout.bytes_per_request_slot == n128 * 524_288
        assert r.pools.kv_bytes <= r.available_bytes


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
@pytest.mark.parametrize("pp", [1, 4])
def test_pro_plans_fit_their_memory_for_every_role(role: Role, pp: int) -> None:
    p = plan(
        PlanInputs(
            model=deepseek_v4_pro(),
            role=role,
            gpu_memory_bytes=141_000_000_000,
            tp_size=8,
            pp_size=pp,
        )
    )
    for r in p.ranks:
        assert r.pools.kv_bytes <= r.available_bytes
        # nothing left on the table: one more full page would not fit
        assert r.available_bytes - r.pools.kv_bytes < r.layout.bytes_per_full_page
        assert r.pools.swa_pages >= r.swa_need.pages_per_request * r.capacity.max_running_requests
        assert r.pools.swa_pages >= r.swa_need.chunk_pages


# ------------------------------------------------------------------------------------------
# Bugs of the reference engine we must not have


def test_pp4_rank_prices_about_a_quarter_not_all_layers() -> None:
    """PR #25750: every PP stage priced every layer (bytes per token over-counted x pp_size)."""
    kw: dict[str, object] = dict(
        model=deepseek_v4_pro(), role="decode", gpu_memory_bytes=141_000_000_000, tp_size=8
    )
    one = plan(PlanInputs(**kw)).ranks[0]  # type: ignore[arg-type]
    four = plan(PlanInputs(**kw, pp_size=4)).ranks  # type: ignore[arg-type]
    whole = one.layout.bytes_per_full_token
    for r in four:
        assert 0.2 * whole < r.layout.bytes_per_full_token < 0.3 * whole
    assert sum(r.layout.bytes_per_full_page for r in four) == one.layout.bytes_per_full_page
    assert sum(r.layout.bytes_per_swa_page for r in four) == one.layout.bytes_per_swa_page
    # a quarter of the bytes per token buys far more tokens per rank
    assert min(r.capacity.full_tokens for r in four) > 3 * one.capacity.full_tokens


def test_context_is_bounded_by_full_pool_never_by_swa_pool() -> None:
    """PR #26607: PD prefill capped prompts at the SWA pool (DSV4-Pro capped at 18,432)."""
    for role in ("prefill", "decode"):
        p = plan(
            PlanInputs(
                model=deepseek_v4_pro(),
                role=role,
                gpu_memory_bytes=141_000_000_000,
                tp_size=8,
                swa_ratio=0.01,
                max_running_requests=16,
            )
        )
        (r,) = p.ranks
        assert r.capacity.max_context_tokens > 10 * r.capacity.swa_tokens
        assert r.capacity.max_context_tokens == min(1_048_576, r.capacity.full_tokens)


def test_mtp_tail_entry_does_not_enlarge_the_plan() -> None:
    model = deepseek_v4_pro()
    trimmed = dataclasses.replace(model, compress_ratios=model.compress_ratios[:61])
    kw: dict[str, object] = dict(role="decode", gpu_memory_bytes=141_000_000_000, tp_size=8)
    a = plan(PlanInputs(model=model, **kw)).ranks[0]  # type: ignore[arg-type]
    b = plan(PlanInputs(model=trimmed, **kw)).ranks[0]  # type: ignore[arg-type]
    assert a.layout.bytes_per_full_page == b.layout.bytes_per_full_page
    assert a.pools == b.pools


def test_speculation_enlarges_draft_layer_and_rings_and_nothing_else() -> None:
    kw: dict[str, object] = dict(
        model=deepseek_v4_pro(),
        role="decode",
        gpu_memory_bytes=141_000_000_000,
        tp_size=8,
        pp_size=2,
        max_running_requests=32,
    )
    base = plan(PlanInputs(**kw))  # type: ignore[arg-type]
    spec = plan(PlanInputs(**kw, speculative_draft_tokens=3))  # type: ignore[arg-type]
    (b0, b1), (s0, s1) = base.ranks, spec.ranks
    # full-page components (compressed KV, indexer keys) are untouched on every rank
    assert s0.layout.bytes_per_full_page == b0.layout.bytes_per_full_page
    assert s1.layout.bytes_per_full_page == b1.layout.bytes_per_full_page
    # the draft layer lives on the last rank only, and only as window KV
    assert (s0.layout.draft_layer_ids, s1.layout.draft_layer_ids) == ((), (61,))
    assert s1.layout.component("swa_kv").num_layers == b1.layout.component("swa_kv").num_layers + 1
    # rings double (c4 per SWA page, c128 per request)
    for r_spec, r_base in ((s0, b0), (s1, b1)):
        assert r_spec.layout.bytes_per_request_slot == 2 * r_base.layout.bytes_per_request_slot
        rings = ("c4_attn_state", "c4_indexer_state")
        for name in rings:
            assert (
                r_spec.layout.component(name).unit_bytes
                == 2 * r_base.layout.component(name).unit_bytes
            )
    # weights: the MTP layer only on the last rank
    assert s0.weight_bytes == b0.weight_bytes and s1.weight_bytes > b1.weight_bytes
    # the per-request window still fits in 2 pages (128 + 3 draft tokens < 256)
    assert s0.swa_need == b0.swa_need


def test_auto_swa_is_sized_from_what_the_role_needs() -> None:
    kw: dict[str, object] = dict(
        model=tiny_bf16(),
        gpu_memory_bytes=64 * MIB,
        max_running_requests=10,
        chunked_prefill_tokens=128,
    )
    d = plan(PlanInputs(role="decode", **kw)).ranks[0]  # type: ignore[arg-type]
    p = plan(PlanInputs(role="prefill", **kw)).ranks[0]  # type: ignore[arg-type]
    assert d.pools.swa_pages == 10 * 2
    assert p.pools.swa_pages == 10 * 2 + (-(-(128 + 8) // 16) + 1)


def test_pp_ranks_share_one_request_count() -> None:
    p = plan(
        PlanInputs(
            model=deepseek_v4_pro(),
            role="decode",
            gpu_memory_bytes=141_000_000_000,
            tp_size=8,
            pp_size=4,
        )
    )
    assert len({r.capacity.max_running_requests for r in p.ranks}) == 1


# ------------------------------------------------------------------------------------------
# Fail fast, with the limit named


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        (
            lambda: tiny_inputs("decode", swa_ratio=0.001),
            r"cannot hold even one request's window \+ page \(8 \+ 16 tokens",
        ),
        (
            lambda: tiny_inputs("prefill", swa_ratio=0.004, chunked_prefill_tokens=4096),
            r"cannot hold one prefill chunk \+ window \+ page",
        ),
        (
            lambda: PlanInputs(
                model=deepseek_v4_pro(),
                role="decode",
                gpu_memory_bytes=H200,
                tp_size=8,
                speculative_draft_tokens=11,
            ),
            r"speculative_draft_tokens=11 exceeds what the c4_attn_state ring \(16 rows\)",
        ),
        (
            lambda: tiny_inputs("decode", pp_size=7, weight_bytes_per_rank=None),
            r"pp_size=7 exceeds the model's 6 target layers",
        ),
        (
            lambda: PlanInputs(model=deepseek_v4_pro(), role="decode", gpu_memory_bytes=H200),
            r"weights need .* GiB per GPU .*raise tp_size or pp_size",
        ),
        (
            lambda: tiny_inputs("decode", max_running_requests=200),
            r"200 request slots need .* MiB of request state",
        ),
        (
            lambda: tiny_inputs(
                "decode", pp_size=2, layer_split=(4, 3), weight_bytes_per_rank=(0, 0)
            ),
            r"layer_split=\[4, 3\] sums to 7, the model has 6 layers",
        ),
        (
            lambda: tiny_inputs(
                "decode", pp_size=2, layer_split=(6, 0), weight_bytes_per_rank=(0, 0)
            ),
            r"every PP rank needs at least one layer",
        ),
        (lambda: tiny_inputs("decode", page_size=24), r"page_size=24 must be divisible"),
        (
            lambda: PlanInputs(
                model=hybrid_tiny(), role="decode", gpu_memory_bytes=MIB, speculative_draft_tokens=2
            ),
            r"no draft layer",
        ),
        (lambda: tiny_inputs("decode", mem_fraction=1.5), r"mem_fraction=1.5 must be in"),
        (
            lambda: tiny_inputs("decode", gpu_memory_bytes=20 * 1024),
            r"4 request slots need 65.2 KiB of request state, but only 20.0 KiB is left",
        ),
        (
            lambda: tiny_inputs("decode", gpu_memory_bytes=70_000, max_running_requests=1),
            r"no memory left for even one full page",
        ),
    ],
)
def test_fail_fast_names_the_limit(inputs: object, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        plan(inputs())  # type: ignore[operator]


def test_even_split_gives_extra_layers_to_the_first_ranks() -> None:
    assert [len(r) for r in split_layers(61, 4, None)] == [16, 15, 15, 15]
    assert [len(r) for r in split_layers(43, 4, None)] == [11, 11, 11, 10]
    assert split_layers(6, 2, (2, 4)) == [range(0, 2), range(2, 6)]


@settings(max_examples=60, deadline=None)
@given(
    role=st.sampled_from(["colocated", "prefill", "decode"]),
    pp=st.integers(1, 6),
    mem_mib=st.integers(1, 256),
    reqs=st.one_of(st.none(), st.integers(1, 64)),
    ratio=st.one_of(st.none(), st.floats(0.05, 1.0)),
    draft=st.integers(0, 2),
)
def test_any_successful_plan_fits_memory_and_holds_one_request(
    role: Role, pp: int, mem_mib: int, reqs: int | None, ratio: float | None, draft: int
) -> None:
    try:
        p = plan(
            PlanInputs(
                model=tiny_bf16(),
                role=role,
                gpu_memory_bytes=mem_mib * MIB,
                pp_size=pp,
                max_running_requests=reqs,
                swa_ratio=ratio,
                speculative_draft_tokens=draft,
                chunked_prefill_tokens=64,
            )
        )
    except PlanError:
        return
    for r in p.ranks:
        assert r.pools.kv_bytes <= r.available_bytes
        assert r.pools.swa_pages >= r.swa_need.pages_per_request
        assert r.capacity.max_context_tokens == min(r.context_len, r.capacity.full_tokens)
        assert (
            sum(
                r.component_units()[c.name] * c.bytes_per_unit_all_layers
                for c in r.layout.components
            )
            == r.pools.kv_bytes
        )
    owned = sorted(i for r in p.ranks for i in r.layout.layer_ids)
    assert owned == list(range(6 + (1 if draft else 0)))
