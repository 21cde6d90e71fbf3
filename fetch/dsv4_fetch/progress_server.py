"""`GET /progress`: the fetch's `FetchStatus` document as JSON, for the operator (the download
Job's pod serves it on its progress port; the operator's NetworkPolicy rule admits only the
operator's pods). Anything else is 404. A daemon thread; `close()` stops it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dsv4_common.api.fetch_status import PROGRESS_PATH, FetchStatus, fetch_status_to_dict


class ProgressServer:
    def __init__(self, host: str, port: int, read: Callable[[], FetchStatus]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != PROGRESS_PATH:
                    self.send_error(404, "only GET /progress")
                    return
                body = json.dumps(fetch_status_to_dict(read())).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # one GET per reconcile: not worth a log line

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fetch-progress", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
