"""`dsv4 serve` start-up errors exit 2 with one line naming the flag or file, never a
traceback: a port in use, a host that is not an address, weights and tokenizers that are not
what they claim. `--port 0` serves on a free port and prints which; so does the router."""

from __future__ import annotations

import http.client
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_support import ENV, serve_argv

START_S = 120.0
INSTANCES = ["--instance", "prefill=127.0.0.1:1:2:3", "--instance", "decode=127.0.0.1:4:5:6"]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def serve_error(*args: str) -> str:
    """`dsv4 serve ARGS` must exit 2 saying why in one line (its last); that line."""
    done = subprocess.run(
        serve_argv(*args), env=ENV, capture_output=True, text=True, timeout=START_S
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr and lines, done.stderr
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:], done.stderr
    return lines[-1]


def test_a_port_in_use_exits_2_naming_it(busy_port: int) -> None:
    err = serve_error("--port", str(busy_port))
    assert err.startswith(f"dsv4 serve: error: --port: cannot listen on 127.0.0.1:{busy_port}")
    assert err.endswith("--port 0 takes any free port")


def test_a_router_port_in_use_exits_2(busy_port: int) -> None:
    err = serve_error("--role", "router", "--port", str(busy_port), *INSTANCES)
    assert f"--port: cannot listen on 127.0.0.1:{busy_port}" in err


@pytest.mark.parametrize("role", ["colocated", "router"])
def test_a_host_that_is_no_address_exits_2(role: str) -> None:
    extra = INSTANCES if role == "router" else []
    err = serve_error("--role", role, "--host", "256.1.1.1", "--port", "0", *extra)
    assert "--host: cannot listen on '256.1.1.1'" in err


@pytest.mark.parametrize(
    ("flag", "content"),
    [
        ("--weights", b"\x00" * 64),
        ("--weights", b"not a safetensors file at all, just text\n" * 4),
        ("--tokenizer", b"\xff\xfe not UTF-8"),
        ("--tokenizer", b'{"not": "a tokenizer"}'),
    ],
)
def test_a_bad_weights_or_tokenizer_file_exits_2_naming_it(
    tmp_path: Path, flag: str, content: bytes
) -> None:
    path = tmp_path / "file"
    path.write_bytes(content)
    err = serve_error("--port", "0", flag, str(path))
    assert str(path) in err and (flag in err or "weights" in err), err


def _listening_port(proc: subprocess.Popen[str], pattern: str) -> int:
    assert proc.stdout is not None
    for line in proc.stdout:
        if found := re.search(pattern, line):
            return int(found.group(1))
    raise AssertionError(f"no listening line; exit {proc.wait()}")


@pytest.mark.parametrize("role", ["colocated", "router"])
def test_port_0_serves_on_a_free_port_and_prints_it(role: str) -> None:
    extra = INSTANCES if role == "router" else ["--gpu-memory-gib", "0.05"]
    proc = subprocess.Popen(
        serve_argv("--role", role, "--port", "0", *extra),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        port = _listening_port(proc, r"listening on http://127\.0\.0\.1:(\d+)")
        assert port != 0
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
