"""The hub's side of a fetch, through `huggingface_hub`: a revision resolved to a commit with its
file list (`HfApi.model_info(files_metadata=True)`: sizes, git blob ids, LFS sha256), one small
file's text (config.json, through `hf_hub_download`) and the hub's errors as `FetchError`s.

`endpoint` None means `HF_ENDPOINT`, else huggingface.co; `token` None means no token (never the
one a user may have saved on this machine: what a fetch may read must not depend on it).
"""

from __future__ import annotations

import contextlib
import errno
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx2
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils import disable_progress_bars

from dsv4_common.api.model_source import HfSource
from dsv4_fetch.errors import FetchError

CONFIG_FILE: Final = "config.json"
RESOLVE_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class RepoFile:
    path: str  # relative to the repo root, '/'-separated
    size: int
    blob_id: str  # the git object id (sha1 of "blob <size>\0" + content, for a non-LFS file)
    sha256: str | None = None  # LFS files: the content's sha256

    @property
    def etag(self) -> str:
        """What the hub's ETag names the content by, and the cache names its blob by."""
        return self.sha256 if self.sha256 is not None else self.blob_id


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A repo at one commit: every file, as the hub lists it."""

    source: HfSource  # as asked (its revision may be a branch or tag)
    commit: str
    files: tuple[RepoFile, ...]
    gated: bool = False

    @property
    def repo_id(self) -> str:
        return self.source.repo_id

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> RepoFile | None:
        return next((f for f in self.files if f.path == path), None)


def resolve(source: HfSource, *, endpoint: str | None, token: str | None) -> Snapshot:
    """The commit `source.revision` names now, with its files (one API call)."""
    api = HfApi(endpoint=endpoint, token=token or False)
    with hub_errors(source):
        info = api.model_info(
            source.repo_id, revision=source.revision, files_metadata=True, timeout=RESOLVE_TIMEOUT_S
        )
    if not info.sha:
        raise FetchError("HubUnavailable", f"{source.uri}: the hub named no commit")
    files = []
    for sibling in info.siblings or []:
        if sibling.size is None or sibling.blob_id is None:
            raise FetchError(
                "HubUnavailable", f"{source.uri}: the hub gave no size or blob id for "
                f"{sibling.rfilename} (is the endpoint a Hugging Face hub?)"
            )  # fmt: skip
        sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
        if sibling.lfs is not None and sibling.lfs.size != sibling.size:
            raise FetchError(
                "SizeMismatch",
                f"{source.uri}: {sibling.rfilename}: the hub lists {sibling.size} bytes but its "
                f"LFS object has {sibling.lfs.size}",
            )
        files.append(RepoFile(sibling.rfilename, sibling.size, sibling.blob_id, sha256))
    return Snapshot(source, info.sha, tuple(files), gated=bool(info.gated))


def read_text(snapshot: Snapshot, path: str, *, endpoint: str | None, token: str | None) -> str:
    """One (small) file of the snapshot as text, through a throwaway cache (without
    huggingface_hub's per-file bar: the caller says what it reads)."""
    if snapshot.file(path) is None:
        raise FetchError("NotFound", f"{snapshot.source.uri}: the repo has no {path}")
    disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="dsv4-hub-") as tmp, hub_errors(snapshot.source):
        local = hf_hub_download(
            snapshot.repo_id,
            path,
            revision=snapshot.commit,
            cache_dir=tmp,
            endpoint=endpoint,
            token=token or False,
        )
        return Path(local).read_text(encoding="utf-8")


@contextlib.contextmanager
def hub_errors(source: HfSource, what: str = "") -> Iterator[None]:
    """The hub's exceptions as FetchErrors naming the source (and `what`: a file)."""
    where = f"{source.uri}{': ' + what if what else ''}"
    try:
        yield
    except hf_errors.GatedRepoError as exc:
        raise FetchError(
            "Unauthorized",
            f"{where}: the repo is gated ({_status(exc)}): give a token whose account was "
            "granted access (spec.model.hub.tokenSecretRef, or HF_TOKEN)",
        ) from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise FetchError(
            "NotFound", f"{where}: no revision {source.revision!r} ({_status(exc)})"
        ) from exc
    except hf_errors.RemoteEntryNotFoundError as exc:
        raise FetchError("NotFound", f"{where}: no such file ({_status(exc)})") from exc
    except hf_errors.EntryNotFoundError as exc:
        raise FetchError("NotFound", f"{where}: no such file ({exc})") from exc
    except hf_errors.RepositoryNotFoundError as exc:
        status = _status(exc)
        if status.startswith(("401", "403")):
            raise FetchError(
                "Unauthorized",
                f"{where}: {status}: the repo is private or gated, or does not exist; give a "
                "token that may read it (spec.model.hub.tokenSecretRef, or HF_TOKEN)",
            ) from exc
        raise FetchError("NotFound", f"{where}: no such repo ({status})") from exc
    except hf_errors.HfHubHTTPError as exc:
        status = _status(exc)
        if status.startswith(("401", "403")):
            raise FetchError(
                "Unauthorized", f"{where}: {status}: the token may not read this repo"
            ) from exc
        raise FetchError("HubUnavailable", f"{where}: {status}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise  # the volume's, not the hub's: the caller names it
        raise FetchError("HubUnavailable", f"{where}: {type(exc).__name__}: {exc}") from exc
    except httpx2.HTTPError as exc:
        raise FetchError("HubUnavailable", f"{where}: {type(exc).__name__}: {exc}") from exc


def _status(exc: hf_errors.HfHubHTTPError) -> str:
    response = getattr(exc, "response", None)
    if response is None:
        return "no response"
    return f"{response.status_code} {response.reason_phrase}".strip()
