"""The operator's own configuration (frozen), read once from its environment at start-up
(`settings.on_startup`) and kept in kopf's memo. Pure.

Environment (set by the Helm chart):
  DSV4_WORKER_IMAGE   default worker image when a CR sets no spec.image
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from dsv4_operator.workloads import DEFAULT_WORKER_IMAGE


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    default_image: str = DEFAULT_WORKER_IMAGE

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        return cls(default_image=env.get("DSV4_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE)


DEFAULT_CONFIG: Final = OperatorConfig()
