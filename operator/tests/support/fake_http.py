"""Plain HTTP requests to the fake API server, for tests that check its answers on the wire
(codes, Status objects) rather than through a client library."""

from __future__ import annotations

import http.client
import json
from typing import Any, Final

from support.fake_apiserver import FakeApiServer

APPLY: Final = "application/apply-patch+yaml"
MERGE: Final = "application/merge-patch+json"
STRATEGIC: Final = "application/strategic-merge-patch+json"
JSON_PATCH: Final = "application/json-patch+json"


def call(
    server: FakeApiServer,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    user_agent: str = "test-client/1.0",
) -> tuple[int, Any]:
    """(status code, parsed JSON body) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "User-Agent": user_agent}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def ok(result: tuple[int, Any]) -> Any:
    """The body of a successful answer (fails the test with the Status otherwise)."""
    code, body = result
    assert 200 <= code < 300, (code, body)
    return body


def owned(obj: dict[str, Any], manager: str, operation: str = "Apply") -> dict[str, Any]:
    """The fieldsV1 of one manager's managedFields entry ({} when it has none)."""
    for entry in obj["metadata"].get("managedFields") or []:
        if (entry["manager"], entry["operation"]) == (manager, operation):
            fields: dict[str, Any] = entry["fieldsV1"]
            return fields
    return {}
