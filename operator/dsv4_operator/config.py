"""The operator's own configuration (frozen), read once from its environment at start-up
(`settings.on_startup`) and kept in kopf's memo. Pure.

Environment (set by the Helm chart):
  DSV4_WORKER_IMAGE   default worker image when a CR sets no spec.image
  DSV4_METRICS_SCRAPE_NAMESPACE  namespace whose pods (Prometheus) each CR's NetworkPolicy
                      lets scrape the workers' metrics port; empty or unset = none
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from dsv4_operator.workloads import DEFAULT_WORKER_IMAGE


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    default_image: str = DEFAULT_WORKER_IMAGE
    metrics_scrape_namespace: str = ""  # "" = no scrape rule in the NetworkPolicy

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        return cls(
            default_image=env.get("DSV4_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE,
            metrics_scrape_namespace=env.get("DSV4_METRICS_SCRAPE_NAMESPACE", ""),
        )


DEFAULT_CONFIG: Final = OperatorConfig()
