"""`HttpWorkerProbe`: GETs each running worker's `/status` document. The operator's only network
call besides the Kubernetes API."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from dsv4_operator.observe import PodState
from dsv4_operator.workerconfig import STATUS_PORT

PROBE_TIMEOUT_S: Final = 2.0
PROBE_THREADS: Final = 8


class HttpWorkerProbe:
    """GETs each running worker's /status on its pod IP (the NetworkPolicy admits the operator
    on the status port only)."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S, port: int = STATUS_PORT) -> None:
        self.timeout_s = timeout_s
        self.port = port  # the rendered pods' status port; other values are for tests

    def _one(self, pod: PodState) -> tuple[str, Mapping[str, Any] | None]:
        url = f"http://{pod.ip}:{self.port}/status"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError):
            return pod.name, None
        return pod.name, doc if isinstance(doc, Mapping) else None

    def fetch(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        targets = [p for p in pods if p.ip and p.phase == "Running" and not p.deleting]
        if not targets:
            return {}
        with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(targets))) as pool:
            results = list(pool.map(self._one, targets))
        return {name: doc for name, doc in results if doc is not None}
