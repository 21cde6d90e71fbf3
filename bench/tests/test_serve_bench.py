"""bench/serve.py's HTTP client: a refused or failed request stops the bench with the answer it
got (bench/pp.py on one GPU printed 0.0 tokens/s for a PP=2 group that failed every request)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import serve as http_bench


class _Refuse(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b'{"error": {"message": "group failed", "code": "stage_lost"}}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_refused_request_stops_the_round_with_its_answer(refusing_port: int) -> None:
    with pytest.raises(RuntimeError, match=r"HTTP 503.*group failed"):
        http_bench._round(refusing_port, clients=3, requests=2, max_tokens=4)


def test_the_table_names_the_model_the_server_serves() -> None:
    """A --serve-arg=--model=DIR overrides the bench's tiny, and the header says so."""
    base = ["dsv4", "serve", *http_bench.TINY]
    assert http_bench._last_model(base) == "tiny"
    assert http_bench._last_model([*base, "--model=/models/medium"]) == "/models/medium"
    assert http_bench._last_model([*base, "--model", "/m", "--port", "1"]) == "/m"
