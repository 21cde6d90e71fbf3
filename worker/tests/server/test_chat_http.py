"""Chat replies over HTTP as OpenAI clients read them, from a scripted engine that answers with
the bytes of a reply written in DeepSeek-V4's format (one token per byte: every tag is split
across tokens): reasoning_content and content apart, DSML as `tool_calls` with
finish_reason "tool_calls", streamed deltas that never carry a tag, and the API defaults
(`X-DSV4-Ignored-Fields`, --strict-fields, the chat max_tokens rule)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from dsv4_common.api.worker_status import RankCapacity, WorkerStatus
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.admission import ADMIT, Verdict
from dsv4_worker.server.api_options import IGNORED_FIELDS_HEADER, ApiOptions
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.dsml import BLOCK_LEAD, MARK, THINK_END, render_block
from dsv4_worker.server.runner import Done, Handle, Snapshot, Token
from dsv4_worker.server.tokenizer import ByteTokenizer

CTX = 4096
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]
ARGS = {"city": 'Paris "FR"', "days": 3}
CALLS_REPLY = "Let me check." + BLOCK_LEAD + render_block([("get_weather", ARGS), ("search", {})])


class ScriptedRunner:
    """Answers every request with `reply`'s bytes, one token each, then Done("stop")."""

    alive = True
    failure = None

    def __init__(self, reply: str) -> None:
        self.reply = list(reply.encode())
        self.submitted: list[tuple[tuple[int, ...], SamplingParams]] = []

    def snapshot(self) -> Snapshot:
        return Snapshot()

    def overloaded(self) -> bool:
        return False

    def admission(self, need_tokens: int) -> Verdict:
        return ADMIT

    def submit(self, prompt: tuple[int, ...], params: SamplingParams, *_: Any, **__: Any) -> Any:
        self.submitted.append((prompt, params))
        events: asyncio.Queue[Token | Done] = asyncio.Queue()
        for token_id in self.reply[: params.max_new_tokens]:
            events.put_nowait(Token(token_id, time.monotonic()))
        done = "stop" if len(self.reply) <= params.max_new_tokens else "length"
        events.put_nowait(Done(done))
        return Handle(str(len(self.submitted)), events, time.monotonic())

    def abort(self, handle: Handle) -> None:
        pass


def post(
    reply: str, body: dict[str, Any], api: ApiOptions | None = None
) -> tuple[int, Any, dict[str, str], ScriptedRunner]:
    """POST one chat body; the answer (the parsed body, or a stream's chunks)."""
    runner = ScriptedRunner(reply)
    status_doc = WorkerStatus("colocated", 0, RankCapacity(1, 1, 1, 1))
    info = ServeInfo("tiny", 300, CTX, status_doc, api=api or ApiOptions())

    async def go() -> tuple[int, Any, dict[str, str]]:
        app = build_app(runner, ByteTokenizer(), info)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/chat/completions", json=body)
            text = await resp.text()
            if body.get("stream") and resp.status == 200:
                chunks = [
                    json.loads(line[len("data: ") :])
                    for line in text.splitlines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
                return resp.status, chunks, dict(resp.headers)
            return resp.status, json.loads(text), dict(resp.headers)

    return (*asyncio.run(go()), runner)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "weather in Paris?"}], **fields}


def test_tool_calls_replace_the_dsml_and_finish_with_tool_calls() -> None:
    status, doc, _, runner = post(CALLS_REPLY, chat(tools=TOOLS))
    assert status == 200, doc
    choice = doc["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check." and message["reasoning_content"] is None
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [ARGS, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    prompt = bytes(runner.submitted[0][0]).decode()
    assert "## Tools" in prompt and '"name": "get_weather"' in prompt  # shown to the model


def test_a_stream_carries_the_same_reply_with_no_tag_in_any_delta() -> None:
    reply = "Weighing it." + THINK_END + CALLS_REPLY
    status, chunks, _, _ = post(reply, chat(tools=TOOLS, stream=True, thinking={"type": "enabled"}))
    assert status == 200
    reasoning = content = ""
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        for key in ("reasoning_content", "content"):
            piece = delta.get(key) or ""
            assert MARK not in piece and "think>" not in piece and "<｜" not in piece, piece
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        calls += delta.get("tool_calls") or []
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert reasoning == "Weighing it." and content == "Let me check."
    assert [c["index"] for c in calls] == [0, 1]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_hides_the_tools_and_drops_calls() -> None:
    status, doc, _, runner = post(CALLS_REPLY, chat(tools=TOOLS, tool_choice="none"))
    assert status == 200
    message = doc["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == "Let me check."
    assert doc["choices"][0]["finish_reason"] == "stop"
    assert "## Tools" not in bytes(runner.submitted[0][0]).decode()


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    _, doc, _, _ = post(CALLS_REPLY, chat(tools=TOOLS, parallel_tool_calls=False))
    calls = doc["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_a_call_to_a_tool_not_offered_is_dropped() -> None:
    _, doc, _, _ = post(CALLS_REPLY, chat(tools=TOOLS[1:]))
    message = doc["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search"]


def test_thinking_switches_and_reasoning_content() -> None:
    reply = "step 1, step 2" + THINK_END + "42"
    for switch in (
        {"thinking": {"type": "enabled"}},
        {"chat_template_kwargs": {"thinking": True}},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"reasoning_effort": "high"},
    ):
        _, doc, _, runner = post(reply, chat(**switch))
        message = doc["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("step 1, step 2", "42")
        assert bytes(runner.submitted[0][0]).decode().endswith("<think>"), switch
    _, doc, _, runner = post("42", chat(thinking={"type": "disabled"}))
    assert doc["choices"][0]["message"]["content"] == "42"
    assert bytes(runner.submitted[0][0]).decode().endswith("</think>")
    _, doc, _, _ = post(reply, chat(), ApiOptions(thinking_default=True))  # --thinking on
    assert doc["choices"][0]["message"]["reasoning_content"] == "step 1, step 2"


def test_unknown_fields_are_named_in_a_header_or_refused_when_strict() -> None:
    status, _, headers, _ = post("ok", chat(bogus=1, add_generation_prompt=True))
    assert status == 200 and headers[IGNORED_FIELDS_HEADER] == "add_generation_prompt, bogus"
    status, chunks, headers, _ = post("ok", chat(bogus=1, stream=True))
    assert status == 200 and headers[IGNORED_FIELDS_HEADER] == "bogus" and chunks
    status, _, headers, _ = post("ok", chat(**{"x\r\ny": 1, "é": 2}))
    assert status == 200 and headers[IGNORED_FIELDS_HEADER] == "x\\r\\ny, \\u00e9"
    status, doc, headers, runner = post("ok", chat(bogus=1), ApiOptions(strict_fields=True))
    assert status == 400 and doc["error"]["param"] == "bogus" and not runner.submitted
    status, _, headers, _ = post("ok", chat())
    assert status == 200 and IGNORED_FIELDS_HEADER not in headers


def test_chat_without_max_tokens_may_use_the_rest_of_the_context() -> None:
    _, _, _, runner = post("ok", chat())
    prompt, params = runner.submitted[0]
    assert params.max_new_tokens == CTX - len(prompt)
    _, _, _, runner = post("ok", chat(), ApiOptions(max_tokens_default=12))
    assert runner.submitted[0][1].max_new_tokens == 12
    _, _, _, runner = post("ok", chat(max_tokens=5), ApiOptions(max_tokens_default=12))
    assert runner.submitted[0][1].max_new_tokens == 5


def test_history_with_tool_calls_and_results_is_accepted() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    status, doc, _, runner = post("Sunny.", {"messages": messages, "tools": TOOLS})
    assert status == 200 and doc["choices"][0]["message"]["content"] == "Sunny."
    prompt = bytes(runner.submitted[0][0]).decode()
    assert "<tool_result>sunny</tool_result>" in prompt and 'invoke name="get_weather"' in prompt
