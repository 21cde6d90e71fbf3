"""The KV layout spec: hand-computed bytes for every preset, PP slicing, fail-fast geometry,
and every layout pinned as it was before layout.py became a table."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_variants import tiny_bf16

from dsv4_common.core import index_space as ix
from dsv4_common.core.layout import IndexSpace, KVLayout, LayoutError, build_layout
from dsv4_common.core.model import ModelConfig
from dsv4_common.core.presets import (
    PRESETS,
    deepseek_v4_flash,
    deepseek_v4_pro,
    hybrid_tiny,
    load_model_config,
    tiny,
)

# fp8 KV row: 448 B fp8 nope + 64 x 2 B bf16 rope + 7 B scales (one per 64) = 583 -> 8-aligned 584.
KV_ROW = 448 + 64 * 2 + 7 + 1
# Pages of fp8 KV are aligned to 576 B.
SWA_PAGE_UNIT = 260 * 576  # 256 x 584 = 149,504 -> 149,760 (the reference engine's log: 149,760)
C4_PAGE_UNIT = 65 * 576  # 64 rows x 584 = 37,376 -> 37,440
C128_PAGE_UNIT = 3 * 576  # 2 rows x 584 = 1,168 -> 1,728 (reference log: 1,728)
IDX_PAGE_UNIT = 64 * (128 + 4)  # 64 rows x (128 B fp8 key + 4 B fp32 scale) = 8,448
C4_STATE_UNIT = 8 * (2 * 2 * 512) * 4  # ring 8 x (kv, score) x (prev, cur) x 512 fp32 = 65,536
C4_IDX_STATE_UNIT = 8 * (2 * 2 * 128) * 4  # 16,384
C128_STATE_UNIT = 128 * (2 * 512) * 4  # ring 128 x (kv, score) x 512 fp32 = 524,288


def test_fp8_kv_row_is_584_bytes() -> None:
    layout = build_layout(deepseek_v4_pro(), 256)
    assert layout.component("swa_kv").row_elems == KV_ROW == 584


def test_pro_units_match_hand_arithmetic_and_reference_logs() -> None:
    layout = build_layout(deepseek_v4_pro(), 256)
    expected = {
        "swa_kv": (SWA_PAGE_UNIT, 61, IndexSpace.SWA_PAGE),
        "c4_kv": (C4_PAGE_UNIT, 30, IndexSpace.FULL_PAGE),
        "c4_indexer": (IDX_PAGE_UNIT, 30, IndexSpace.FULL_PAGE),
        "c4_attn_state": (C4_STATE_UNIT, 30, IndexSpace.SWA_PAGE),
        "c4_indexer_state": (C4_IDX_STATE_UNIT, 30, IndexSpace.SWA_PAGE),
        "c128_kv": (C128_PAGE_UNIT, 31, IndexSpace.FULL_PAGE),
        "c128_state": (C128_STATE_UNIT, 31, IndexSpace.REQ_SLOT),
    }
    got = {c.name: (c.unit_bytes, c.num_layers, c.index_space) for c in layout.components}
    assert got == expected
    assert (
        layout.bytes_per_full_page == 30 * C4_PAGE_UNIT + 31 * C128_PAGE_UNIT + 30 * IDX_PAGE_UNIT
    )
    assert layout.bytes_per_full_page == 1_430_208
    assert layout.bytes_per_swa_page == 61 * SWA_PAGE_UNIT + 30 * (
        C4_STATE_UNIT + C4_IDX_STATE_UNIT
    )
    assert layout.bytes_per_request_slot == 31 * C128_STATE_UNIT  # 15.5 MiB per request
    assert layout.bytes_per_request_slot == int(15.5 * 2**20)


def test_flash_units_match_hand_arithmetic() -> None:
    layout = build_layout(deepseek_v4_flash(), 256)
    counts = {c.name: c.num_layers for c in layout.components}
    assert counts == {
        "swa_kv": 43,
        "c4_kv": 21,
        "c4_indexer": 21,
        "c4_attn_state": 21,
        "c4_indexer_state": 21,
        "c128_kv": 20,
        "c128_state": 20,
    }
    assert (
        layout.bytes_per_full_page == 21 * C4_PAGE_UNIT + 20 * C128_PAGE_UNIT + 21 * IDX_PAGE_UNIT
    )
    assert layout.bytes_per_full_token == pytest.approx(998_208 / 256)
    assert layout.bytes_per_swa_page == 43 * SWA_PAGE_UNIT + 21 * (
        C4_STATE_UNIT + C4_IDX_STATE_UNIT
    )
    assert layout.bytes_per_request_slot == 20 * C128_STATE_UNIT


def test_tiny_units_match_hand_arithmetic() -> None:
    # tiny: 6 layers, ratios (0, 4, 16, 4, 16, 4), head 24 + 8 = 32 bf16 -> 64 B rows, page 16.
    layout = build_layout(tiny_bf16(), 16)
    got = {c.name: (c.unit_bytes, c.layer_ids) for c in layout.components}
    assert got == {
        "swa_kv": (16 * 64, (0, 1, 2, 3, 4, 5)),
        "c4_kv": (4 * 64, (1, 3, 5)),  # 16 / 4 rows per page
        "c4_indexer": (4 * 16 * 2, (1, 3, 5)),  # index dim 16, bf16
        "c4_attn_state": (8 * 4 * 32 * 4, (1, 3, 5)),  # ring 8 x 4 x 32 fp32
        "c4_indexer_state": (8 * 4 * 16 * 4, (1, 3, 5)),
        "c16_kv": (1 * 64, (2, 4)),
        "c16_state": (16 * 2 * 32 * 4, (2, 4)),  # ring 16 x (kv, score) x 32 fp32
    }
    assert layout.bytes_per_full_page == 3 * 256 + 3 * 128 + 2 * 64 == 1280
    assert layout.bytes_per_swa_page == 6 * 1024 + 3 * 4096 + 3 * 2048 == 24_576
    assert layout.bytes_per_request_slot == 2 * 4096


def test_hybrid_layout_splits_full_and_sliding_layers_and_shards_heads_by_tp() -> None:
    model = hybrid_tiny()  # layers 3 and 7 full, 2 KV heads of 16 + 16 dims, bf16
    layout = build_layout(model, 16)
    assert layout.component("full_kv").layer_ids == (3, 7)
    assert layout.component("swa_kv").layer_ids == (0, 1, 2, 4, 5, 6)
    assert layout.component("full_kv").unit_bytes == 16 * 2 * 32 * 2
    tp2 = build_layout(model, 16, tp_size=2)
    assert tp2.component("full_kv").unit_bytes * 2 == layout.component("full_kv").unit_bytes
    tp8 = build_layout(model, 16, tp_size=8)  # never fewer than one head per rank
    assert tp8.component("full_kv").unit_bytes == tp2.component("full_kv").unit_bytes


def test_mtp_tail_entry_is_not_a_target_layer() -> None:
    model = deepseek_v4_pro()
    assert len(model.compress_ratios) == 62 and model.num_hidden_layers == 61
    layout = build_layout(model, 256)
    assert layout.layer_ids == tuple(range(61))
    assert layout.component("swa_kv").num_layers == 61
    assert layout.draft_layer_ids == ()


def test_speculation_adds_the_draft_window_and_doubles_rings_only() -> None:
    base = build_layout(deepseek_v4_pro(), 256)
    spec = build_layout(deepseek_v4_pro(), 256, draft_tokens=3)
    assert spec.draft_layer_ids == (61,)
    assert spec.component("swa_kv").layer_ids == (*range(61), 61)
    for name in ("c4_kv", "c4_indexer", "c128_kv"):
        assert spec.component(name) == base.component(name)
    for name in ("c4_attn_state", "c4_indexer_state", "c128_state"):
        assert spec.component(name).rows_per_unit == 2 * base.component(name).rows_per_unit
        assert spec.component(name).layer_ids == base.component(name).layer_ids


@given(st.lists(st.integers(1, 20), min_size=1, max_size=8))
def test_pp_slices_partition_every_layer_and_every_byte(cuts: list[int]) -> None:
    layout = build_layout(deepseek_v4_pro(), 256, draft_tokens=1)
    bounds = sorted({min(c, 61) for c in cuts} | {0, 62})
    stages = [layout.select(range(a, b)) for a, b in itertools.pairwise(bounds)]
    owned = [i for s in stages for i in s.layer_ids]
    assert sorted(owned) == list(range(62))  # each layer (+ the draft layer) exactly once
    assert sum(s.bytes_per_full_page for s in stages) == layout.bytes_per_full_page
    assert sum(s.bytes_per_swa_page for s in stages) == layout.bytes_per_swa_page
    assert sum(s.bytes_per_request_slot for s in stages) == layout.bytes_per_request_slot


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"model": tiny(), "page_size": 24}, "divisible by every compression ratio"),
        ({"model": tiny(), "page_size": 0}, "page_size=0"),
        (
            {"model": deepseek_v4_pro(), "page_size": 256, "draft_tokens": 11},
            "at most 10 draft tokens",
        ),
        ({"model": hybrid_tiny(), "page_size": 16, "draft_tokens": 1}, "no draft layer"),
        ({"model": tiny(), "page_size": 16, "draft_tokens": -1}, "must be >= 0"),
    ],
)
def test_geometry_errors_name_the_limit(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        build_layout(**kwargs)  # type: ignore[arg-type]


def test_ring_must_divide_the_page() -> None:
    # c4 ring of 16 rows (speculative) cannot be addressed by slot % ring in an 8-token page
    model = dataclasses.replace(tiny(), compress_ratios=(0, 4, 4, 4, 4, 4, 0))
    with pytest.raises(LayoutError, match="multiple of the c4 compressor ring"):
        build_layout(model, 8, draft_tokens=1)


@given(st.integers(1, 10_000), st.sampled_from([4, 16, 128]), st.sampled_from([128, 256, 512]))
def test_page_identity_compressed_page_is_the_full_page(slot: int, ratio: int, page: int) -> None:
    row = ix.compressed_row_of(ix.FullSlot(slot), ratio)
    assert ix.compressed_page_of(row, ratio, page) == ix.full_page_of(ix.FullSlot(slot), page)


@given(st.integers(1, 1000), st.integers(0, 255), st.sampled_from([8, 16]))
def test_page_state_rows_stay_inside_their_swa_page_ring(page: int, offset: int, ring: int) -> None:
    slot = ix.swa_slot_at(ix.SwaPage(page), offset, 256)
    row = ix.page_state_row(slot, 256, ring)
    assert page * ring <= row < (page + 1) * ring


# -- pinned layouts ----------------------------------------------------------------------------
# Computed from layout.py before it was rewritten as a table; a layout changed on purpose must
# update these pins in the same commit.

_FLASH_C4, _FLASH_C128 = tuple(range(2, 43, 2)), tuple(range(3, 42, 2))
_PRO_C4, _PRO_C128 = tuple(range(2, 61, 2)), (0, 1, *range(3, 60, 2))
_TINY_C4, _TINY_C16 = (1, 3, 5), (2, 4)

# (preset, page size, draft tokens) -> [(component, unit bytes, layer ids)], in layout order.
PINNED_COMPONENTS: dict[tuple[str, int, int], list[tuple[str, int, tuple[int, ...]]]] = {
    ("deepseek-v4-flash", 256, 0): [
        ("swa_kv", 149_760, tuple(range(43))),
        ("c4_kv", 37_440, _FLASH_C4),
        ("c4_indexer", 8_448, _FLASH_C4),
        ("c4_attn_state", 65_536, _FLASH_C4),
        ("c4_indexer_state", 16_384, _FLASH_C4),
        ("c128_kv", 1_728, _FLASH_C128),
        ("c128_state", 524_288, _FLASH_C128),
    ],
    ("deepseek-v4-flash", 256, 1): [
        ("swa_kv", 149_760, tuple(range(44))),
        ("c4_kv", 37_440, _FLASH_C4),
        ("c4_indexer", 8_448, _FLASH_C4),
        ("c4_attn_state", 131_072, _FLASH_C4),
        ("c4_indexer_state", 32_768, _FLASH_C4),
        ("c128_kv", 1_728, _FLASH_C128),
        ("c128_state", 1_048_576, _FLASH_C128),
    ],
    ("deepseek-v4-pro", 256, 0): [
        ("swa_kv", 149_760, tuple(range(61))),
        ("c4_kv", 37_440, _PRO_C4),
        ("c4_indexer", 8_448, _PRO_C4),
        ("c4_attn_state", 65_536, _PRO_C4),
        ("c4_indexer_state", 16_384, _PRO_C4),
        ("c128_kv", 1_728, _PRO_C128),
        ("c128_state", 524_288, _PRO_C128),
    ],
    ("deepseek-v4-pro", 256, 1): [
        ("swa_kv", 149_760, tuple(range(62))),
        ("c4_kv", 37_440, _PRO_C4),
        ("c4_indexer", 8_448, _PRO_C4),
        ("c4_attn_state", 131_072, _PRO_C4),
        ("c4_indexer_state", 32_768, _PRO_C4),
        ("c128_kv", 1_728, _PRO_C128),
        ("c128_state", 1_048_576, _PRO_C128),
    ],
    ("hybrid-tiny", 16, 0): [
        ("full_kv", 2_048, (3, 7)),
        ("swa_kv", 2_048, (0, 1, 2, 4, 5, 6)),
    ],
    ("tiny", 16, 0): [
        ("swa_kv", 1_024, tuple(range(6))),
        ("c4_kv", 256, _TINY_C4),
        ("c4_indexer", 128, _TINY_C4),
        ("c4_attn_state", 4_096, _TINY_C4),
        ("c4_indexer_state", 2_048, _TINY_C4),
        ("c16_kv", 64, _TINY_C16),
        ("c16_state", 4_096, _TINY_C16),
    ],
    ("tiny", 16, 1): [
        ("swa_kv", 1_024, tuple(range(7))),
        ("c4_kv", 256, _TINY_C4),
        ("c4_indexer", 128, _TINY_C4),
        ("c4_attn_state", 8_192, _TINY_C4),
        ("c4_indexer_state", 4_096, _TINY_C4),
        ("c16_kv", 64, _TINY_C16),
        ("c16_state", 8_192, _TINY_C16),
    ],
}


@pytest.mark.parametrize(("preset", "page", "draft"), sorted(PINNED_COMPONENTS))
def test_every_preset_layout_equals_its_pinned_component_list(
    preset: str, page: int, draft: int
) -> None:
    model = tiny_bf16() if preset == "tiny" else load_model_config(preset)
    layout = build_layout(model, page, draft)
    got = [(c.name, c.unit_bytes, c.layer_ids) for c in layout.components]
    assert got == PINNED_COMPONENTS[(preset, page, draft)]


def _pin_models() -> dict[str, ModelConfig]:
    """Every preset plus DSV4 variants that reach every branch and every geometry error."""
    models = {name: load_model_config(name) for name in sorted(PRESETS)}
    models["tiny"] = tiny_bf16()  # what the digest was computed for
    tiny = tiny_bf16
    swap = dataclasses.replace
    models["tiny-no-mtp"] = swap(
        tiny(), num_nextn_predict_layers=0, compress_ratios=(0, 4, 16, 4, 16, 4)
    )
    models["tiny-all-c4"] = swap(tiny(), compress_ratios=(0, 4, 4, 4, 4, 4, 0))
    models["tiny-no-c4"] = swap(tiny(), compress_ratios=(0, 16, 128, 0, 16, 128, 0))
    models["tiny-sparse-16"] = swap(tiny(), sparse_ratio=16)
    models["tiny-fp8"] = swap(
        tiny(), kv_dtype="fp8_e4m3", indexer_dtype="fp8", kv_page_align_bytes=96
    )
    models["tiny-fp4-idx"] = swap(
        tiny(), indexer_dtype="fp4", state_dtype="bf16", kv_page_align_bytes=48
    )
    models["tiny-fp32"] = swap(tiny(), kv_dtype="fp32")
    return models


def _canonical(layout: KVLayout) -> str:
    """Every field the layout had when pinned, spelled out (a field added later with a default
    that keeps the old layouts leaves the digest alone)."""
    fields = ("name", "kind", "index_space", "layer_ids", "ratio", "dtype", "row_elems")
    fields += ("rows_per_unit", "unit_bytes", "window_bounded")
    components = [tuple(str(getattr(c, f)) for f in fields) for c in layout.components]
    return repr(
        (
            layout.model_name,
            layout.page_size,
            layout.window_tokens,
            layout.draft_tokens,
            layout.layer_ids,
            layout.draft_layer_ids,
            layout.draft_tolerance,
            layout.version,
            components,
        )
    )


def _outcome(model: ModelConfig, page: int, draft: int, tp: int) -> str:
    try:
        return _canonical(build_layout(model, page, draft, tp))
    except LayoutError as err:
        return f"LayoutError: {err}"


# sha256 over the canonical form (every field of every component) or the error message of 2,310
# builds, computed from layout.py before its table refactor.
PINNED_LAYOUTS_SHA256 = "bb4efdc67573290782e3b13e5d0e844eb58c05c4f300d642e233943e7d8bc284"


def test_every_layout_and_geometry_error_is_byte_identical_to_the_pinned_digest() -> None:
    models = _pin_models()
    grid = itertools.product(
        sorted(models),
        (0, 8, 12, 16, 24, 32, 64, 128, 256, 512),
        (-1, 0, 1, 2, 3, 10, 11),
        (1, 2, 8),
    )
    lines = [f"{n} {p} {d} {t}: " + _outcome(models[n], p, d, t) for n, p, d, t in grid]
    assert len(lines) == 2_310
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == PINNED_LAYOUTS_SHA256
