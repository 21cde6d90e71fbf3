"""`response_format` through the official `openai` client against `dsv4 serve --model tiny`
(the packaged weights, trained on license text: the grammar does all the JSON work). Output
under json_schema validates against the schema and ends with "stop", streamed or not, for
every one of n choices, on both endpoints; json_object is a JSON object; a schema the library
refuses is a 400 naming `response_format.json_schema.schema`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from serve_support import free_port, serve_argv, wait_ready

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "strict": True, "schema": SCHEMA},
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 400  # far more than SCHEMA's output takes (its strings are bounded)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    port = free_port()
    argv = serve_argv("--model", "tiny", "--port", str(port), "--gpu-memory-gib", "0.05")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port)
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_json_schema_choices_validate_and_stop(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=FORMAT,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        n=2,
        temperature=1.0,
        seed=7,
    )
    assert len(answer.choices) == 2
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_schema_streams_the_same_json(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "response_format": FORMAT,
        "max_tokens": MAX_TOKENS,
    }
    whole = client.chat.completions.create(**kwargs)
    text, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert text == whole.choices[0].message.content
    assert [r for r in reasons if r is not None] == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_too(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model="tiny",
        prompt="Copyright",
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": FORMAT},
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)


def test_json_object_is_a_json_object(client: openai.OpenAI) -> None:
    # The license-trained model would write keys forever; a bias on "}" (byte 125) closes the
    # object as soon as the grammar allows it.
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        logit_bias={"125": 30},
        max_tokens=MAX_TOKENS,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_unfinished_json_at_max_tokens_is_a_length_finish(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=FORMAT,  # type: ignore[arg-type]
        max_tokens=4,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and (choice.message.content or "").startswith('{"')


@pytest.mark.parametrize(
    "schema",
    [{"type": "nonsense"}, {"$ref": "#/$defs/missing"}, {"type": "string", "format": "nope"}],
)
def test_a_schema_the_library_refuses_is_a_400_naming_it(
    client: openai.OpenAI, schema: dict[str, Any]
) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=bad,  # type: ignore[arg-type]
            max_tokens=4,
        )
    assert info.value.param == "response_format.json_schema.schema"
