"""DeepSeek-V4 chat as agent frameworks call it: the official `openai` client, langchain-openai
(`bind_tools`, `with_structured_output`) and litellm, with tools, streaming and thinking on and
off, against `dsv4 serve --model tiny` and through the router of `dsv4 up` (tiny-pd.yaml: PD,
the first token sampled by prefill under the same grammar). The tiny model writes nonsense,
but what the API promises holds: reasoning apart from content, tool calls whose arguments
parse and match the tool's schema when the tool choice demands a call, no DSML in content.

Each demanded tool call costs ~200 byte tokens (the DSML tags are spelled byte by byte), so
there are three: `tool_choice: "required"` and langchain's `bind_tools(tool_choice=...)`
against `dsv4 serve`, a named tool streamed through the router."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from serve_support import ENV, free_port, serve_argv, wait_ready

pytestmark = pytest.mark.slow
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no download
ROOT = Path(__file__).resolve().parents[3]
TINY_PD = ROOT / "crds" / "samples" / "tiny-pd.yaml"
UP_TIMEOUT_S = 300.0
DEFAULT_MAX_TOKENS = 8  # the serve endpoint's --max-tokens-default
CALL_TOKENS = 400  # room for one demanded call

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 4, "description": "city name"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@dataclass(frozen=True)
class Endpoint:
    kind: str  # serve | router
    url: str  # the API's base URL (.../v1)

    @property
    def router(self) -> bool:
        return self.kind == "router"


def no_dsml(text: str | None) -> None:
    assert text is None or ("｜DSML｜" not in text and "think>" not in text), text


@pytest.fixture(scope="module", params=["serve", "router"])
def endpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Endpoint]:
    """The API: `dsv4 serve` (with --max-tokens-default), or the router of `dsv4 up`."""
    if request.param == "serve":
        port = free_port()
        argv = serve_argv("--model", "tiny", "--port", str(port), "--gpu-memory-gib", "0.05")
        argv += ["--max-tokens-default", str(DEFAULT_MAX_TOKENS)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
        try:
            wait_ready(proc, port)
            yield Endpoint("serve", f"http://127.0.0.1:{port}/v1")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        return
    workdir = tmp_path_factory.mktemp("up")
    argv = [sys.executable, "-m", "dsv4_cli", "up", str(TINY_PD), "--port", "0"]
    up = subprocess.Popen(
        [*argv, "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        yield Endpoint("router", _router_url(up))
    finally:
        up.terminate()
        up.wait(timeout=60)


def _router_url(up: subprocess.Popen[str]) -> str:
    """The router's API URL, from what `dsv4 up` prints once every process is ready."""
    assert up.stdout is not None
    seen, url = "", None
    while "Ctrl-C stops every process" not in seen:
        line = up.stdout.readline()
        assert line or up.poll() is None, f"dsv4 up exited ({up.returncode}): {seen}"
        seen += line
        found = re.search(r"router\s+(http://127\.0\.0\.1:\d+)", line)
        url = url or (found.group(1) if found else None)
    assert url is not None, seen
    return f"{url}/v1"


@pytest.fixture(scope="module")
def client(endpoint: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.url, api_key="none", max_retries=0, timeout=300)


def test_openai_client_thinking_on_and_off_streaming_or_not(client: openai.OpenAI) -> None:
    on = {"thinking": {"type": "enabled"}}
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, extra_body=on)
    message = reply.choices[0].message
    assert message.content == "" and (message.model_extra or {})["reasoning_content"]
    off = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=6,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    assert off.choices[0].message.content and not (off.choices[0].message.model_extra or {}).get(
        "reasoning_content"
    )
    reasoning = content = ""
    for chunk in client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, stream=True, extra_body=on
    ):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert reasoning == (message.model_extra or {})["reasoning_content"] and content == ""


def test_openai_client_demanded_tool_call_and_a_tool_history(
    client: openai.OpenAI, endpoint: Endpoint
) -> None:
    if endpoint.router:  # a named tool, streamed
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=[TOOL],
            tool_choice=NAMED,
            max_tokens=CALL_TOKENS,
            stream=True,
        ):
            delta = chunk.choices[0].delta
            no_dsml(delta.content)
            for call in delta.tool_calls or []:
                assert call.function is not None
                calls[call.index] = {
                    "id": call.id or "",
                    "name": call.function.name or "",
                    "args": call.function.arguments or "",
                }
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1
        call = calls[0]
        name, args, call_id = call["name"], call["args"], call["id"]
    else:
        reply = client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=[TOOL],
            tool_choice="required",
            max_tokens=CALL_TOKENS,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        no_dsml(choice.message.content)
        assert choice.message.tool_calls
        first = choice.message.tool_calls[0]
        name, args, call_id = first.function.name, first.function.arguments, first.id
    assert name == "get_weather" and call_id.startswith("call_")
    jsonschema.validate(_json(args), WEATHER)
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]
    after = client.chat.completions.create(
        model="tiny", messages=history, tools=[TOOL], tool_choice="none", max_tokens=6
    )
    assert after.choices[0].message.tool_calls is None
    no_dsml(after.choices[0].message.content)


def test_chat_default_length_and_ignored_fields(client: openai.OpenAI, endpoint: Endpoint) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=4, extra_body={"bogus_field": 1}
    )
    assert raw.headers.get("x-dsv4-ignored-fields") == "bogus_field"
    if not endpoint.router:  # the serve endpoint runs with --max-tokens-default
        reply = client.chat.completions.create(model="tiny", messages=USER)
        assert reply.usage is not None
        assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS
        assert reply.choices[0].finish_reason == "length"


def test_langchain_invoke_stream_tools_and_structured_output(endpoint: Endpoint) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather request."""

        city: str = Field(max_length=4)
        days: int = Field(ge=1, le=7)

    def llm(max_tokens: int, **kw: Any) -> ChatOpenAI:
        return ChatOpenAI(
            model="tiny",
            base_url=endpoint.url,
            api_key="none",
            max_tokens=max_tokens,
            max_retries=0,
            timeout=300,
            **kw,
        )

    answer = llm(6).invoke("Hello")
    assert isinstance(answer.content, str) and answer.content
    assert "".join(str(c.content) for c in llm(6).stream("Hello"))
    thinking = llm(6, extra_body={"thinking": {"type": "enabled"}}).invoke("Hello")
    assert thinking.content == ""  # the reasoning is not content
    auto = llm(6).bind_tools([Weather]).invoke("Weather in Oslo?")
    no_dsml(str(auto.content))
    structured = llm(60).with_structured_output(Weather).invoke("Weather in Oslo?")
    assert isinstance(structured, Weather)
    if not endpoint.router:  # a demanded call: ~200 tokens
        called = llm(CALL_TOKENS).bind_tools([Weather], tool_choice="Weather").invoke("Weather?")
        [call] = called.tool_calls
        assert call["name"] == "Weather"
        Weather.model_validate(call["args"])
        assert called.response_metadata["finish_reason"] == "tool_calls"


def test_litellm_with_thinking_streaming_and_tools(endpoint: Endpoint) -> None:
    import litellm

    common: dict[str, Any] = {"model": "openai/tiny", "api_base": endpoint.url, "api_key": "none"}
    on = litellm.completion(
        **common, messages=USER, max_tokens=6, extra_body={"thinking": {"type": "enabled"}}
    )
    message = on.choices[0].message
    assert not message.content and message.reasoning_content
    pieces = litellm.completion(
        **common,
        messages=USER,
        max_tokens=6,
        stream=True,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    reasoning = "".join(
        getattr(p.choices[0].delta, "reasoning_content", None) or "" for p in pieces
    )
    assert reasoning
    off = litellm.completion(**common, messages=USER, max_tokens=6, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in off)
    auto = litellm.completion(**common, messages=USER, tools=[TOOL], max_tokens=6)
    no_dsml(auto.choices[0].message.content)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def _json(text: str) -> Any:
    return json.loads(text)
