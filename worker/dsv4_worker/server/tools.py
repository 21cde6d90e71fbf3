"""The tool fields of a chat request: `tools` (or the legacy `functions`), `tool_choice` (or
`function_call`) and `parallel_tool_calls`, parsed into a `ToolSpec` per tool and a
`ToolChoice`. Pure.

    tool_choice          what happens
    "none"               the tools are not shown to the model; a call it writes anyway is
                         dropped (never content)
    "auto" (default)     the tools are in the prompt; the model calls any, or none
    "required"           the reply is one or more calls (a grammar makes it so)
    {"type": "function", exactly one call of that tool (a grammar makes it so)
     "function": {"name"}}
    parallel_tool_calls  false: at most one call per reply (auto keeps the first; the
                         grammar of required allows one)

Tool names follow OpenAI's rule (1-64 of a-z A-Z 0-9 _ -); `parameters` must be a JSON
object (a JSON schema). The tool as the client sent it (`function`) is what the prompt shows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dsv4_worker.server.fields import RequestError, boolean, json_type

ChoiceMode = Literal["none", "auto", "required", "named"]
NAME_RULE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_CHOICE = (None, "none", "auto")
_TOOL_FIELDS = frozenset({"type", "function"})
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    function: Mapping[str, Any]  # as sent: {"name", "description", "parameters", ...}

    @property
    def parameters(self) -> Mapping[str, Any]:
        params = self.function.get("parameters")
        return params if isinstance(params, dict) else {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ChoiceMode = "auto"
    name: str | None = None  # mode "named"
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """The reply must be calls (a grammar enforces it)."""
        return self.mode in ("required", "named")


@dataclass(frozen=True, slots=True)
class Tools:
    specs: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice()
    key: str = "tools"  # the field they came in (errors name it): tools or functions

    @property
    def shown(self) -> tuple[ToolSpec, ...]:
        """The tools the prompt shows the model."""
        return () if self.choice.mode == "none" else self.specs

    @property
    def callable(self) -> frozenset[str]:
        """The names a reply's calls may have (others are dropped)."""
        if self.choice.mode == "none":
            return frozenset()
        if self.choice.mode == "named":
            return frozenset({self.choice.name or ""})
        return frozenset(s.name for s in self.specs)


def parse_tools(obj: Mapping[str, object]) -> Tools:
    if obj.get("tools") and obj.get("functions"):
        raise RequestError("functions", "give tools or functions (their legacy name), not both")
    legacy = bool(obj.get("functions")) or (
        not obj.get("tools") and obj.get("function_call") not in _NO_CHOICE
    )
    key, choice_key = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    other = "tool_choice" if legacy else "function_call"
    if obj.get(other) not in _NO_CHOICE:
        raise RequestError(other, f"give {choice_key} with {key}")
    specs = _specs(obj.get(key), key, legacy)
    parallel = boolean(obj, "parallel_tool_calls", True)
    choice = _choice(obj.get(choice_key), choice_key, specs, parallel, legacy)
    return Tools(specs, choice, key)


def _specs(value: object, key: str, legacy: bool) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError(key, f"must be a list, not {json_type(value)}")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(value):
        at = f"{key}[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(at, f"must be an object, not {json_type(tool)}")
        if legacy:
            function: object = tool
        else:
            unknown = sorted(str(k) for k in tool if k not in _TOOL_FIELDS)
            if unknown:
                raise RequestError(f"{at}.{unknown[0]}", "unknown field; allowed: type, function")
            if tool.get("type") != "function":
                got = tool.get("type")
                raise RequestError(
                    f"{at}.type", f'must be "function" (the only tool type served), got {got!r}'
                )
            function = tool.get("function")
            at = f"{at}.function"
        specs.append(_spec(at, function))
    names = [s.name for s in specs]
    for name in names:
        if names.count(name) > 1:
            raise RequestError(key, f"the tool name {name!r} is given twice")
    return tuple(specs)


def _spec(at: str, function: object) -> ToolSpec:
    if not isinstance(function, dict):
        raise RequestError(at, f"must be an object, not {json_type(function)}")
    unknown = sorted(str(k) for k in function if k not in _FUNCTION_FIELDS)
    if unknown:
        raise RequestError(
            f"{at}.{unknown[0]}", f"unknown field; allowed: {', '.join(sorted(_FUNCTION_FIELDS))}"
        )
    name = function.get("name")
    if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
        raise RequestError(f"{at}.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{at}.description", f"must be a string, not {json_type(description)}")
    params = function.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(
            f"{at}.parameters", f"must be a JSON schema object, not {json_type(params)}"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{at}.strict", f"must be a boolean, not {json_type(strict)}")
    return ToolSpec(name, function)


def _choice(
    value: object, key: str, specs: tuple[ToolSpec, ...], parallel: bool, legacy: bool
) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto", parallel=parallel)
    if value == "none":
        return ToolChoice("none", parallel=parallel)
    if value == "required" and not legacy:
        if not specs:
            raise RequestError(key, '"required" needs tools')
        return ToolChoice("required", parallel=parallel)
    if isinstance(value, dict):
        name = value.get("name") if legacy else _named(value, key)
        if not isinstance(name, str):
            raise RequestError(f"{key}.name", "must be a string")
        if name not in {s.name for s in specs}:
            raise RequestError(key, f"names {name!r}, which is not one of the tools")
        return ToolChoice("named", name, parallel=False)
    allowed = '"none", "auto"' + ("" if legacy else ', "required"')
    raise RequestError(key, f"must be {allowed} or a named function, got {value!r}")


def _named(value: Mapping[str, object], key: str) -> object:
    if value.get("type") != "function":
        raise RequestError(f"{key}.type", 'must be "function"')
    function = value.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{key}.function", f"must be an object, not {json_type(function)}")
    return function.get("name")
