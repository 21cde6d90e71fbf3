"""The router with an API key (`dsv4_common.api.api_key`, `http_auth`), in front of stub
workers that want the same key: completions on the fast path and on aiohttp's, /v1/models, the
probes and the status paths on each port; the router's own credential reaches the workers and
the client's never does; the official openai client with the key works and a wrong key is its
AuthenticationError."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from router_support import JSON_ANSWER, StubWorker, routed, run_async

from dsv4_common.api.api_key import MISSING_MESSAGE, WRONG_MESSAGE, ApiKeyRule
from dsv4_common.api.rank_config import Instance
from dsv4_router.proxy import request_head

KEY = "sk-router-test-42"
RULE = ApiKeyRule(KEY.encode())
BODY = {"prompt": "hi", "max_tokens": 3}
GOOD = {"Authorization": f"Bearer {KEY}"}


def _stubs() -> tuple[StubWorker, StubWorker]:
    return StubWorker("prefill", api_key=KEY), StubWorker("decode", api_key=KEY)


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data  # a chunked body: the fast path hands the connection to aiohttp


async def _post(
    url: str, *, headers: dict[str, str] | None = None, chunked: bool = False
) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = json.dumps(BODY).encode()
    sent: Any = _chunks(data) if chunked else data
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    async with (
        aiohttp.ClientSession() as client,
        client.post(f"{url}/v1/completions", data=sent, headers=all_headers) as resp,
    ):
        return resp.status, json.loads(await resp.read()), dict(resp.headers)


async def _get(url: str, path: str, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession() as client, client.get(url + path, headers=headers) as resp:
        await resp.read()
        return resp.status


def _refused(status: int, doc: dict[str, Any], headers: dict[str, str], message: str) -> None:
    assert status == 401
    assert doc == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("chunked", [False, True], ids=["fast-path", "aiohttp"])
def test_a_completion_without_the_key_is_a_401_and_reaches_no_worker(chunked: bool) -> None:
    @run_async
    async def run() -> None:
        prefill, decode = _stubs()
        async with routed([prefill], [decode], auth=RULE) as h:
            _refused(*await _post(h.url, chunked=chunked), MISSING_MESSAGE)
            wrong = {"Authorization": "Bearer sk-guess"}
            _refused(*await _post(h.url, headers=wrong, chunked=chunked), WRONG_MESSAGE)
            _refused(*await _post(h.url, headers={"Authorization": KEY}), MISSING_MESSAGE)
            assert decode.seen == []
            status, doc, _ = await _post(h.url, headers=GOOD, chunked=chunked)
            assert (status, doc) == (200, JSON_ANSWER)

    run()


def test_the_router_sends_its_own_key_and_never_the_client_s() -> None:
    @run_async
    async def run() -> None:
        # The workers want the key on /status too: they are eligible only because the
        # router's discovery sends its own credential.
        prefill, decode = _stubs()
        async with routed([prefill], [decode], auth=RULE) as h:
            assert (await _post(h.url, headers=GOOD))[0] == 200
            assert [s.authorization for s in decode.seen] == [f"Bearer {KEY}"]
            assert await _get(h.url, "/v1/models", GOOD) == 200  # through aiohttp's client

    run()
    decode = Instance("127.0.0.1", 1, 2, 3)
    client_headers = [(b"Authorization", b"Bearer client-key"), (b"X-Other", b"1")]
    head = request_head("POST", "/v1/completions", "h:1", client_headers, decode, 2, "r", b"")
    assert b"client-key" not in head and b"authorization" not in head.lower()
    credential = b"Authorization: Bearer router-key\r\n"
    head = request_head("POST", "/v1/x", "h:1", client_headers, decode, 2, "r", credential)
    assert head.count(b"Authorization") == 1 and b"Bearer router-key" in head


def test_the_probes_stay_open_and_the_status_paths_want_the_key() -> None:
    @run_async
    async def run() -> None:
        prefill, decode = _stubs()
        async with routed([prefill], [decode], auth=RULE) as h:
            for path in ("/live", "/health", "/ready"):
                assert await _get(h.url, path) == 200, path
            for path in ("/metrics", "/status", "/instances", "/v1/models", "/nowhere"):
                assert await _get(h.url, path) == 401, path
            for path in ("/metrics", "/status", "/instances"):
                assert await _get(h.url, path, GOOD) == 200, path
        opened = ApiKeyRule(KEY.encode(), open_status=True)
        prefill, decode = _stubs()
        async with routed([prefill], [decode], auth=opened) as h:  # quick form: one port
            for path in ("/metrics", "/status", "/instances"):
                assert await _get(h.url, path) == 200, path
            assert await _get(h.url, "/v1/models") == 401
            assert (await _post(h.url))[0] == 401

    run()


def test_a_deployed_router_opens_its_status_port_not_its_api_port() -> None:
    @run_async
    async def run() -> None:
        prefill, decode = _stubs()
        rule = ApiKeyRule(KEY.encode(), open_status=True)  # as --config-dir makes it
        async with routed([prefill], [decode], auth=rule, status_port=0) as h:
            status_port = h.listening.status_port
            assert status_port is not None
            status_url = f"http://127.0.0.1:{status_port}"
            for path in ("/metrics", "/status", "/instances", "/ready"):
                assert await _get(status_url, path) == 200, path
                assert await _get(h.url, path) == (200 if path == "/ready" else 401), path
            assert await _get(status_url, "/nowhere") == 401

    run()


def test_the_openai_client_with_the_key_works_and_a_wrong_key_is_refused() -> None:
    @run_async
    async def run() -> None:
        prefill, decode = _stubs()
        async with routed([prefill], [decode], auth=RULE) as h:
            good = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key=KEY, max_retries=0)
            answer = await good.completions.create(model="tiny", prompt="hi", max_tokens=3)
            assert answer.choices[0].text == "Hello!"
            bad = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="sk-wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as info:
                await bad.completions.create(model="tiny", prompt="hi", max_tokens=3)
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}]
                )
            await good.close()
            await bad.close()

    run()
