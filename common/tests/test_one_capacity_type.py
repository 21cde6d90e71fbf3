"""The capacity quadruple is declared once (#27 item 3): `RankCapacity`. Every record that
carries it (the rank plan, the rank config, /status, the router's and the operator's records)
embeds that type instead of restating its four fields."""

from __future__ import annotations

import ast
from dataclasses import fields

from repo_paths import ROOT

from dsv4_common.api import RankCapacity

QUADRUPLE = frozenset(f.name for f in fields(RankCapacity))
PACKAGES = (
    "common/dsv4_common",
    "worker/dsv4_worker",
    "router/dsv4_router",
    "operator/dsv4_operator",
    "local/dsv4_local",
)


def _declared_fields(cls: ast.ClassDef) -> set[str]:
    return {
        stmt.target.id
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def classes_declaring_the_quadruple() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and QUADRUPLE.issubset(_declared_fields(node)):
                    found.append(f"{path.relative_to(ROOT)}:{node.name}")
    return found


def test_only_rank_capacity_declares_the_quadruple() -> None:
    assert classes_declaring_the_quadruple() == ["common/dsv4_common/core/capacity.py:RankCapacity"]
