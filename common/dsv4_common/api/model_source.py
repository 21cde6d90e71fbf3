"""Where a model's files come from: `hf://ORG/NAME[@REVISION]` (the Hugging Face hub, or a
mirror), `pvc://CLAIM[/PATH]` (a PersistentVolumeClaim someone filled) or a local path (`dsv4 up`,
`dsv4 serve`). One parser for the CR's `spec.model.source`, `dsv4 serve --model` and `dsv4 fetch`,
so a bad reference fails the same way everywhere, before anything is fetched. Pure.

The shapes (the CRD's `pattern` says the same; `parse_model_source` adds the few rules a pattern
cannot state, each named in its message):
- hf://ORG/NAME: each part letters, digits, '_', '.', '-', starting and ending with a letter, digit
  or '_'; no '--' or '..'; not ending in '.git'; at most 96 characters together (the hub's rule
  for repo ids). `@REVISION`: a branch, a tag or a 40-hex commit (`refs/pr/1` too); without it,
  `main`.
- pvc://CLAIM[/PATH]: a claim name (DNS subdomain) and an optional relative path inside it, whose
  segments are letters, digits, '_', '.', '-' and never '.' or '..'.
- a local path: absolute for a CR (`dsv4 up` only: a cluster cannot read it); `dsv4 serve` also
  takes a relative one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_REVISION",
    "HF_CACHE_MOUNT_PATH",
    "HF_SCHEME",
    "PVC_MOUNT_PATH",
    "PVC_SCHEME",
    "SOURCE_PATTERN",
    "HfSource",
    "LocalSource",
    "ModelSource",
    "PvcSource",
    "SourceError",
    "is_commit",
    "parse_model_source",
    "repo_folder_name",
    "snapshot_path",
]

# Where worker pods mount a pvc:// claim (its PATH as the mount's subPath) and an hf:// source's
# cache claim (a Hugging Face cache: models--ORG--NAME/snapshots/COMMIT inside).
PVC_MOUNT_PATH: Final = "/var/lib/dsv4/weights"
HF_CACHE_MOUNT_PATH: Final = "/var/lib/dsv4/hf"
HF_SCHEME: Final = "hf://"
PVC_SCHEME: Final = "pvc://"
DEFAULT_REVISION: Final = "main"
MAX_REPO_ID_LENGTH: Final = 96  # huggingface_hub's validate_repo_id
MAX_REVISION_LENGTH: Final = 255
MAX_SOURCE_LENGTH: Final = 1024

_PART: Final = r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_REVISION: Final = r"[A-Za-z0-9_]([A-Za-z0-9_./-]*[A-Za-z0-9_])?"
_CLAIM: Final = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
_SEGMENT: Final = r"[A-Za-z0-9_.-]+"
# The CRD's `pattern` of spec.model.source (RE2 and ECMA alike: no lookarounds).
SOURCE_PATTERN: Final = rf"^(hf://{_PART}/{_PART}(@{_REVISION})?|pvc://{_CLAIM}(/{_SEGMENT})*|/.*)$"
_HF: Final = re.compile(rf"^hf://(?P<repo>{_PART}/{_PART})(@(?P<rev>{_REVISION}))?$")
_PVC: Final = re.compile(rf"^pvc://(?P<claim>{_CLAIM})(?P<path>(/{_SEGMENT})*)$")
_COMMIT: Final = re.compile(r"^[0-9a-f]{40}$")


class SourceError(ValueError):
    """A model source that cannot be parsed; the message says which rule it breaks."""


@dataclass(frozen=True, slots=True)
class HfSource:
    repo_id: str  # ORG/NAME
    revision: str = DEFAULT_REVISION  # a branch, tag or commit, as written

    @property
    def uri(self) -> str:
        return f"{HF_SCHEME}{self.repo_id}@{self.revision}"

    @property
    def pinned(self) -> bool:
        """The revision is a commit: it names the same files forever."""
        return is_commit(self.revision)

    def at(self, commit: str) -> HfSource:
        """The same repo at a resolved commit."""
        return HfSource(self.repo_id, commit)


@dataclass(frozen=True, slots=True)
class PvcSource:
    claim: str
    path: str = ""  # relative, inside the claim ("": its root)

    @property
    def uri(self) -> str:
        return f"{PVC_SCHEME}{self.claim}" + (f"/{self.path}" if self.path else "")


@dataclass(frozen=True, slots=True)
class LocalSource:
    path: str

    @property
    def uri(self) -> str:
        return self.path


ModelSource = HfSource | PvcSource | LocalSource


def is_commit(revision: str) -> bool:
    return bool(_COMMIT.match(revision))


def repo_folder_name(repo_id: str) -> str:
    """A model repo's folder in a Hugging Face cache (huggingface_hub's layout)."""
    return "models--" + repo_id.replace("/", "--")


def snapshot_path(cache_dir: str, repo_id: str, commit: str) -> str:
    """Where a commit's files are in a Hugging Face cache at `cache_dir` ('/'-joined)."""
    return f"{cache_dir.rstrip('/')}/{repo_folder_name(repo_id)}/snapshots/{commit}"


def parse_model_source(text: str, *, relative_ok: bool = False) -> ModelSource:
    """`text` as a source. `relative_ok`: a relative local path is accepted (the CLI's
    `--model`); a CR's local path must be absolute. Raises SourceError."""
    if len(text) > MAX_SOURCE_LENGTH:
        raise SourceError(f"at most {MAX_SOURCE_LENGTH} characters, got {len(text)}")
    if text.startswith(HF_SCHEME):
        return _hf(text)
    if text.startswith(PVC_SCHEME):
        return _pvc(text)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise SourceError(
            f"unknown scheme {scheme}://: use hf://ORG/NAME[@REVISION], pvc://CLAIM[/PATH] or a "
            "local path"
        )
    if not text:
        raise SourceError("must not be empty")
    if not text.startswith("/") and not relative_ok:
        raise SourceError(f"a local path must be absolute, got {text!r}")
    return LocalSource(text)


def _hf(text: str) -> HfSource:
    match = _HF.match(text)
    if match is None:
        raise SourceError(
            f"{text!r} is not hf://ORG/NAME[@REVISION] (ORG and NAME: letters, digits, '_', '.', "
            "'-', starting and ending with a letter, digit or '_'; REVISION: a branch, tag or "
            "commit)"
        )
    repo, revision = match["repo"], match["rev"] or DEFAULT_REVISION
    if "--" in repo or ".." in repo:
        raise SourceError(f"{text!r}: a repo id may not contain '--' or '..'")
    if repo.endswith(".git"):
        raise SourceError(f"{text!r}: a repo id may not end in '.git'")
    if len(repo) > MAX_REPO_ID_LENGTH:
        raise SourceError(
            f"{text!r}: a repo id has at most {MAX_REPO_ID_LENGTH} characters, got {len(repo)}"
        )
    if len(revision) > MAX_REVISION_LENGTH or ".." in revision or "//" in revision:
        raise SourceError(
            f"{text!r}: the revision must be a git branch, tag or commit (at most "
            f"{MAX_REVISION_LENGTH} characters, no '..' or '//')"
        )
    return HfSource(repo, revision)


def _pvc(text: str) -> PvcSource:
    match = _PVC.match(text)
    if match is None or len(match["claim"]) > 253:
        raise SourceError(
            f"{text!r} is not pvc://CLAIM[/PATH] (CLAIM: a PersistentVolumeClaim name; PATH: "
            "segments of letters, digits, '_', '.', '-')"
        )
    path = match["path"].removeprefix("/")
    if any(seg in (".", "..") for seg in path.split("/")):
        raise SourceError(f"{text!r}: the path inside the claim may not hold '.' or '..' segments")
    return PvcSource(match["claim"], path)
