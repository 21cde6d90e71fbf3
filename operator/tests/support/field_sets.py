"""Field sets and the typed operations server-side apply is built from, restated from
kubernetes-sigs/structured-merge-diff (typed/tofieldset.go, compare.go, merge.go, remove.go;
fieldpath/set.go EnsureNamedFieldsAreMembers, serialize.go, element.go) over plain JSON values
typed by support/field_types.py. Pure.

A path is a tuple of path elements written as managedFields writes them: `f:name` (a field or
map key), `k:{"name":"x"}` (an item of a keyed list, by its key fields), `v:"x"` (an item of a
set). Invariants the operations keep:
  field_set  a manager owns every scalar it set, every atomic list or map as one path, every
             item of a keyed list or set (its path and what it set inside), every map key
             (of a Go map or schemaless object), every null or empty-map value; never the
             struct fields that merely hold such paths
  compare    added / removed / modified paths between two objects; a node present on one side
             only is added or removed with everything under it
  merge      maps merge key by key, keyed lists item by item (items only the live object has
             stay, in place); atomic values and scalars are the applied object's
  remove     drops the paths listed, whole subtrees for a listed node; a map or list left empty
             goes too
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from support.field_types import FieldType

Path = tuple[str, ...]
FieldSet = frozenset[Path]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()  # a value absent on one side (not JSON null)


class FieldSetError(ValueError):
    """A value a typed operation refuses (a keyed list item without its keys, duplicates)."""


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def item_element(item: Any, list_type: FieldType, where: Path = ()) -> str:
    """The path element of an item of a keyed list or set (helpers.go listItemToPathElement):
    key fields it omits take their schema default, or are left out of the key."""
    if list_type.keys == ():
        return "v:" + _json(item)
    if not isinstance(item, Mapping):
        raise FieldSetError(
            f"{path_string(where)}: associative list with keys may not have non-map elements"
        )
    keys = list_type.keys or ()
    key = {k: item[k] for k in keys if k in item}
    key.update({k: v for k, v in list_type.key_defaults.items() if k not in key})
    if not key:
        raise FieldSetError(
            f"{path_string(where)}: associative list with keys has an element that omits all key "
            f"fields {list(keys)} (and doesn't have default values for any key fields)"
        )
    return "k:" + _json(key)


def _items(value: list[Any], list_type: FieldType, where: Path, *, unique: bool) -> dict[str, Any]:
    """Items by path element (the first of duplicates, or an error when `unique`)."""
    out: dict[str, Any] = {}
    for item in value:
        pe = item_element(item, list_type, where)
        if pe in out:
            if unique:
                raise FieldSetError(
                    f"{path_string(where)}: duplicate entries for key {element_string(pe)}"
                )
            continue
        out[pe] = item
    return out


# ---------------------------------------------------------------------------------------------
# Field sets


def field_set(value: Any, t: FieldType, *, unique: bool = True) -> FieldSet:
    """The paths a manager owns by setting `value` (ToFieldSet)."""
    out: set[Path] = set()
    _collect(value, t, (), out, unique)
    return frozenset(out)


def _collect(value: Any, t: FieldType, path: Path, out: set[Path], unique: bool) -> None:
    if isinstance(value, dict):
        if t.atomic:
            out.add(path)
            return
        for key, sub in value.items():
            child = (*path, "f:" + key)
            _collect(sub, t.child(key), child, out, unique)
            if sub is None or sub == {} or not t.is_field(key):
                out.add(child)
    elif isinstance(value, list):
        if not t.granular_list:
            out.add(path)
            return
        for pe, item in _items(value, t, path, unique=unique).items():
            child = (*path, pe)
            _collect(item, t.item(), child, out, unique)
            out.add(child)
    elif path:
        out.add(path)


def ensure_named(paths: Iterable[Path], root: FieldType) -> FieldSet:
    """`paths` plus every struct field that holds one of them (EnsureNamedFieldsAreMembers)."""
    out = set(paths)
    for path in list(out):
        t = root
        for depth, pe in enumerate(path[:-1], start=1):
            if pe.startswith("f:"):
                name = pe[2:]
                if t.is_field(name):
                    out.add(path[:depth])
                t = t.child(name)
            else:
                t = t.item()
    return frozenset(out)


def under(paths: Iterable[Path], pe: str) -> set[Path]:
    """The paths below element `pe`, without it (Set.WithPrefix)."""
    return {p[1:] for p in paths if len(p) > 1 and p[0] == pe}


# ---------------------------------------------------------------------------------------------
# Compare


def compare(live: Any, new: Any, t: FieldType) -> tuple[FieldSet, FieldSet, FieldSet]:
    """(added, removed, modified) from `live` to `new` (typed.Compare)."""
    added: set[Path] = set()
    removed: set[Path] = set()
    modified: set[Path] = set()
    _compare(live, new, t, (), added, removed, modified)
    return frozenset(added), frozenset(removed), frozenset(modified)


def _is_leaf(lhs: Any, rhs: Any, t: FieldType) -> bool:
    """A node compared or merged as one value: a scalar, an atomic map or list, values of
    different shapes, or maps/lists empty on both sides."""
    sides = [v for v in (lhs, rhs) if v is not MISSING]
    if all(isinstance(v, dict) for v in sides):
        return t.atomic or all(not v for v in sides)
    if all(isinstance(v, list) for v in sides):
        return not t.granular_list or all(not v for v in sides)
    return True


def _compare(
    lhs: Any,
    rhs: Any,
    t: FieldType,
    path: Path,
    added: set[Path],
    removed: set[Path],
    modified: set[Path],
) -> None:
    if _is_leaf(lhs, rhs, t):
        if not path:
            return
        if lhs is MISSING:
            added.add(path)
        elif rhs is MISSING:
            removed.add(path)
        elif lhs != rhs:
            modified.add(path)
        return
    if isinstance(lhs, dict) or isinstance(rhs, dict):
        left = lhs if isinstance(lhs, dict) else {}
        right = rhs if isinstance(rhs, dict) else {}
        for key in {**left, **right}:
            sub = (*path, "f:" + key)
            _compare(
                left.get(key, MISSING),
                right.get(key, MISSING),
                t.child(key),
                sub,
                added,
                removed,
                modified,
            )
    else:
        left = _items(lhs if isinstance(lhs, list) else [], t, path, unique=False)
        right = _items(rhs if isinstance(rhs, list) else [], t, path, unique=False)
        for pe in {**left, **right}:
            sub = (*path, pe)
            _compare(
                left.get(pe, MISSING),
                right.get(pe, MISSING),
                t.item(),
                sub,
                added,
                removed,
                modified,
            )
    if path and lhs is MISSING:
        added.add(path)
    elif path and rhs is MISSING:
        removed.add(path)


# ---------------------------------------------------------------------------------------------
# Merge


def merge(live: Any, applied: Any, t: FieldType) -> Any:
    """`applied` merged over `live` (TypedValue.Merge)."""
    if applied is MISSING:
        return copy.deepcopy(live)
    if live is MISSING or _is_leaf(live, applied, t):
        return copy.deepcopy(applied)
    if isinstance(live, dict):
        return {
            key: merge(live.get(key, MISSING), applied.get(key, MISSING), t.child(key))
            for key in {**live, **applied}
        }
    return _merge_items(live, applied, t)


def _merge_items(live: list[Any], applied: list[Any], t: FieldType) -> list[Any]:
    """Keyed list items merged; the order (merge.go visitListItems): the applied items in
    their order, each live-only item where it was relative to the items around it."""
    left = _items(live, t, (), unique=False)
    right = _items(applied, t, (), unique=True)
    lpes, rpes = list(left), list(right)
    shared = [pe for pe in rpes if pe in left]
    next_shared = shared.pop(0) if shared else None
    done: set[str] = set()
    out: list[Any] = []
    li = ri = 0
    while li < len(lpes) or ri < len(rpes):
        if li < len(lpes) and ri < len(rpes):
            pe = lpes[li]
            if pe == rpes[ri]:  # the same item next on both sides
                done.add(pe)
                out.append(merge(left[pe], right[pe], t.item()))
                li, ri = li + 1, ri + 1
                next_shared = shared.pop(0) if shared else None
                continue
            if pe in right and next_shared is not None and next_shared != pe:
                li += 1  # a shared item the applied object puts later: placed there
                continue
        if li < len(lpes):
            pe = lpes[li]
            if pe not in right:  # only live: stays here
                out.append(copy.deepcopy(left[pe]))
                li += 1
                continue
            if pe in done:
                li += 1
        if ri < len(rpes):
            pe = rpes[ri]
            done.add(pe)
            out.append(merge(left.get(pe, MISSING), right[pe], t.item()))
            ri += 1
            if next_shared == pe:
                next_shared = shared.pop(0) if shared else None
    return out


# ---------------------------------------------------------------------------------------------
# Remove


def remove(value: Any, paths: Iterable[Path], t: FieldType) -> Any:
    """`value` without `paths` (TypedValue.RemoveItems); maps and lists left empty are dropped
    (the server stores no null)."""
    targets = set(paths)
    if not targets:
        return copy.deepcopy(value)
    if isinstance(value, dict) and not t.atomic:
        out = {}
        for key, sub in value.items():
            pe = "f:" + key
            if (pe,) in targets:
                continue
            below = under(targets, pe)
            kept = remove(sub, below, t.child(key)) if below else copy.deepcopy(sub)
            if kept is not None or sub is None:
                out[key] = kept
        return out or None
    if isinstance(value, list) and t.granular_list:
        items = []
        for item in value:
            pe = item_element(item, t)
            if (pe,) in targets:
                continue
            below = under(targets, pe)
            items.append(remove(item, below, t.item()) if below else copy.deepcopy(item))
        return items or None
    return copy.deepcopy(value)


# ---------------------------------------------------------------------------------------------
# managedFields' fieldsV1 and conflict paths


def to_fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    """The fieldsV1 object of a set (serialize.go): a node that is itself owned and holds owned
    paths carries `.`."""
    root: dict[str, Any] = {}
    members = set(paths)
    for path in sorted(members):
        node = root
        for pe in path:
            node = node.setdefault(pe, {})
    _mark(root, (), members)
    return root


def _mark(node: dict[str, Any], path: Path, members: set[Path]) -> None:
    for pe, child in node.items():
        if pe == ".":
            continue
        sub = (*path, pe)
        if child and sub in members:
            child["."] = {}
        _mark(child, sub, members)


def from_fields_v1(fields: Mapping[str, Any], path: Path = ()) -> FieldSet:
    out: set[Path] = set()
    for pe, child in fields.items():
        if pe == ".":
            if path:
                out.add(path)
            continue
        sub = (*path, pe)
        if not child:
            out.add(sub)
        elif isinstance(child, Mapping):
            out |= from_fields_v1(child, sub)
    return frozenset(out)


def element_string(pe: str) -> str:
    """A path element as conflicts print it (element.go String): `.name`, `[name="x"]`."""
    kind, _, body = pe.partition(":")
    if kind == "f":
        return "." + body
    if kind == "k":
        return "[" + ",".join(f"{k}={_json(v)}" for k, v in json.loads(body).items()) + "]"
    if kind == "v":
        return f"[={body}]"
    return f"[{body}]"


def path_string(path: Path) -> str:
    return "".join(element_string(pe) for pe in path)
