"""The worker's `/status` document (`GET http://<pod>:<status port>/status`), version 1.

One builder (`build_worker_status`, used by the worker) and one parser (`parse_worker_status`,
used by the operator and the router). Wire form, snake_case JSON:

    {"version": 1, "role": "prefill", "pp_rank": 0,
     "capacity": {"full_tokens": int, "swa_tokens": int, "max_running_requests": int,
                  "max_context_tokens": int},
     "kv_transfer": {"backend": "nixl" | null, "ready": bool, "layout_hash": str | null,
                     "endpoint": "host:port" | null},
     "load": {"free_full_tokens": int, "free_swa_tokens": int, "free_request_slots": int,
              "running": int, "waiting": int, "accepting": bool, "draining": bool,
              "max_queue_requests": int},
     "threads": {"intra_op": int, "inter_op": int, "cpus": float,
                 "source": "flag" | "rank_config" | "auto" | "unknown"},
     "weights": {"held_bytes": int, "planned_bytes": int, "compute_dtype": str}}

`capacity` (a `RankCapacity`) is what the pools realize (fixed at start); `load` is what is
free now (the router picks instances by it); `threads` is torch's thread counts, set once at
start, where they came from and the CPUs the worker found it may use (all 0 / "unknown" from a
worker that predates it). `weights` is what the worker's parameters hold as stored (FP8 blocks
and FP4 experts with their scales, floats in their stored dtype), beside the planner's figure
for the rank, and the dtype it computes in (zeros / "unknown" from a worker that predates it).
`kv_transfer.endpoint` is a prefill's KV control address (decode
workers connect there); `ready` turns true once a manifest handshake with a peer succeeded.

A document of another version, or one missing or mistyping a field, is refused with an error
naming the field. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from dsv4_common.api.documents import (
    DocumentError,
    check_version,
    from_document,
    to_document,
)
from dsv4_common.api.names import Transfer
from dsv4_common.core.capacity import RankCapacity

WORKER_STATUS_VERSION: Final = 1
StatusRole = Literal["colocated", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class KVTransferState:
    backend: Transfer | None = None  # None: no transfer engine (colocated, or not started)
    ready: bool = False  # the handshake with the peer role succeeded
    layout_hash: str | None = None  # hash of the KV transfer manifest both sides must share
    endpoint: str | None = None  # "host:port" of a prefill's KV control socket


@dataclass(frozen=True, slots=True)
class Load:
    """What is free now; the defaults describe an idle worker that reports nothing."""

    free_full_tokens: int = 0
    free_swa_tokens: int = 0
    free_request_slots: int = 0
    running: int = 0
    waiting: int = 0  # requests accepted and not yet scheduled (its queue depth)
    accepting: bool = False  # its queue has room for another request
    draining: bool = False  # it got SIGTERM: it finishes what it has and takes nothing new
    max_queue_requests: int = 0  # the bound of its queue (0: not reported)


ThreadSource = Literal["flag", "rank_config", "auto", "unknown"]


@dataclass(frozen=True, slots=True)
class Threads:
    """Torch's thread counts in the worker (`dsv4_worker.threads`); zeros: not reported."""

    intra_op: int = 0
    inter_op: int = 0
    source: ThreadSource = "unknown"
    cpus: float = 0.0  # the CPUs the worker may use (affinity and cgroup quota)


@dataclass(frozen=True, slots=True)
class WeightsHeld:
    """The worker's weights (`dsv4_worker.model.params`); zeros: not reported."""

    held_bytes: int = 0  # as held in memory (what the realized plan subtracts)
    planned_bytes: int = 0  # the planner's figure for this rank (tensor by tensor, as stored)
    compute_dtype: str = "unknown"  # bfloat16 | float32 | float64


@dataclass(frozen=True, slots=True)
class WorkerStatusDoc:
    """The wire schema (nested as on the wire)."""

    version: int
    role: StatusRole
    pp_rank: int
    capacity: RankCapacity  # what its pools realize (the planner's figures from measured memory)
    kv_transfer: KVTransferState = KVTransferState()
    load: Load = Load()
    threads: Threads = Threads()
    weights: WeightsHeld = WeightsHeld()


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A parsed status document, flat for its readers."""

    role: StatusRole
    pp_rank: int
    capacity: RankCapacity
    kv_backend: Transfer | None = None
    kv_ready: bool = False
    kv_layout_hash: str | None = None
    kv_endpoint: str | None = None
    load: Load = Load()
    threads: Threads = Threads()
    weights: WeightsHeld = WeightsHeld()


def build_worker_status(status: WorkerStatus) -> dict[str, Any]:
    """The JSON document a worker serves on /status."""
    doc = WorkerStatusDoc(
        version=WORKER_STATUS_VERSION,
        role=status.role,
        pp_rank=status.pp_rank,
        capacity=status.capacity,
        kv_transfer=KVTransferState(
            backend=status.kv_backend,
            ready=status.kv_ready,
            layout_hash=status.kv_layout_hash,
            endpoint=status.kv_endpoint,
        ),
        load=status.load,
        threads=status.threads,
        weights=status.weights,
    )
    result: dict[str, Any] = to_document(doc)
    return result


def parse_worker_status(doc: object) -> WorkerStatus:
    """Parse a /status document; raises DocumentError naming the first bad field."""
    check_version(doc, "status", WORKER_STATUS_VERSION)
    parsed = from_document(WorkerStatusDoc, doc, "status")  # RankCapacity checks its own counts
    counts = {
        "pp_rank": parsed.pp_rank,
        **{
            f"load.{k}": getattr(parsed.load, k)
            for k in Load.__dataclass_fields__
            if k not in ("accepting", "draining")
        },
        "threads.intra_op": parsed.threads.intra_op,
        "threads.inter_op": parsed.threads.inter_op,
        "threads.cpus": parsed.threads.cpus,
        "weights.held_bytes": parsed.weights.held_bytes,
        "weights.planned_bytes": parsed.weights.planned_bytes,
    }
    for name, value in counts.items():
        if value < 0:
            raise DocumentError(f"status.{name}: must be >= 0, got {value}")
    kv = parsed.kv_transfer
    return WorkerStatus(
        role=parsed.role,
        pp_rank=parsed.pp_rank,
        capacity=parsed.capacity,
        kv_backend=kv.backend,
        kv_ready=kv.ready,
        kv_layout_hash=kv.layout_hash,
        kv_endpoint=kv.endpoint,
        load=parsed.load,
        threads=parsed.threads,
        weights=parsed.weights,
    )
