"""The KV transfer manifest: derived from the layout, round-trips, and a mismatch names the
first differing field (page size, dtype, layer set, geometry)."""

from __future__ import annotations

import pytest

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.manifest import (
    group_mismatch,
    manifest_hash,
    manifest_mismatch,
    manifest_of,
    manifest_to_dict,
    parse_manifest,
    select_layers,
)
from dsv4_common.core.layout import build_layout
from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import load_model_config


def _layout(page: int = 16, preset: str = "tiny", state: str = "ring"):  # type: ignore[no-untyped-def]
    return build_layout(load_model_config(preset), page, request_state=state)  # type: ignore[arg-type]


def test_round_trip_and_units_do_not_count() -> None:
    a = manifest_of(_layout(), {"full_page": 10, "swa_page": 4, "req_slot": 3})
    b = manifest_of(_layout(), {"full_page": 99, "swa_page": 7, "req_slot": 1})
    assert parse_manifest(manifest_to_dict(a)) == a
    assert manifest_mismatch(a, b) is None
    assert manifest_hash(a) == manifest_hash(b)
    assert [c.name for c in a.components] == [c.name for c in _layout().components]


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (_layout(page=32), "page_size"),
        (_layout(state="online"), "request_state"),
        (_layout(preset="hybrid-tiny"), "model"),
    ],
)
def test_mismatch_names_the_field(other, field) -> None:  # type: ignore[no-untyped-def]
    why = manifest_mismatch(manifest_of(_layout()), manifest_of(other))
    assert why is not None and f"manifest {field}:" in why
    assert manifest_hash(manifest_of(_layout())) != manifest_hash(manifest_of(other))


def test_dtype_mismatch_names_the_component() -> None:
    model = load_model_config("tiny")
    assert isinstance(model, DSV4Config)
    import dataclasses

    bf16 = dataclasses.replace(model, kv_dtype="bf16")
    why = manifest_mismatch(manifest_of(_layout()), manifest_of(build_layout(bf16, 16)))
    assert why is not None
    assert why.startswith("manifest components[swa_kv].")
    assert "dtype" in why or "unit_bytes" in why or "row_elems" in why


def test_layer_set_mismatch_names_the_layers() -> None:
    full = _layout()
    half = full.select(full.layer_ids[: len(full.layer_ids) // 2])
    why = manifest_mismatch(manifest_of(full), manifest_of(half))
    assert why is not None and why.startswith("manifest layer_ids:")
    assert str(full.layer_ids[-1]) in why


def test_other_version_refused_naming_it() -> None:
    doc = manifest_to_dict(manifest_of(_layout()))
    doc["version"] = 2
    with pytest.raises(DocumentError, match=r"manifest\.version"):
        parse_manifest(doc)
    del doc["version"]
    with pytest.raises(DocumentError, match=r"manifest\.version"):
        parse_manifest(doc)


# -- PP x PD: the prefill group's stages against decode's whole manifest -----------------------


def _stages(split: tuple[int, ...]) -> tuple:  # type: ignore[type-arg]
    full, start, out = _layout(), 0, []
    for n in split:
        out.append(manifest_of(full.select(full.layer_ids[start : start + n])))
        start += n
    return tuple(out)


@pytest.mark.parametrize("split", [(6,), (3, 3), (1, 5), (2, 2, 2), (1, 1, 1, 1, 1, 1)])
def test_any_split_covering_decodes_layers_once_is_accepted(split: tuple[int, ...]) -> None:
    decode = manifest_of(_layout())
    assert group_mismatch(_stages(split), (decode,)) is None
    # Each stage's slice of decode's manifest is exactly its own (PP slicing is a filter).
    for stage in _stages(split):
        assert manifest_mismatch(stage, select_layers(decode, stage.layer_ids)) is None


def test_a_split_missing_layers_is_refused_naming_them() -> None:
    why = group_mismatch(_stages((3, 3))[:1], (manifest_of(_layout()),))
    assert why == (
        "PP split: decode layers [3, 4, 5] are computed by no prefill stage, prefill layers [] "
        "are held by no decode stage"
    )


def test_overlapping_stages_are_refused_naming_the_layer() -> None:
    a, b = _stages((3, 3))
    why = group_mismatch((a, a, b), (manifest_of(_layout()),))
    assert why == "PP split: layer 0 is on prefill stages 0 and 1"


def test_a_stage_of_another_geometry_is_refused_naming_the_stage() -> None:
    full = _layout(page=32)
    other = manifest_of(full.select(full.layer_ids[3:]))
    why = group_mismatch((_stages((3, 3))[0], other), (manifest_of(_layout()),))
    assert why is not None and why.startswith("manifest page_size: prefill stage 1 has 32")


@pytest.mark.parametrize(
    ("prefill", "decode"), [((3, 3), (3, 3)), ((2, 4), (3, 3)), ((6,), (2, 2, 2)), ((3, 3), (6,))]
)
def test_any_two_splits_of_the_same_layers_match(
    prefill: tuple[int, ...], decode: tuple[int, ...]
) -> None:
    assert group_mismatch(_stages(prefill), _stages(decode)) is None


def test_a_decode_group_with_overlapping_stages_is_refused() -> None:
    a, b = _stages((3, 3))
    assert group_mismatch(_stages((6,)), (a, a, b)) == (
        "PP split: layer 0 is on decode stages 0 and 1"
    )


def test_a_mismatched_pair_names_both_stages() -> None:
    full = _layout(page=32)
    other = manifest_of(full.select(full.layer_ids[3:]))
    why = group_mismatch(_stages((3, 3)), (_stages((3, 3))[0], other))
    assert why is not None
    assert why.startswith("manifest page_size: prefill stage 1 has 16, decode stage 1 has 32")
