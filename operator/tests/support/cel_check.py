"""Type-checking of `x-kubernetes-validations` rules at CRD creation, as the API server compiles
them (apiextensions-apiserver pkg/apiserver/schema/cel/compilation.go, Compile), for the CEL
subset that support/crd_support.py parses and evaluates; pure.

`self` has the type of the schema node the rule sits on (k8s.io/apiserver pkg/cel/common/
schemas.go, SchemaDeclType): integer -> int, number -> double, boolean -> bool, string ->
string (format byte -> bytes, duration -> duration, date and date-time -> timestamp),
x-kubernetes-int-or-string -> dyn, an array -> list(items), an object with
additionalProperties -> map(string, values), else an object of its declared properties
(x-kubernetes-preserve-unknown-fields exposes no undeclared field; a property without a type is
not exposed). The root, and an x-kubernetes-embedded-resource, also get apiVersion, kind and a
metadata of name and generateName only (WithTypeAndObjectMeta).

What is refused, with cel-go's wording: a field the type does not declare ("undefined field"),
`has()` on a value that is not an object or map, operands no overload takes (`==` needs the same
type on both sides: cel-go's checker has no int == double; `&&`, `||`, `!`, `?:` need bools),
`in` with an element of the wrong type, a function on a receiver or argument it does not take,
a `matches()` pattern that is not RE2 (cel.ValidateRegexLiterals, 1.29+), and a rule whose
result is not bool ("cel expression must evaluate to a bool"). Anything outside the subset
(oldSelf, macros, list literals, other functions, comparisons that mix int and double, which
only 1.28+ servers accept) is refused too, saying so: a rule is either checked or refused here,
never waved through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

Schema = Mapping[str, Any]

_SCALARS: Final = ("int", "double", "string", "bool", "bytes", "timestamp", "duration")
_ORDERED: Final = ("int", "double", "string", "bytes", "timestamp", "duration")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# CEL's reserved words: a property so named is only reachable escaped (`__namespace__`).
_RESERVED: Final = frozenset(
    ("true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
     "function", "if", "import", "let", "loop", "package", "namespace", "return", "var")
)  # fmt: skip


class CelTypeError(Exception):
    """The rule does not compile; the message is what the API server reports after
    `compilation failed: `."""


@dataclass(frozen=True)
class CelType:
    kind: str  # a scalar, "dyn", "list", "map" or "object"
    elem: CelType | None = None  # list items, map values
    fields: tuple[tuple[str, CelType], ...] = ()  # object properties

    def field(self, name: str) -> CelType | None:
        return dict(self.fields).get(name)

    def __str__(self) -> str:
        if self.kind == "list":
            return f"list({self.elem})"
        if self.kind == "map":
            return f"map(string, {self.elem})"
        return self.kind


DYN: Final = CelType("dyn")
BOOL: Final = CelType("bool")
INT: Final = CelType("int")
STRING: Final = CelType("string")
_STRING_FORMATS: Final = {
    "byte": "bytes",
    "duration": "duration",
    "date": "timestamp",
    "date-time": "timestamp",
}
_META: Final = CelType("object", fields=(("generateName", STRING), ("name", STRING)))


def schema_type(schema: Schema, resource_root: bool = False) -> CelType | None:
    """The CEL type of a schema node (None: not exposed to rules)."""
    if schema.get("x-kubernetes-int-or-string"):
        return DYN
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, Mapping):
            return None
        item = schema_type(items, bool(items.get("x-kubernetes-embedded-resource")))
        return CelType("list", item) if item is not None else None
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            value = schema_type(extra, bool(extra.get("x-kubernetes-embedded-resource")))
            return CelType("map", value) if value is not None else None
        fields: dict[str, CelType] = {}
        for name, prop in (schema.get("properties") or {}).items():
            typed = schema_type(prop, bool(prop.get("x-kubernetes-embedded-resource")))
            if typed is not None and _IDENTIFIER.match(name) and name not in _RESERVED:
                fields[name] = typed
        if resource_root:
            fields.update(apiVersion=STRING, kind=STRING, metadata=_META)
        return CelType("object", fields=tuple(sorted(fields.items())))
    if kind == "string":
        return CelType(_STRING_FORMATS.get(str(schema.get("format", "")), "string"))
    return {"boolean": BOOL, "number": CelType("double"), "integer": INT}.get(str(kind))


def compile_error(rule: str, schema: Schema, resource_root: bool) -> str | None:
    """Why the API server would refuse to compile `rule` on this schema node, or None."""
    # crd_support imports the fake API server, which imports crd_rules and so this module.
    from support.crd_support import parse

    try:
        tree = parse(rule)
    except (SyntaxError, ValueError) as exc:
        return f"outside the CEL subset the tests check: {exc}"
    self_type = schema_type(schema, resource_root) or DYN
    try:
        check(tree, self_type)
    except CelTypeError as exc:
        return str(exc)
    return None


def check(tree: Any, self_type: CelType) -> None:
    """Raise CelTypeError unless the parsed rule is a bool over `self_type`."""
    result = _type_of(tree, self_type)
    if result != BOOL:
        raise CelTypeError("cel expression must evaluate to a bool")


def _no_overload(name: str, *operands: CelType) -> CelTypeError:
    return CelTypeError(
        f"found no matching overload for '{name}' applied to '({', '.join(map(str, operands))})'"
    )


def _assignable(a: CelType, b: CelType) -> bool:
    """The two may stand for one type parameter (dyn matches anything)."""
    if DYN in (a, b):
        return True
    if a.kind != b.kind:
        return False
    if a.kind in ("list", "map"):
        assert a.elem is not None and b.elem is not None
        return _assignable(a.elem, b.elem)
    return a == b


def _select(target: CelType, name: str) -> CelType:
    if target == DYN:
        return DYN
    if target.kind == "map":
        assert target.elem is not None
        return target.elem
    if target.kind == "object":
        found = target.field(name)
        if found is None:
            raise CelTypeError(f"undefined field '{name}'")
        return found
    raise CelTypeError(f"type '{target}' does not support field selection")


def _type_of(node: Any, this: CelType) -> CelType:
    op = node[0]
    if op == "lit":
        value = node[1]
        if isinstance(value, bool):
            return BOOL
        if isinstance(value, int):
            return INT
        return CelType("double") if isinstance(value, float) else STRING
    if op == "self":
        return this
    if op == "field":
        return _select(_type_of(node[1], this), node[2])
    if op == "has":
        target = _type_of(node[1], this)
        if target.kind not in ("object", "map", "dyn"):
            raise CelTypeError("invalid argument to has() macro")
        _select(target, node[2])
        return BOOL
    if op == "!":
        operand = _type_of(node[1], this)
        if not _assignable(operand, BOOL):
            raise _no_overload("!_", operand)
        return BOOL
    if op == "?:":
        cond, yes, no = (_type_of(n, this) for n in node[1:])
        if not _assignable(cond, BOOL):
            raise _no_overload("_?_:_", cond, yes, no)
        if not _assignable(yes, no):
            raise _no_overload("_?_:_", cond, yes, no)
        return no if yes == DYN else yes
    if op == "call":
        return _call(node[1], _type_of(node[2], this), [_type_of(a, this) for a in node[3]], node)
    left, right = _type_of(node[1], this), _type_of(node[2], this)
    return _binary(op, left, right)


def _binary(op: str, left: CelType, right: CelType) -> CelType:
    name = {"in": "@in"}.get(op, f"_{op}_")
    if op in ("&&", "||"):
        if not (_assignable(left, BOOL) and _assignable(right, BOOL)):
            raise _no_overload(name, left, right)
        return BOOL
    if op == "in":
        if right == DYN:
            return BOOL
        if right.kind == "list" and right.elem is not None and _assignable(left, right.elem):
            return BOOL
        if right.kind == "map" and _assignable(left, STRING):
            return BOOL
        raise _no_overload(name, left, right)
    if op in ("==", "!="):
        if not _assignable(left, right):
            raise _no_overload(name, left, right)
        return BOOL
    # <, <=, >, >=
    if {left.kind, right.kind} == {"int", "double"}:
        raise CelTypeError(
            f"outside the CEL subset the tests check: '{name}' on ({left}, {right}) mixes int "
            "and double (only API servers >= 1.28 accept it); write a double literal (0.0)"
        )
    if left == right == BOOL:
        raise CelTypeError(
            f"outside the CEL subset the tests check: '{name}' on (bool, bool) (CEL orders "
            "bools; the interpreter does not)"
        )
    if DYN in (left, right):
        return BOOL
    if left == right and left.kind in _ORDERED:
        return BOOL
    raise _no_overload(name, left, right)


_RE2_UNSUPPORTED = re.compile(r"\(\?<?[=!]|\\[1-9]")


def _call(name: str, target: CelType, args: list[CelType], node: Any) -> CelType:
    described = f"{target}.({', '.join(map(str, args))})"
    if name == "size":
        if args or target.kind not in ("string", "bytes", "list", "map", "dyn"):
            raise CelTypeError(f"found no matching overload for 'size' applied to '{described}'")
        return INT
    if name in ("contains", "startsWith", "matches"):
        if len(args) != 1 or not (_assignable(target, STRING) and _assignable(args[0], STRING)):
            raise CelTypeError(f"found no matching overload for '{name}' applied to '{described}'")
        pattern = node[3][0]
        if name == "matches" and pattern[0] == "lit":
            _check_regex(str(pattern[1]))
        return BOOL
    raise CelTypeError(f"outside the CEL subset the tests check: the function {name}()")


def _check_regex(pattern: str) -> None:
    """ValidateRegexLiterals: the pattern compiles as RE2 (no lookaround, no backreference)."""
    if _RE2_UNSUPPORTED.search(pattern):
        raise CelTypeError(f"invalid regex: {pattern!r} uses lookaround or backreferences")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise CelTypeError(f"invalid regex: {pattern!r}: {exc}") from exc
