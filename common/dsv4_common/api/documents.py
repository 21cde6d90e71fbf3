"""Frozen dataclasses <-> JSON documents, for the versioned documents of the contract.

One generic encoder and one generic, strict decoder, driven by the dataclass's type hints, so
a document's schema is its dataclass and nothing else. The decoder checks every field's type
(int, float, bool, str, Literal, None, tuple, dict[str, T], nested dataclasses) and raises
`DocumentError` naming the field path of the first problem; unknown keys are ignored (a newer
writer may add fields within one version). Pure.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class DocumentError(ValueError):
    """A document does not match its schema; the message names the field path."""


def to_document(obj: Any) -> Any:
    """A dataclass (or a value inside one) as plain JSON-able data: tuples become lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_document(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_document(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_document(v) for k, v in obj.items()}
    return obj


def check_version(doc: object, name: str, version: int) -> None:
    """Refuse a document of another version (or none) before decoding it, naming the field."""
    if isinstance(doc, Mapping) and doc.get("version") != version:
        raise DocumentError(
            f"{name}.version: this reader understands version {version}, got {doc.get('version')!r}"
        )


def from_document(cls: type[T], doc: object, path: str = "") -> T:
    """Decode `doc` into the dataclass `cls`, checking every field (errors name the path)."""
    return _decode(cls, doc, path or cls.__name__)  # type: ignore[no-any-return]


def _decode(tp: Any, value: object, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, path)
    if origin is Union or origin is types.UnionType:
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, value, path)
            except DocumentError as exc:
                errors.append(str(exc))
        raise DocumentError(errors[0] if len(errors) == 1 else f"{path}: got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise DocumentError(f"{path}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise DocumentError(f"{path}: must be a list, got {_kind(value)}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise DocumentError(f"{path}: must have {len(args)} items, got {len(value)}")
        return tuple(
            _decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is dict:
        if not isinstance(value, Mapping):
            raise DocumentError(f"{path}: must be an object, got {_kind(value)}")
        key_tp, val_tp = get_args(tp)
        return {
            _decode(key_tp, k, f"{path} key"): _decode(val_tp, v, f"{path}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise DocumentError(f"{path}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DocumentError(f"{path}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DocumentError(f"{path}: must be a number, got {value!r}")
        if not math.isfinite(value):
            raise DocumentError(f"{path}: must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise DocumentError(f"{path}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported schema type {tp!r}")


def _decode_dataclass(cls: Any, value: object, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise DocumentError(f"{path}: must be an object, got {_kind(value)}")
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        where = f"{path}.{f.name}"
        if f.name not in value:
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            if has_default:
                continue
            raise DocumentError(f"{where}: required")
        kwargs[f.name] = _decode(hints[f.name], value[f.name], where)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # the dataclass's own invariants (__post_init__)
        raise DocumentError(f"{path}: {exc}") from exc


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
