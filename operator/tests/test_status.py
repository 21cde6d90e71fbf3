"""Status is a pure function: conditions per situation, transition times kept while a
condition's status holds, observedGeneration everywhere, observed capacity as the least over
replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dsv4_common.api import RankCapacity
from dsv4_common.api.deployment import plan_memory
from dsv4_common.api.spec import parse_meta, parse_spec
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_operator.observe import Observed
from dsv4_operator.status import CONDITION_TYPES, Problem, summarize

Body = dict[str, Any]


def report(role: str, rank: int, full: int, **kw: Any) -> WorkerStatus:
    fields: dict[str, Any] = {
        "role": role,
        "pp_rank": rank,
        "capacity": RankCapacity(
            full_tokens=full, swa_tokens=1, max_running_requests=8, max_context_tokens=full
        ),
        "kv_backend": "nixl",
        "kv_ready": True,
        "kv_layout_hash": "h",
    }
    fields.update(kw)
    return WorkerStatus(**fields)


def by_type(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_invalid_spec_status(make_body: Callable[..., Body]) -> None:
    body = make_body()
    status = summarize(
        None,
        None,
        Observed(),
        3,
        meta=parse_meta(body),
        problem=Problem("InvalidSpec", "spec.kv.transfer: bad"),
        now="t1",
    )
    cond = by_type(status)
    assert [c["type"] for c in status["conditions"]] == list(CONDITION_TYPES)
    assert (
        cond["PlanValid"]["status"] == "False"
        and "spec.kv.transfer" in cond["PlanValid"]["message"]
    )
    assert cond["ContextFits"]["status"] == "Unknown"
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert "plan" not in status and "roles" not in status


def test_context_too_long_status_names_the_largest_fit(make_body: Callable[..., Body]) -> None:
    body = make_body(maxContextTokens=8192)
    spec = parse_spec(body)
    memory = plan_memory(spec)
    status = summarize(
        spec,
        memory,
        Observed(),
        1,
        meta=parse_meta(body),
        problem=Problem("ContextTooLong", memory.context_message()),
        now="t1",
    )
    cond = by_type(status)
    assert (cond["ContextFits"]["status"], cond["PlanValid"]["status"]) == ("False", "True")
    assert "largest context that fits is 4096" in cond["ContextFits"]["message"]
    assert status["maxContextTokens"] == 4096 and len(status["plan"]) == 3


@pytest.mark.parametrize(
    ("reports", "status", "reason"),
    [
        ({}, "False", "WaitingForWorkers"),
        ({"p": report("prefill", 0, 9)}, "False", "WaitingForWorkers"),
        ({"p": report("prefill", 0, 9), "d": report("decode", 0, 9)}, "True", "HandshakeComplete"),
        (
            {"p": report("prefill", 0, 9), "d": report("decode", 0, 9, kv_layout_hash="x")},
            "False",
            "LayoutMismatch",
        ),
        (
            {"p": report("prefill", 0, 9), "d": report("decode", 0, 9, kv_backend="zmq")},
            "False",
            "BackendMismatch",
        ),
    ],
    ids=["none", "prefill-only", "both", "layouts-differ", "silent-fallback"],
)
def test_kv_transfer_condition(
    make_body: Callable[..., Body], reports: dict[str, WorkerStatus], status: str, reason: str
) -> None:
    body = make_body()
    spec = parse_spec(body)
    out = summarize(
        spec, plan_memory(spec), Observed(reports=reports), 1, meta=parse_meta(body), now="t"
    )
    kv = by_type(out)["KVTransferReady"]
    assert (kv["status"], kv["reason"]) == (status, reason)


def test_transition_time_is_kept_while_status_holds(make_body: Callable[..., Body]) -> None:
    body = make_body()
    spec, meta = parse_spec(body), parse_meta(body)
    memory = plan_memory(spec)
    first = summarize(spec, memory, Observed(), 1, meta=meta, now="t1")
    again = summarize(spec, memory, Observed(), 2, meta=meta, previous=first, now="t2")
    assert all(c["lastTransitionTime"] == "t1" for c in again["conditions"])
    assert all(c["observedGeneration"] == 2 for c in again["conditions"])
    reports = {"p": report("prefill", 0, 9), "d": report("decode", 0, 9)}
    changed = summarize(
        spec, memory, Observed(reports=reports), 2, meta=meta, previous=again, now="t3"
    )
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times["KVTransferReady"] == "t3" and times["PlanValid"] == "t1"


def test_observed_capacity_is_the_least_over_replicas(make_body: Callable[..., Body]) -> None:
    body = make_body()
    spec = parse_spec(body)
    reports = {"a": report("decode", 0, 100), "b": report("decode", 0, 70)}
    out = summarize(
        spec, plan_memory(spec), Observed(reports=reports), 1, meta=parse_meta(body), now="t"
    )
    decode0 = next(p for p in out["plan"] if p["role"] == "decode")
    assert decode0["observed"]["fullTokens"] == 70
    assert "observed" not in next(p for p in out["plan"] if p["role"] == "prefill")
    assert sum(p["bottleneck"] for p in out["plan"] if p["role"] == "prefill") == 1
