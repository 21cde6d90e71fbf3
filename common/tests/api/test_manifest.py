"""The KV transfer manifest: derived from the layout, round-trips, and a mismatch names the
first differing field (page size, dtype, layer set, geometry)."""

from __future__ import annotations

import pytest

from dsv4_common.api.documents import DocumentError
from dsv4_common.api.manifest import (
    manifest_hash,
    manifest_mismatch,
    manifest_of,
    manifest_to_dict,
    parse_manifest,
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

    fp32 = dataclasses.replace(model, kv_dtype="fp32")
    why = manifest_mismatch(manifest_of(_layout()), manifest_of(build_layout(fp32, 16)))
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
