"""`HfHub`: the operator's calls to the Hugging Face hub (or a mirror) through `dsv4_fetch.hub`:
a revision resolved to a commit with its file list, and config.json's text, for the plan. The
operator's only network calls besides the Kubernetes API and the probes.

A commit's answer never changes: successful answers for commits are kept (per endpoint and
token); a failure is kept for FAILURE_TTL_S, so a reconcile loop does not hammer the hub.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Final

from huggingface_hub.utils import disable_progress_bars
from huggingface_hub.utils import tqdm as hf_tqdm

from dsv4_common.api.model_source import HfSource, is_commit
from dsv4_fetch.errors import FetchError
from dsv4_fetch.hub import CONFIG_FILE, read_text, resolve
from dsv4_operator.weights import HubError, Resolved

FAILURE_TTL_S: Final = 30.0
MAX_KEPT: Final = 256

Key = tuple[str, str, str, str]  # endpoint, repo, revision, token digest


class HfHub:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # huggingface_hub's tqdm bars: none in the operator's log, and no monitor thread (tqdm
        # starts one for any bar, even a disabled one, unless its interval is 0).
        disable_progress_bars()
        hf_tqdm.monitor_interval = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: dict[Key, Resolved] = {}
        self._failures: dict[Key, tuple[float, HubError]] = {}

    def resolve(self, source: HfSource, *, endpoint: str | None, token: str | None) -> Resolved:
        """`source` at the commit its revision names now (raises HubError)."""
        digest = hashlib.sha256((token or "").encode()).hexdigest()[:16]
        key = (endpoint or "", source.repo_id, source.revision, digest)
        now = self._clock()
        with self._lock:
            if (kept := self._answers.get(key)) is not None:
                return kept
            if (failed := self._failures.get(key)) is not None and now - failed[0] < FAILURE_TTL_S:
                raise failed[1]
        try:
            snapshot = resolve(source, endpoint=endpoint, token=token)
            config = None
            if snapshot.file(CONFIG_FILE) is not None:
                config = read_text(snapshot, CONFIG_FILE, endpoint=endpoint, token=token)
        except FetchError as exc:
            error = HubError(exc.reason, exc.message)
            with self._lock:
                self._failures[key] = (now, error)
            raise error from exc
        answer = Resolved(
            source, snapshot.commit, snapshot.total_bytes, len(snapshot.files), config
        )
        if is_commit(source.revision):
            with self._lock:
                if len(self._answers) >= MAX_KEPT:
                    self._answers.pop(next(iter(self._answers)))
                self._answers[key] = answer
                self._failures.pop(key, None)
        return answer
