"""kopf glue: create, update, resume, a periodic timer and events of watched children all run
the one reconcile; errors are mapped to kopf's retry semantics here and nowhere else. No
decisions in this module, and no state: what handlers share (the API client, the worker probe,
the configuration, the reconcile gate, the metrics) lives in kopf's memo, filled by
`settings.on_startup`. Every reconcile is counted and timed in the operator's metrics, which
forget a DSV4Deployment's capacity series when its DELETED event arrives.

Events of the worker pods (one failed, restarted, became ready) and of the router Deployment
(its readiness gates Ready) trigger a reconcile of the owning DSV4Deployment at once instead of
at the next timer tick, coalesced by the gate (`gate.py`). So do events of a ConfigMap that a
DSV4Deployment's `spec.model.configMapRef` names (found through a kopf index).

The validating admission webhook (`validate_deployment`) refuses at apply time what the
reconcile would reject (`admission.py`); it is served only when `settings` configures a server.

The handlers that call out (the API, the workers) are async and run that work `in_thread`, so
that SIGTERM never waits on it (`handler_threads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, TypeVar, cast

import kopf

from dsv4_operator import admission
from dsv4_operator import labels as L
from dsv4_operator.config import OperatorConfig
from dsv4_operator.gate import ReconcileGate, deployment_key
from dsv4_operator.kube import Kube, KubeError
from dsv4_operator.latency import LatencyTracker
from dsv4_operator.metrics import OperatorMetrics
from dsv4_operator.modelsource import config_map_index
from dsv4_operator.observe import WorkerProbe
from dsv4_operator.reconcile import ReconcileResult, reconcile, utc_clock
from dsv4_operator.weights import Hub

RECONCILE_INTERVAL_S: Final = 15.0  # level-based safety net: pod failures, worker reports
WEIGHTS_INTERVAL_S: Final = 5.0  # progress of an hf:// download into status
RETRY_DELAY_S: Final = 10.0
GROUP_FAILED: Final = (
    "restart budget spent (spec.groupRestarts.budget): the group is left failed until the "
    "spec changes or its pods are deleted"
)

T = TypeVar("T")
AnyLogger = logging.Logger | logging.LoggerAdapter[Any]
Warn = Callable[[Mapping[str, Any], str, str], None]  # (CR body, Event reason, message)
Inform = Warn  # the same for a Normal Event


@dataclass(frozen=True, slots=True)
class Deps:
    """What every handler uses, as `settings.on_startup` put it in kopf's memo."""

    kube: Kube
    probe: WorkerProbe
    config: OperatorConfig
    gate: ReconcileGate
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    clock: Callable[[], datetime] = utc_clock  # restart backoff runs on it
    # The deployments whose PD Secret this process created or found (`reconcile`'s step 6).
    pd_secrets: set[str] = field(default_factory=set)
    latency: LatencyTracker | None = None  # None: latency targets have no figures
    hub: Hub | None = None  # hf:// sources: the hub's answers (dsv4_operator.hub.HfHub)

    @classmethod
    def from_memo(cls, memo: kopf.Memo) -> Deps:
        return cls(
            memo["kube"],
            memo["probe"],
            memo["config"],
            memo["gate"],
            memo["metrics"],
            memo.get("clock", utc_clock),
            memo.setdefault("pd_secrets", set()),
            memo.get("latency"),
            memo.get("hub"),
        )


def run_reconcile(
    body: Mapping[str, Any],
    deps: Deps,
    logger: AnyLogger,
    warn: Warn | None = None,
    inform: Inform | None = None,
) -> ReconcileResult | None:
    """Reconcile under the deployment's lock and translate the outcome for kopf
    (PermanentError / TemporaryError). The CR is read again inside the lock: kopf's `body` can
    predate the last reconcile's status write (a restart count, a failed group), and acting on
    it could restart a group twice or roll a count back. None when the CR is gone or going.
    `warn(cr_body, reason, message)` is told of each group restarted or failed."""
    meta = body.get("metadata", {})
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    with deps.gate.lock(deployment_key(namespace, name)):
        done = _reconcile_current(namespace, name, deps, logger)
    if done is not None:
        _announce(done[1], done[0], warn, inform)
    return done[1] if done is not None else None


def _announce(
    result: ReconcileResult,
    body: Mapping[str, Any],
    warn: Warn | None,
    inform: Inform | None = None,
) -> None:
    """One Warning Event per group restarted or failed, one Normal Event per role the
    autoscaler resized (reason ScaledUp or ScaledDown), and the weights' download's Events
    (start, each 10%, ready: Normal; failed: Warning), whichever path reconciled."""
    if inform is not None:
        for change in result.scale_changes:
            inform(body, change.reason, change.text)
        for event in result.events:
            if event.type != "Warning":
                inform(body, event.reason, event.message)
    if warn is None:
        return
    for event in result.events:
        if event.type == "Warning":
            warn(body, event.reason, event.message)
    for action in result.group_actions:
        if action.restart:
            warn(body, action.reason, f"{action.group} restarted as a unit: {action.message}")
    for group in result.failed_groups:
        warn(body, "GroupFailed", f"{group}: {GROUP_FAILED}")


def _reconcile_current(
    namespace: str, name: str, deps: Deps, logger: AnyLogger
) -> tuple[Mapping[str, Any], ReconcileResult] | None:
    """For a caller that holds the deployment's lock: read the CR as the API holds it now
    (None when it is gone or being deleted) and reconcile it; (CR, result)."""
    started = time.monotonic()
    try:
        body = deps.kube.get(L.API_VERSION, L.KIND, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None
        result = reconcile(
            body,
            deps.kube,
            deps.probe,
            config=deps.config,
            clock=deps.clock,
            pd_secrets=deps.pd_secrets,
            latency=deps.latency,
            hub=deps.hub,
        )
    except KubeError as exc:
        if exc.namespace_terminating:
            # Its namespace is being deleted, the CR and its children with it: nothing to do,
            # and nothing worth a warning (no Event either: it could not be created there).
            logger.info("namespace %s is being deleted: not reconciling %s", namespace, name)
            return None
        deps.metrics.failed(exc, time.monotonic() - started)
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
        raise
    except Exception as exc:
        deps.metrics.failed(exc, time.monotonic() - started)
        raise
    seconds = time.monotonic() - started
    deps.metrics.reconciled(namespace, name, result, seconds)
    for key in result.applied:
        logger.info("applied %s %s", key[1], key[2])
    for key in result.pruned:
        logger.info("pruned %s %s", key[1], key[2])
    # Group restarts and failures go out as Warning Events with their own reasons (_announce);
    # kopf would post a logger warning as a second Event with reason "Logging".
    for action in result.group_actions:
        logger.info("group %s: %s (%s)", action.group, action.message, action.reason)
    for group in result.failed_groups:
        logger.info("group %s: GroupFailed: %s", group, GROUP_FAILED)
    for change in result.scale_changes:
        logger.info("autoscaling: %s (%s)", change.text, change.reason)
    if result.problem is not None:
        message = f"{result.problem.reason}: {result.problem.message}"
        if result.permanent:
            # The status already says so (PlanValid=False); retrying cannot help until an edit.
            raise kopf.PermanentError(message)
        logger.warning(message)
    return body, result


async def in_thread(memo: kopf.Memo, fn: Callable[[], T]) -> T:
    """`fn` (blocking: the API, the workers) on the handler threads (`handler_threads`), in
    this context (kopf's logging and event posting read it). Cancelled, when the operator
    stops, it returns at once and leaves `fn` there: kopf would wait for a sync handler's
    thread, and a reconcile stuck on a silent API server held the exit past the pod's grace."""
    executor: Executor | None = memo.get("handler_threads")
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        executor, functools.partial(context.run, fn)
    )


def _reconcile_posting(
    body: Mapping[str, Any], deps: Deps, logger: AnyLogger
) -> ReconcileResult | None:
    return run_reconcile(body, deps, logger, warn=_post_warning, inform=_post_info)


@kopf.on.create(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.resume(L.GROUP, L.VERSION, L.PLURAL)
async def on_change(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    deps = Deps.from_memo(memo)
    await in_thread(memo, lambda: _reconcile_posting(body, deps, logger))


@kopf.timer(L.GROUP, L.VERSION, L.PLURAL, interval=RECONCILE_INTERVAL_S, initial_delay=5.0)
async def on_timer(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    # A permanent problem is already in status and was raised by the change handler.
    deps = Deps.from_memo(memo)
    with contextlib.suppress(kopf.PermanentError):
        await in_thread(memo, lambda: _reconcile_posting(body, deps, logger))


@kopf.timer(
    L.GROUP,
    L.VERSION,
    L.PLURAL,
    id="weights_progress",
    interval=WEIGHTS_INTERVAL_S,
    initial_delay=WEIGHTS_INTERVAL_S,
    when=lambda status, **_: downloading(status),
)
async def on_weights_timer(
    namespace: str | None, name: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """While an hf:// source downloads, its progress reaches status more often than the
    safety-net timer (reconciles coalesce with other events'; status.weights is written at
    most once per weights_progress.STATUS_MIN_INTERVAL_S)."""
    if namespace and name:
        deps = Deps.from_memo(memo)
        await in_thread(
            memo,
            lambda: reconcile_owner(
                namespace, name, deps, logger, warn=_post_warning, inform=_post_info
            ),
        )


def downloading(status: Mapping[str, Any] | None) -> bool:
    """status.weights says a download is under way."""
    weights = (status or {}).get("weights") or {}
    return weights.get("phase") in ("Pending", "Downloading", "Checking", "Resolving")


def reconcile_owner(
    namespace: str,
    name: str,
    deps: Deps,
    logger: AnyLogger,
    warn: Warn | None = None,
    inform: Inform | None = None,
) -> ReconcileResult | None:
    """Reconcile the DSV4Deployment `namespace/name` because a watched child (a worker pod, the
    router Deployment) changed; None when the event was coalesced into a reconcile already
    waiting, or the CR is gone or going. `warn(cr_body, reason, message)` is told of each group
    restarted or failed (kopf does not post the loggers of event handlers as Kubernetes Events,
    so the caller posts them)."""
    with deps.gate.event_turn(deployment_key(namespace, name)) as turn:
        if not turn:
            return None
        try:
            done = _reconcile_current(namespace, name, deps, logger)
        except kopf.PermanentError:  # already in status (PlanValid=False)
            return None
    if done is None:
        return None
    _announce(done[1], done[0], warn, inform)
    return done[1]


@kopf.on.event(L.GROUP, L.VERSION, L.PLURAL)
def on_deployment_event(
    event: Mapping[str, Any], namespace: str | None, name: str | None, memo: kopf.Memo, **_: Any
) -> None:
    if event.get("type") == "DELETED" and namespace and name:
        forget_deployment(namespace, name, Deps.from_memo(memo))


def forget_deployment(namespace: str, name: str, deps: Deps) -> None:
    """The CR is gone: drop its metric series, after any reconcile of it still in flight."""
    with deps.gate.lock(deployment_key(namespace, name)):
        deps.metrics.forget(namespace, name)
        if deps.latency is not None:
            deps.latency.forget((namespace, name))


def _post_warning(body: Mapping[str, Any], reason: str, message: str) -> None:
    kopf.warn(kopf.Body(cast(kopf.RawBody, dict(body))), reason=reason, message=message)


def _post_info(body: Mapping[str, Any], reason: str, message: str) -> None:
    # kopf.event, not kopf.info: settings.posting.level (WARNING) filters only the loggers' and
    # kopf.info's posts, and a scale change is worth an Event at any level.
    body_ = kopf.Body(cast(kopf.RawBody, dict(body)))
    kopf.event(body_, type="Normal", reason=reason, message=message)


@kopf.on.event("", "v1", "pods", labels={L.DEPLOYMENT_LABEL: kopf.PRESENT})
@kopf.on.event(
    "apps",
    "v1",
    "deployments",
    labels={L.DEPLOYMENT_LABEL: kopf.PRESENT, L.APP_COMPONENT: "router"},
)
async def on_child_event(
    namespace: str | None,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    if namespace:
        deps, owner = Deps.from_memo(memo), labels[L.DEPLOYMENT_LABEL]
        await in_thread(
            memo,
            lambda: reconcile_owner(
                namespace, owner, deps, logger, warn=_post_warning, inform=_post_info
            ),
        )


@kopf.index(L.GROUP, L.VERSION, L.PLURAL)
def model_config_maps(
    namespace: str | None, name: str | None, spec: kopf.Spec, **_: Any
) -> dict[tuple[str, str], str]:
    """DSV4Deployments by the ConfigMap their `spec.model.configMapRef` names."""
    return config_map_index(namespace, name, spec)


@kopf.on.event("", "v1", "configmaps")
async def on_config_map_event(
    namespace: str | None, name: str, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """A ConfigMap that DSV4Deployments plan from was created, edited or deleted: re-plan them
    now rather than at the next timer tick. (This watches every ConfigMap of the served
    namespaces; one not in the index costs a dict lookup.)"""
    index: kopf.Index[tuple[str, str], str] = kwargs["model_config_maps"]  # kopf passes it
    key = (namespace or "", name)
    if key not in index:
        return
    deps = Deps.from_memo(memo)

    def reconcile_them() -> None:
        for deployment in sorted(set(index[key])):
            reconcile_owner(key[0], deployment, deps, logger, warn=_post_warning, inform=_post_info)

    await in_thread(memo, reconcile_them)


@kopf.index(L.GROUP, L.VERSION, L.PLURAL)
def weights_users(
    namespace: str | None, name: str | None, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], str]:
    """DSV4Deployments by the download their status.weights names (namespace, key)."""
    weights: Mapping[str, Any] = dict(status or {}).get("weights") or {}
    key = weights.get("key")
    if not (namespace and name and isinstance(key, str)):
        return {}
    return {(namespace, key): name}


@kopf.on.event("batch", "v1", "jobs", labels={L.WEIGHTS_KEY_LABEL: kopf.PRESENT})
async def on_weights_job_event(
    namespace: str | None,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A download Job changed (started, completed, failed): reconcile every DSV4Deployment
    that uses it now, rather than at its next timer tick."""
    index: kopf.Index[tuple[str, str], str] = kwargs["weights_users"]  # kopf passes it
    key = (namespace or "", labels[L.WEIGHTS_KEY_LABEL])
    if key not in index:
        return
    deps = Deps.from_memo(memo)

    def reconcile_them() -> None:
        for deployment in sorted(set(index[key])):
            reconcile_owner(key[0], deployment, deps, logger, warn=_post_warning, inform=_post_info)

    await in_thread(memo, reconcile_them)


@kopf.on.validate(
    L.GROUP, L.VERSION, L.PLURAL, id=admission.WEBHOOK_ID, operations=["CREATE", "UPDATE"]
)
async def validate_deployment(
    subresource: str | None,
    namespace: str | None,
    warnings: list[str],
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    """The validating admission webhook (served when `settings` configures a server): refuse a
    CR that the reconcile would reject, with its message (`admission.py`)."""
    operation, new, old = kwargs.get("operation"), kwargs.get("new"), kwargs.get("old")
    request = admission.AdmissionRequest(operation or "", new, old, subresource)
    resolve = admission.cluster_resolver(namespace or "", memo["kube"])
    verdict = await in_thread(
        memo, lambda: admission.review(request, resolve=resolve, config=memo["config"])
    )
    warnings.extend(verdict.warnings)
    if not verdict.allowed:
        raise kopf.AdmissionError(verdict.refusal, code=admission.REFUSAL_CODE)
