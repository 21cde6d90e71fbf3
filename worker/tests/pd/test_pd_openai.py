"""The OpenAI API through `dsv4 up` (the router in front of a prefill and a decode worker, KV
over NIXL: crds/samples/tiny-pd.yaml) with the official client answers exactly what a
colocated `dsv4 serve` answers: n seeded choices with penalties, logit bias and min_tokens
(prefill samples the first token, decode the rest), logprobs of the sampled tokens and, with
echo, of the prompt (computed by prefill, carried to decode), streaming and not; `model` is
checked and /v1/models answered through the router."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_support import ENV, free_port, serve_argv, wait_ready

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "crds" / "samples" / "tiny-pd.yaml"
START_S = 300.0
TOL = 1e-5  # the same weights and forward on both sides; batches may differ


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """(through the router of `dsv4 up`, a colocated worker with the same weights)."""
    workdir = tmp_path_factory.mktemp("up")
    up_argv = [sys.executable, "-m", "dsv4_cli", "up", str(SAMPLE), "--port", "0"]
    up = subprocess.Popen(
        [*up_argv, "--workdir", str(workdir)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = free_port()
    serve = serve_argv("--model", "tiny", "--port", str(port), "--gpu-memory-gib", "0.25")
    colocated = subprocess.Popen(
        [*serve, "--page-size", "16", "--chunked-prefill-size", "256"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        router = _router_url(up)
        wait_ready(colocated, port)
        yield _client(router), _client(f"http://127.0.0.1:{port}")
    finally:
        up.send_signal(signal.SIGTERM)
        colocated.terminate()
        for proc in (up, colocated):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _router_url(up: subprocess.Popen[str]) -> str:
    """The router's URL from `dsv4 up`'s ready summary (it prints it once all are ready)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen, deadline = "", time.monotonic() + START_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen += line
        found = re.match(r"(?:router:|api:\s+router)\s+(http://\S+)", line)  # its API URL
        if found:
            return found.group(1)
    raise AssertionError(f"dsv4 up did not get ready:\n{seen}")


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and abs(x - y) <= TOL)
        for x, y in zip(a, b, strict=True)
    )


def test_sampled_choices_and_logprobs_equal_colocated(clients: tuple[Any, Any]) -> None:
    pd, colocated = clients
    body: dict[str, Any] = dict(
        model="tiny",
        prompt="This License applies",
        n=2,
        seed=21,
        temperature=0.8,
        top_p=0.95,
        max_tokens=8,
        logprobs=2,
        echo=True,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={"101": -100},  # no "e"
        extra_body={
            "repetition_penalty": 1.1,
            "min_tokens": 3,
            "stop_token_ids": [46],
            "return_token_ids": True,
            "top_k": 40,
        },
    )
    got, want = pd.completions.create(**body), colocated.completions.create(**body)
    assert got.usage == want.usage and got.id != want.id
    for g, w in zip(got.choices, want.choices, strict=True):
        assert (g.index, g.text, g.finish_reason) == (w.index, w.text, w.finish_reason)
        assert g.model_extra["token_ids"] == w.model_extra["token_ids"]
        assert "e" not in g.text[len(body["prompt"]) :]
        assert g.logprobs.tokens == w.logprobs.tokens
        assert _close(g.logprobs.token_logprobs, w.logprobs.token_logprobs)
        assert g.logprobs.text_offset == w.logprobs.text_offset
        assert g.logprobs.token_logprobs[0] is None  # echo: the prompt's come from prefill
    assert got.choices[0].text != got.choices[1].text  # seeds 21 and 22


def test_streamed_chat_with_logprobs_equals_colocated(clients: tuple[Any, Any]) -> None:
    pd, colocated = clients

    def run(client: Any) -> tuple[list[str], list[float], Any]:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            max_completion_tokens=6,
            logprobs=True,
            top_logprobs=2,
            n=2,
            seed=4,
            temperature=1.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts, values, usage = ["", ""], [], None
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.logprobs and c.logprobs.content:
                    values += [e.logprob for e in c.logprobs.content]
        return texts, sorted(values), usage

    got, want = run(pd), run(colocated)
    assert got[0] == want[0] and got[2] == want[2]
    assert _close(list(got[1]), list(want[1]))


def test_model_check_and_models_through_the_router(clients: tuple[Any, Any]) -> None:
    pd, _ = clients
    models = pd.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].model_extra["max_model_len"] > 0
    assert pd.models.retrieve("tiny").model_extra["max_model_len"] > 0
    for call in (
        lambda: pd.models.retrieve("gpt-4o"),
        lambda: pd.completions.create(model="gpt-4o", prompt="x", max_tokens=1),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "model_not_found"


def test_response_format_through_the_router_equals_colocated(clients: tuple[Any, Any]) -> None:
    """Constrained decoding across PD: prefill masks the first token, decode rebuilds the
    matcher from it and masks the rest; the JSON equals colocated's, streamed or not."""
    pd, colocated = clients
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "A person as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": schema},
        },
        "max_tokens": 200,
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
    }

    def whole(client: Any) -> list[tuple[str, str]]:
        answer = client.chat.completions.create(**kwargs)
        return [(c.message.content, c.finish_reason) for c in answer.choices]

    def streamed(client: Any) -> list[str]:
        texts = ["", ""]
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        return texts

    got = whole(pd)
    assert got == whole(colocated)
    for text, reason in got:
        assert reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool), value
    assert streamed(pd) == [text for text, _ in got]
