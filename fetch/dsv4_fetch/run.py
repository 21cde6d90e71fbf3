"""`dsv4 fetch hf://ORG/NAME[@REV]`: one fetch as a process, which is what the operator's
download Job runs, and what `dsv4 up` and `dsv4 serve --model hf://...` call in-process
(`fetch_with_progress`).

Progress goes to stderr (a bar on a terminal, else a line each 10% and each minute), and, with
`--progress-port`, to `GET /progress`. With `--termination-log` the final document is written
there (the kubelet shows it in the pod's status). Exit codes: 0 complete; 3 failed in a way a
retry cannot fix (the Job's podFailurePolicy fails the Job at once); 1 failed, retryable; 2 a
bad argument.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Final, TextIO

from huggingface_hub import constants, get_token
from huggingface_hub.utils import disable_progress_bars

from dsv4_common.api.fetch_status import (
    EXIT_PERMANENT,
    EXIT_RETRY,
    EXIT_USAGE,
    FetchStatus,
    fetch_status_to_dict,
    termination_text,
)
from dsv4_common.api.model_source import HfSource, SourceError, parse_model_source
from dsv4_fetch.errors import FetchError
from dsv4_fetch.fetch import Fetched, FetchOptions, fetch
from dsv4_fetch.progress import Progress
from dsv4_fetch.progress_server import ProgressServer

EXIT_OK: Final = 0
TICK_S: Final = 1.0
LOG_EVERY_S: Final = 60.0
GIB: Final = 1 << 30


def parse_hf(text: str) -> HfSource:
    """An hf:// source, or SourceError naming what is wrong."""
    source = parse_model_source(text, relative_ok=True)
    if not isinstance(source, HfSource):
        raise SourceError(f"{text!r}: dsv4 fetch takes hf://ORG/NAME[@REVISION]")
    return source


def default_cache_dir() -> Path:
    """HF_HUB_CACHE (or HF_HOME/hub), as huggingface_hub reads them."""
    return Path(constants.HF_HUB_CACHE)


def run(args: argparse.Namespace) -> int:
    try:
        source = parse_hf(args.source)
    except SourceError as exc:
        print(f"dsv4 fetch: error: source: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = FetchOptions(
        cache_dir=Path(args.cache_dir) if args.cache_dir else default_cache_dir(),
        endpoint=args.endpoint,
        token=None if args.offline else get_token(),
        workers=args.workers,
        offline=args.offline,
    )
    progress = Progress(source.uri)
    server = None
    if args.progress_port is not None:
        try:
            server = ProgressServer(args.progress_host, args.progress_port, progress.snapshot)
        except OSError as exc:
            print(
                f"dsv4 fetch: error: --progress-port {args.progress_port}: {exc}", file=sys.stderr
            )
            return EXIT_USAGE
        where = f"http://{args.progress_host}:{server.port}/progress"
        print(f"dsv4 fetch: progress on {where}", file=sys.stderr, flush=True)
    try:
        done, status = fetch_with_progress(source, options, progress, style=args.progress)
    finally:
        if server is not None:
            server.close()
    if args.termination_log:
        with contextlib.suppress(OSError):
            Path(args.termination_log).write_text(termination_text(status))
    if args.json:
        print(json.dumps(fetch_status_to_dict(status)))
    elif done is not None:
        print(done.path)
    if status.phase == "complete":
        return EXIT_OK
    retryable = status.reason == "HubUnavailable"
    return EXIT_RETRY if retryable else EXIT_PERMANENT


def fetch_for_serve(
    source: HfSource, *, offline: bool, endpoint: str | None = None
) -> tuple[Path | None, str]:
    """`dsv4 serve --model hf://...`: the snapshot's directory in the local cache (token:
    HF_TOKEN or the saved login; endpoint: HF_ENDPOINT), or None and why."""
    options = FetchOptions(
        cache_dir=default_cache_dir(),
        endpoint=endpoint,
        token=None if offline else get_token(),
        offline=offline,
    )
    done, status = fetch_with_progress(source, options, say_failure=False)
    if done is None:
        return None, f"{status.reason}: {status.message}"
    return done.path, ""


def fetch_with_progress(
    source: HfSource,
    options: FetchOptions,
    progress: Progress | None = None,
    *,
    style: str = "auto",
    out: TextIO | None = None,
    say_failure: bool = True,
) -> tuple[Fetched | None, FetchStatus]:
    """Fetch, showing progress on `out` (stderr); the snapshot (None on failure) and the final
    document. Never raises FetchError: a failure is the document's reason and message (printed
    too unless `say_failure` is False: a caller that names its own flag or field says it)."""
    out = out or sys.stderr
    progress = progress or Progress(source.uri)
    disable_progress_bars()  # huggingface_hub's per-file bars; ours covers the whole fetch
    if style == "auto":
        style = "bar" if out.isatty() else "log"
    with _ticker(progress, style, out):
        try:
            done = fetch(source, options, progress)
        except FetchError as exc:
            status = replace(progress.snapshot(), phase="failed", reason=exc.reason)
            status = replace(status, message=exc.message, eta_seconds=None)
            progress.finish(status)
            if style != "none" and say_failure:
                print(f"dsv4 fetch: {exc}", file=out, flush=True)
            return None, status
    status = replace(
        progress.snapshot(),
        phase="complete",
        eta_seconds=0.0,
        message=done.checked,
        draft_layers=done.draft_layers,
    )
    progress.finish(status)
    if style != "none":
        print(
            f"dsv4 fetch: {source.uri} is {done.snapshot.commit} in {done.path} ({done.checked})",
            file=out,
            flush=True,
        )
    return done, status


@contextlib.contextmanager
def _ticker(progress: Progress, style: str, out: TextIO) -> Iterator[None]:
    """Samples the rate each second (the progress server reads the same meter) and shows it."""
    stop = threading.Event()
    show = _Bar(out) if style == "bar" else _Lines(out) if style == "log" else None

    def tick() -> None:
        while not stop.wait(TICK_S):
            status = progress.snapshot()
            if show is not None:
                show.update(status)

    thread = threading.Thread(target=tick, name="fetch-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if show is not None:
            show.close(progress.snapshot())


def describe(s: FetchStatus) -> str:
    """`42% 1.20/2.86 GiB 3/12 files 85.0 MB/s ETA 20 s`."""
    eta = "" if s.eta_seconds is None else f" ETA {_duration(s.eta_seconds)}"
    return (
        f"{s.percent}% {s.bytes_done / GIB:.2f}/{s.bytes_total / GIB:.2f} GiB "
        f"{s.files_done}/{s.files_total} files {s.bytes_per_second / 1e6:.1f} MB/s{eta}"
    )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Bar:
    """One tqdm bar over the whole fetch (bytes)."""

    def __init__(self, out: TextIO) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=0, unit="B", unit_scale=True, file=out, desc="fetch", leave=True)

    def update(self, s: FetchStatus) -> None:
        if s.bytes_total and self._bar.total != s.bytes_total:
            self._bar.total = s.bytes_total
        self._bar.n = s.bytes_done
        self._bar.set_postfix_str(f"{s.files_done}/{s.files_total} files", refresh=False)
        self._bar.refresh()

    def close(self, s: FetchStatus) -> None:
        self.update(s)
        self._bar.close()


class _Lines:
    """A line at each 10% and at least each minute (logs, the Job's pod)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._decile = -1
        self._last = 0.0

    def update(self, s: FetchStatus) -> None:
        if s.phase != "downloading" or not s.bytes_total:
            return
        decile, now = s.percent // 10, time.monotonic()
        if decile != self._decile or now - self._last >= LOG_EVERY_S:
            self._decile, self._last = decile, now
            print(f"dsv4 fetch: {s.source}: {describe(s)}", file=self._out, flush=True)

    def close(self, s: FetchStatus) -> None:
        return None
