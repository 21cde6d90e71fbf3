"""The router's state for people: one instance record (`GET /instances`) and the whole router
(`GET /status`: readiness, every instance with its state, the settings it runs with).

Pure: records, a clock reading and the settings in, JSON-able dicts out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsv4_common.api.documents import to_document
from dsv4_common.api.names import WORKER_ROLES
from dsv4_router.choice import (
    METRIC_STATES,
    InstanceRecord,
    assess,
    choose_pair,
    metric_state,
    unavailable_reason,
)
from dsv4_router.config import RouterSettings
from dsv4_router.liveness import LivenessRule


def instance_view(record: InstanceRecord, now_s: float, rule: LivenessRule) -> dict[str, Any]:
    """One record (GET /instances, and each entry of GET /status)."""
    health, reason = assess(record, now_s, rule)
    status = record.status
    age_s = None if record.status_at_s is None else round(now_s - record.status_at_s, 3)
    return {
        "role": record.role,
        **to_document(record.instance),
        "state": health,
        "reason": reason or None,
        "ready": record.ready,
        "status_age_s": age_s,
        "missed_probes": record.liveness.misses,
        "kv_ready": None if status is None else status.kv_ready,
        "load": None if status is None else to_document(status.load),
        "router_inflight": record.inflight,
        "router_pending": record.pending,
        "error": record.error,
    }


def router_status(
    records: Sequence[InstanceRecord], now_s: float, settings: RouterSettings, process: int = 0
) -> dict[str, Any]:
    """GET /status: `ready` as /ready decides it (and why not), the instances by role and
    state, each instance, and the settings, as router process `process` sees them (each
    process polls the instances itself: `processes`)."""
    rule = settings.liveness
    counts = {role: dict.fromkeys(METRIC_STATES, 0) for role in WORKER_ROLES}
    for record in records:
        counts[record.role][metric_state(assess(record, now_s, rule)[0])] += 1
    ready = choose_pair(records, now_s, rule) is not None
    return {
        "ready": ready,
        "reason": None if ready else unavailable_reason(records, now_s, rule),
        "instance_counts": counts,
        "instances": [instance_view(r, now_s, rule) for r in records],
        "process": process,
        "settings": settings_view(settings),
    }


def settings_view(settings: RouterSettings) -> dict[str, Any]:
    rule = settings.liveness
    return {
        "host": settings.host,
        "port": settings.port,
        "status_port": settings.status_port,
        "roles": {
            role: {
                "service": targets.service,
                "instances": [to_document(i) for i in targets.instances],
            }
            for role, targets in settings.roles.items()
        },
        "poll_interval_s": settings.poll_interval_s,
        "status_timeout_s": settings.status_timeout_s,
        "stale_after_misses": rule.misses,
        "stale_after_grace_s": rule.grace_s,
        "connect_timeout_s": settings.connect_timeout_s,
        "first_byte_timeout_s": settings.first_byte_timeout_s,
        "stall_after_s": settings.stall_after_s,
        "max_attempts": settings.max_attempts,
        "shutdown_timeout_s": settings.shutdown_timeout_s,
        "processes": settings.processes,
        "busy_poll_us": round(settings.busy_poll_s * 1e6),
        "http": to_document(settings.http),
    }
