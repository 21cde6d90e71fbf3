"""A whole fetch: resolve the revision, refuse a volume that cannot hold what is left, download
every file (several at once, largest first), check the checkpoint's tensors against the plan's,
and record the snapshot as verified. Offline, only a verified snapshot in the cache is taken.

    1. resolve: `source.revision` -> a commit and its files (the hub's sizes and hashes)
    2. a snapshot already recorded as verified is done (no byte moves)
    3. space: what is left to download (less what partial files hold) must fit the volume
    4. download the files (`download.fetch_file`: resumable, each one hashed)
    5. check: config.json's model and the safetensors headers against the planner's tensor
       list (`dsv4_common.plan.checkpoint_match`); a mismatch names the first differing tensor
    6. record the snapshot (`layout.RepoCache.write_record`), written last
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dsv4_common.api.model_source import HfSource
from dsv4_common.core.hf import parse_hf_config
from dsv4_common.core.model import DSV4Config, ModelConfig, ModelConfigError
from dsv4_common.plan.checkpoint_match import first_mismatch, has_draft_layers, published_names
from dsv4_fetch.download import fetch_file, partial_bytes
from dsv4_fetch.errors import FetchError
from dsv4_fetch.hub import CONFIG_FILE, RepoFile, Snapshot, resolve
from dsv4_fetch.layout import RepoCache
from dsv4_fetch.progress import Progress
from dsv4_fetch.tensor_index import read_index

DEFAULT_WORKERS: Final = 8


@dataclass(frozen=True, slots=True)
class FetchOptions:
    cache_dir: Path
    endpoint: str | None = None  # None: HF_ENDPOINT, else huggingface.co
    token: str | None = None
    workers: int = DEFAULT_WORKERS
    offline: bool = False
    check_tensors: bool = True


@dataclass(frozen=True, slots=True)
class Fetched:
    snapshot: Snapshot
    path: Path  # snapshots/<commit>: the model directory
    checked: str  # what the tensor check found, in words
    draft_layers: bool  # the checkpoint holds the MTP layers too, as the plan counts them


def fetch(source: HfSource, options: FetchOptions, progress: Progress) -> Fetched:
    """Steps 1-6 above; raises FetchError."""
    if options.offline:
        return cached(source, options)
    snapshot = resolve(source, endpoint=options.endpoint, token=options.token)
    cache = RepoCache(options.cache_dir, source.repo_id)
    cache.root.mkdir(parents=True, exist_ok=True)
    cache.write_ref(source.revision, snapshot.commit)
    done = cache.read_record(snapshot.commit)
    if done is not None:
        files = len(done.files)
        progress.start(snapshot.commit, done.total_bytes, files, done.total_bytes, files)
        return _fetched(Snapshot(source, done.commit, done.files), cache)
    held = {f.path: partial_bytes(f, cache) for f in snapshot.files}
    complete = [f for f in snapshot.files if held[f.path] == f.size]
    progress.start(
        snapshot.commit,
        snapshot.total_bytes,
        len(snapshot.files),
        sum(held.values()),
        len(complete),
    )
    check_space(snapshot, cache, held)
    _download_all(snapshot, cache, options, progress)
    progress.phase("checking")
    checks = check_checkpoint(snapshot, cache) if options.check_tensors else {}
    cache.write_record(snapshot, checks)
    return _fetched(snapshot, cache)


def cached(source: HfSource, options: FetchOptions) -> Fetched:
    """The verified snapshot `source` names in the cache, without the network."""
    cache = RepoCache(options.cache_dir, source.repo_id)
    commit = cache.read_ref(source.revision)
    snapshot = cache.read_record(commit) if commit is not None else None
    if snapshot is None:
        what = (
            f"revision {source.revision!r} was never fetched"
            if commit is None
            else (f"commit {commit} is not complete and verified")
        )
        raise FetchError(
            "NotCached",
            f"{source.uri}: offline, and the cache {options.cache_dir} lacks it ({what}): fetch "
            "it once with the network (dsv4 fetch)",
        )
    return _fetched(Snapshot(source, snapshot.commit, snapshot.files), cache)


def check_space(snapshot: Snapshot, cache: RepoCache, held: dict[str, int]) -> None:
    """VolumeTooSmall when the bytes left to download exceed what the volume has free."""
    need = sum(f.size - held[f.path] for f in snapshot.files)
    free = shutil.disk_usage(cache.root).free
    if need > free:
        raise FetchError(
            "VolumeTooSmall",
            f"{snapshot.source.uri}: {_gib(need)} left to download ({len(snapshot.files)} files, "
            f"{_gib(snapshot.total_bytes)} in all) but the cache volume has {_gib(free)} free "
            f"({cache.cache_dir}): use a larger volume (spec.model.cache)",
        )


def check_checkpoint(snapshot: Snapshot, cache: RepoCache) -> dict[str, object]:
    """The repo's config.json and tensors against the planner's list (TensorMismatch)."""
    root = cache.snapshot_dir(snapshot.commit)
    if snapshot.file(CONFIG_FILE) is None:
        raise FetchError("TensorMismatch", f"{snapshot.source.uri}: the repo has no config.json")
    try:
        text = (root / CONFIG_FILE).read_text(encoding="utf-8")
        model: ModelConfig = parse_hf_config(text, name=snapshot.repo_id.rsplit("/", 1)[-1])
    except (OSError, UnicodeDecodeError, ModelConfigError) as exc:
        raise FetchError("TensorMismatch", f"{snapshot.source.uri}: config.json: {exc}") from exc
    index = read_index(root)
    if not isinstance(model, DSV4Config):
        return {"tensors": len(index), "summary": "no per-tensor list for this model family"}
    if not published_names(index):
        summary = (
            "tensors in transformers' names: not compared (the worker checks them as it loads)"
        )
        return {"tensors": len(index), "summary": summary}
    mismatch = first_mismatch(model, index, with_draft=False)
    if mismatch is not None:
        raise FetchError(
            "TensorMismatch",
            f"{snapshot.source.uri}@{snapshot.commit[:12]}: {mismatch.message}",
        )
    draft = first_mismatch(model, index, with_draft=True) is None and has_draft_layers(model, index)
    summary = f"{len(index)} tensors match the plan of {model.name}"
    if not draft:
        summary += " (without MTP layers: speculative decoding cannot use this checkpoint)"
    return {"tensors": len(index), "draft_layers": draft, "summary": summary}


class _Stopped(Exception):
    """Another file failed: this one stops where it is (its partial stays, for a resume)."""


def _download_all(
    snapshot: Snapshot, cache: RepoCache, options: FetchOptions, progress: Progress
) -> None:
    stop = threading.Event()

    def grew(delta: int) -> None:
        if delta > 0 and stop.is_set():
            raise _Stopped
        progress.add_bytes(delta)

    def one(f: RepoFile) -> None:
        already = partial_bytes(f, cache) == f.size
        fetch_file(snapshot, f, cache, endpoint=options.endpoint, token=options.token, grew=grew)
        if not already:
            progress.file_done()

    pool = ThreadPoolExecutor(max_workers=max(1, options.workers), thread_name_prefix="fetch")
    try:
        futures = [pool.submit(one, f) for f in sorted(snapshot.files, key=lambda f: -f.size)]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [e for fut in finished if (e := fut.exception()) is not None]
        if errors:
            stop.set()
            first = next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
            raise first
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _fetched(snapshot: Snapshot, cache: RepoCache) -> Fetched:
    checks = cache.record_checks(snapshot.commit)
    return Fetched(
        snapshot=snapshot,
        path=cache.snapshot_dir(snapshot.commit),
        checked=str(checks.get("summary", "not checked")),
        draft_layers=bool(checks.get("draft_layers", False)),
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
