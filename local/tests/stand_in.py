"""A stand-in for a worker or router process in the supervisor tests (standard library only).

    python stand_in.py --pid-dir D --name N --mode ready|fail|never|stubborn --port P ...

Every mode first writes its PID to D/N.pid and appends it to D/N.history (a restarted
stand-in replaces N.pid; the history keeps every one), and with --grandchild starts a child in
its own process group that writes D/N.grandchild.pid (appended to D/N.grandchild.history),
then:
  ready     after --delay-s, answers GET /ready, GET /live, GET /status and POST
            /v1/completions on every --port; with --exit-after-s, exits with code 4 that long
            after it first answered /ready; with --unlive-after-s, /live (and /ready) answer
            503 from that long after it first answered /ready on, and it keeps running (a
            worker whose engine thread died)
  stubborn  as ready, but ignores SIGTERM (only SIGKILL stops it)
  drainer   as ready, but a SIGTERM only starts its "drain": a second one ends it (exit 0),
            as a worker's or the router's second signal does
  fail      prints 50 numbered lines, waits for --wait-for (a file) if given, exits with 3
  never     sleeps, never ready
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FAIL_CODE = 3
EXIT_AFTER_CODE = 4
ANSWERED_READY = threading.Event()
UNLIVE_AFTER_S: list[float] = []  # --unlive-after-s, when given
READY_AT_S: list[float] = []  # when it first answered /ready
COMPLETION = {
    "choices": [{"index": 0, "text": " stand-in text"}],
    "usage": {"completion_tokens": 3},
}
GRANDCHILD = (
    "import os, sys, time\n"
    "path = sys.argv[1]\n"
    "open(path[:-4] + '.history', 'a').write(f'{os.getpid()}\\n')\n"
    "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
    "os.replace(path + '.tmp', path)\n"
    "time.sleep(3600)\n"
)


def write_pid(path: Path, pid: int) -> None:
    """Append to the history first: a test that sees the PID file finds it in the history."""
    with path.with_suffix(".history").open("a") as history:
        history.write(f"{pid}\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(pid))
    os.replace(tmp, path)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        dead = bool(UNLIVE_AFTER_S and READY_AT_S) and (
            time.monotonic() - READY_AT_S[0] >= UNLIVE_AFTER_S[0]
        )
        if dead and self.path in ("/ready", "/live"):
            self._answer(503, {"error": "engine not running"})
        elif self.path in ("/ready", "/status", "/live"):
            self._answer(200, {"ok": True})
            if self.path == "/ready" and not ANSWERED_READY.is_set():
                READY_AT_S.append(time.monotonic())
                ANSWERED_READY.set()
        else:
            self._answer(404, {"error": self.path})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/v1/completions" and body.get("temperature") == 0:
            self._answer(200, {**COMPLETION, "echo": body})
        else:
            self._answer(400, {"error": "bad request"})

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        print(format % args, flush=True)


TERMS: list[int] = []


def drain_then_exit(signum: int, frame: object) -> None:
    TERMS.append(signum)
    print(f"SIGTERM {len(TERMS)}", flush=True)
    if len(TERMS) >= 2:
        os._exit(0)


def serve(ports: list[int]) -> None:
    servers = [ThreadingHTTPServer(("127.0.0.1", port), Handler) for port in ports]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"serving on {ports}", flush=True)
    if servers:
        servers[0].serve_forever()
    else:
        time.sleep(3600)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid-dir", type=Path, required=True)
    parser.add_argument("--name", required=True)
    modes = ("ready", "fail", "never", "stubborn", "drainer")
    parser.add_argument("--mode", choices=modes, required=True)
    parser.add_argument("--port", type=int, action="append", default=[])
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--exit-after-s", type=float, default=None)
    parser.add_argument("--unlive-after-s", type=float, default=None)
    parser.add_argument("--wait-for", type=Path, default=None)
    parser.add_argument("--grandchild", action="store_true")
    args = parser.parse_args()

    if args.unlive_after_s is not None:
        UNLIVE_AFTER_S.append(args.unlive_after_s)
    if args.mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.mode == "drainer":
        signal.signal(signal.SIGTERM, drain_then_exit)
    write_pid(args.pid_dir / f"{args.name}.pid", os.getpid())
    if args.grandchild:
        path = args.pid_dir / f"{args.name}.grandchild.pid"
        subprocess.Popen([sys.executable, "-c", GRANDCHILD, str(path)])
    if args.mode == "fail":
        for i in range(50):
            print(f"line {i}", flush=True)
        while args.wait_for is not None and not args.wait_for.exists():
            time.sleep(0.02)
        return FAIL_CODE
    if args.mode == "never":
        time.sleep(3600)
        return 0
    time.sleep(args.delay_s)
    if args.exit_after_s is not None:
        threading.Thread(target=serve, args=(args.port,), daemon=True).start()
        ANSWERED_READY.wait()
        time.sleep(args.exit_after_s)
        return EXIT_AFTER_CODE
    serve(args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
