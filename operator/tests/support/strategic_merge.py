"""Strategic merge patch (application/strategic-merge-patch+json) as the API server applies it to
built-in kinds, restated from kubernetes/apimachinery pkg/util/strategicpatch/patch.go
(StrategicMergeMapPatch with IgnoreUnmatchedNulls and MergeParallelList; mergeMap,
mergeSlice, normalizeElementOrder, applyRetainKeysDirective, mergePatchIntoOriginal) and the
error mapping of k8s.io/apiserver handlers/patch.go (interpretStrategicMergePatchError).
Custom resources have no patch strategies: the server answers 415 before getting here. Pure.

The rules:
  maps        merged key by key; null deletes a key; `$patch: replace` replaces the map,
              `$patch: delete` empties it; `$retainKeys: [...]` drops the keys not listed
  lists       replaced, unless the field's patch strategy is merge (support/field_types.py,
              from the Go types' patchStrategy/patchMergeKey tags): lists of maps merge item by
              item on the merge key (an item without it is an error), `{$patch: delete, key:
              v}` removes an item, `{$patch: replace}` replaces the list; lists of scalars are
              unioned, and `$deleteFromPrimitiveList/<field>` removes items
  order       patched items in patch order, the other live items where they were;
              `$setElementOrder/<field>` gives the order explicitly
"""

from __future__ import annotations

import copy
from typing import Any, Final

from support.field_types import FieldType

Obj = dict[str, Any]

_PATCH: Final = "$patch"
_RETAIN: Final = "$retainKeys"
_DELETE_FROM: Final = "$deleteFromPrimitiveList/"
_ORDER: Final = "$setElementOrder/"


class PatchError(Exception):
    """The server's refusal: 400 for a malformed directive, 422 for content the directives
    contradict, 500 (the server passes the patch library's error through) for the rest."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _no_merge_key(item: Any, key: str) -> PatchError:
    return PatchError(500, f"map: {item} does not contain declared merge key: {key}")


def apply_patch(original: Obj, patch: Obj, t: FieldType) -> Obj:
    """`original` with the strategic merge patch applied."""
    return _merge_map(copy.deepcopy(original), copy.deepcopy(patch), t)


def _merge_map(original: Obj, patch: Obj, t: FieldType) -> Obj:
    if _PATCH in patch:
        directive = patch.pop(_PATCH)
        if directive == "replace":
            return _clean(patch)  # type: ignore[no-any-return]
        if directive == "delete":
            return {}
        raise PatchError(500, f"unknown patch type: {directive} in map: {patch}")
    _retain_keys(original, patch)
    _set_element_order(original, patch, t)
    for key, value in patch.items():
        deleting = key.startswith(_DELETE_FROM)
        if deleting:
            key = key[len(_DELETE_FROM) :]
        elif key.startswith("$"):
            continue  # not a field: the Go type has no such field, so nothing is stored
        if value is None:
            original.pop(key, None)
            continue
        if key not in original or _shape(original[key]) != _shape(value):
            if not deleting and not (isinstance(value, dict) and _PATCH in value):
                original[key] = _clean(value)
            continue
        if isinstance(value, dict):
            original[key] = _merge_map(original[key], value, t.child(key))
        elif isinstance(value, list):
            field_type = t.child(key)
            if field_type.merge_list or deleting:
                original[key] = _merge_list(original[key], value, field_type, deleting)
            else:
                original[key] = _clean(value)
        else:
            original[key] = value
    return original


def _shape(value: Any) -> str:
    """Go's view of a JSON value's type (numbers are all float64)."""
    if isinstance(value, dict):
        return "map"
    if isinstance(value, list):
        return "list"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def _clean(value: Any) -> Any:
    """A patch value stored as is: nulls, directives and items carrying `$patch` dropped."""
    if isinstance(value, dict):
        return {
            k: _clean(v)
            for k, v in value.items()
            if v is not None and not k.startswith("$") and not (isinstance(v, dict) and _PATCH in v)
        }
    if isinstance(value, list):
        return [_clean(v) for v in value if not (isinstance(v, dict) and _PATCH in v)]
    return value


def _retain_keys(original: Obj, patch: Obj) -> None:
    if _RETAIN not in patch:
        return
    retained = patch.pop(_RETAIN)
    if not isinstance(retained, list):
        raise PatchError(400, "invalid patch format of retainKeys")
    for key, value in patch.items():
        if value is None or key.startswith((_DELETE_FROM, _ORDER)):
            continue
        if key not in retained:
            raise PatchError(400, "invalid patch format of retainKeys")
    for key in [k for k in original if k not in retained]:
        del original[key]


def _set_element_order(original: Obj, patch: Obj, t: FieldType) -> None:
    for order_key in [k for k in patch if k.startswith(_ORDER)]:
        order = patch.pop(order_key)
        key = order_key[len(_ORDER) :]
        field_type = t.child(key)
        if not isinstance(order, list):
            raise PatchError(400, "invalid patch format of setElementOrder list")
        live: list[Any] | None = original.get(key)
        patched: list[Any] | None = patch.pop(key, None)
        _check_order(patched, order, field_type.merge_key)
        if live is None and patched is None:
            continue
        merged: list[Any]
        if patched is None:
            merged = list(live or [])
        elif live is None:
            merged = _clean(patched)
        else:
            merged = _merge_list(live, patched, field_type, False)
        in_order = [x for x in merged if _find(order, x, field_type.merge_key) >= 0]
        rest = [x for x in merged if _find(order, x, field_type.merge_key) < 0]
        original[key] = _ordered(in_order, rest, order, live or [], field_type.merge_key)


def _check_order(patched: Any, order: list[Any], merge_key: str | None) -> None:
    """validatePatchWithSetOrderList: the patch list is in the order the directive gives."""
    if patched is None or not order:
        return
    if not isinstance(patched, list):
        raise PatchError(400, "invalid patch format of setElementOrder list")
    at = 0
    for item in patched:
        if isinstance(item, dict) and _PATCH in item:
            continue
        while at < len(order) and not _same_key(item, order[at], merge_key):
            at += 1
        if at >= len(order):
            raise PatchError(
                500,
                f"The order in patch list:\n{patched}\n doesn't match {_ORDER} list:\n{order}\n",
            )
        at += 1


def _key_of(item: Any, merge_key: str | None) -> Any:
    if merge_key is None:
        return item
    if not isinstance(item, dict) or merge_key not in item:
        raise _no_merge_key(item, merge_key)
    return item[merge_key]


def _same_key(a: Any, b: Any, merge_key: str | None) -> bool:
    return bool(_key_of(a, merge_key) == _key_of(b, merge_key))


def _find(items: list[Any], item: Any, merge_key: str | None) -> int:
    want = item.get(merge_key) if merge_key and isinstance(item, dict) else item
    for i, x in enumerate(items):
        have = x.get(merge_key) if merge_key and isinstance(x, dict) else x
        if have == want:
            return i
    return -1


def _merge_list(original: list[Any], patch: list[Any], t: FieldType, deleting: bool) -> list[Any]:
    if not original and not patch:
        return original
    shapes = {_shape(x) for x in (*original, *patch)}
    if "list" in shapes:
        raise PatchError(422, "lists of lists are not supported")
    if len(shapes) > 1:
        raise PatchError(500, f"list element types are not identical: {[original, patch]}")
    if shapes != {"map"}:
        if deleting:
            return [x for x in original if x not in patch]
        merged = list(original)
        merged += [x for x in patch if x not in merged]
        in_patch = [x for x in merged if x in patch]
        return _ordered(in_patch, [x for x in merged if x not in patch], patch, original, None)
    key = t.merge_key
    if key is None:
        raise PatchError(500, "cannot merge lists without merge key")
    items: list[Any] = []
    replace_all = False
    for item in patch:
        directive = item.get(_PATCH)
        if directive is None:
            items.append(item)
        elif directive == "delete":
            if key not in item:
                raise _no_merge_key(item, key)
            original = [
                x for x in original if not (isinstance(x, dict) and x.get(key) == item[key])
            ]
        elif directive == "replace":
            replace_all = True
        elif directive == "merge":
            raise PatchError(500, "merging lists cannot yet be specified in the patch")
        else:
            raise PatchError(500, f"unknown patch type: {directive} in map: {item}")
    if replace_all:
        original, items = [_clean(x) for x in items], []
    merged = list(original)
    for item in items:
        at = next(
            (
                i
                for i, x in enumerate(merged)
                if isinstance(x, dict) and _key_of(item, key) == x.get(key)
            ),
            -1,
        )
        if at >= 0:
            merged[at] = _merge_map(merged[at], item, t.item())
        else:
            merged.append(_clean(item))
    in_patch = [x for x in merged if _find(items, x, key) >= 0]
    rest = [x for x in merged if _find(items, x, key) < 0]
    return _ordered(in_patch, rest, items, original, key)


def _ordered(
    patched: list[Any], live_only: list[Any], patch_order: list[Any], live_order: list[Any],
    merge_key: str | None,
) -> list[Any]:  # fmt: skip
    """normalizeElementOrder: patched items in patch order, live-only items in live order, the
    two interleaved by their places in the live list (mergeSortedSlice)."""
    patched = sorted(patched, key=lambda x: _find(patch_order, x, merge_key))
    live_only = sorted(live_only, key=lambda x: _find(live_order, x, merge_key))
    out: list[Any] = []
    i = j = 0
    while i < len(live_only) or j < len(patched):
        if j >= len(patched):
            out.append(live_only[i])
            i += 1
        elif i >= len(live_only):
            out.append(patched[j])
            j += 1
        else:
            left = _find(live_order, live_only[i], merge_key)
            right = _find(live_order, patched[j], merge_key)
            if left >= 0 and right >= 0 and left < right:
                out.append(live_only[i])
                i += 1
            else:
                out.append(patched[j])
                j += 1
    return out
