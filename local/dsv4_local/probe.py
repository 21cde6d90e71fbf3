"""Readiness probes over loopback HTTP (side effects: network). No proxy is ever used: the
environment's `http_proxy` must not see 127.0.0.1 traffic."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

__all__ = ["is_ready", "status_of"]


def is_ready(url: str, timeout_s: float = 1.0) -> bool:
    """Whether `GET url` answers 200 within `timeout_s`; any failure is "not ready"."""
    return status_of(url, timeout_s) == 200


def status_of(url: str, timeout_s: float = 1.0) -> int | None:
    """The status `GET url` answers within `timeout_s`; None when nothing answered."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/")
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
