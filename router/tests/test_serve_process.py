"""`dsv4 serve --role router` as a real process: it listens (both ports in the deployed form),
answers the probes, and exits 0 on SIGTERM."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from serve_support import free_port

from dsv4_common.api.rank_config import ROUTER_CONFIG_KEY

DEADLINE_S = 30.0


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def start(*args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "dsv4_cli", "serve", "--role", "router", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_live(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline_s = time.monotonic() + DEADLINE_S
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"the router exited ({proc.returncode}): {out}")
        try:
            if get(port, "/live")[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline_s, "the router did not start listening"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM; the exit code must be 0. Returns the output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    text = out.decode()
    assert proc.returncode == 0, text
    return text


def test_quick_form_process() -> None:
    port = free_port()
    dead = [free_port() for _ in range(6)]  # nothing listens there: never eligible
    proc = start(
        "--instance",
        f"prefill=127.0.0.1:{dead[0]}:{dead[1]}:{dead[2]}",
        "--instance",
        f"decode=127.0.0.1:{dead[3]}:{dead[4]}:{dead[5]}",
        "--port",
        str(port),
    )
    try:
        wait_live(proc, port)
        status, body = get(port, "/ready")
        assert status == 503 and b"not ready" in body
    finally:
        out = stop(proc) if proc.poll() is None else ""
    assert f"dsv4 serve: router listening on http://127.0.0.1:{port}" in out


def test_deployed_form_process(tmp_path: Path) -> None:
    api_port, status_port = free_port(), free_port()
    doc = {
        "version": 1,
        "deployment": "demo",
        "port": api_port,
        "status_port": status_port,
        "max_context_tokens": 4096,
        "transfer": "zmq",
        "roles": {
            role: {
                "service": f"demo-{role}",
                "port": 1,
                "bootstrap_port": 3,
                "instances": [
                    {"host": "127.0.0.1", "http_port": p, "status_port": p, "kv_port": p}
                ],
            }
            for role, p in (("prefill", free_port()), ("decode", free_port()))
        },
    }
    (tmp_path / ROUTER_CONFIG_KEY).write_text(json.dumps(doc))
    proc = start("--config-dir", str(tmp_path), "--host", "127.0.0.1")
    try:
        wait_live(proc, api_port)
        wait_live(proc, status_port)
        for port in (api_port, status_port):
            assert get(port, "/ready")[0] == 503
            status, metrics = get(port, "/metrics")
            assert status == 200 and b"dsv4_router_instances" in metrics
    finally:
        out = stop(proc) if proc.poll() is None else ""
    assert f"router listening on http://127.0.0.1:{api_port}" in out
