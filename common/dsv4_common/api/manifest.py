"""The KV transfer manifest, version 1: what a prefill and a decode worker exchange at handshake.

Derived from the layout spec alone (`manifest_of`), so both sides describe every component the
same way: name, kind, index space, layer ids, bytes per unit, rows per unit, row dtype and
elements, compression ratio, plus the geometry that fixes addressing (page size, window, draft
tokens, request-state form). `units` (pool sizes) is informative: the two sides' pools differ.

`manifest_mismatch` names the first field that differs (`components[c4_kv].unit_bytes: prefill
1024, decode 2048`), so a mismatch is refused at handshake, never at transfer time. PP slicing
is a filter on layer ids (`KVLayout.select`), so a split that leaves layers uncovered shows up
as a differing `layer_ids`. Pure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dsv4_common.api.documents import (
    DocumentError,
    check_version,
    from_document,
    to_document,
)
from dsv4_common.core.layout import KVLayout

MANIFEST_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class ComponentEntry:
    name: str
    kind: str
    index_space: str
    layer_ids: tuple[int, ...]
    unit_bytes: int
    rows_per_unit: int
    dtype: str
    row_elems: int
    ratio: int


@dataclass(frozen=True, slots=True)
class Manifest:
    version: int
    model: str
    page_size: int
    window_tokens: int
    draft_tokens: int
    request_state: str
    layer_ids: tuple[int, ...]
    components: tuple[ComponentEntry, ...]
    units: dict[str, int]  # index space -> units of this side's pools (not compared)


def manifest_of(layout: KVLayout, units: Mapping[str, int] | None = None) -> Manifest:
    return Manifest(
        version=MANIFEST_VERSION,
        model=layout.model_name,
        page_size=layout.page_size,
        window_tokens=layout.window_tokens,
        draft_tokens=layout.draft_tokens,
        request_state=layout.request_state,
        layer_ids=layout.layer_ids,
        components=tuple(
            ComponentEntry(
                name=c.name,
                kind=str(c.kind),
                index_space=str(c.index_space),
                layer_ids=c.layer_ids,
                unit_bytes=c.unit_bytes,
                rows_per_unit=c.rows_per_unit,
                dtype=c.dtype,
                row_elems=c.row_elems,
                ratio=c.ratio,
            )
            for c in layout.components
        ),
        units=dict(units or {}),
    )


def manifest_to_dict(manifest: Manifest) -> dict[str, Any]:
    doc: dict[str, Any] = to_document(manifest)
    return doc


def parse_manifest(doc: object) -> Manifest:
    """Parse a peer's manifest; raises DocumentError naming the first bad field."""
    check_version(doc, "manifest", MANIFEST_VERSION)
    return from_document(Manifest, doc, "manifest")


def manifest_hash(manifest: Manifest) -> str:
    """A short hash of everything both sides must agree on (`units` excluded)."""
    doc = manifest_to_dict(manifest)
    doc.pop("units")
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def manifest_mismatch(
    mine: Manifest, theirs: Manifest, mine_name: str = "prefill", their_name: str = "decode"
) -> str | None:
    """The first field on which the two manifests differ, as a message, or None."""

    def differ(field: str, a: object, b: object) -> str:
        return f"manifest {field}: {mine_name} has {a!r}, {their_name} has {b!r}"

    for field in ("version", "model", "page_size", "window_tokens", "draft_tokens"):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            return differ(field, a, b)
    if mine.request_state != theirs.request_state:
        return differ("request_state", mine.request_state, theirs.request_state)
    if mine.layer_ids != theirs.layer_ids:
        only_a = sorted(set(mine.layer_ids) - set(theirs.layer_ids))
        only_b = sorted(set(theirs.layer_ids) - set(mine.layer_ids))
        return (
            f"manifest layer_ids: layers {only_a} only on {mine_name}, "
            f"{only_b} only on {their_name}"
        )
    names_a = [c.name for c in mine.components]
    names_b = [c.name for c in theirs.components]
    if names_a != names_b:
        return differ("components", names_a, names_b)
    for a_entry, b_entry in zip(mine.components, theirs.components, strict=True):
        for field in ComponentEntry.__dataclass_fields__:
            a, b = getattr(a_entry, field), getattr(b_entry, field)
            if a != b:
                return differ(f"components[{a_entry.name}].{field}", a, b)
    return None


def select_layers(manifest: Manifest, layer_ids: tuple[int, ...]) -> Manifest:
    """The manifest of the same layout restricted to `layer_ids` (PP slicing is this filter)."""
    keep = frozenset(layer_ids)
    comps = []
    for c in manifest.components:
        ids = tuple(i for i in c.layer_ids if i in keep)
        if ids:
            comps.append(dataclasses.replace(c, layer_ids=ids))
    return dataclasses.replace(
        manifest,
        layer_ids=tuple(i for i in manifest.layer_ids if i in keep),
        components=tuple(comps),
    )


def shared_layers(a: Manifest, b: Manifest) -> tuple[int, ...]:
    """The layer ids both manifests hold, in `a`'s order (PP: what one stage sends another)."""
    theirs = set(b.layer_ids)
    return tuple(i for i in a.layer_ids if i in theirs)


def _overlap(stages: tuple[Manifest, ...], side: str) -> str | None:
    seen: dict[int, int] = {}
    for rank, stage in enumerate(stages):
        for layer in stage.layer_ids:
            if layer in seen:
                return f"PP split: layer {layer} is on {side} stages {seen[layer]} and {rank}"
            seen[layer] = rank
    return None


def group_mismatch(
    stages: tuple[Manifest, ...], theirs: tuple[Manifest, ...], their_name: str = "decode"
) -> str | None:
    """PP x PD: the prefill group's stages against the peer group's stages (one manifest each,
    in rank order). Each side holds every layer once, both sides hold the same layers, and
    wherever a prefill stage and a peer stage share layers their slices match; the message
    names the stages and the layers otherwise."""
    why = _overlap(stages, "prefill") or _overlap(theirs, their_name)
    if why is not None:
        return why
    mine_ids = {i for s in stages for i in s.layer_ids}
    their_ids = {i for s in theirs for i in s.layer_ids}
    missing, extra = sorted(their_ids - mine_ids), sorted(mine_ids - their_ids)
    if missing or extra:
        return (
            f"PP split: {their_name} layers {missing} are computed by no prefill stage, "
            f"prefill layers {extra} are held by no {their_name} stage"
        )
    for rank, stage in enumerate(stages):
        for peer_rank, peer in enumerate(theirs):
            shared = shared_layers(stage, peer)
            if not shared:
                continue
            peer_name = their_name if len(theirs) == 1 else f"{their_name} stage {peer_rank}"
            why = manifest_mismatch(
                select_layers(stage, shared),
                select_layers(peer, shared),
                f"prefill stage {rank}",
                peer_name,
            )
            if why is not None:
                return why
    return None


__all__ = [
    "MANIFEST_VERSION",
    "ComponentEntry",
    "DocumentError",
    "Manifest",
    "group_mismatch",
    "manifest_hash",
    "manifest_mismatch",
    "manifest_of",
    "manifest_to_dict",
    "parse_manifest",
    "select_layers",
    "shared_layers",
]
