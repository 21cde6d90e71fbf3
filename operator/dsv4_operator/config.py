"""The operator's own configuration (frozen), read once from its environment at start-up
(`settings.on_startup`) and kept in kopf's memo. Pure.

Environment (set by the Helm chart):
  DSV4_WORKER_IMAGE   default worker image when a CR sets no spec.image
  DSV4_METRICS_SCRAPE_NAMESPACE  namespace whose pods (Prometheus) each CR's NetworkPolicy
                      lets scrape the workers' metrics port; empty or unset = none
  DSV4_OPERATOR_NAMESPACE  the operator's own namespace (the downward API): each CR's
                      NetworkPolicies admit the operator's pods from there only
                      (default dsv4-system, the chart's documented one)
  DSV4_POD_SECURITY_LEVEL  the Pod Security Standard a podTemplate's containers and volumes
                      are held to: restricted (default), baseline or privileged
  DSV4_HF_ENDPOINT    the hub (or mirror) hf:// sources use when a CR sets no
                      spec.model.hub.endpoint; empty or unset = HF_ENDPOINT, else huggingface.co
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from dsv4_operator.manifests import DEFAULT_OPERATOR_NAMESPACE
from dsv4_operator.pod_security import DEFAULT_LEVEL, Level, parse_level
from dsv4_operator.workloads import DEFAULT_WORKER_IMAGE


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    default_image: str = DEFAULT_WORKER_IMAGE
    metrics_scrape_namespace: str = ""  # "" = no scrape rule in the NetworkPolicy
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    pod_security: Level = DEFAULT_LEVEL
    hf_endpoint: str | None = None  # None: the hub (HF_ENDPOINT where set)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        """ValueError (naming the variable) for a level that is not one."""
        level = env.get("DSV4_POD_SECURITY_LEVEL") or DEFAULT_LEVEL
        return cls(
            default_image=env.get("DSV4_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE,
            metrics_scrape_namespace=env.get("DSV4_METRICS_SCRAPE_NAMESPACE", ""),
            operator_namespace=env.get("DSV4_OPERATOR_NAMESPACE") or DEFAULT_OPERATOR_NAMESPACE,
            pod_security=parse_level(level, "DSV4_POD_SECURITY_LEVEL"),
            hf_endpoint=env.get("DSV4_HF_ENDPOINT") or env.get("HF_ENDPOINT") or None,
        )


DEFAULT_CONFIG: Final = OperatorConfig()
