"""The API as users' code calls it: the official `openai` client against `dsv4 serve --model
tiny` (a real process on 127.0.0.1), both endpoints, streaming and not. Every supported field
reaches the engine; n choices equal n single requests with seeds seed + i; logprobs (sampled
and, with echo, the prompt's) equal the log-softmax of the model's own logits, recomputed here
from the same weights; `model` must be a served name; ids are unique."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from serve_support import free_port, serve_argv, wait_ready
from tokenizer_support import conv

from dsv4_common.core.presets import tiny
from dsv4_worker.model.oracle import oracle_greedy, oracle_logits
from dsv4_worker.model.weights import init_weights
from dsv4_worker.server.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow
SEED_WEIGHTS = 3
NAMES = ("dsv4-tiny", "tiny")  # --served-model-name: answers carry the first by default
TOL = 2e-4  # the served float32 forward vs the float64 oracle


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    port = free_port()
    argv = serve_argv("--model", "tiny", "--port", str(port), "--gpu-memory-gib", "0.05")
    argv += ["--seed", str(SEED_WEIGHTS), "--served-model-name", *NAMES]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port)
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


WEIGHTS = init_weights(tiny(), seed=SEED_WEIGHTS)
TOK = ByteTokenizer()


def log_softmax(ids: list[int]) -> torch.Tensor:
    """The model's logprobs at every position of `ids` [len(ids), vocab]."""
    return torch.log_softmax(oracle_logits(tiny(), WEIGHTS, ids), dim=-1)


def piece(token: int) -> str:
    """How logprobs show a byte token: its character, or its byte when it is not one."""
    return chr(token) if token < 0x80 else f"bytes:\\x{token:02x}"


def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
    return list(TOK.encode_chat(conv(messages)).ids)


def test_completion_with_every_supported_field_streams_what_it_answers(
    client: openai.OpenAI,
) -> None:
    fields: dict[str, Any] = dict(
        model="tiny",
        prompt=["Once upon", "The cat"],
        n=2,
        best_of=2,
        seed=11,
        temperature=0.9,
        top_p=0.95,
        max_tokens=8,
        logprobs=2,
        echo=True,
        stop=["zzz"],
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logit_bias={"32": -100},  # no spaces
        suffix=None,
        user="u1",
        extra_body={
            "top_k": 50,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    full = client.completions.create(**fields)
    assert full.model == "tiny" and full.id.startswith("cmpl-")
    assert [c.index for c in full.choices] == [0, 1, 2, 3]  # prompt p, sample i: 2p + i
    for c in full.choices:
        prompt = fields["prompt"][c.index // 2]
        assert c.text.startswith(prompt) and " " not in c.text[len(prompt) :]
        assert c.finish_reason == "length"
        assert c.logprobs is not None and c.logprobs.tokens is not None
        assert len(c.logprobs.tokens) == len(prompt) + 8  # byte tokens: prompt, then 8 new
        assert c.logprobs.token_logprobs is not None and c.logprobs.token_logprobs[0] is None
        offsets = c.logprobs.text_offset
        assert offsets is not None and offsets[: len(prompt) + 1] == list(range(len(prompt) + 1))
        assert offsets == sorted(offsets) and offsets[-1] < len(c.text)
    assert full.usage is not None
    assert full.usage.prompt_tokens == len("Once upon") + len("The cat")
    assert full.usage.completion_tokens == 4 * 8
    stream = client.completions.create(
        **fields, stream=True, stream_options={"include_usage": True}
    )
    texts = ["", "", "", ""]
    tokens: list[list[str]] = [[], [], [], []]
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None and c.logprobs.tokens:
                tokens[c.index] += c.logprobs.tokens
    assert texts == [c.text for c in full.choices]
    assert tokens == [c.logprobs.tokens for c in full.choices if c.logprobs]
    assert usage == full.usage


def test_n_choices_equal_single_requests_with_their_seeds(client: openai.OpenAI) -> None:
    common: dict[str, Any] = dict(model="tiny", prompt="It was", max_tokens=6, temperature=1.0)
    many = client.completions.create(**common, n=3, seed=5)
    singles = [client.completions.create(**common, seed=5 + i).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == singles
    messages: Any = [{"role": "user", "content": "hi"}]
    chats = client.chat.completions.create(
        model="dsv4-tiny", messages=messages, n=2, seed=9, temperature=1.0, max_tokens=5
    )
    for i, choice in enumerate(chats.choices):
        one = client.chat.completions.create(
            model="dsv4-tiny", messages=messages, seed=9 + i, temperature=1.0, max_tokens=5
        )
        assert choice.message.content == one.choices[0].message.content
    assert chats.usage is not None and chats.usage.prompt_tokens == len(chat_ids(messages))


def test_completion_logprobs_equal_the_models_log_softmax(client: openai.OpenAI) -> None:
    prompt = "The sun"
    answer = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        logprobs=3,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    choice = answer.choices[0]
    new: list[int] = choice.model_extra["token_ids"]  # type: ignore[index]
    assert new == oracle_greedy(tiny(), WEIGHTS, list(prompt.encode()), 6)
    ids = [*prompt.encode(), *new]
    ref = log_softmax(ids)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        value = lp.token_logprobs[pos]
        assert value is not None and value == pytest.approx(float(row[ids[pos]]), abs=TOL)
        top = lp.top_logprobs[pos]
        assert top is not None
        best = [piece(t) for t in row.topk(3).indices.tolist()]
        assert set(best) <= set(top)  # the 3 most likely (and the token itself)


def test_chat_logprobs_equal_the_models_log_softmax(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    answer = client.chat.completions.create(
        model="dsv4-tiny",
        messages=messages,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    prompt = chat_ids([{"role": "user", "content": "Hello"}])
    new = [entry.bytes[0] for entry in content if entry.bytes]
    assert new == oracle_greedy(tiny(), WEIGHTS, prompt, 5)
    ref = log_softmax([*prompt, *new])
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[new[i]]), abs=TOL)
        assert [t.bytes for t in entry.top_logprobs] == [[t] for t in row.topk(2).indices.tolist()]
        assert entry.top_logprobs[0].logprob == pytest.approx(float(row.max()), abs=TOL)


def test_echo_without_new_tokens_scores_prompts(client: openai.OpenAI) -> None:
    prompts = ["ab cd", "xyz"]
    answer = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=0
    )
    assert [c.text for c in answer.choices] == prompts
    assert answer.usage is not None and answer.usage.completion_tokens == 0
    for c, p in zip(answer.choices, prompts, strict=True):
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None
        values = c.logprobs.token_logprobs
        ref = log_softmax(list(p.encode()))
        assert values[0] is None and len(values) == len(p)
        total = sum(float(ref[j - 1][p.encode()[j]]) for j in range(1, len(p)))
        assert math.fsum(v for v in values if v is not None) == pytest.approx(total, abs=1e-3)


def test_chat_stream_carries_the_role_first_and_the_usage_last(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            tools=[],
            tool_choice="none",
            parallel_tool_calls=False,
            store=False,
            metadata={"k": "v"},
            service_tier="auto",
            presence_penalty=0,
            response_format={"type": "text"},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = chat_ids(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    )
    assert text == TOK.decode(oracle_greedy(tiny(), WEIGHTS, prompt, 4))


def test_penalties_bias_and_min_tokens_reach_the_sampler(client: openai.OpenAI) -> None:
    def tokens(**kw: Any) -> tuple[list[int], str | None]:
        c = client.completions.create(model="tiny", prompt="abcabc", max_tokens=6, **kw).choices[0]
        return c.model_extra["token_ids"], c.finish_reason  # type: ignore[index,no-any-return]

    base, _ = tokens(extra_body={"return_token_ids": True})
    banned, _ = tokens(
        logit_bias={str(t): -100 for t in set(base)}, extra_body={"return_token_ids": True}
    )
    assert not set(banned) & set(base)
    stopped, reason = tokens(extra_body={"return_token_ids": True, "stop_token_ids": [base[0]]})
    assert (stopped, reason) == ([base[0]], "stop")
    held, _ = tokens(
        extra_body={"return_token_ids": True, "stop_token_ids": [base[0]], "min_tokens": 3}
    )
    assert len(held) >= 3 and base[0] not in held[:3]
    penalized, _ = tokens(frequency_penalty=2.0, extra_body={"return_token_ids": True})
    repeated = [t for t in set(base) if base.count(t) > 1]
    assert penalized != base or not repeated


def test_models_model_check_and_unique_ids(client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == list(NAMES)
    assert all(m.model_extra["max_model_len"] > 0 for m in listed)  # type: ignore[index]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"
    for call in (
        lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=1),
        lambda: client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=1
        ),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "model_not_found" and "gpt-4o" in str(info.value)
    answers = [client.completions.create(model="tiny", prompt="x", max_tokens=1) for _ in range(3)]
    ids = {a.id for a in answers}
    assert len(ids) == 3 and all(len(i) == len("cmpl-") + 32 for i in ids)
    default = client.completions.create(model=None, prompt="x", max_tokens=1)  # type: ignore[call-overload]
    assert default.model == NAMES[0]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": []},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
    ],
)
def test_what_cannot_be_honored_is_a_400_naming_it(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=1, **body)
    assert info.value.param == param
