"""`dsv4 serve` as a real process on 127.0.0.1: completions (streaming and not) equal the
oracle's greedy tokens, chat works, every bad request is a 400 naming the field and is
followed by a request that succeeds, and a client that disconnects mid-stream gets its pages
freed at once."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serve_support import free_port, wait_ready

from dsv4_common.api.worker_status import parse_worker_status
from dsv4_common.core.presets import tiny
from dsv4_worker.model.oracle import oracle_greedy
from dsv4_worker.model.weights import init_weights


class Server:
    def __init__(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "dsv4_cli", "serve", "--model", "tiny"]
        cmd += ["--port", str(self.port), "--gpu-memory-gib", "0.05", "--seed", "3"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_ready(self.proc, self.port)

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def get(self, path: str) -> tuple[int, bytes]:
        c = self.conn()
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def post(self, path: str, body: object) -> tuple[int, dict[str, Any], dict[str, str]]:
        c = self.conn()
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read()), dict(r.getheaders())
        finally:
            c.close()

    def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        c = self.conn()
        try:
            c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode())
            r = c.getresponse()
            assert r.status == 200
            chunks = []
            for line in r.read().decode().splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
            return chunks
        finally:
            c.close()

    def used_full_pages(self) -> float:
        _, text = self.get("/metrics")
        for line in text.decode().splitlines():
            if line.startswith('dsv4_kv_used_pages{pool="full"}'):
                return float(line.split()[-1])
        raise AssertionError("no full-pool gauge in /metrics")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    try:
        yield srv
    finally:
        srv.close()


def wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_completion_equals_the_oracle_and_streaming_agrees(server: Server) -> None:
    prompt = "Hello, DeepSeek-V4! " * 3
    body = {"prompt": prompt, "max_tokens": 12, "return_token_ids": True}
    status, doc, _ = server.post("/v1/completions", body)
    assert status == 200
    ids = doc["choices"][0]["token_ids"]
    assert ids == oracle_greedy(tiny(), init_weights(tiny(), seed=3), list(prompt.encode()), 12)
    assert doc["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                            "total_tokens": len(prompt) + 12}  # fmt: skip
    chunks = server.stream(body)
    assert chunks[-1]["choices"][0]["token_ids"] == ids
    assert "".join(c["choices"][0]["text"] for c in chunks) == doc["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_token_id_prompts_and_chat(server: Server) -> None:
    status, doc, _ = server.post(
        "/v1/completions", {"prompt": [72, 105], "max_tokens": 3, "return_token_ids": True}
    )
    assert status == 200 and len(doc["choices"][0]["token_ids"]) == 3
    status, doc, _ = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200 and doc["choices"][0]["message"]["role"] == "assistant"
    assert doc["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", ""),
        ([1, 2], ""),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 256]}, "prompt[1]"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "stream_options": {"bogus": 1}}, "stream_options.bogus"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"prompt": "x", "max_tokens": 4096}, "max_tokens"),
    ],
)
def test_bad_requests_are_400_naming_the_field_and_lose_nothing(
    server: Server, body: object, field: str
) -> None:
    status, doc, _ = server.post("/v1/completions", body)
    assert status == 400, doc
    assert doc["error"]["param"] == (field or None)  # OpenAI: null when no one field
    assert doc["error"]["message"]
    status, doc, _ = server.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert status == 200 and doc["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: server.used_full_pages() == 0)


def test_a_disconnect_mid_stream_frees_the_pages(server: Server) -> None:
    c = server.conn()
    body = {"prompt": "a long story " * 20, "max_tokens": 3000, "stream": True}
    c.request("POST", "/v1/completions", body=json.dumps(body).encode())
    r = c.getresponse()
    assert r.status == 200
    r.readline()  # the first event: the request is running
    wait_until(lambda: server.used_full_pages() > 0)
    c.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    c.close()
    wait_until(lambda: server.used_full_pages() == 0)


def test_status_health_and_models(server: Server) -> None:
    status, body = server.get("/status")
    report = parse_worker_status(json.loads(body))
    assert status == 200 and report.role == "colocated" and report.capacity.full_tokens > 0
    assert server.get("/health") == (200, b"ok")
    status, body = server.get("/v1/models")
    assert json.loads(body)["data"][0]["id"] == "tiny"


def test_stop_strings_cut_the_text_streaming_or_not(server: Server) -> None:
    body: dict[str, Any] = {"prompt": "stop here", "max_tokens": 16}
    full = server.post("/v1/completions", body)[1]["choices"][0]["text"]
    stop = full[4:6]
    expected = full[: full.find(stop)]
    status, doc, _ = server.post("/v1/completions", {**body, "stop": [stop]})
    assert status == 200
    assert doc["choices"][0]["text"] == expected and doc["choices"][0]["finish_reason"] == "stop"
    chunks = server.stream({**body, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    wait_until(lambda: server.used_full_pages() == 0)
