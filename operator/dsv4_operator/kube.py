"""The Kubernetes API as the reconciler sees it: a small `Kube` protocol and its error type.

Pure: the implementation on the official client is `kube_api.ApiKube`; tests use fakes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

NAMESPACE_TERMINATING = "NamespaceTerminating"  # a Status cause: a create in a deleted namespace


class KubeError(Exception):
    """An API call failed. `retryable`: a conflict, throttling, timeout or server error.
    `cause`: the Status's first cause (NAMESPACE_TERMINATING: the namespace is being deleted,
    so nothing new may be created in it; what is there goes with it)."""

    def __init__(
        self, message: str, *, retryable: bool, status: int | None = None, cause: str = ""
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.cause = cause

    @property
    def namespace_terminating(self) -> bool:
        return self.cause == NAMESPACE_TERMINATING


class Kube(Protocol):
    def apply(self, obj: Mapping[str, Any]) -> None:
        """Server-side apply `obj` (namespaced; namespace in its metadata)."""
        ...

    def create(self, obj: Mapping[str, Any]) -> bool:
        """Create `obj` unless an object of its name exists (then leave it as it is and return
        False). The one write of a kind the operator may not read (Secrets)."""
        ...

    def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None: ...

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete (background propagation); a missing object is not an error."""
        ...

    def delete_pods(self, namespace: str, selector: str) -> None:
        """Delete every pod matching `selector` (one PP group)."""
        ...

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """JSON-merge-patch the DSV4Deployment's status subresource with `{"status": patch}`."""
        ...
