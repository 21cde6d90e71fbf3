"""Worker status endpoints for tests: one HTTP server per pod IP (127.0.0.x), all on one port,
as pods share the status port. What `GET http://<ip>:<port>/status` answers is `docs[ip]`,
`GET .../server_info` (SGLang's, on its HTTP port: the same port here) `info[ip]`, and
`GET .../metrics` `metrics[ip]`:

  a dict     200 with that JSON document
  bytes      200 with that body as it is (a malformed document)
  an int     that HTTP error status
  HANG       no answer until `close()` (a worker that hangs)
  absent     404
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Final

HANG: Final = object()


class StatusServers:
    def __init__(self, ips: list[str]) -> None:
        self.docs: dict[str, Any] = {}  # /status
        self.info: dict[str, Any] = {}  # /server_info
        self.metrics: dict[str, Any] = {}  # /metrics (bytes: Prometheus text)
        self.hits: list[str] = []  # "<ip><path>" of every request, in order
        self._release = threading.Event()
        self._servers: list[http.server.ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        for _attempt in range(20):
            try:
                self._bind(ips)
                break
            except OSError:  # the port taken on one of the IPs: try another
                self.close()
        else:
            raise RuntimeError("no port free on every worker IP")
        for srv in self._servers:
            thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _bind(self, ips: list[str]) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ip = self.connection.getsockname()[0]
                outer.hits.append(f"{ip}{self.path}")
                served = {
                    "/status": outer.docs,
                    "/server_info": outer.info,
                    "/metrics": outer.metrics,
                }.get(self.path, {})
                doc = served.get(ip)
                if doc is HANG:
                    outer._release.wait(timeout=30)
                    return
                if doc is None:
                    self.send_error(404)
                    return
                if isinstance(doc, int):
                    self.send_error(doc)
                    return
                data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.port = 0
        for ip in ips:
            srv = http.server.ThreadingHTTPServer((ip, self.port), Handler)
            srv.daemon_threads = True
            self._servers.append(srv)
            self.port = srv.server_address[1]

    def close(self) -> None:
        self._release.set()
        for srv in self._servers:
            if self._threads:
                srv.shutdown()
            srv.server_close()
        for thread in self._threads:
            thread.join(5)
        self._servers, self._threads = [], []
