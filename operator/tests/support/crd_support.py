"""Offline stand-in for the API server's CRD checks, shared by test_crd_*.py, test_chart_*.py,
test_samples.py and the live tests (`admit`, the admission hook of the fake API server).

What it does, as the API server would: structural defaulting, OpenAPI validation (jsonschema
Draft 4, the dialect closest to the CRD's OpenAPI v3 subset, plus `x-kubernetes-int-or-string`),
unknown-field detection (what `kubectl --validate=strict` rejects and the server otherwise prunes),
and evaluation of every `x-kubernetes-validations` rule with a small CEL interpreter.

NOTE: the interpreter covers only the CEL subset our rules use (field access, has(), ! && || ?:,
comparisons, `in`, size/contains/startsWith/matches, literals) with CEL's typing for those: int
and double never compare with each other (a `type: number` field is a double, so rules must
write `0.0`), a missing field is an error, and || / && absorb errors the CEL way. It does not
run the API server's type checker or cost estimator; a rule outside the subset fails the tests
instead of being skipped. Only a real cluster (e2e/) checks those.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from repo_paths import CRD_FILE, SAMPLES, SHARED_EXAMPLES
from support import list_types
from support.fake_apiserver import AdmissionError

EXAMPLE = SHARED_EXAMPLES / "dsv4deployment-tiny.yaml"  # the design's example CR

Schema = dict[str, Any]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def crd_schema(crd: dict[str, Any] | None = None) -> Schema:
    crd = crd if crd is not None else load_yaml(CRD_FILE)
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    schema: Schema = version["schema"]["openAPIV3Schema"]
    return schema


def valid_samples() -> list[Path]:
    return sorted(SAMPLES.glob("*.yaml"))


def invalid_samples() -> list[Path]:
    return sorted((SAMPLES / "invalid").glob("*.yaml"))


def pod_security_samples() -> list[Path]:
    """CRs whose podTemplate breaks the Pod Security Standards (refused by the CRD's rules at
    restricted, and by the operator at the level their `# refused at:` line names)."""
    return sorted((SAMPLES / "pod-security").glob("*.yaml"))


def expected_path(path: Path, tag: str = "expect") -> str:
    """The `# <tag>: <value>` line of a sample (`expect`: the field its refusal names)."""
    for line in path.read_text().splitlines():
        if line.startswith(f"# {tag}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{path.name}: no '# {tag}: ...' comment")


# ---------------------------------------------------------------------------------------------
# Schema walking: defaults, unknown fields, CEL values


def _prop_schema(schema: Schema, key: str) -> Schema | None:
    props = schema.get("properties", {})
    if key in props:
        return props[key]  # type: ignore[no-any-return]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting: a missing property with a `default` gets it, then recurse."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: Schema, value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            sub = _prop_schema(schema, key)
            if sub is not None:
                _default_in_place(sub, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(schema["items"], item)


def unknown_fields(schema: Schema, value: Any, path: str = "") -> list[str]:
    """Paths the API server would prune (and `kubectl --validate=strict` reject)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return []
    out: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, item in value.items():
            sub = _prop_schema(schema, key)
            if path == "" and key in ("apiVersion", "kind", "metadata"):
                continue  # always kept at the root, whatever the schema says
            if sub is None:
                out.append(f"{path}.{key}")
            else:
                out.extend(unknown_fields(sub, item, f"{path}.{key}"))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out.extend(unknown_fields(schema["items"], item, f"{path}[{i}]"))
    return [p.lstrip(".") for p in out]


def prune_unknown(schema: Schema, value: Any, path: str = "") -> Any:
    """The value without the fields `unknown_fields` lists (what the API server stores)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return value
    if isinstance(value, dict) and schema.get("type") == "object":
        out = {}
        for key, item in value.items():
            sub = _prop_schema(schema, key)
            if path == "" and key in ("apiVersion", "kind", "metadata"):
                out[key] = item
            elif sub is not None:
                out[key] = prune_unknown(sub, item, f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_unknown(schema["items"], item, f"{path}[]") for item in value]
    return value


def to_cel(schema: Schema, value: Any) -> Any:
    """The value as CEL sees it: `type: number` fields are doubles even when written as 0."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            sub = _prop_schema(schema, key)
            out[key] = to_cel(sub, item) if sub is not None else item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [to_cel(schema["items"], item) for item in value]
    return value


def rule_sites(schema: Schema, value: Any, path: str = "") -> Iterator[tuple[Schema, Any, str]]:
    """Every (schema node with CEL rules, value there, path) present in `value`."""
    if schema.get("x-kubernetes-validations"):
        yield schema, value, path.lstrip(".")
    if isinstance(value, dict):
        for key, item in value.items():
            sub = _prop_schema(schema, key)
            if sub is not None:
                yield from rule_sites(sub, item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from rule_sites(schema["items"], item, f"{path}[{i}]")


def all_rules(schema: Schema, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every CEL rule in the schema with the schema path it sits on."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path.lstrip("."), rule
    for key, sub in schema.get("properties", {}).items():
        yield from all_rules(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from all_rules(schema[key], f"{path}.{key}")


# ---------------------------------------------------------------------------------------------
# Validation the way the API server reports it: "<field path>: <message>"


def _int_or_string(validator: Any, enabled: Any, instance: Any, schema: Schema) -> Iterator[Any]:
    if enabled and (isinstance(instance, bool) or not isinstance(instance, int | str)):
        yield jsonschema.ValidationError(f"{instance!r} must be an integer or a string")


_Validator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-int-or-string": _int_or_string}
)


def _format_path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def schema_errors(schema: Schema, obj: Any) -> list[str]:
    """OpenAPI (jsonschema) errors; `required` errors name the missing field itself."""
    out = []
    for err in _Validator(schema).iter_errors(obj):
        path = _format_path(err.absolute_path)
        if err.validator == "required":
            missing = re.match(r"'([^']+)' is a required property", err.message)
            if missing:
                path = f"{path}.{missing.group(1)}".lstrip(".")
        out.append(f"{path}: {err.message}")
    return out


def cel_errors(schema: Schema, obj: Any) -> list[str]:
    out = []
    for node, value, path in rule_sites(schema, obj):
        for rule in node["x-kubernetes-validations"]:
            where = (path + rule.get("fieldPath", "")).lstrip(".")
            try:
                ok = evaluate(rule["rule"], to_cel(node, value))
            except CelError as exc:
                out.append(f"{where}: rule {rule['rule']!r} failed to evaluate: {exc}")
                continue
            if ok is not True:
                out.append(f"{where}: Invalid value: {rule.get('message', rule['rule'])}")
    return out


def validate_cr(obj: dict[str, Any], schema: Schema | None = None) -> list[str]:
    """Everything the API server (with kubectl's strict field validation) would report."""
    schema = schema if schema is not None else crd_schema()
    obj = apply_defaults(schema, obj)
    errors = schema_errors(schema, obj)
    errors += [f"{p}: unknown field" for p in unknown_fields(schema, obj)]
    errors += cel_errors(schema, obj)
    errors += list_types.duplicates(schema, obj)
    return errors


def admit(obj: dict[str, Any], schema: Schema | None = None) -> dict[str, Any]:
    """The API server's part for the CRD, as an admission hook of the fake API server:
    default, prune unknown fields, then validate (schema, CEL rules, unique set items and
    map-list keys) or refuse."""
    schema = schema if schema is not None else crd_schema()
    obj = prune_unknown(schema, apply_defaults(schema, obj))
    errors = schema_errors(schema, obj) + cel_errors(schema, obj)
    errors += list_types.duplicates(schema, obj)
    if errors:
        raise AdmissionError(errors)
    return obj


# ---------------------------------------------------------------------------------------------
# The CEL subset: tokenizer, recursive-descent parser to tuples, evaluator


class CelError(Exception):
    """An evaluation error (no such key, no matching overload); the rule then fails."""


_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d+|\d+)|(?P<str>'[^']*'|\"[^\"]*\")|(?P<id>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>&&|\|\||==|!=|<=|>=|[<>!?:().,\[\]]))"
)


def _tokenize(text: str) -> list[tuple[str, Any]]:
    tokens: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise SyntaxError(f"outside the supported CEL subset at {text[pos:]!r}")
        pos = m.end()
        if m["num"]:
            tokens.append(("lit", float(m["num"]) if "." in m["num"] else int(m["num"])))
        elif m["str"]:
            tokens.append(("lit", m["str"][1:-1]))
        elif m["id"] in ("true", "false"):
            tokens.append(("lit", m["id"] == "true"))
        elif m["id"] == "in":
            tokens.append(("op", "in"))
        elif m["id"]:
            tokens.append(("id", m["id"]))
        else:
            tokens.append(("op", m["op"]))
    return tokens


@dataclass
class _Parser:
    tokens: list[tuple[str, Any]]
    pos: int = 0

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, Any]:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise SyntaxError(f"expected {value!r}, got {tok!r}")
        self.pos += 1
        return tok

    def accept(self, *values: str) -> str | None:
        tok = self.peek()
        if tok is not None and tok[0] == "op" and tok[1] in values:
            self.pos += 1
            return str(tok[1])
        return None

    def expr(self) -> Any:
        cond = self.binary(0)
        if self.accept("?"):
            yes = self.expr()
            self.take(":")
            return ("?:", cond, yes, self.expr())
        return cond

    _LEVELS = (("||",), ("&&",), ("==", "!=", "<", "<=", ">", ">=", "in"))

    def binary(self, level: int) -> Any:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while op := self.accept(*self._LEVELS[level]):
            left = (op, left, self.binary(level + 1))
        return left

    def unary(self) -> Any:
        if self.accept("!"):
            return ("!", self.unary())
        return self.member()

    def member(self) -> Any:
        node = self.primary()
        while self.accept("."):
            _, name = self.take()
            if self.accept("("):
                args = self.args()
                node = ("call", name, node, args)
            else:
                node = ("field", node, name)
        return node

    def args(self) -> list[Any]:
        args: list[Any] = []
        while not self.accept(")"):
            args.append(self.expr())
            self.accept(",")
        return args

    def primary(self) -> Any:
        kind, value = self.take()
        if kind == "lit":
            return ("lit", value)
        if kind == "op" and value == "(":
            inner = self.expr()
            self.take(")")
            return inner
        if kind == "id" and value == "has":
            self.take("(")
            (arg,) = self.args()
            if arg[0] != "field":
                raise SyntaxError("has() takes a field selection")
            return ("has", arg[1], arg[2])
        if kind == "id" and value == "self":
            return ("self",)
        raise SyntaxError(f"unsupported token {value!r}")


def parse(rule: str) -> Any:
    parser = _Parser(_tokenize(rule))
    tree = parser.expr()
    if parser.peek() is not None:
        raise SyntaxError(f"trailing tokens in {rule!r}")
    return tree


def _same_type(a: Any, b: Any) -> None:
    def kind(x: Any) -> str:
        return "bool" if isinstance(x, bool) else type(x).__name__

    if kind(a) != kind(b):
        raise CelError(f"no matching overload for {kind(a)} and {kind(b)}")


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"expected bool, got {value!r}")
    return value


def _eval(node: Any, this: Any) -> Any:
    op = node[0]
    if op == "lit":
        return node[1]
    if op == "self":
        return this
    if op == "field":
        obj = _eval(node[1], this)
        if not isinstance(obj, dict) or node[2] not in obj:
            raise CelError(f"no such key: {node[2]}")
        return obj[node[2]]
    if op == "has":
        obj = _eval(node[1], this)
        if not isinstance(obj, dict):
            raise CelError("has() on a non-object")
        return node[2] in obj
    if op == "!":
        return not _bool(_eval(node[1], this))
    if op in ("||", "&&"):
        short = op == "||"
        try:
            left: Any = _bool(_eval(node[1], this))
        except CelError as exc:
            left = exc
        if left is short:
            return short
        right = _bool(_eval(node[2], this))
        if right is short:
            return short
        if isinstance(left, CelError):
            raise left
        return not short
    if op == "?:":
        return _eval(node[2] if _bool(_eval(node[1], this)) else node[3], this)
    if op == "call":
        return _call(node[1], _eval(node[2], this), [_eval(a, this) for a in node[3]])
    a, b = _eval(node[1], this), _eval(node[2], this)
    if op == "in":
        if not isinstance(b, dict | list):
            raise CelError("'in' needs a map or a list")
        return a in b
    _same_type(a, b)
    if op in ("==", "!="):
        return (a == b) == (op == "==")
    if isinstance(a, dict | list | bool):
        raise CelError(f"no ordering for {type(a).__name__}")
    return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


def _call(name: str, target: Any, args: list[Any]) -> Any:
    if name == "size" and not args and isinstance(target, str | list | dict):
        return len(target)
    if name in ("contains", "startsWith", "matches") and isinstance(target, str):
        (arg,) = args
        if not isinstance(arg, str):
            raise CelError(f"{name}() takes a string")
        if name == "matches":  # RE2 semantics: a match anywhere unless anchored
            return re.search(arg, target) is not None
        return arg in target if name == "contains" else target.startswith(arg)
    raise CelError(f"unsupported call {name}() on {type(target).__name__}")


def evaluate(rule: str, this: Any) -> Any:
    return _eval(parse(rule), this)


_ADMISSION_VARIABLES = re.compile(r"\b(object|oldObject|request)\b")


def admission_match(
    conditions: Iterable[Mapping[str, str]],
) -> Callable[[dict[str, Any]], bool]:
    """A webhook's `matchConditions` as a predicate on an AdmissionReview's request: each CEL
    expression (this module's subset) over `object`, `oldObject` and `request` must hold."""
    trees = [parse(_ADMISSION_VARIABLES.sub(r"self.\1", c["expression"])) for c in conditions]

    def matches(request: dict[str, Any]) -> bool:
        scope = {"object": request.get("object"), "oldObject": request.get("oldObject")}
        scope["request"] = request
        return all(_bool(_eval(tree, scope)) for tree in trees)

    return matches


def crd_admission(crd: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """`admit` for the custom resources of `crd` (its storage version's schema): the fake API
    server's `crd_admission`, so a CRD created over HTTP validates its objects."""
    schema = crd_schema(crd)
    return lambda obj: admit(obj, schema)
