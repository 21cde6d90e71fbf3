"""managedFields and server-side apply as the API server keeps them, restated from
kubernetes-sigs/structured-merge-diff merge/update.go (Updater.Update, Updater.Apply, prune,
addBackOwnedItems, addBackDanglingItems), merge/conflict.go, and kubernetes/apimachinery
pkg/util/managedfields/internal (managedfields.go BuildManagerIdentifier and the entry order,
stripmeta.go, skipnonapplied.go, managedfieldsupdater.go, conflict.go NewConflictError).
Pure: objects in, objects and entries out.

The rules:
  identity  a manager is its name, operation (Apply or Update), subresource and, for Update
            only, apiVersion: `m` applying and `m` updating are two managers
  update    a write that is not an apply (create, replace, merge/JSON/strategic patch) takes
            every field it adds or changes from whoever owned it, and nobody keeps a removed
            field; an object stored without managedFields stays without
  apply     the applied object is merged over the live one; the applier owns exactly what it
            applied; a field it applied last time and omits now is removed unless another
            manager owns it; a field another manager owns that the apply adds or changes is a
            conflict (409, every field and manager listed) unless `force`, which takes it
  meta      nobody owns apiVersion, kind, metadata.name/namespace/uid/resourceVersion/
            generation/creationTimestamp/managedFields
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from support import field_sets as F
from support.field_types import FieldType

Obj = dict[str, Any]

_STRIPPED: Final = frozenset(
    {("f:apiVersion",), ("f:kind",), ("f:metadata",)}
    | {
        ("f:metadata", "f:" + name)
        for name in ("name", "namespace", "creationTimestamp", "selfLink", "uid", "clusterName",
                     "generation", "managedFields", "resourceVersion")
    }
)  # fmt: skip
BEFORE_FIRST_APPLY: Final = "before-first-apply"


@dataclass(frozen=True)
class Entry:
    """One managedFields entry."""

    manager: str
    operation: str  # "Apply" or "Update"
    api_version: str
    subresource: str
    time: str
    fields: F.FieldSet

    @property
    def identity(self) -> tuple[str, str, str, str]:
        return (
            self.manager,
            self.operation,
            self.api_version if self.operation == "Update" else "",
            self.subresource,
        )

    def shown(self) -> str:
        """The manager as conflict messages name it (conflict.go printManager)."""
        out = json.dumps(self.manager)
        if self.subresource:
            out += f" with subresource {json.dumps(self.subresource)}"
        if self.operation == "Update":
            out += f" using {self.api_version}"
        return out


class ApplyConflict(Exception):
    """Fields another manager owns that an apply would change (409)."""

    def __init__(self, conflicts: Iterable[tuple[Entry, F.Path]]) -> None:
        self.conflicts = sorted(conflicts, key=lambda c: (c[0].identity, c[1]))
        super().__init__(self.message())

    def message(self) -> str:
        if len(self.conflicts) == 1:
            entry, path = self.conflicts[0]
            where = F.path_string(path)
            return f"Apply failed with 1 conflict: conflict with {entry.shown()}: {where}"
        lines: list[str] = []
        for entry, path in self.conflicts:
            head = f"conflicts with {entry.shown()}:"
            if head not in lines:
                lines.append(head)
            lines.append(f"- {F.path_string(path)}")
        return f"Apply failed with {len(self.conflicts)} conflicts: " + "\n".join(lines)

    def causes(self) -> list[Obj]:
        return [
            {
                "type": "FieldManagerConflict",
                "message": f"conflict with {entry.shown()}",
                "field": F.path_string(path),
            }
            for entry, path in self.conflicts
        ]


# ---------------------------------------------------------------------------------------------
# metadata.managedFields


def decode(raw: object) -> list[Entry] | None:
    """The entries of a managedFields list (None: not a valid one)."""
    if not isinstance(raw, list):
        return None
    out = []
    for item in raw:
        if not isinstance(item, Mapping) or item.get("operation") not in ("Apply", "Update"):
            return None
        if not item.get("apiVersion") or item.get("fieldsType") != "FieldsV1":
            return None
        fields = item.get("fieldsV1") or {}
        if not isinstance(fields, Mapping):
            return None
        out.append(
            Entry(
                str(item.get("manager") or ""),
                item["operation"],
                item["apiVersion"],
                str(item.get("subresource") or ""),
                str(item.get("time") or ""),
                F.from_fields_v1(fields),
            )
        )
    return out


def encode(entries: Iterable[Entry]) -> list[Obj]:
    """managedFields, in the server's order (operation, time, manager, apiVersion,
    subresource)."""
    ordered = sorted(
        entries, key=lambda e: (e.operation, e.time, e.manager, e.api_version, e.subresource)
    )
    out = []
    for e in ordered:
        entry: Obj = {
            "manager": e.manager,
            "operation": e.operation,
            "apiVersion": e.api_version,
            "time": e.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": F.to_fields_v1(e.fields),
        }
        if e.subresource:
            entry["subresource"] = e.subresource
        out.append(entry)
    return out


def is_reset(raw: object) -> bool:
    """A write that sends `managedFields: []` (or one empty entry) clears them."""
    return raw == [] or raw == [{}]


def without_managed_fields(obj: Mapping[str, Any]) -> Obj:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def same_ignoring_times(a: Iterable[Entry], b: Iterable[Entry]) -> bool:
    """Equal apart from timestamps (the server keeps the old times then: no write)."""

    def untimed(entries: Iterable[Entry]) -> set[tuple[Any, ...]]:
        return {(*e.identity, e.api_version, e.fields) for e in entries}

    return untimed(a) == untimed(b)


# ---------------------------------------------------------------------------------------------
# Update and Apply


def update(
    live: Mapping[str, Any] | None,
    new: Mapping[str, Any],
    entries: list[Entry],
    *,
    manager: str,
    api_version: str,
    subresource: str,
    t: FieldType,
    now: str,
) -> list[Entry]:
    """The entries after `manager` writes `new` over `live` (None: a create)."""
    if not entries and live is not None:
        return []  # an object stored without managedFields is not tracked
    before = without_managed_fields(live) if live is not None else F.MISSING
    added, removed, modified = F.compare(before, without_managed_fields(new), t)
    taken = added | modified
    out = _without(entries, lambda e: e.fields - taken - removed)
    own = Entry(manager, "Update", api_version, subresource, now, taken - _STRIPPED)
    if own.fields:
        previous = next((e for e in out if e.identity == own.identity), None)
        if previous is not None:
            out.remove(previous)
            own = replace(own, fields=own.fields | previous.fields)
        out.append(own)
    return out


def apply(
    live: Mapping[str, Any] | None,
    applied: Mapping[str, Any],
    entries: list[Entry],
    *,
    manager: str,
    api_version: str,
    subresource: str,
    force: bool,
    t: FieldType,
    now: str,
) -> tuple[Obj, list[Entry]]:
    """The object and entries after `manager` applies `applied` (raises ApplyConflict, or
    field_sets.FieldSetError for an applied object the schema refuses)."""
    base: Obj = without_managed_fields(live) if live is not None else {}
    if live is not None and not entries:  # skipnonapplied: the existing fields get an owner
        entries = update(
            None, base, [], manager=BEFORE_FIRST_APPLY, api_version=api_version,
            subresource=subresource, t=t, now=now,
        )  # fmt: skip
    identity = (manager, "Apply", "", subresource)
    last = next((e for e in entries if e.identity == identity), None)
    mine = Entry(manager, "Apply", api_version, subresource, now, F.field_set(applied, t))
    others = [e for e in entries if e.identity != identity]
    merged = F.merge(base, dict(applied), t)
    if last is not None and last.fields:
        merged = _prune(merged, [*others, mine], last.fields, t)
    added, removed, modified = F.compare(base, merged, t)
    conflicts = [(e, p) for e in others for p in e.fields & (added | modified)]
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    out = _without(others, lambda e: e.fields - added - modified - removed)
    changed = bool(added or removed or modified)
    kept_time = last.time if last is not None and not changed else now
    mine = replace(mine, fields=mine.fields - _STRIPPED, time=kept_time)
    if mine.fields:
        out.append(mine)
    return _drop_nulls(merged), out


def _prune(merged: Obj, entries: list[Entry], last: F.FieldSet, t: FieldType) -> Obj:
    """Remove what the applier applied last time and no longer does, unless someone owns it
    (update.go prune: remove the last set, add back owned items, then dangling ones)."""
    last_named = F.ensure_named(last, t)
    owned = F.ensure_named(frozenset().union(*(e.fields for e in entries)), t)
    every = F.ensure_named(F.field_set(merged, t, unique=False), t)
    pruned = F.remove(merged, last_named, t) or {}
    kept = F.ensure_named(F.field_set(pruned, t, unique=False), t)
    pruned = F.remove(merged, every - (kept | owned), t) or {}
    kept = F.ensure_named(F.field_set(pruned, t, unique=False), t)
    out: Obj = F.remove(merged, (every - kept) & last_named, t) or {}
    return out


def _without(entries: Iterable[Entry], keep: Any) -> list[Entry]:
    """Entries with their fields replaced by `keep(entry)`; those left empty go."""
    out = []
    for e in entries:
        fields = keep(e)
        if fields:
            out.append(replace(e, fields=fields))
    return out


def _drop_nulls(value: Any) -> Any:
    """An applied null clears the field (the stored object holds no nulls)."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value
