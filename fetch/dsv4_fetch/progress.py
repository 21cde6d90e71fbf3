"""A fetch's progress: bytes and files done of the total, the rate over the last seconds and the
time left, as the `FetchStatus` document (`dsv4_common.api.fetch_status`). Download threads add
bytes as they are written; readers (the progress server, a progress bar) take snapshots. The
rate is the bytes gained over a sliding window, so a resumed download's earlier bytes do not
count as speed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Final

from dsv4_common.api.fetch_status import FETCH_STATUS_VERSION, FetchStatus, Phase

RATE_WINDOW_S: Final = 10.0
MIN_RATE_SPAN_S: Final = 0.5


class RateMeter:
    """Bytes per second over the last `window_s`, from (time, bytes done) samples."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, done: int) -> None:
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        if t1 - t0 < MIN_RATE_SPAN_S:
            return 0.0
        return max(0.0, (b1 - b0) / (t1 - t0))


class Progress:
    """Thread-safe counters of one fetch."""

    def __init__(self, source: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._meter = RateMeter()
        self._status = FetchStatus(version=FETCH_STATUS_VERSION, source=source, phase="resolving")

    def start(
        self, commit: str, bytes_total: int, files_total: int, bytes_done: int, files_done: int
    ) -> None:
        with self._lock:
            self._status = replace(
                self._status,
                phase="downloading",
                commit=commit,
                bytes_total=bytes_total,
                files_total=files_total,
                bytes_done=bytes_done,
                files_done=files_done,
            )
            self._meter.add(self._clock(), bytes_done)

    def add_bytes(self, delta: int) -> None:
        with self._lock:
            done = max(0, self._status.bytes_done + delta)
            self._status = replace(self._status, bytes_done=done)

    def file_done(self) -> None:
        with self._lock:
            self._status = replace(self._status, files_done=self._status.files_done + 1)

    def phase(self, phase: Phase) -> None:
        with self._lock:
            self._status = replace(self._status, phase=phase)

    def finish(self, status: FetchStatus) -> None:
        """The final document (complete or failed)."""
        with self._lock:
            self._status = status

    def snapshot(self) -> FetchStatus:
        with self._lock:
            now = self._clock()
            self._meter.add(now, self._status.bytes_done)
            rate = self._meter.rate()
            status = self._status
        left = status.bytes_total - status.bytes_done
        eta = left / rate if rate > 0 and status.phase == "downloading" else None
        return replace(status, bytes_per_second=round(rate, 1), eta_seconds=_round(eta))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
