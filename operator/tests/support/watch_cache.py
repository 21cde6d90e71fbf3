"""The fake API server's event history with compaction, and its paginated lists; pure. What
each part restates (k8s.io/apiserver):

- `History.since`: pkg/storage/cacher/watch_cache_history.go, GetIntervalLocked: a watch from
  a resourceVersion older than the oldest event kept, less one, is answered `410 Expired`
  "too old resource version: R (C)" (the cacher sends it as an ERROR event in the watch
  stream: cacher.go, newErrWatcher). History is lost by compaction (etcd's, every 5 minutes by
  default) and by the window's size (the watch cache's capacity): `compact()` and `window`.
- `Pages`: pkg/storage/continue.go (EncodeContinue, DecodeContinue, PrepareContinueToken) and
  pkg/storage/etcd3 (store.go GetList, errors.go): `limit` cuts a list in key order and hands
  out a continue token (base64url JSON {"v":"meta.k8s.io/v1","rv":R,"start":KEY}); every
  page of one list is read at the first page's resourceVersion; `remainingItemCount` is set
  only when no selector filters the list; a token from before the compaction is refused with
  410 Expired (inconsistentContinue), and the Status carries a token with rv -1 that continues
  at the latest version; a malformed token is 400 "invalid continue token: ..."; a continue
  with a resourceVersion is 400.
"""

from __future__ import annotations

import base64
import binascii
import json
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

Obj = Mapping[str, Any]

EXPIRED_CONTINUE: Final = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter, or use the continue token in this "
    "response to retrieve the remainder of the results. Continuing with the provided token "
    "results in an inconsistent list - objects that were created, modified, or deleted "
    "between the time the first chunk was returned and now may show up in the list."
)


class Expired(Exception):
    """410 Gone, reason Expired; `continue_token` goes into the Status's metadata."""

    def __init__(self, message: str, continue_token: str = "") -> None:
        super().__init__(message)
        self.message, self.continue_token = message, continue_token


class BadRequest(Exception):
    """400 BadRequest with this message."""


class _Versioned(Protocol):
    @property
    def rv(self) -> int: ...


E = TypeVar("E", bound=_Versioned)


@dataclass
class History(Generic[E]):
    """Events in resourceVersion order. `compacted_rv`: the newest resourceVersion whose
    history is gone; a watch may resume from it or later. `window`: events kept at most
    (None: all until `compact`)."""

    window: int | None = None
    events: list[E] = field(default_factory=list)
    compacted_rv: int = 0

    def append(self, event: E) -> None:
        self.events.append(event)
        if self.window is not None and len(self.events) > self.window:
            dropped = self.events[: len(self.events) - self.window]
            self.events = self.events[len(dropped) :]
            self.compacted_rv = max(self.compacted_rv, dropped[-1].rv)

    def compact(self, rv: int) -> None:
        """Forget every event up to and including `rv`."""
        self.events = [e for e in self.events if e.rv > rv]
        self.compacted_rv = max(self.compacted_rv, rv)

    def since(self, rv: int) -> list[E]:
        """The events after `rv`; Expired when some of them are gone."""
        if rv < self.compacted_rv:
            raise Expired(f"too old resource version: {rv} ({self.compacted_rv})")
        return [e for e in self.events if e.rv > rv]


# ---------------------------------------------------------------------------------------------
# Paginated lists


def encode_continue(rv: int, start_key: str) -> str:
    token = {"v": "meta.k8s.io/v1", "rv": rv, "start": start_key}
    raw = json.dumps(token, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    """(rv, start key) of a continue token; BadRequest as DecodeContinue refuses it."""
    invalid = "invalid continue token: continue key is not valid"
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        decoded = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{invalid}: {exc}") from exc
    if not isinstance(decoded, dict):
        raise BadRequest(invalid)
    if decoded.get("v") != "meta.k8s.io/v1":
        raise BadRequest(
            f"{invalid}: server does not recognize this encoded version {decoded.get('v')}"
        )
    rv, start = decoded.get("rv"), decoded.get("start")
    if not isinstance(rv, int) or isinstance(rv, bool) or rv == 0:
        raise BadRequest(
            f"{invalid}: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
        )
    if not isinstance(start, str) or not start:
        raise BadRequest(f"{invalid}: encoded start key empty (version meta.k8s.io/v1)")
    key = start if start.startswith("/") else "/" + start
    if posixpath.normpath(key) != key:  # no way out of the listed prefix
        raise BadRequest(f"{invalid}: {start}")
    return rv, start


@dataclass(frozen=True)
class Page:
    items: list[Obj]
    resource_version: int  # the list's: the same on every page of one list
    continue_token: str = ""
    remaining_item_count: int | None = None


@dataclass
class Pages:
    """Snapshots of the lists being paged through, by (resourceVersion, resource type)."""

    max_snapshots: int = 256
    snapshots: dict[tuple[int, str], list[tuple[str, Obj]]] = field(default_factory=dict)

    def forget_before(self, rv: int) -> None:
        """Compaction: the snapshots older than `rv` are gone."""
        self.snapshots = {k: v for k, v in self.snapshots.items() if k[0] >= rv}

    def page(
        self,
        type_key: str,
        current: Sequence[tuple[str, Obj]],
        *,
        namespace: str,
        rv_now: int,
        compacted_rv: int,
        limit: int,
        token: str,
        keep: Callable[[Obj], bool],
        filtered: bool,
    ) -> Page:
        """One page of a list. `current`: the type's objects now, by etcd key (`namespace/name`,
        or `name` when cluster-scoped); `namespace`: the list's ("" for all); `keep`: the
        request's selectors; `filtered`: whether any selector is set (then no
        remainingItemCount: the count would include objects the selectors drop)."""
        start = ""
        list_rv = rv_now
        objects: Sequence[tuple[str, Obj]] = current
        if token:
            rv, start = decode_continue(token)
            if rv != -1:
                snapshot = self.snapshots.get((rv, type_key))
                if rv < compacted_rv or snapshot is None:
                    raise Expired(EXPIRED_CONTINUE, encode_continue(-1, start))
                objects, list_rv = snapshot, rv
        ordered = sorted(objects, key=lambda item: item[0])
        if limit > 0 and (list_rv, type_key) not in self.snapshots:
            self._remember((list_rv, type_key), ordered)
        prefix = f"{namespace}/" if namespace else ""
        after = [(k, o) for k, o in ordered if k >= start and k.startswith(prefix)]
        chosen = [(k, o) for k, o in after if keep(o)]
        if limit <= 0 or len(chosen) <= limit:
            return Page([o for _, o in chosen], list_rv)
        last_key = chosen[limit - 1][0]
        remaining = None if filtered else len(after) - limit
        return Page(
            [o for _, o in chosen[:limit]],
            list_rv,
            encode_continue(list_rv, last_key + "\x00"),
            remaining,
        )

    def _remember(self, key: tuple[int, str], ordered: list[tuple[str, Obj]]) -> None:
        self.snapshots[key] = ordered
        while len(self.snapshots) > self.max_snapshots:
            del self.snapshots[min(self.snapshots)]
