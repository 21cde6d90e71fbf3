"""`spec.<role>.autoscaling` and `spec.autoscaling`: defaults, and each refusal names its field
(table-driven); the binding pool and the latency quantile behind the figures."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dsv4_common.api.autoscaling_spec import RatioBand
from dsv4_common.api.load_figures import (
    binding,
    bucket_delta,
    histogram_buckets,
    quantile,
    role_figures,
)
from dsv4_common.api.spec import SpecError, parse_spec
from dsv4_common.api.worker_status import Load, WorkerStatus
from dsv4_common.core.capacity import RankCapacity

BASE: dict[str, Any] = {
    "metadata": {"name": "tiny"},
    "spec": {"model": {"preset": "tiny"}, "maxContextTokens": 4096},
}


def body(spec: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out["spec"].update(spec)
    return out


def test_a_role_autoscales_between_its_bounds_with_defaults() -> None:
    spec = parse_spec(
        body(
            {
                "decode": {"autoscaling": {"maxReplicas": 4, "kvUtilization": 0.8}},
                "autoscaling": {"prefillDecodeRatio": {"min": 0.25, "max": 1}},
            }
        )
    )
    a = spec.decode.autoscaling
    assert a is not None and (a.min_replicas, a.max_replicas) == (1, 4)
    assert a.targets.kv_utilization == 0.8 and a.stabilization_s == 60 and a.cooldown_s == 30
    assert spec.prefill.autoscaling is None
    assert spec.autoscaling.ratio == RatioBand(0.25, 1.0) and spec.autoscaling.max_skew == 1


REFUSED = [
    (
        {
            "prefill": {
                "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "queueDepthPerReplica": 1}
            }
        },
        "spec.prefill.autoscaling.minReplicas: must be >= 1: prefill cannot scale to zero",
    ),
    (
        {
            "decode": {
                "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "queueDepthPerReplica": 1}
            }
        },
        "spec.decode.autoscaling.minReplicas: must be >= 1",
    ),
    (
        {
            "decode": {
                "autoscaling": {"minReplicas": 3, "maxReplicas": 2, "queueDepthPerReplica": 1}
            }
        },
        "spec.decode.autoscaling.maxReplicas: must be >= minReplicas (3)",
    ),
    ({"decode": {"autoscaling": {"maxReplicas": 2}}}, "spec.decode.autoscaling: names no target"),
    (
        {"decode": {"autoscaling": {"queueDepthPerReplica": 2}}},
        "spec.decode.autoscaling.maxReplicas: required",
    ),
    (
        {"decode": {"autoscaling": {"maxReplicas": 2, "kvUtilization": 0}}},
        "spec.decode.autoscaling.kvUtilization: must be in (0, 1]",
    ),
    (
        {"decode": {"autoscaling": {"maxReplicas": 2, "queueDepth": 2}}},
        "spec.decode.autoscaling.queueDepth: unknown field",
    ),
    (
        {"autoscaling": {"prefillDecodeRatio": {"min": 2, "max": 1}}},
        "spec.autoscaling.prefillDecodeRatio.max: must be >= min (2)",
    ),
    (
        {"autoscaling": {"prefillDecodeRatio": {"min": 2, "max": 3}}},
        "spec.autoscaling.prefillDecodeRatio: [2, 3] leaves no prefill count in [1, 1]",
    ),
    (
        {"autoscaling": {"engine": "keda"}},
        "spec.autoscaling.engine: keda needs a role with autoscaling",
    ),
    (
        {
            "autoscaling": {"engine": "hpa", "prefillDecodeRatio": {"min": 1, "max": 1}},
            "decode": {"autoscaling": {"maxReplicas": 1, "queueDepthPerReplica": 2}},
        },
        "spec.autoscaling.prefillDecodeRatio: needs engine operator",
    ),
]


@pytest.mark.parametrize(("patch", "message"), REFUSED)
def test_refusals_name_the_field(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(body(patch))
    assert any(e.startswith(message) for e in err.value.errors), err.value.errors


def rank(free_full: int, free_swa: int, free_slots: int, waiting: int = 0) -> WorkerStatus:
    return WorkerStatus(
        role="decode",
        pp_rank=0,
        capacity=RankCapacity(1000, 200, 10, 1000),
        load=Load(free_full, free_swa, free_slots, waiting=waiting),
    )


def test_the_binding_pool_is_the_fullest_of_three_on_the_fullest_rank() -> None:
    assert binding([rank(900, 20, 8)]) == pytest.approx((0.9, "swa"))
    assert binding([rank(900, 190, 1), rank(500, 190, 9)]) == pytest.approx((0.9, "req_slots"))
    figures = role_figures({"g0": [rank(100, 190, 9, waiting=3)], "g1": [rank(900, 190, 5, 1)]})
    assert figures is not None and figures.groups == 2 and figures.queue_depth == 4
    assert figures.kv_utilization == pytest.approx((0.9 + 0.5) / 2)
    assert figures.binding_pool == "full"
    assert role_figures({"g0": []}) is None
    # A rank that reports no load (the defaults: an older worker) gives no figures.
    silent = WorkerStatus(role="decode", pp_rank=0, capacity=RankCapacity(1000, 200, 10, 1000))
    assert role_figures({"g0": [silent]}) is None


METRICS = """# HELP dsv4_time_to_first_token_seconds TTFT
dsv4_time_to_first_token_seconds_bucket{le="0.1"} 10.0
dsv4_time_to_first_token_seconds_bucket{le="1.0"} 30.0
dsv4_time_to_first_token_seconds_bucket{le="+Inf"} 40.0
dsv4_time_to_first_token_seconds_count 40.0
"""


def test_quantiles_interpolate_inside_their_bucket_like_prometheus() -> None:
    b = histogram_buckets(METRICS, "dsv4_time_to_first_token_seconds")
    assert b == ((0.1, 10.0), (1.0, 30.0), (float("inf"), 40.0))
    assert quantile(b, 0.25) == pytest.approx(0.1)
    assert quantile(b, 0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert quantile(b, 0.9) == pytest.approx(1.0)  # in +Inf: the highest finite bound
    assert quantile((), 0.5) is None
    assert bucket_delta(b, ((0.1, 5.0), (1.0, 5.0), (float("inf"), 5.0)))[1] == (1.0, 25.0)
    # A worker that restarted counts from zero: the new counts are the delta.
    assert bucket_delta(((0.1, 1.0),), ((0.1, 5.0),)) == ((0.1, 1.0),)
