"""The download's progress document, version 1: what `dsv4 fetch` serves on
`GET http://<pod>:<port>/progress` while it runs, and writes as its termination message when it
ends (the operator reads one from the Job's pod, the other from its status). Wire form,
snake_case JSON:

    {"version": 1, "source": "hf://ORG/NAME@REV", "commit": "40 hex" | null,
     "phase": "resolving" | "downloading" | "checking" | "complete" | "failed",
     "bytes_done": int, "bytes_total": int, "files_done": int, "files_total": int,
     "bytes_per_second": float, "eta_seconds": float | null,
     "reason": str | null, "message": str | null, "draft_layers": bool}

`reason` (CamelCase) and `message` say why a fetch failed (`FAILURE_REASONS`), or, when complete,
what was checked. `draft_layers`: the checkpoint also holds the MTP layers, and they match the
plan's. A termination message is at most 4096 bytes (the kubelet's limit): `termination_text`
shortens the message to fit. One builder-side helper and one parser, both pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Final, Literal

from dsv4_common.api.documents import DocumentError, check_version, from_document, to_document

FETCH_STATUS_VERSION: Final = 1
TERMINATION_LIMIT_BYTES: Final = 4096
# `dsv4 fetch`'s exit codes: 3 = a retry cannot help (the download Job's podFailurePolicy fails
# the Job at once); 1 = it may (the Job's backoff tries again); 2 = a bad argument.
EXIT_RETRY: Final = 1
EXIT_USAGE: Final = 2
EXIT_PERMANENT: Final = 3
PROGRESS_PATH: Final = "/progress"
Phase = Literal["resolving", "downloading", "checking", "complete", "failed"]

# Why a fetch failed, and whether trying again can help (False: the Job fails at once).
FAILURE_REASONS: Final[dict[str, bool]] = {
    "Unauthorized": False,  # 401/403: a gated or private repo without a token that may read it
    "NotFound": False,  # the repo, the revision or a file does not exist
    "HashMismatch": False,  # a file's bytes differ from the hub's sha256/git hash, twice
    "SizeMismatch": False,  # the hub's file metadata disagree with its listing
    "VolumeTooSmall": False,  # the cache volume cannot hold what is left to download
    "TensorMismatch": False,  # the checkpoint's tensors differ from what the plan counts
    "NotCached": False,  # offline, and the cache lacks a complete, verified snapshot
    "HubUnavailable": True,  # network errors, 5xx, throttling
}


@dataclass(frozen=True, slots=True)
class FetchStatus:
    version: int
    source: str
    phase: Phase
    commit: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int = 0
    bytes_per_second: float = 0.0
    eta_seconds: float | None = None
    reason: str | None = None
    message: str | None = None
    draft_layers: bool = False

    @property
    def percent(self) -> int:
        """Whole percent of the bytes (100 only when complete)."""
        if self.phase == "complete":
            return 100
        if self.bytes_total <= 0:
            return 0
        return min(99, self.bytes_done * 100 // self.bytes_total)


def fetch_status_to_dict(status: FetchStatus) -> dict[str, object]:
    doc: dict[str, object] = to_document(status)
    return doc


def parse_fetch_status(doc: object) -> FetchStatus:
    """Parse a progress document; raises DocumentError naming the first bad field."""
    check_version(doc, "fetch_status", FETCH_STATUS_VERSION)
    status = from_document(FetchStatus, doc, "fetch_status")
    if status.reason is not None and status.reason not in FAILURE_REASONS:
        raise DocumentError(f"fetch_status.reason: unknown reason {status.reason!r}")
    if min(status.bytes_done, status.bytes_total, status.files_done, status.files_total) < 0:
        raise DocumentError("fetch_status: byte and file counts must be >= 0")
    return status


def termination_text(status: FetchStatus) -> str:
    """The JSON document, its message shortened until it fits the kubelet's limit."""
    text = json.dumps(fetch_status_to_dict(status), separators=(",", ":"))
    message = status.message or ""
    while len(text.encode()) > TERMINATION_LIMIT_BYTES and message:
        message = message[: max(0, len(message) - (len(text.encode()) - TERMINATION_LIMIT_BYTES))]
        message = message[:-1] + "…" if message else ""
        text = json.dumps(
            fetch_status_to_dict(replace(status, message=message)), separators=(",", ":")
        )
    return text
