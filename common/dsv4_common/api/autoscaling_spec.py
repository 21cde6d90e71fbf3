"""`spec.<role>.autoscaling` and `spec.autoscaling` as frozen dataclasses, and their parser.

A role with `autoscaling` has between `minReplicas` and `maxReplicas` PP groups, decided from
its workers' own figures against the targets it names (`scaling.py`); `replicas` is then only
the count it starts with (clamped into the range). `spec.autoscaling` holds what couples the
roles: the prefill:decode ratio band, `maxSkew`, and who acts (`engine`). Pure; errors are
recorded on the caller's `FieldReader`, each naming its field (the CRD's rules say the same).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, cast

from dsv4_common.api.fields import FieldReader
from dsv4_common.api.names import MAX_ROLE_REPLICAS, WorkerRole

ScalingEngine = Literal["operator", "keda", "hpa"]
SCALING_ENGINES: Final[tuple[ScalingEngine, ...]] = ("operator", "keda", "hpa")
DEFAULT_STABILIZATION_S: Final = 60
DEFAULT_COOLDOWN_S: Final = 30
DEFAULT_LATENCY_PERCENTILE: Final = 90
DEFAULT_MAX_SKEW: Final = 1
MAX_WINDOW_S: Final = 3600
MAX_RATIO: Final = 64.0
# Why prefill cannot scale to zero (the refusal's text; docs/operator.md says the same).
PREFILL_TO_ZERO: Final = (
    "must be >= 1: prefill cannot scale to zero (a decode worker takes requests only with "
    "their KV from a prefill, and there is no colocated worker to route them to meanwhile)"
)
_URL: Final = re.compile(r"^https?://[^\s/]+(/\S*)?$")
TARGET_KEYS: Final = (
    "queueDepthPerReplica",
    "kvUtilization",
    "ttftSeconds",
    "interTokenLatencySeconds",
)


@dataclass(frozen=True, slots=True)
class ScalingTargets:
    """What one replica of a role should carry; None: not a target. At least one is set."""

    queue_depth_per_replica: int | None = None  # requests waiting per group
    kv_utilization: float | None = None  # of the binding pool (full, SWA or request state)
    ttft_s: float | None = None  # the role's TTFT at `latency_percentile`
    inter_token_latency_s: float | None = None  # the role's ITL at `latency_percentile`
    latency_percentile: int = DEFAULT_LATENCY_PERCENTILE

    @property
    def latency(self) -> bool:
        return self.ttft_s is not None or self.inter_token_latency_s is not None


@dataclass(frozen=True, slots=True)
class RoleAutoscaling:
    min_replicas: int
    max_replicas: int
    targets: ScalingTargets
    # A scale-down takes the highest recommendation of this window (so a dip does not
    # shrink the role), and never comes sooner than this after a scale-up.
    stabilization_s: int = DEFAULT_STABILIZATION_S
    cooldown_s: int = DEFAULT_COOLDOWN_S  # at least this between two changes of the role

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True, slots=True)
class RatioBand:
    """prefill groups / decode groups must stay within [min_ratio, max_ratio]."""

    min_ratio: float
    max_ratio: float

    def prefill_bounds(self, decode: int) -> tuple[int, int]:
        """The prefill counts the band allows with `decode` groups (may be empty: lo > hi)."""
        lo = math.ceil(self.min_ratio * decode - 1e-9)
        hi = math.floor(self.max_ratio * decode + 1e-9)
        return lo, hi


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """`spec.autoscaling`: who acts on the roles' autoscaling, and what couples them."""

    engine: ScalingEngine = "operator"
    ratio: RatioBand | None = None  # None: the roles scale independently
    max_skew: int = DEFAULT_MAX_SKEW  # groups a role may run outside the band while scaling
    # engine keda: the Prometheus its ScaledObjects' triggers query (the workers' metrics).
    prometheus_address: str | None = None


def parse_role_autoscaling(
    r: FieldReader, raw: object, path: str, role: WorkerRole
) -> RoleAutoscaling | None:
    if raw is None:
        return None
    m = r.obj(raw, path)
    r.keys(
        m,
        path,
        {"minReplicas", "maxReplicas", "stabilizationWindowSeconds", "cooldownSeconds"}
        | {"latencyPercentile", *TARGET_KEYS},
    )
    lowest = r.integer(m, "minReplicas", path, 1, 0, MAX_ROLE_REPLICAS)
    if lowest == 0 and role == "prefill":
        r.fail(f"{path}.minReplicas", PREFILL_TO_ZERO)
    elif lowest == 0:
        r.fail(f"{path}.minReplicas", "must be >= 1: decode serves every request")
    highest = r.integer(m, "maxReplicas", path, None, 1, MAX_ROLE_REPLICAS, required=True)
    if lowest is not None and highest is not None and highest < lowest:
        r.fail(f"{path}.maxReplicas", f"must be >= minReplicas ({lowest}), got {highest}")
    targets = ScalingTargets(
        queue_depth_per_replica=r.integer(m, "queueDepthPerReplica", path, None, 1, 65_536),
        kv_utilization=_fraction(r, m, "kvUtilization", path),
        ttft_s=_seconds(r, m, "ttftSeconds", path),
        inter_token_latency_s=_seconds(r, m, "interTokenLatencySeconds", path),
        latency_percentile=r.integer(
            m, "latencyPercentile", path, DEFAULT_LATENCY_PERCENTILE, 50, 99
        )
        or DEFAULT_LATENCY_PERCENTILE,
    )
    if not any(m.get(k) is not None for k in TARGET_KEYS):
        r.fail(path, f"names no target: set at least one of {', '.join(TARGET_KEYS)}")
    stabilization = r.integer(
        m, "stabilizationWindowSeconds", path, DEFAULT_STABILIZATION_S, 0, MAX_WINDOW_S
    )
    cooldown = r.integer(m, "cooldownSeconds", path, DEFAULT_COOLDOWN_S, 0, MAX_WINDOW_S)
    if lowest is None or highest is None or lowest < 1 or highest < lowest:
        return None
    return RoleAutoscaling(
        min_replicas=lowest,
        max_replicas=highest,
        targets=targets,
        stabilization_s=DEFAULT_STABILIZATION_S if stabilization is None else stabilization,
        cooldown_s=DEFAULT_COOLDOWN_S if cooldown is None else cooldown,
    )


def parse_autoscaling(
    r: FieldReader,
    raw: object,
    roles: Mapping[WorkerRole, tuple[int, RoleAutoscaling | None]],
) -> AutoscalingSpec:
    """`roles`: each role's (replicas, autoscaling), for the band's feasibility."""
    path = "spec.autoscaling"
    m = r.obj(raw, path)
    r.keys(m, path, {"engine", "prefillDecodeRatio", "maxSkew", "prometheusAddress"})
    engine = r.string(m, "engine", path, enum=SCALING_ENGINES) or "operator"
    prometheus = r.string(
        m,
        "prometheusAddress",
        path,
        max_length=1024,
        pattern=_URL,
        pattern_hint="must be an http(s) URL such as http://prometheus.monitoring.svc:9090",
    )
    if engine == "keda" and prometheus is None:
        r.fail(f"{path}.prometheusAddress", "required with engine keda (its triggers query it)")
    elif engine != "keda" and prometheus is not None:
        r.fail(f"{path}.prometheusAddress", f"is for engine keda, not {engine}")
    max_skew = r.integer(m, "maxSkew", path, DEFAULT_MAX_SKEW, 0, MAX_ROLE_REPLICAS)
    ratio: RatioBand | None = None
    if m.get("prefillDecodeRatio") is not None:
        rp = f"{path}.prefillDecodeRatio"
        band = r.obj(m["prefillDecodeRatio"], rp)
        r.keys(band, rp, {"min", "max"})
        lo = r.number(band, "min", rp, 1 / MAX_RATIO, MAX_RATIO)
        hi = r.number(band, "max", rp, 1 / MAX_RATIO, MAX_RATIO)
        for key in ("min", "max"):
            if band.get(key) is None:
                r.fail(f"{rp}.{key}", "required")
        if lo is not None and hi is not None:
            if hi < lo:
                r.fail(f"{rp}.max", f"must be >= min ({lo:g}), got {hi:g}")
            else:
                ratio = RatioBand(lo, hi)
                if (why := band_infeasible(ratio, roles)) is not None:
                    r.fail(rp, why)
    if engine != "operator" and ratio is not None:
        r.fail(
            f"{path}.prefillDecodeRatio",
            f"needs engine operator: {engine} scales each role on its own and cannot keep the band",
        )
    if engine != "operator" and not any(a is not None for _, a in roles.values()):
        r.fail(f"{path}.engine", f"{engine} needs a role with autoscaling")
    return AutoscalingSpec(
        engine=cast(ScalingEngine, engine),
        ratio=ratio,
        max_skew=DEFAULT_MAX_SKEW if max_skew is None else max_skew,
        prometheus_address=prometheus,
    )


def role_range(replicas: int, autoscaling: RoleAutoscaling | None) -> tuple[int, int]:
    """The groups a role may have: its autoscaling range, or exactly `replicas`."""
    if autoscaling is None:
        return replicas, replicas
    return autoscaling.min_replicas, autoscaling.max_replicas


def band_infeasible(
    band: RatioBand, roles: Mapping[WorkerRole, tuple[int, RoleAutoscaling | None]]
) -> str | None:
    """Why some decode count of its range has no prefill count of its range in the band (the
    decision needs one for every decode count it may pick), or None."""
    p_lo, p_hi = role_range(*roles["prefill"])
    d_lo, d_hi = role_range(*roles["decode"])
    for decode in range(d_lo, d_hi + 1):
        lo, hi = band.prefill_bounds(decode)
        if max(lo, p_lo) > min(hi, p_hi):
            return (
                f"[{band.min_ratio:g}, {band.max_ratio:g}] leaves no prefill count in "
                f"[{p_lo}, {p_hi}] for {decode} decode group(s): widen the band or the ranges"
            )
    return None


def _fraction(r: FieldReader, m: Mapping[str, object], key: str, path: str) -> float | None:
    value = r.number(m, key, path, 0.0, 1.0)
    if value is not None and value <= 0:
        r.fail(f"{path}.{key}", f"must be in (0, 1], got {value:g}")
        return None
    return value


def _seconds(r: FieldReader, m: Mapping[str, object], key: str, path: str) -> float | None:
    value = r.number(m, key, path, 0.0, 3600.0)
    if value is not None and value <= 0:
        r.fail(f"{path}.{key}", f"must be > 0, got {value:g}")
        return None
    return value
