"""`HttpWorkerProbe`: GETs each running worker's `/status` document (engine dsv4), or SGLang's
`/server_info` from PP rank 0 of each group (engine sglang), and a download Job pod's
`/progress`. With the hub's calls (`hub.py`), the operator's only network calls besides the
Kubernetes API."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from dsv4_common.api.fetch_status import PROGRESS_PATH
from dsv4_operator.flavors.sglang.info import SERVER_INFO_PATH
from dsv4_operator.observe import PodState
from dsv4_operator.weights_objects import PROGRESS_PORT
from dsv4_operator.workerconfig import HTTP_PORT, STATUS_PORT

PROBE_TIMEOUT_S: Final = 2.0
PROBE_THREADS: Final = 8


def _serving(pod: PodState) -> bool:
    return bool(pod.ip) and pod.phase == "Running" and not pod.deleting


class HttpWorkerProbe:
    """GETs JSON documents from worker pods on their pod IPs (the NetworkPolicy admits the
    operator on the status port of our workers and the HTTP port of SGLang's)."""

    def __init__(
        self,
        timeout_s: float = PROBE_TIMEOUT_S,
        port: int = STATUS_PORT,
        http_port: int = HTTP_PORT,
        progress_port: int = PROGRESS_PORT,
    ) -> None:
        self.timeout_s = timeout_s
        # The rendered pods' ports; other values are for tests.
        self.port = port
        self.http_port = http_port
        self.progress_port = progress_port

    def _get(self, url: str) -> Mapping[str, Any] | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, Mapping) else None

    def _fan_out(
        self, targets: Sequence[PodState], port: int, path: str
    ) -> dict[str, Mapping[str, Any]]:
        if not targets:
            return {}

        def one(pod: PodState) -> tuple[str, Mapping[str, Any] | None]:
            return pod.name, self._get(f"http://{pod.ip}:{port}{path}")

        with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(targets))) as pool:
            results = list(pool.map(one, targets))
        return {name: doc for name, doc in results if doc is not None}

    def fetch(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        return self._fan_out([p for p in pods if _serving(p)], self.port, "/status")

    def metrics(self, pods: Sequence[PodState]) -> dict[str, str]:
        """Each serving pod's /metrics text (the autoscaler's latency histograms)."""
        targets = [p for p in pods if _serving(p)]
        if not targets:
            return {}

        def one(pod: PodState) -> tuple[str, str | None]:
            url = f"http://{pod.ip}:{self.port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                    return pod.name, resp.read().decode("utf-8", errors="replace")
            except OSError:
                return pod.name, None

        with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(targets))) as pool:
            results = list(pool.map(one, targets))
        return {name: text for name, text in results if text is not None}

    def progress(self, ip: str) -> Mapping[str, Any] | None:
        """A download Job's pod: its `dsv4 fetch` progress document (`GET :8081/progress`)."""
        return self._get(f"http://{ip}:{self.progress_port}{PROGRESS_PATH}")

    def server_info(self, pods: Sequence[PodState]) -> dict[str, Mapping[str, Any]]:
        # Only PP rank 0 of an SGLang group runs the HTTP server.
        targets = [p for p in pods if _serving(p) and p.pp_rank == 0]
        return self._fan_out(targets, self.http_port, SERVER_INFO_PATH)
