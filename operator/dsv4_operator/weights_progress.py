"""An hf:// download's `status.weights` figures, their write throttle and the Events their
changes mark, purely: the figures from the Job's progress document (or the final state), at most
one change of them per STATUS_MIN_INTERVAL_S per CR (a reconcile in between keeps the previous
figures and their time), and Events at the start, each 10%, completion and failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from dsv4_common.api.fetch_status import FetchStatus
from dsv4_common.core.units import GIB
from dsv4_operator.weights_objects import Resolved

STATUS_MIN_INTERVAL_S: Final = 2.0
Phase = Literal["Resolving", "Pending", "Downloading", "Checking", "Ready", "Failed"]
EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Event:
    type: EventType
    reason: str
    message: str


def figures(phase: Phase, resolved: Resolved, p: FetchStatus | None) -> dict[str, Any]:
    eta: int | None
    if phase == "Ready":
        done, files, rate, eta = resolved.total_bytes, resolved.files, 0.0, 0
    elif p is not None:
        done, files, rate = p.bytes_done, p.files_done, p.bytes_per_second
        eta = None if p.eta_seconds is None else round(p.eta_seconds)
    else:
        done, files, rate, eta = 0, 0, 0.0, None
    total = max(resolved.total_bytes, 1)
    percent = 100 if phase == "Ready" else min(99, done * 100 // total)
    out: dict[str, Any] = {
        "bytesDone": done,
        "filesDone": files,
        "bytesPerSecond": round(rate),
        "progress": f"{percent}%" if phase != "Failed" else "Failed",
    }
    if eta is not None:
        out["etaSeconds"] = eta
    return out


_PROGRESS_KEYS: Final = ("bytesDone", "filesDone", "bytesPerSecond", "etaSeconds", "progress")


def throttled(status: dict[str, Any], before: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """At most one progress write per STATUS_MIN_INTERVAL_S: when only the figures moved since
    a write less than that ago, the previous figures (and their time) stay."""
    last = before.get("updateTime")
    same = {k: v for k, v in status.items() if k not in _PROGRESS_KEYS}
    same_before = {k: v for k, v in before.items() if k not in (*_PROGRESS_KEYS, "updateTime")}
    if isinstance(last, str) and same == same_before:
        if all(status.get(k) == before.get(k) for k in _PROGRESS_KEYS):
            return {**status, "updateTime": last}
        seconds = (now - _parse_time(last)).total_seconds()
        if 0 <= seconds < STATUS_MIN_INTERVAL_S:
            return {
                **same,
                **{k: before[k] for k in _PROGRESS_KEYS if k in before},
                "updateTime": last,
            }
    return stamped(status, now)


def stamped(status: dict[str, Any], now: datetime) -> dict[str, Any]:
    return {**status, "updateTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}


def _parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def _decile(status: Mapping[str, Any]) -> int:
    progress = str(status.get("progress") or "")
    return int(progress[:-1]) // 10 if progress.endswith("%") and progress[:-1].isdigit() else -1


def events(before: Mapping[str, Any], after: Mapping[str, Any], message: str) -> tuple[Event, ...]:
    """Start, each 10%, completion and failure, from the change of status.weights."""
    was, now = before.get("phase"), after.get("phase")
    source = after.get("source", "")
    if now == was and now not in ("Downloading", "Checking"):
        return ()
    if now == "Ready":
        return (Event("Normal", "WeightsReady", message),)
    if now == "Failed":
        return (Event("Warning", "WeightsFailed", message),)
    out: list[Event] = []
    if now in ("Pending", "Downloading") and was not in ("Pending", "Downloading", "Checking"):
        total = after.get("bytesTotal")
        size = f" ({gib_text(int(total))}, {after.get('filesTotal')} files)" if total else ""
        out.append(
            Event(
                "Normal",
                "WeightsDownloading",
                f"downloading {source}{size} with Job {after.get('job')} into claim "
                f"{after.get('claim')}",
            )
        )
    decile = _decile(after)
    if now == "Downloading" and decile >= 1 and decile > max(_decile(before), 0):
        out.append(Event("Normal", "WeightsProgress", message))
    return tuple(out)


def gib_text(n: int) -> str:
    """A size in GiB, or MiB below one GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def described(status: Mapping[str, Any]) -> str:
    """`42% (67.0 GiB of 160.0 GiB, 3/12 files), 210.0 MB/s, ETA 11 min`, from status.weights."""
    eta = status.get("etaSeconds")
    when = "" if eta is None else f", ETA {_duration(float(eta))}"
    return (
        f"{status['progress']} ({gib_text(status['bytesDone'])} of "
        f"{gib_text(status['bytesTotal'])}, "
        f"{status['filesDone']}/{status['filesTotal']} files), "
        f"{status['bytesPerSecond'] / 1e6:.1f} MB/s{when}"
    )
