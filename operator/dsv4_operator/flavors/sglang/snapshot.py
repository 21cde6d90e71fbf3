"""argparse parser <-> JSON snapshot, both ways. Pure; stdlib only.

`snapshot_parser` is what scripts/sglang_flags.py runs over SGLang's real parsers;
`build_parser` turns a snapshot back into an equivalent `argparse.ArgumentParser`.

Equivalent means: the same option strings, abbreviation rule, arity (`nargs`), choices,
`required`, defaults and type conversion for the types in `_TYPES`. What is NOT reproduced:
- A `type` outside `_TYPES` (SGLang's `parse_cuda_graph_*` parsers): the raw string is kept.
- Custom `argparse.Action` classes ("custom" below): modelled by arity only, as `store`
  (or `store_const` with the recorded `const` when they take no value). Their side effects
  (SGLang's deprecation warnings, `LoRAPathAction`'s JSON split, `--monokernel-backend`
  storing True) are not; the opt-in test against the real package covers those.
- `-h/--help` and `--version` are refused (they print and exit) instead of run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from enum import Enum
from typing import Any, NoReturn

SNAPSHOT_FORMAT = 1
# Action kinds that take no value words (custom actions say so with nargs=0).
_NO_VALUE = frozenset(
    ("store_true", "store_false", "store_const", "append_const", "count", "help", "version")
) | {"boolean_optional"}

# argparse's own action classes, by name (exact class, not subclasses).
_ACTION_KINDS: dict[type[argparse.Action], str] = {
    argparse._StoreAction: "store",
    argparse._StoreConstAction: "store_const",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._AppendAction: "append",
    argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
    argparse._ExtendAction: "extend",
    argparse._HelpAction: "help",
    argparse._VersionAction: "version",
    argparse.BooleanOptionalAction: "boolean_optional",
}


class SglangArgsError(ValueError):
    """A command line the SGLang parser (or our copy of it) refuses. `flag` names the
    offending option when one can be named."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


# ---- parser -> JSON ---------------------------------------------------------------------


def snapshot_parser(parser: argparse.ArgumentParser, **meta: Any) -> dict[str, Any]:
    """A deterministic JSON document describing every action of `parser`, in order.
    `meta` (package, version, source, ...) is stored alongside."""
    if parser._mutually_exclusive_groups:
        raise ValueError("mutually exclusive groups are not supported by the snapshot")
    positional = [a.dest for a in parser._actions if not a.option_strings]
    if positional:
        raise ValueError(f"positional arguments are not supported by the snapshot: {positional}")
    return {
        "format": SNAPSHOT_FORMAT,
        **meta,
        "parser": {"allow_abbrev": parser.allow_abbrev, "prefix_chars": parser.prefix_chars},
        "actions": [_snapshot_action(action) for action in parser._actions],
    }


def _snapshot_action(action: argparse.Action) -> dict[str, Any]:
    kind = _ACTION_KINDS.get(type(action), "custom")
    entry: dict[str, Any] = {
        "option_strings": list(action.option_strings),
        "dest": action.dest,
        "action": kind,
        "type": type_name(action.type),
        "nargs": action.nargs,
        "choices": _snapshot_choices(action.choices),
        "const": _plain(action.const, f"{action.dest}.const"),
        "required": action.required,
    }
    if kind == "custom":
        entry["action_class"] = type(action).__name__
    if _is_json(action.default):
        entry["default"] = action.default
    else:
        entry["default"] = None
        entry["default_repr"] = repr(action.default)
    return entry


def type_name(fn: object) -> str | None:
    """The snapshot's name for an argparse `type=` callable: str/int/float/json, else the
    function's own name (e.g. `human_readable_int`)."""
    if fn is None:
        return None
    for ours, converter in _TYPES.items():  # a rebuilt parser's converters name themselves
        if fn is converter:
            return ours
    name = getattr(fn, "__name__", type(fn).__name__)
    if name == "loads" and getattr(fn, "__module__", "").split(".")[0] in ("json", "orjson"):
        return "json"
    return str(name)


def _snapshot_choices(choices: Any) -> list[Any] | None:
    """Sorted: argparse only tests membership, and some upstream lists come from sets or a
    Rust hash map (the router's `--tool-call-parser`), whose order changes run to run."""
    if choices is None:
        return None
    return sorted((_plain(c, "choice") for c in choices), key=lambda v: (type(v).__name__, v))


def _plain(value: Any, what: str) -> Any:
    """A JSON scalar for a choice or const; loud failure instead of a lossy snapshot."""
    if isinstance(value, Enum):
        value = value.value
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"{what}: {value!r} has no JSON form in the snapshot")


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | str):
        return not isinstance(value, Enum)
    if isinstance(value, float):
        return math.isfinite(value)
    if type(value) is list:
        return all(_is_json(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


# ---- JSON -> parser ---------------------------------------------------------------------


class SnapshotParser(argparse.ArgumentParser):
    """An ArgumentParser that raises `SglangArgsError` instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise SglangArgsError(f"{self.prog}: {message}", flag=_flag_in(message))


class _Refuse(argparse.Action):
    """Stands in for actions that print and exit (help, version)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        raise SglangArgsError(f"{parser.prog}: {option} prints and exits; refused", flag=option)


def human_readable_int(value: str) -> int:
    """SGLang's `human_readable_int`: an integer, or a number with an SI suffix (k, M, G, T;
    decimals allowed) or an IEC suffix (Ki, Mi, Gi, Ti; integers only). Case-sensitive."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer value: {value!r}") from None
    number, suffix = match.groups()
    if suffix.endswith("i"):
        if "." in number:
            raise argparse.ArgumentTypeError(f"no decimals with IEC suffix {suffix!r}")
        return int(number) << (10 * ("KMGT".index(suffix[0]) + 1))
    return int(Decimal(number) * 10 ** (3 * ("kMGT".index(suffix) + 1)))


def nullable_str(value: str) -> str | None:
    """SGLang's `nullable_str`: "" and "None" mean None."""
    return None if not value or value == "None" else value


def json_value(value: str) -> Any:
    """`json.loads` as an argparse type."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"invalid JSON: {err}") from None


def json_list_type(value: str) -> Any:
    """SGLang's `json_list_type`: any JSON (despite the name, a list is not enforced)."""
    return json_value(value)


# Type names the rebuilt parser converts like SGLang does; any other name keeps the string.
_TYPES: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "json": json_value,
    "json_list_type": json_list_type,
    "human_readable_int": human_readable_int,
    "nullable_str": nullable_str,
}


def type_is_checked(name: str | None) -> bool:
    """Whether the rebuilt parser converts/validates values of this type like SGLang."""
    return name is None or name in _TYPES


def build_parser(snapshot: Mapping[str, Any], prog: str) -> SnapshotParser:
    """An ArgumentParser equivalent to the one `snapshot` was taken from (module doc)."""
    parser = _empty_parser(snapshot, prog)
    for entry in snapshot["actions"]:
        _add_action(parser, entry)
    return parser


class _Record(argparse.Action):
    """Appends (option, raw value words) to `namespace.uses` instead of storing."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        words = () if values is None else (values,) if isinstance(values, str) else values
        namespace.uses.append((option, tuple(words)))


def build_recorder(snapshot: Mapping[str, Any], prog: str) -> SnapshotParser:
    """A parser with the snapshot's option strings, abbreviation rule and arities whose
    actions only record what they see: `parse_args(argv, Namespace(uses=[]))` leaves the
    (option, raw words) pairs in order, split exactly as the real parser splits them."""
    parser = _empty_parser(snapshot, prog)
    for entry in snapshot["actions"]:
        nargs = 0 if entry["action"] in _NO_VALUE else entry["nargs"]
        parser.add_argument(
            *entry["option_strings"], action=_Record, nargs=nargs, dest=argparse.SUPPRESS
        )
    return parser


def _empty_parser(snapshot: Mapping[str, Any], prog: str) -> SnapshotParser:
    settings = snapshot["parser"]
    return SnapshotParser(
        prog=prog,
        add_help=False,
        allow_abbrev=settings["allow_abbrev"],
        prefix_chars=settings["prefix_chars"],
        exit_on_error=False,
    )


def _add_action(parser: argparse.ArgumentParser, entry: Mapping[str, Any]) -> None:
    kind: str = entry["action"]
    options: list[str] = entry["option_strings"]
    common: dict[str, Any] = {"dest": entry["dest"], "default": entry["default"]}
    if kind in ("help", "version"):
        parser.add_argument(*options, action=_Refuse, nargs=0, dest=argparse.SUPPRESS)
    elif kind in ("store_true", "store_false", "count"):
        parser.add_argument(*options, action=kind, required=entry["required"], **common)
    elif kind in ("store_const", "append_const") or (kind == "custom" and entry["nargs"] == 0):
        action = "append_const" if kind == "append_const" else "store_const"
        parser.add_argument(*options, action=action, const=entry["const"], **common)
    elif kind == "boolean_optional":  # argparse adds the --no- spellings itself
        positive = [o for o in options if not (o.startswith("--no-") and f"--{o[5:]}" in options)]
        parser.add_argument(*positive, action=argparse.BooleanOptionalAction, **common)
    elif kind in ("store", "append", "extend", "custom"):
        valued: dict[str, Any] = {
            "nargs": entry["nargs"],
            "choices": entry["choices"],
            "required": entry["required"],
            "type": None if entry["type"] is None else _TYPES.get(entry["type"], str),
        }
        if entry["nargs"] == "?":
            valued["const"] = entry["const"]
        action = kind if kind in ("append", "extend") else "store"
        parser.add_argument(*options, action=action, **valued, **common)
    else:
        raise ValueError(f"snapshot action {options}: unknown kind {kind!r}")


def _flag_in(message: str) -> str | None:
    """The first option-looking word of an argparse error message."""
    match = re.search(r"(?<![\w-])(--?[A-Za-z][\w-]*)", message)
    return match.group(1) if match else None
