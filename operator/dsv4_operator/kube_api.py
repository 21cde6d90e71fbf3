"""`Kube` on the official `kubernetes` client (dynamic client, server-side apply with
fieldManager `dsv4-operator` and forced conflicts on the fields we own).

The only module that talks to the API server.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from dsv4_operator import labels as L
from dsv4_operator.kube import KubeError

_RETRYABLE = {409, 429, 500, 502, 503, 504}
# A kind found not served (an add-on's CRD, e.g. Volcano's PodGroup, not installed) is answered
# from memory for this long: each failed lookup makes the client refetch all of discovery.
UNSERVED_RECHECK_S: Final = 300.0


class ApiKube:
    """`Kube` on `kubernetes.dynamic.DynamicClient` (synchronous; kopf runs sync handlers in
    threads, which share one instance)."""

    def __init__(
        self,
        api_client: Any,
        request_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import dynamic

        self._dyn = dynamic.DynamicClient(api_client)  # type: ignore[no-untyped-call]
        self._timeout_s = request_timeout_s
        self._clock = clock
        self._unserved: dict[tuple[str, str], float] = {}  # kind -> when found not served
        # The DynamicClient's discovery cache is not thread-safe: a lookup that misses resets
        # it while another thread fills it (KeyError). One discovery at a time.
        self._discovery = threading.Lock()

    @classmethod
    def from_environment(cls, request_timeout_s: float = 30.0) -> ApiKube:
        """In-cluster config when running in a pod, else the local kubeconfig."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(client.ApiClient(), request_timeout_s)

    def _resource(self, api_version: str, kind: str) -> Any:
        """The kind's API resource. Discovery is lazy (the first use of a group asks the API
        server), so its failures are mapped to `KubeError` like those of any other call; a kind
        not served is a permanent error with status 404."""
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        what = f"discover {api_version} {kind}"
        unserved = KubeError(f"{what}: not served by the API server", retryable=False, status=404)
        key = (api_version, kind)
        since = self._unserved.get(key)
        if since is not None and self._clock() - since < UNSERVED_RECHECK_S:
            raise unserved
        try:
            with self._discovery:
                res = self._guard(
                    what, lambda: self._dyn.resources.get(api_version=api_version, kind=kind)
                )
        except ResourceNotFoundError as exc:
            res = None
            cause: Exception | None = exc
        else:
            cause = None
        if res is None:  # not in discovery, or 404 on a discovery document
            self._unserved[key] = self._clock()
            raise unserved from cause
        self._unserved.pop(key, None)
        return res

    def _call(self, what: str, fn: Any, *args: Any, missing_ok: bool = True, **kwargs: Any) -> Any:
        return self._guard(
            what, lambda: fn(*args, _request_timeout=self._timeout_s, **kwargs), missing_ok
        )

    def _guard(self, what: str, thunk: Callable[[], Any], missing_ok: bool = True) -> Any:
        """`thunk()`, with API failures as `KubeError`; 404 is None when `missing_ok` (a get or
        delete of what is already gone), else a permanent error (an apply must never be lost)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return thunk()
        except ApiException as exc:
            status = int(exc.status or 0)
            if status == 404 and missing_ok:
                return None
            raise KubeError(
                f"{what}: {status} {exc.reason}",
                retryable=status in _RETRYABLE,
                status=status,
                cause=_cause(exc.body),
            ) from exc
        except (HTTPError, OSError) as exc:
            raise KubeError(f"{what}: {exc}", retryable=True) from exc

    def apply(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        self._call(
            f"apply {obj['kind']}/{meta['name']}",
            self._resource(obj["apiVersion"], obj["kind"]).server_side_apply,
            body=dict(obj),
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=L.FIELD_MANAGER,
            force_conflicts=True,
            missing_ok=False,
        )

    def create(self, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        try:
            self._call(
                f"create {obj['kind']}/{meta['name']}",
                self._resource(obj["apiVersion"], obj["kind"]).create,
                body=dict(obj),
                namespace=meta["namespace"],
                missing_ok=False,
            )
        except KubeError as exc:
            if exc.status == 409:  # AlreadyExists: kept as it is
                return False
            raise
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        res = self._resource(api_version, kind)
        got = self._call(f"get {kind}/{name}", res.get, name=name, namespace=namespace)
        return None if got is None else dict(got.to_dict())

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        res = self._resource(api_version, kind)
        got = self._call(f"list {kind}", res.get, namespace=namespace, label_selector=selector)
        if got is None:
            return []
        return [dict(item) for item in got.to_dict().get("items", [])]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        res = self._resource(api_version, kind)
        self._call(
            f"delete {kind}/{name}",
            res.delete,
            name=name,
            namespace=namespace,
            body={"propagationPolicy": "Background"},
        )

    def delete_pods(self, namespace: str, selector: str) -> None:
        res = self._resource("v1", "Pod")
        self._call(
            f"delete pods {selector}", res.delete, namespace=namespace, label_selector=selector
        )

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        res = self._resource(L.API_VERSION, L.KIND).status
        self._call(
            f"patch {L.KIND}/{name} status",
            res.patch,
            body={"status": dict(patch)},
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
        )


def _cause(body: object) -> str:
    """The first cause of an error's Status body ("" when it has none or is not one)."""
    try:
        status = json.loads(body) if isinstance(body, str | bytes) else None
        causes = status["details"]["causes"] if isinstance(status, dict) else None
        return str(causes[0]["reason"]) if causes else ""
    except (ValueError, KeyError, TypeError, IndexError):
        return ""
