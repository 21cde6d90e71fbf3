"""`dsv4 serve` with an API key, as a process on 127.0.0.1: the official openai client with the
key is served (completions, chat, models), a wrong or missing key is a 401 in OpenAI's shape
with `WWW-Authenticate: Bearer`, the probes stay open and /metrics and /status want the key
(unless --open-status). Deployed (`--config-dir`, the key file named by the rank config): the
status port serves /status open (the operator reads it), the API port wants the key."""

from __future__ import annotations

import dataclasses
import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serve_support import ENV, free_port, serve_argv, wait_ready
from test_serve_config_dir import colocated_config, write

pytestmark = pytest.mark.slow
KEY = "sk-worker-test-7"


def _request(
    port: int, method: str, path: str, key: str | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), resp.read()


def _stop(proc: subprocess.Popen[bytes]) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out.decode()


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(f"{KEY}\n")  # a file's last newline is not part of the key
    port = free_port()
    argv = serve_argv("--model", "tiny", "--port", str(port), "--gpu-memory-gib", "0.05")
    proc = subprocess.Popen(
        [*argv, "--api-key-file", str(key_file)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(proc, port)  # /ready needs no key
        yield port
    finally:
        out = _stop(proc)
        assert "without an API key" not in out  # loopback, and a key


def test_the_openai_client_with_the_key_is_served(quick: int) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{quick}/v1", api_key=KEY, max_retries=0, timeout=60
    )
    answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.choices[0].message.role == "assistant"
    streamed = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True)
    assert sum(1 for _ in streamed) >= 1
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_wrong_or_missing_key_is_openai_s_401(quick: int) -> None:
    bad = openai.OpenAI(
        base_url=f"http://127.0.0.1:{quick}/v1", api_key="sk-wrong", max_retries=0, timeout=60
    )
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    status, headers, raw = _request(quick, "POST", "/v1/completions", body=body)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    error = json.loads(raw)["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_the_probes_are_open_and_status_and_metrics_want_the_key(quick: int) -> None:
    for path in ("/live", "/health", "/ready"):
        assert _request(quick, "GET", path)[0] == 200, path
    for path in ("/status", "/metrics", "/v1/models", "/nowhere"):
        assert _request(quick, "GET", path)[0] == 401, path
        assert _request(quick, "GET", path, key="sk-wrong")[0] == 401, path
    for path in ("/status", "/metrics"):
        assert _request(quick, "GET", path, key=KEY)[0] == 200, path


def test_a_deployed_worker_opens_its_status_port_and_not_its_api_port(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY)
    http_port, status_port = free_port(), free_port()
    config = dataclasses.replace(
        colocated_config(http_port, status_port), api_key_file=str(key_file)
    )
    argv = [sys.executable, "-m", "dsv4_cli", "serve", "--role", "colocated"]
    argv += ["--config-dir", str(write(tmp_path, config)), "--host", "127.0.0.1"]
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, status_port)
        for path in ("/status", "/metrics", "/ready"):
            assert _request(status_port, "GET", path)[0] == 200, path
        assert _request(http_port, "GET", "/status")[0] == 401
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        assert _request(http_port, "POST", "/v1/completions", body=body)[0] == 401
        assert _request(http_port, "POST", "/v1/completions", KEY, body)[0] == 200
    finally:
        _stop(proc)


def test_an_unusable_key_file_exits_2_naming_the_field(tmp_path: Path) -> None:
    http_port, status_port = free_port(), free_port()
    config = dataclasses.replace(
        colocated_config(http_port, status_port), api_key_file=str(tmp_path / "missing")
    )
    argv = [sys.executable, "-m", "dsv4_cli", "serve", "--role", "colocated"]
    argv += ["--config-dir", str(write(tmp_path, config)), "--host", "127.0.0.1"]
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "rank config api_key_file: cannot read" in done.stderr
