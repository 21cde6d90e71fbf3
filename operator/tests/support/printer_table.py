"""The API server's Table answer for custom resources: what `kubectl get` asks for (`Accept:
application/json;as=Table;v=v1;g=meta.k8s.io`) and prints. As apiextensions-apiserver's
tableconvertor builds it: a Name column, then the served version's additionalPrinterColumns in
order, each cell read from the object with the column's JSONPath (a field that is not there is
an empty cell; several matches are joined with ","; a `date` is shown as an age, "5m"), each
row carrying the object's metadata (`includeObject`: Metadata, the default; Object; None).

The JSONPath subset the CRDs here use: dotted fields and `[?(@.field=="value")]` filters over a
list. Another form raises ValueError: the fake must not answer what it cannot read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

Obj = dict[str, Any]

_STEP = re.compile(r'\.([A-Za-z0-9_-]+)(?:\[\?\(@\.([A-Za-z0-9_-]+)=="([^"]*)"\)\])?')


def wants_table(accept: str) -> bool:
    """The client asked for a meta.k8s.io Table first (kubectl get)."""
    first = accept.split(",")[0]
    return "as=Table" in first and "g=meta.k8s.io" in first


def printer_columns(crd: Mapping[str, Any], version: str) -> list[Obj]:
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return list(served.get("additionalPrinterColumns") or [])
    return []


def table(
    columns: Sequence[Mapping[str, Any]],
    objects: Sequence[Mapping[str, Any]],
    *,
    include_object: str = "Metadata",
    now: datetime | None = None,
) -> Obj:
    now = now or datetime.now(UTC)
    definitions = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "description": "Name must be unique within a namespace.",
            "priority": 0,
        }
    ]
    for c in columns:
        definitions.append(
            {
                "name": c["name"],
                "type": c["type"],
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
        )
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        cells += [_cell(c, obj, now) for c in columns]
        row: Obj = {"cells": cells}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {},
        "columnDefinitions": definitions,
        "rows": rows,
    }


def _cell(column: Mapping[str, Any], obj: Mapping[str, Any], now: datetime) -> Any:
    values = list(_select(obj, column["jsonPath"]))
    if not values:
        return None
    if column["type"] == "date" and isinstance(values[0], str):
        return human_age(now - datetime.fromisoformat(values[0].replace("Z", "+00:00")))
    if len(values) == 1:
        return values[0]
    return ",".join(str(v) for v in values)


def _select(obj: Mapping[str, Any], path: str) -> Iterator[Any]:
    steps = list(_STEP.finditer(path))
    if not steps or "".join(m.group(0) for m in steps) != path:
        raise ValueError(f'JSONPath {path!r}: the fake API server reads .a.b and [?(@.k=="v")]')
    nodes: list[Any] = [obj]
    for m in steps:
        field, key, want = m.groups()
        nodes = [n[field] for n in nodes if isinstance(n, Mapping) and field in n]
        if key is not None:
            nodes = [
                item
                for n in nodes
                if isinstance(n, list)
                for item in n
                if isinstance(item, Mapping) and str(item.get(key)) == want
            ]
    yield from nodes


def human_age(elapsed: timedelta) -> str:
    """An age as k8s.io/apimachinery's HumanDuration writes it (the server's date cells)."""
    seconds = int(elapsed.total_seconds())
    if seconds < -1:
        return "<invalid>"
    if seconds < 120:
        return f"{max(seconds, 0)}s"
    minutes, hours = seconds // 60, seconds // 3600
    if minutes < 10:
        return _two(minutes, "m", seconds % 60, "s")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return _two(hours, "h", minutes % 60, "m")
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return _two(days, "d", hours % 24, "h")
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return _two(days // 365, "y", days % 365, "d")
    return f"{days // 365}y"


def _two(big: int, big_unit: str, small: int, small_unit: str) -> str:
    return f"{big}{big_unit}{small}{small_unit}" if small else f"{big}{big_unit}"
