"""kopf glue: create, update, resume and a periodic timer all run the one reconcile; errors are
mapped to kopf's retry semantics here and nowhere else. No decisions in this module.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any, Final

import kopf

from dsv4_operator import labels as L
from dsv4_operator.kube import Kube, KubeError
from dsv4_operator.observe import WorkerProbe
from dsv4_operator.reconcile import OperatorConfig, ReconcileResult, reconcile

RECONCILE_INTERVAL_S: Final = 15.0  # level-based safety net: pod failures, worker reports
RETRY_DELAY_S: Final = 10.0

# Timers and change handlers of one object may run concurrently (both in kopf's thread pool);
# one reconcile per object at a time.
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def run_reconcile(
    body: Mapping[str, Any],
    kube: Kube,
    probe: WorkerProbe,
    config: OperatorConfig,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> ReconcileResult:
    """Reconcile and translate the outcome for kopf (PermanentError / TemporaryError)."""
    uid = str(body.get("metadata", {}).get("uid", ""))
    with _lock_for(uid):
        try:
            result = reconcile(body, kube, probe, config=config)
        except KubeError as exc:
            if exc.retryable:
                raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
            raise
    for key in result.applied:
        logger.info("applied %s %s", key[1], key[2])
    for key in result.pruned:
        logger.info("pruned %s %s", key[1], key[2])
    for action in result.group_actions:
        logger.warning("group %s: %s (%s)", action.group, action.message, action.reason)
    if result.problem is not None:
        message = f"{result.problem.reason}: {result.problem.message}"
        if result.permanent:
            # The status already says so (PlanValid=False); retrying cannot help until an edit.
            raise kopf.PermanentError(message)
        logger.warning(message)
    return result


def _deps(memo: kopf.Memo) -> tuple[Kube, WorkerProbe, OperatorConfig]:
    return memo["kube"], memo["probe"], memo["config"]


@kopf.on.create(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.resume(L.GROUP, L.VERSION, L.PLURAL)
def on_change(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    run_reconcile(body, *_deps(memo), logger)


@kopf.timer(L.GROUP, L.VERSION, L.PLURAL, interval=RECONCILE_INTERVAL_S, initial_delay=5.0)
def on_timer(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    # A permanent problem is already in status and was raised by the change handler.
    with contextlib.suppress(kopf.PermanentError):
        run_reconcile(body, *_deps(memo), logger)
