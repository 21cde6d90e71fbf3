"""Operator start-up: kopf settings (timeouts, storage of kopf's own records, peering for HA)
and the shared dependencies handlers use, kept in kopf's memo (API client, worker probe,
configuration from env, the reconcile gate).

Environment (set by the Helm chart):
  DSV4_WORKER_IMAGE   default worker image when a CR sets no spec.image
  DSV4_PEERING        kopf peering object name; empty = standalone (a single replica)
  DSV4_PEERING_CLUSTERWIDE  "true" when the operator watches all namespaces
  DSV4_PRIORITY       this replica's peering priority (the highest active replica works)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final

import kopf

from dsv4_operator import labels as L
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.kube_api import ApiKube
from dsv4_operator.probe import HttpWorkerProbe

REQUEST_TIMEOUT_S: Final = 30.0
# Watches that silently stall are a known kopf failure mode: make the server end each watch
# and reconnect well before any proxy or load balancer idles it out.
WATCH_SERVER_TIMEOUT_S: Final = 270
WATCH_CLIENT_TIMEOUT_S: Final = 300


def configure(settings: kopf.OperatorSettings, env: dict[str, str]) -> None:
    """Pure mapping of environment to kopf settings (tested without a cluster)."""
    settings.persistence.finalizer = f"{L.GROUP}/finalizer"
    # Keep kopf's progress and diff-base out of the user-facing status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=L.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=L.GROUP, key="last-handled-configuration"
    )
    # Warnings and errors of the handlers' loggers (a group restarted, a plan failed) become
    # Kubernetes Events on the CR (kopf 1.45 defaults `posting.loggers` to False: none are).
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    settings.networking.request_timeout = REQUEST_TIMEOUT_S
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    peering = env.get("DSV4_PEERING", "")
    settings.peering.standalone = not peering
    if peering:
        settings.peering.name = peering
        settings.peering.mandatory = True
        settings.peering.clusterwide = env.get("DSV4_PEERING_CLUSTERWIDE", "") == "true"
        settings.peering.priority = int(env.get("DSV4_PRIORITY", "0") or 0)


@kopf.on.startup()
def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    env = dict(os.environ)
    configure(settings, env)
    memo["kube"] = ApiKube.from_environment(REQUEST_TIMEOUT_S)
    memo["probe"] = HttpWorkerProbe()
    memo["config"] = OperatorConfig.from_env(env)
    memo["gate"] = ReconcileGate()
