"""Frozen dataclasses <-> JSON documents, for the versioned documents of the contract.

One generic encoder and one generic, strict decoder, driven by the dataclass's type hints, so
a document's schema is its dataclass and nothing else. The decoder checks every field's type
(int, float, bool, str, Literal, None, tuple, dict[str, T], nested dataclasses) and raises
`DocumentError` naming the field path of the first problem; unknown keys are ignored (a newer
writer may add fields within one version). A dataclass field marked `INLINE` is written as its
own fields in the enclosing object (not nested under its name), so a type can be embedded
without changing a document's wire form. Pure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from dsv4_common.core.invariants import FieldError

T = TypeVar("T")


class DocumentError(ValueError):
    """A document does not match its schema; the message names the field path."""


_SCALARS: Final = (int, float, bool, str, type(None))
# `field(metadata=INLINE)`: a dataclass-typed field whose fields sit in the enclosing object.
INLINE: Final = MappingProxyType({"inline": True})


def to_document(obj: Any) -> Any:
    """A dataclass (or a value inside one) as plain JSON-able data: tuples become lists."""
    if type(obj) in _SCALARS:
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        doc: dict[str, Any] = {}
        for name, inline in _fields(type(obj)):
            value = to_document(getattr(obj, name))
            if inline:
                doc.update(value)
            else:
                doc[name] = value
        return doc
    if isinstance(obj, tuple | list):
        return [v if type(v) in _SCALARS else to_document(v) for v in obj]
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
    schema: Any = cls
    return _decoder(schema)(doc, path or cls.__name__)  # type: ignore[no-any-return]


# A decoder takes (value, path) and returns the decoded value or raises DocumentError naming
# `path`. One is built per schema type and cached: the type hints are read once per dataclass,
# not once per document (control messages are decoded on the PD request path).
_Decoder = Callable[[object, str], Any]


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, inline) of each field."""
    return tuple((f.name, _is_inline(f)) for f in dataclasses.fields(cls))


def _is_inline(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("inline"))


@functools.cache
def _decoder(tp: Any) -> _Decoder:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if origin is Union or origin is types.UnionType:
        return _union_decoder(get_args(tp))
    if origin is Literal:
        return _literal_decoder(get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return _variadic_tuple_decoder(args[0])
        return _fixed_tuple_decoder(args)
    if origin is dict:
        return _dict_decoder(*get_args(tp))
    if tp in _SCALAR_DECODERS:
        return _SCALAR_DECODERS[tp]
    raise TypeError(f"unsupported schema type {tp!r}")


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise DocumentError(f"{path}: must be true or false, got {value!r}")
    return value


def _int(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DocumentError(f"{path}: must be an integer, got {value!r}")
    return value


def _float(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DocumentError(f"{path}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise DocumentError(f"{path}: must be finite, got {value!r}")
    return float(value)


def _str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise DocumentError(f"{path}: must be a string, got {value!r}")
    return value


_SCALAR_DECODERS: Final[dict[type, _Decoder]] = {bool: _bool, int: _int, float: _float, str: _str}
# A variadic tuple of these keeps its items as they are when every item has exactly this type.
_EXACT: Final[dict[type, type]] = {int: int, str: str, bool: bool}


def _union_decoder(args: tuple[Any, ...]) -> _Decoder:
    optional = type(None) in args
    options = [_decoder(a) for a in args if a is not type(None)]

    def decode(value: object, path: str) -> Any:
        if value is None and optional:
            return None
        errors = []
        for option in options:
            try:
                return option(value, path)
            except DocumentError as exc:
                errors.append(str(exc))
        raise DocumentError(errors[0] if len(errors) == 1 else f"{path}: got {value!r}")

    return decode


def _literal_decoder(allowed: tuple[Any, ...]) -> _Decoder:
    def decode(value: object, path: str) -> Any:
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise DocumentError(f"{path}: must be one of {list(allowed)}, got {value!r}")
        return value

    return decode


def _as_list(value: object, path: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise DocumentError(f"{path}: must be a list, got {_kind(value)}")
    return value


def _variadic_tuple_decoder(item_tp: Any) -> _Decoder:
    item = _decoder(item_tp)
    exact = _EXACT.get(item_tp)

    def decode(value: object, path: str) -> tuple[Any, ...]:
        items = _as_list(value, path)
        if exact is not None and all(type(v) is exact for v in items):
            return tuple(items)  # the item decoder would return each unchanged
        return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(items))

    return decode


def _fixed_tuple_decoder(args: tuple[Any, ...]) -> _Decoder:
    items = [_decoder(a) for a in args]

    def decode(value: object, path: str) -> tuple[Any, ...]:
        values = _as_list(value, path)
        if len(values) != len(items):
            raise DocumentError(f"{path}: must have {len(items)} items, got {len(values)}")
        return tuple(
            d(v, f"{path}[{i}]") for i, (d, v) in enumerate(zip(items, values, strict=True))
        )

    return decode


def _dict_decoder(key_tp: Any, val_tp: Any) -> _Decoder:
    key, val = _decoder(key_tp), _decoder(val_tp)

    def decode(value: object, path: str) -> dict[Any, Any]:
        if not isinstance(value, Mapping):
            raise DocumentError(f"{path}: must be an object, got {_kind(value)}")
        return {key(k, f"{path} key"): val(v, f"{path}.{k}") for k, v in value.items()}

    return decode


def _dataclass_decoder(cls: Any) -> _Decoder:
    hints = get_type_hints(cls)
    # (name, has a default, inline, type); the field decoders are built on first use, so a
    # dataclass may refer to itself.
    fields = [
        (
            f.name,
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING,
            _is_inline(f),
            hints[f.name],
        )
        for f in dataclasses.fields(cls)
        if f.init
    ]

    def decode(value: object, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise DocumentError(f"{path}: must be an object, got {_kind(value)}")
        kwargs: dict[str, Any] = {}
        for name, has_default, inline, tp in fields:
            if inline:  # its fields are this object's: decode them from here, at this path
                kwargs[name] = _decoder(tp)(value, path)
                continue
            if name not in value:
                if has_default:
                    continue
                raise DocumentError(f"{path}.{name}: required")
            kwargs[name] = _decoder(tp)(value[name], f"{path}.{name}")
        try:
            return cls(**kwargs)
        except FieldError as exc:  # an invariant of one field: name that field's path
            raise DocumentError(f"{path}.{exc.field}: {exc.reason}") from exc
        except ValueError as exc:  # the dataclass's own invariants (__post_init__)
            raise DocumentError(f"{path}: {exc}") from exc

    return decode


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
