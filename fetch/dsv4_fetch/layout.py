"""The Hugging Face cache layout (`huggingface_hub`'s, so its tools and `hf_hub_download` read
what a fetch writes), plus this project's record of a verified snapshot:

    <cache>/models--ORG--NAME/
      blobs/<etag>                    a file's content, named by its sha256 (LFS) or git blob id
      blobs/<etag>.incomplete         a download in progress (a restarted fetch resumes it)
      snapshots/<commit>/<path>       a relative symlink to ../../blobs/<etag>
      refs/<branch or tag>            the commit it named when fetched
      .dsv4/<commit>.json             written last: every file checked, the tensors matched

Paths only, and the small writes that keep the layout consistent (a pointer, a ref, the record).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dsv4_common.api.model_source import HfSource, is_commit, repo_folder_name
from dsv4_fetch.hub import RepoFile, Snapshot

PARTIAL_SUFFIX: Final = ".incomplete"
RECORD_DIR: Final = ".dsv4"
RECORD_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class RepoCache:
    """One repo's folder in a cache directory."""

    cache_dir: Path
    repo_id: str

    @property
    def root(self) -> Path:
        return self.cache_dir / repo_folder_name(self.repo_id)

    def blob(self, f: RepoFile) -> Path:
        return self.root / "blobs" / f.etag

    def partial(self, f: RepoFile) -> Path:
        return self.partial_of(f.etag)

    def partial_of(self, etag: str) -> Path:
        return self.root / "blobs" / (etag + PARTIAL_SUFFIX)

    def snapshot_dir(self, commit: str) -> Path:
        return self.root / "snapshots" / commit

    def pointer(self, commit: str, f: RepoFile) -> Path:
        return self.snapshot_dir(commit).joinpath(*f.path.split("/"))

    def record_path(self, commit: str) -> Path:
        return self.root / RECORD_DIR / f"{commit}.json"

    # --- writes -----------------------------------------------------------------------------

    def link(self, commit: str, f: RepoFile) -> None:
        """snapshots/<commit>/<path> -> ../../blobs/<etag> (relative: the cache may be mounted
        anywhere)."""
        pointer = self.pointer(commit, f)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.blob(f), pointer.parent)
        if pointer.is_symlink() and os.readlink(pointer) == target:
            return
        tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(pointer)

    def write_ref(self, revision: str, commit: str) -> None:
        """refs/<revision> = commit, for a branch or tag (a commit needs none)."""
        if is_commit(revision):
            return
        ref = self.root / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(ref, commit)

    def read_ref(self, revision: str) -> str | None:
        if is_commit(revision):
            return revision
        try:
            commit = (self.root / "refs" / revision).read_text().strip()
        except OSError:
            return None
        return commit if is_commit(commit) else None

    def write_record(self, snapshot: Snapshot, checks: dict[str, Any]) -> None:
        """The snapshot is complete and verified: every file, its size and hash, and what was
        checked. Written last, atomically."""
        doc = {
            "version": RECORD_VERSION,
            "repo_id": snapshot.repo_id,
            "commit": snapshot.commit,
            "files": {
                f.path: {"size": f.size, "blob_id": f.blob_id, "sha256": f.sha256}
                for f in snapshot.files
            },
            "checks": checks,
        }
        path = self.record_path(snapshot.commit)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, json.dumps(doc, indent=1, sort_keys=True))

    def read_record(self, commit: str) -> Snapshot | None:
        """The verified snapshot of `commit`, if a fetch completed it and every file is still
        there at its size; else None."""
        try:
            doc = json.loads(self.record_path(commit).read_text())
            files = tuple(
                RepoFile(path, int(v["size"]), str(v["blob_id"]), v.get("sha256"))
                for path, v in sorted(doc["files"].items())
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if doc.get("version") != RECORD_VERSION or doc.get("commit") != commit:
            return None
        for f in files:
            try:
                if self.pointer(commit, f).stat().st_size != f.size:
                    return None
            except OSError:
                return None
        return Snapshot(HfSource(self.repo_id, commit), commit, files)

    def record_checks(self, commit: str) -> dict[str, Any]:
        try:
            checks = json.loads(self.record_path(commit).read_text()).get("checks")
        except (OSError, ValueError, AttributeError):
            return {}
        return checks if isinstance(checks, dict) else {}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
