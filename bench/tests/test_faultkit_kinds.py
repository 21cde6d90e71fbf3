"""What bench/faultkit.py's client calls each way a request can end without an answer (the
fault matrix allows `refused` only while the router is down, `reset` only when it is killed):
no connection made is `refused`, whether nothing listened or the handshake was reset as a
listener closed; a connection accepted and then closed without a response is `reset`."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import faultkit
import pytest
from serve_support import free_port


def _ask(port: int) -> faultkit.Record:
    record = faultkit.Record(started_s=time.monotonic(), stream=False)
    faultkit.completion(f"http://127.0.0.1:{port}", {"prompt": "hi"}, 10.0, record)
    return record


@pytest.fixture
def closing_port() -> Iterator[int]:
    """A port whose server reads a request and closes the connection without a response."""
    with socket.create_server(("127.0.0.1", 0)) as server:

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield server.getsockname()[1]
        thread.join(10.0)


def test_nothing_listening_is_refused() -> None:
    assert _ask(free_port()).kind == "refused"


def test_a_handshake_reset_as_the_listener_closes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def reset(self: http.client.HTTPConnection) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(http.client.HTTPConnection, "connect", reset)
    record = _ask(free_port())
    assert record.kind == "refused" and "ConnectionResetError" in record.detail


def test_a_connection_closed_without_a_response_is_reset(closing_port: int) -> None:
    record = _ask(closing_port)
    assert record.kind == "reset" and "RemoteDisconnected" in record.detail
