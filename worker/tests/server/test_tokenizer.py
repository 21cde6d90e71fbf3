"""Tokenizers, the streaming detokenizer and stop-string search."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizer_support import conv

from dsv4_worker.server.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    StreamDecoder,
    Tokenizer,
    find_stop,
    load_tokenizer,
    stop_holdback,
)

TEXTS = ["", "hello, world", "héllo wörld", "日本語のテキスト", "emoji 🦀🚀 end", "mixed é日🦀a"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_facts() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.eos_token_id is None
    assert tok.eos_token_ids == ()
    assert tok.decode([0xC3]) == "\ufffd"  # invalid UTF-8 is replaced, never raised
    assert tok.decode([104, 300, 105]) == "hi"  # ids past the bytes have no text


def test_chat_template_exact() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q?"},
        {"role": "assistant", "content": "a."},
        {"role": "user", "content": "more"},
    ]
    # DeepSeek-V4's encoding (non-thinking): the special tokens are text to the byte tokenizer.
    assert ByteTokenizer().apply_chat_template(conv(messages)) == (
        "<｜begin▁of▁sentence｜>sys<｜User｜>q?<｜Assistant｜></think>a.<｜end▁of▁sentence｜>"
        "<｜User｜>more<｜Assistant｜></think>"
    )
    prompt = ByteTokenizer().encode_chat(conv(messages))
    assert prompt.text == ByteTokenizer().apply_chat_template(conv(messages))
    assert prompt.ids == tuple(prompt.text.encode("utf-8"))
    assert ByteTokenizer().decode(prompt.ids) == prompt.text  # the special tokens round-trip


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_byte_by_byte(text: str) -> None:
    decoder = StreamDecoder(ByteTokenizer())
    pieces = [decoder.push(b) for b in text.encode("utf-8")]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert decoder.flush() == ""


def test_stream_decoder_emits_a_character_when_its_last_byte_arrives() -> None:
    decoder = StreamDecoder(ByteTokenizer())
    assert [decoder.push(b) for b in "a🦀b".encode()] == ["a", "", "", "", "🦀", "b"]


def test_stream_decoder_flush_gives_up_an_incomplete_sequence() -> None:
    decoder = StreamDecoder(ByteTokenizer())
    assert decoder.push(ord("x")) == "x"
    assert decoder.push(0xF0) == ""
    assert decoder.push(0x9F) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.flush() == ""


def test_stream_decoder_passes_invalid_bytes_once_followed_by_text() -> None:
    decoder = StreamDecoder(ByteTokenizer())
    out = decoder.push(0xFF) + decoder.push(ord("a")) + decoder.push(ord("b"))
    assert out == "\ufffdab"


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello world", [], None),
        ("hello world", ["xyz"], None),
        ("hello world", ["world"], 6),
        ("hello world", ["o"], 4),
        ("hello world", ["world", "lo"], 3),  # the earliest start wins, not the list order
        ("hello world", ["hello"], 0),
        ("abc", ["abcd"], None),
        ("a\n\nb", ["\n\n", "\n"], 1),
        ("日本語", ["語"], 2),  # a str index, not a byte offset
    ],
)
def test_find_stop(text: str, stops: list[str], expected: int | None) -> None:
    assert find_stop(text, stops) == expected


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello", [], 0),
        ("hello wo", ["world"], 2),
        ("hello w", ["world", "wx"], 1),
        ("abc", ["xyz"], 0),
        ("ab", ["abc", "b"], 2),  # a complete stop is find_stop's job; "ab" may begin "abc"
        ("", ["abc"], 0),
    ],
)
def test_stop_holdback(text: str, stops: list[str], expected: int) -> None:
    assert stop_holdback(text, stops) == expected


def test_load_tokenizer_default_is_bytes() -> None:
    tok: Tokenizer = load_tokenizer(None, 256)
    assert isinstance(tok, ByteTokenizer)
    assert isinstance(load_tokenizer(None, 1024), ByteTokenizer)


def test_load_tokenizer_byte_needs_256() -> None:
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        load_tokenizer(None, 255)


def test_load_tokenizer_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path), 1000)


def _write_word_level(directory: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    hf.add_special_tokens(["</s>"])
    path = directory / "tokenizer.json"
    hf.save(str(path))
    return path


def test_hf_tokenizer_round_trip(tmp_path: Path) -> None:
    path = _write_word_level(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path), 8)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 5
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == (1,)
    ids = tok.encode("hello world again")
    assert ids == [2, 3, 4]
    assert tok.decode(ids) == "hello world again"
    assert tok.apply_chat_template(conv([{"role": "user", "content": "x"}])) == (
        "<｜begin▁of▁sentence｜><｜User｜>x<｜Assistant｜></think>"
    )  # no chat_template in the config: DeepSeek-V4's encoding
    assert isinstance(load_tokenizer(str(path), 5), HFTokenizer)


def test_hf_tokenizer_eos_as_object_and_absent(tmp_path: Path) -> None:
    _write_word_level(tmp_path)
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_token_id is None
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_token_ids == ()
    config = {"eos_token": {"content": "</s>", "lstrip": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_token_id == 1


def test_hf_tokenizer_eos_ids_from_generation_config(tmp_path: Path) -> None:
    _write_word_level(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 1, 4]}))
    tok = load_tokenizer(str(tmp_path), 8)
    assert tok.eos_token_ids == (1, 4)  # the config's eos_token first, no repeats
    assert tok.eos_token_id == 1


def test_hf_tokenizer_file_path_reads_the_configs_beside_it(tmp_path: Path) -> None:
    path = _write_word_level(tmp_path)
    template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(str(path), 8)
    prompt = tok.encode_chat(conv([{"role": "user", "content": "hello world"}]))
    assert prompt == ("hello world ", (2, 3))


def test_load_tokenizer_byte_fallback_for_a_model_dir_without_tokenizer_json(
    tmp_path: Path,
) -> None:
    assert isinstance(load_tokenizer(str(tmp_path), 300, byte_fallback=True), ByteTokenizer)
    _write_word_level(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path), 8, byte_fallback=True), HFTokenizer)


def test_hf_tokenizer_larger_than_the_model_is_rejected(tmp_path: Path) -> None:
    _write_word_level(tmp_path)
    with pytest.raises(ValueError, match="more than the model's 4"):
        load_tokenizer(str(tmp_path), 4)


def test_hf_tokenizer_stream_decoder(tmp_path: Path) -> None:
    tok = load_tokenizer(str(_write_word_level(tmp_path)), 8)
    decoder = StreamDecoder(tok)
    assert "".join(decoder.push(i) for i in [2, 3, 4]) + decoder.flush() == "hello world again"


def test_hf_tokenizer_without_the_package_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(RuntimeError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path), 1000)
