"""Tokenizer and chat template from a HuggingFace model directory: the template renders
exactly, its tokens are `tokenizers`' own encoding without a second BOS, content parts join,
every template or file problem is a clear error, EOS ids end generation, and a chat request
through the HTTP layer reaches the engine as those tokens."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizer_support import (
    ASSISTANT,
    BOS,
    BOS_ID,
    DEEPSEEK_TEMPLATE,
    EOS,
    EOS_ID,
    EOT,
    EOT_ID,
    MODEL_VOCAB,
    USER,
    USER_ID,
    conv,
    deepseek_config,
    write_model_dir,
)

from dsv4_common.api import RankCapacity
from dsv4_common.api.worker_status import WorkerStatus
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.server.admission import ADMIT, Verdict
from dsv4_worker.server.app import ServeInfo, build_app
from dsv4_worker.server.chat_template import ChatTemplate, ChatTemplateError
from dsv4_worker.server.protocol import RequestError, parse_chat, parse_completion
from dsv4_worker.server.runner import Done, Handle, Snapshot, Token
from dsv4_worker.server.tokenizer import HFTokenizer, load_tokenizer

CTX = 256
Messages = list[dict[str, Any]]


def _load(directory: Path) -> HFTokenizer:
    tok = load_tokenizer(str(directory), MODEL_VOCAB)
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture
def deepseek_dir(tmp_path: Path) -> Path:
    write_model_dir(tmp_path, config=deepseek_config())
    return tmp_path


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


CONVERSATIONS: list[tuple[str, Messages, str]] = [
    ("one-user-turn", [_user("Hi")], f"{BOS}{USER}Hi{ASSISTANT}"),
    (
        "system-and-turns",
        [
            {"role": "system", "content": "Be brief."},
            _user("Hello!"),
            _assistant("I am fine."),
            _user("How are you today?"),
        ],
        f"{BOS}Be brief.{USER}Hello!{ASSISTANT}I am fine.{EOS}{USER}How are you today?{ASSISTANT}",
    ),
    (
        "turns-without-system",
        [_user("2+2?"), _assistant("4"), _user("3+3?")],
        f"{BOS}{USER}2+2?{ASSISTANT}4{EOS}{USER}3+3?{ASSISTANT}",
    ),
    ("empty-content", [_user("")], f"{BOS}{USER}{ASSISTANT}"),
    (
        "unicode-and-newlines",
        [_user("日本語\n  🦀 {{ not a tag }}")],
        f"{BOS}{USER}日本語\n  🦀 {{{{ not a tag }}}}{ASSISTANT}",
    ),
]


@pytest.mark.parametrize(
    ("messages", "expected"), [c[1:] for c in CONVERSATIONS], ids=[c[0] for c in CONVERSATIONS]
)
def test_template_renders_exactly_and_tokens_are_the_tokenizers_own(
    deepseek_dir: Path, messages: Messages, expected: str
) -> None:
    tok = _load(deepseek_dir)
    hf = write_model_dir(deepseek_dir / "copy")  # the same training: the same tokenizer
    assert tok.apply_chat_template(conv(messages)) == expected
    prompt = tok.encode_chat(conv(messages))
    assert prompt.text == expected
    assert list(prompt.ids) == hf.encode(expected, add_special_tokens=False).ids
    assert prompt.ids.count(BOS_ID) == 1 and prompt.ids[0] == BOS_ID


def test_bos_is_not_doubled_although_the_tokenizer_adds_one(deepseek_dir: Path) -> None:
    tok = _load(deepseek_dir)
    hf = write_model_dir(deepseek_dir / "copy")
    text = tok.apply_chat_template(conv([_user("Hi")]))
    assert hf.encode(text).ids[:2] == [BOS_ID, BOS_ID]  # what adding special tokens would do
    assert tok.encode_chat(conv([_user("Hi")])).ids[:2] == (BOS_ID, USER_ID)
    # A completion prompt gets the one BOS that add_bos_token asks for.
    assert tok.encode("Hello") == hf.encode("Hello").ids
    assert tok.encode("Hello")[0] == BOS_ID and tok.encode("Hello").count(BOS_ID) == 1


@pytest.mark.parametrize(
    ("add_bos", "post_processor_bos", "expected_first"),
    [
        (None, True, [BOS_ID]),  # unset: the post-processor decides
        (None, False, []),
        (True, True, [BOS_ID]),  # set: exactly one, whatever the post-processor does
        (True, False, [BOS_ID]),
        (False, True, []),
    ],
)
def test_completion_bos_follows_add_bos_token(
    tmp_path: Path, add_bos: bool | None, post_processor_bos: bool, expected_first: list[int]
) -> None:
    hf = write_model_dir(tmp_path)
    if not post_processor_bos:
        hf.post_processor = None
        hf.save(str(tmp_path / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": BOS, "eos_token": EOS}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = _load(tmp_path).encode("Hello")
    body = hf.encode("Hello", add_special_tokens=False).ids
    assert ids == expected_first + body


def test_add_bos_token_without_a_bos_token_is_an_error(tmp_path: Path) -> None:
    write_model_dir(tmp_path, config={"add_bos_token": True, "eos_token": EOS})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: add_bos_token is true"):
        _load(tmp_path)


# ---- through the request parser ---------------------------------------------------------------


def _chat(tok: HFTokenizer, messages: object) -> Any:
    return parse_chat({"messages": messages}, tok, vocab_size=MODEL_VOCAB, max_context_tokens=CTX)


def test_text_parts_are_joined_with_newlines(deepseek_dir: Path) -> None:
    tok = _load(deepseek_dir)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    req = _chat(tok, [{"role": "user", "content": parts}])
    assert req.echo_prompt_text == f"{BOS}{USER}Hello\nthere{ASSISTANT}"
    assert req.prompt_ids == tok.encode_chat(conv([_user("Hello\nthere")])).ids


@pytest.mark.parametrize(
    ("content", "field", "substring"),
    [
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
            "messages[0].content[1].type",
            "'image_url'",
        ),
        ([{"text": "a"}], "messages[0].content[0].type", "got null"),
        ([], "messages[0].content", "must not be an empty list"),
        (["a"], "messages[0].content[0]", "must be an object"),
        ([{"type": "text", "text": 3}], "messages[0].content[0].text", "must be a string"),
        ([{"type": "text", "text": "a", "x": 1}], "messages[0].content[0].x", "unknown"),
        (None, "messages[0].content", "a string or a list of text parts"),
    ],
)
def test_bad_content_parts_are_refused_naming_the_field(
    deepseek_dir: Path, content: object, field: str, substring: str
) -> None:
    with pytest.raises(RequestError) as info:
        _chat(_load(deepseek_dir), [{"role": "user", "content": content}])
    assert info.value.field == field
    assert substring in info.value.message


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([_assistant("first")], "turns must alternate"),
        ([_user("a"), _user("b")], "turns must alternate"),
        ([_user("a"), {"role": "system", "content": "late"}], "a system message may only"),
    ],
)
def test_a_template_refusal_is_a_400_on_messages(
    deepseek_dir: Path, messages: Messages, reason: str
) -> None:
    tok = _load(deepseek_dir)
    with pytest.raises(ChatTemplateError, match=reason) as direct:
        tok.encode_chat(conv(messages))
    assert isinstance(direct.value, ValueError)
    with pytest.raises(RequestError) as info:
        _chat(tok, messages)
    assert info.value.field == "messages"
    assert "the chat template refused these messages" in info.value.message
    assert reason in info.value.message


def test_eos_ids_join_the_stop_ids(tmp_path: Path) -> None:
    write_model_dir(tmp_path, config=deepseek_config(), generation={"eos_token_id": [EOT_ID, 1]})
    tok = _load(tmp_path)
    assert tok.eos_token_ids == (EOS_ID, EOT_ID)
    assert tok.eos_token_id == EOS_ID
    assert _chat(tok, [_user("Hi")]).params.stop_token_ids == (EOS_ID, EOT_ID)
    body = {"prompt": "Hi", "stop": [7, EOT_ID, "x"]}
    req = parse_completion(body, tok, vocab_size=MODEL_VOCAB, max_context_tokens=CTX)
    assert req.params.stop_token_ids == (7, EOT_ID, EOS_ID)  # the request's first, no repeats
    assert req.stop_strings == ("x",)


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        ({"eos_token_id": EOT_ID}, (EOS_ID, EOT_ID)),
        ({"eos_token_id": None}, (EOS_ID,)),
        ({"bos_token_id": 0}, (EOS_ID,)),
    ],
)
def test_generation_config_eos_forms(
    tmp_path: Path, generation: dict[str, Any], expected: tuple[int, ...]
) -> None:
    write_model_dir(tmp_path, config=deepseek_config(), generation=generation)
    assert _load(tmp_path).eos_token_ids == expected


# ---- where the template comes from ------------------------------------------------------------


def test_chat_template_jinja_beside_the_config_wins(tmp_path: Path) -> None:
    write_model_dir(tmp_path, config=deepseek_config(chat_template="ignored"))
    (tmp_path / "chat_template.jinja").write_text(DEEPSEEK_TEMPLATE, encoding="utf-8")
    assert _load(tmp_path).apply_chat_template(conv([_user("Hi")])) == f"{BOS}{USER}Hi{ASSISTANT}"


def test_chat_template_jinja_without_a_config(tmp_path: Path) -> None:
    write_model_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages|length }}]")
    tok = _load(tmp_path)
    assert tok.apply_chat_template(conv([_user("a"), _assistant("b")])) == "[2]"  # no bos_token set
    assert tok.eos_token_ids == ()


def test_list_of_templates_uses_the_default(tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "tools!"},
        {"name": "default", "template": DEEPSEEK_TEMPLATE},
    ]
    write_model_dir(tmp_path, config=deepseek_config(chat_template=templates))
    assert _load(tmp_path).apply_chat_template(conv([_user("Hi")])) == f"{BOS}{USER}Hi{ASSISTANT}"


def test_missing_tokenizer_config_falls_back_to_the_built_in_template(tmp_path: Path) -> None:
    hf = write_model_dir(tmp_path)
    tok = _load(tmp_path)
    assert tok.chat_template is None and tok.eos_token_ids == () and tok.eos_token_id is None
    messages = [_user("Hi")]
    prompt = tok.encode_chat(conv(messages))
    assert prompt.text == f"{BOS}{USER}Hi{ASSISTANT}</think>"  # DeepSeek-V4's encoding
    # The encoding writes its BOS: tokenized without adding one, so there is exactly one.
    assert list(prompt.ids) == hf.encode(prompt.text, add_special_tokens=False).ids
    assert prompt.ids[0] == BOS_ID and prompt.ids.count(BOS_ID) == 1


def test_config_without_chat_template_falls_back_too(tmp_path: Path) -> None:
    config = deepseek_config()
    del config["chat_template"]
    write_model_dir(tmp_path, config=config)
    tok = _load(tmp_path)
    assert tok.apply_chat_template(conv([_user("Hi")])) == f"{BOS}{USER}Hi{ASSISTANT}</think>"
    assert tok.eos_token_ids == (EOS_ID,)


# ---- errors that name the file ----------------------------------------------------------------


def _write_raw(directory: Path, name: str, text: str) -> None:
    write_model_dir(directory, config=deepseek_config())
    (directory / name).write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    ("name", "text", "pattern"),
    [
        ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: not valid JSON"),
        ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: must hold a JSON object"),
        ("generation_config.json", "{", r"generation_config\.json: not valid JSON"),
        (
            "generation_config.json",
            '{"eos_token_id": ["x"]}',
            r"generation_config\.json: eos_token_id must be a token id",
        ),
        (
            "generation_config.json",
            '{"eos_token_id": 9999}',
            r"generation_config\.json: eos_token_id 9999 is outside the tokenizer's",
        ),
        ("tokenizer.json", "{broken", r"tokenizer\.json: the tokenizers package cannot read"),
        ("chat_template.jinja", "{% if %}", r"chat_template\.jinja: the chat template does not"),
    ],
)
def test_malformed_files_are_value_errors_naming_the_file(
    tmp_path: Path, name: str, text: str, pattern: str
) -> None:
    _write_raw(tmp_path, name, text)
    with pytest.raises(ValueError, match=pattern):
        _load(tmp_path)


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"chat_template": "{% for m in messages %}"}, r"chat_template: the chat template does"),
        ({"chat_template": "{{ x | no_such_filter }}"}, "does not compile"),
        ({"chat_template": 3}, "chat_template must be a string or a list"),
        ({"chat_template": [{"name": "rag", "template": "x"}]}, r"\(rag\) but none named"),
        ({"chat_template": [{"name": "default"}]}, r"chat_template\[0\] must be an object"),
        ({"eos_token": "<no such token>"}, "eos_token '<no such token>' is not a token"),
        ({"eos_token": 5}, "eos_token must be a string"),
        ({"add_bos_token": "yes"}, "add_bos_token must be true or false"),
    ],
)
def test_bad_config_values_are_value_errors_naming_the_file(
    tmp_path: Path, extra: dict[str, Any], pattern: str
) -> None:
    write_model_dir(tmp_path, config=deepseek_config(**extra))
    with pytest.raises(ValueError, match=pattern) as info:
        _load(tmp_path)
    assert "tokenizer_config.json" in str(info.value)


def test_a_tokenizer_larger_than_the_model_is_refused(deepseek_dir: Path) -> None:
    size = _load(deepseek_dir).vocab_size
    with pytest.raises(ValueError, match=f"has {size} tokens, more than the model's {size - 1}"):
        load_tokenizer(str(deepseek_dir), size - 1)


def test_added_tokens_decoder_adds_missing_tokens_at_their_ids(tmp_path: Path) -> None:
    hf = write_model_dir(tmp_path)
    size = hf.get_vocab_size(with_added_tokens=True)
    added = {
        str(BOS_ID): {"content": BOS, "special": True},
        str(size): {"content": "<｜tool▁call｜>", "special": True},
    }
    config = deepseek_config(added_tokens_decoder=added)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = _load(tmp_path)
    assert tok.vocab_size == size + 1
    assert tok.encode_chat(conv([_user("<｜tool▁call｜>")])).ids[2] == size
    assert tok.decode([size, *hf.encode("Hi", add_special_tokens=False).ids]) == "Hi"


def test_added_tokens_decoder_disagreeing_with_tokenizer_json_is_refused(tmp_path: Path) -> None:
    config = deepseek_config(added_tokens_decoder={"7": {"content": EOS, "special": True}})
    write_model_dir(tmp_path, config=config)
    with pytest.raises(ValueError, match=r"gives '<｜end▁of▁sentence｜>' id 7, but .* id 1"):
        _load(tmp_path)


def test_directory_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path), MODEL_VOCAB)
    tok = load_tokenizer(str(tmp_path), MODEL_VOCAB, byte_fallback=True)
    assert tok.vocab_size == 256 and tok.eos_token_ids == ()
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        load_tokenizer(str(tmp_path), 100, byte_fallback=True)


# ---- the renderer itself -----------------------------------------------------------------------


def _render(source: str, messages: Messages, **tokens: str) -> str:
    return ChatTemplate(source, origin="test", special_tokens=tokens).render(messages)


def test_trim_and_lstrip_blocks_as_hf_sets_them() -> None:
    chatml = (
        "{% for message in messages %}\n"
        "<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n"
        "    {% endfor %}\n"
        "{% if add_generation_prompt %}\n"
        "<|im_start|>assistant\n"
        "{% endif %}\n"
    )
    assert _render(chatml, [_user("Hi")]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_globals_and_filters_hf_templates_use() -> None:
    source = (
        "{{ messages | tojson }}|{{ {'b': 1, 'a': '<é>'} | tojson(sort_keys=True) }}|"
        "{{ tools is none }}|{{ bos_token }}{{ eos_token }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|"
        "{{ strftime_now('%Y') | length }}"
    )
    out = _render(source, [_user("ü"), _user("x")], bos_token="<s>", eos_token="</s>")
    assert out == (
        '[{"role": "user", "content": "ü"}, {"role": "user", "content": "x"}]|'
        '{"a": "<é>", "b": 1}|True|<s></s>|ü|4'
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ raise_exception('no tools here') }}", "refused these messages: no tools here"),
        ("{{ messages[0]['content'] + 1 }}", "failed on these messages: TypeError"),
        ("{{ messages[3]['role'].upper() }}", "failed on these messages: UndefinedError"),
        ("{{ messages.append(1) }}", "failed on these messages: SecurityError"),
        ("{{ ''.__class__.__mro__ }}", "failed on these messages: SecurityError"),
    ],
)
def test_render_errors_are_chat_template_errors(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        _render(source, [_user("hi")])


def test_the_template_cannot_change_the_callers_messages() -> None:
    messages = [_user("hi")]
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        _render("{{ messages[0].pop('role') }}", messages)
    assert messages == [_user("hi")]


def test_same_text_and_ids_as_transformers(deepseek_dir: Path) -> None:
    """Our renderer and BOS rule against transformers' apply_chat_template (a dev dependency)."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(deepseek_dir))
    tok = _load(deepseek_dir)
    for _, messages, _ in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        assert tok.encode_chat(conv(messages)) == (text, tuple(ids))
    assert tok.encode("Hello there") == theirs("Hello there")["input_ids"]


# ---- through the HTTP layer (a runner stub instead of the engine) -----------------------------


class ReplyRunner:
    """Records each submitted prompt and answers it with `reply` token ids, then Done."""

    alive = True
    failure = None

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
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
        for token_id in self.reply:
            events.put_nowait(Token(token_id, time.monotonic()))
        events.put_nowait(Done("stop"))
        return Handle(len(self.submitted), events, time.monotonic())

    def abort(self, handle: Handle) -> None:
        pass


async def _post_chats(
    runner: ReplyRunner, tok: HFTokenizer, bodies: list[dict[str, Any]]
) -> list[tuple[int, dict[str, Any]]]:
    info = ServeInfo("ds", MODEL_VOCAB, CTX, WorkerStatus("colocated", 0, RankCapacity(1, 1, 1, 1)))
    app = build_app(runner, tok, info)  # type: ignore[arg-type]
    out = []
    async with TestClient(TestServer(app)) as client:
        for body in bodies:
            resp = await client.post("/v1/chat/completions", json=body)
            out.append((resp.status, await resp.json()))
    return out


def test_chat_over_http_reaches_the_engine_as_the_templated_tokens(deepseek_dir: Path) -> None:
    tok = _load(deepseek_dir)
    hf = write_model_dir(deepseek_dir / "copy")
    runner = ReplyRunner([*hf.encode("I am fine.", add_special_tokens=False).ids, EOS_ID])
    parts = [{"type": "text", "text": "Hello!"}]
    bodies: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 20},
        {"messages": [_assistant("first")]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    ]
    (ok, body), (refused, refusal), (image, image_error) = asyncio.run(
        _post_chats(runner, tok, bodies)
    )
    assert ok == 200, body
    assert body["choices"][0]["message"]["content"] == "I am fine."  # EOS is not text
    assert body["usage"]["prompt_tokens"] == len(runner.submitted[0][0])
    prompt, params = runner.submitted[0]
    assert list(prompt) == hf.encode(f"{BOS}{USER}Hello!{ASSISTANT}", add_special_tokens=False).ids
    assert params.stop_token_ids == (EOS_ID,)
    assert refused == 400 and refusal["error"]["param"] == "messages"
    assert "turns must alternate" in refusal["error"]["message"]
    assert image == 400 and image_error["error"]["param"] == "messages[0].content[0].type"
    assert len(runner.submitted) == 1


def test_eot_is_an_alternative_eos(tmp_path: Path) -> None:
    write_model_dir(tmp_path, config=deepseek_config(eos_token=EOT))
    tok = _load(tmp_path)
    assert tok.eos_token_ids == (EOT_ID,)
