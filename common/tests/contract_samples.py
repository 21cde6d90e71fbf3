"""Sample contract documents shared by the common and operator tests (`import contract_samples`)."""

from __future__ import annotations

from typing import Final

from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import WorkerStatus

# A decode worker that reports its capacity and a ready NIXL engine.
DECODE_STATUS: Final = WorkerStatus(
    role="decode",
    pp_rank=1,
    capacity=RankCapacity(
        full_tokens=8192, swa_tokens=1024, max_running_requests=16, max_context_tokens=4096
    ),
    kv_backend="nixl",
    kv_ready=True,
    kv_layout_hash="abc123",
)
