"""Operator start-up: kopf settings (timeouts, storage of kopf's own records, peering for HA)
and the shared dependencies handlers use, kept in kopf's memo (API client, worker probe,
configuration from env, the reconcile gate, the operator's metrics and their HTTP server).

Environment (set by the Helm chart):
  DSV4_WORKER_IMAGE   default worker image when a CR sets no spec.image
  DSV4_PEERING        kopf peering object name; empty = standalone (a single replica)
  DSV4_PEERING_CLUSTERWIDE  "true" when the operator watches all namespaces
  DSV4_PRIORITY       this replica's peering priority (the highest active replica works)
  DSV4_NAMESPACED     "true" when the operator serves given namespaces only: kopf then takes
                      them as given and scans no cluster-wide resource (no namespace or CRD
                      list/watch, which its namespaced Roles do not allow)
  DSV4_OPERATOR_METRICS_PORT  serve the operator's Prometheus metrics on this port (/metrics);
                      empty, unset or 0 = not served
  DSV4_OPERATOR_METRICS_HOST  the address to bind (default 0.0.0.0)
  DSV4_WEBHOOK_PORT   serve the validating admission webhook (HTTPS) on this port; empty,
                      unset or 0 = not served (the API server then has no webhook to call)
  DSV4_WEBHOOK_HOST   the address to bind (default 0.0.0.0)
  DSV4_WEBHOOK_CERT_DIR  the mounted serving certificate: tls.crt and tls.key (re-read when
                      they change, e.g. renewed by cert-manager)
  DSV4_EXIT_TIMEOUT_S  kopf's last resort after SIGTERM: it kills the process this long after
                      (default 25, under the pod's 30 s grace; kopf's own is 10 minutes)
(and config.py's variables)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Final

import kopf
from prometheus_client import start_http_server

from dsv4_operator import labels as L
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate
from dsv4_operator.handler_threads import DaemonThreadExecutor
from dsv4_operator.hub import HfHub
from dsv4_operator.kube_api import ApiKube
from dsv4_operator.latency import LatencyTracker
from dsv4_operator.metrics import OperatorMetrics
from dsv4_operator.probe import HttpWorkerProbe

REQUEST_TIMEOUT_S: Final = 30.0
DEFAULT_EXIT_TIMEOUT_S: Final = 25.0
HANDLER_THREADS: Final = 16
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
    # SIGTERM: the handlers' threads never hold the process (`handler_threads`), and past
    # DSV4_EXIT_TIMEOUT_S kopf kills it whatever is still running.
    settings.execution.executor = DaemonThreadExecutor(HANDLER_THREADS)
    exit_timeout_s = float(env.get("DSV4_EXIT_TIMEOUT_S") or DEFAULT_EXIT_TIMEOUT_S)
    settings.process.ultimate_exiting_timeout = exit_timeout_s
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    peering = env.get("DSV4_PEERING", "")
    settings.peering.standalone = not peering
    if peering:
        settings.peering.name = peering
        settings.peering.mandatory = True
        settings.peering.clusterwide = env.get("DSV4_PEERING_CLUSTERWIDE", "") == "true"
        settings.peering.priority = int(env.get("DSV4_PRIORITY", "0") or 0)
    # kopf otherwise lists and watches every namespace (403 under namespaced Roles, then a
    # warning and a fallback to the exact names) and every CRD.
    settings.scanning.disabled = env.get("DSV4_NAMESPACED", "") == "true"
    settings.admission.server = webhook_server(env) or WebhookOff()


class WebhookOff:
    """A webhook "server" that serves nothing. kopf refuses to start with a validate handler
    and no server, so this is what runs while the webhook is off."""

    def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        return self

    def __aiter__(self) -> AsyncIterator[kopf.WebhookClientConfig]:
        return self

    async def __anext__(self) -> kopf.WebhookClientConfig:
        await asyncio.Event().wait()  # until kopf cancels it on exit
        raise StopAsyncIteration


def webhook_server(env: Mapping[str, str]) -> kopf.WebhookServer | None:
    """The admission webhook's HTTPS server, with the mounted certificate; None when off.
    Pure: nothing listens until kopf runs it. The chart owns the ValidatingWebhookConfiguration,
    so kopf manages none (`settings.admission.managed` stays None)."""
    port = int(env.get("DSV4_WEBHOOK_PORT", "") or 0)
    if not port:
        return None
    cert_dir = env.get("DSV4_WEBHOOK_CERT_DIR", "")
    if not cert_dir:
        raise ValueError(
            "DSV4_WEBHOOK_PORT is set without DSV4_WEBHOOK_CERT_DIR (tls.crt, tls.key)"
        )
    return kopf.WebhookServer(
        addr=env.get("DSV4_WEBHOOK_HOST") or "0.0.0.0",
        port=port,
        certfile=Path(cert_dir, "tls.crt"),
        pkeyfile=Path(cert_dir, "tls.key"),
    )


def metrics_address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """Where to serve the operator's metrics; None when not at all. Pure."""
    port = int(env.get("DSV4_OPERATOR_METRICS_PORT", "") or 0)
    return (env.get("DSV4_OPERATOR_METRICS_HOST") or "0.0.0.0", port) if port else None


@kopf.on.startup()
def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    env = dict(os.environ)
    configure(settings, env)
    memo["handler_threads"] = settings.execution.executor  # `handlers.in_thread` runs on it
    memo["kube"] = ApiKube.from_environment(REQUEST_TIMEOUT_S)
    memo["probe"] = HttpWorkerProbe()
    memo["hub"] = HfHub()
    memo["config"] = OperatorConfig.from_env(env)
    memo["gate"] = ReconcileGate()
    memo["latency"] = LatencyTracker()  # the autoscaler's latency windows (latency.py)
    memo["metrics"] = metrics = OperatorMetrics()
    if (address := metrics_address(env)) is not None:
        host, port = address
        memo["metrics_server"] = start_http_server(port, host, registry=metrics.registry)


@kopf.on.cleanup()
def on_cleanup(memo: kopf.Memo, **_: Any) -> None:
    served: tuple[Any, threading.Thread] | None = memo.get("metrics_server")
    if served is not None:
        server, thread = served
        server.shutdown()
        server.server_close()
        thread.join()
