"""Tokenizers behind one small Protocol (bytes for the tiny models, a local HuggingFace
tokenizer.json otherwise), the incremental detokenizer for streaming, and stop-string search."""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
_BYTE_VOCAB = 256


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str: ...


def render_chat(messages: Sequence[Mapping[str, str]]) -> str:
    """The built-in chat template: "<|{role}|>\\n{content}\\n" per message, then
    "<|assistant|>\\n" to open the reply."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


class ByteTokenizer:
    """Token id == UTF-8 byte value (vocab 256), for the tiny test models.

    Ids outside [0, 256) have no text. Invalid UTF-8 decodes to U+FFFD. No EOS token.
    The chat template is `render_chat`: "<|{role}|>\\n{content}\\n" for each message,
    then "<|assistant|>\\n".
    """

    def __init__(self) -> None:
        self.vocab_size: int = _BYTE_VOCAB
        self.eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < _BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        return render_chat(messages)


class HFTokenizer:
    """A local HuggingFace `tokenizer.json`, through the `tokenizers` package (imported here).

    EOS comes from `eos_token` in a `tokenizer_config.json` beside it, when present.
    Jinja chat templates are not supported yet: chat uses the built-in `render_chat` template.
    """

    def __init__(self, path: Path) -> None:
        try:
            lib = importlib.import_module("tokenizers")
        except ImportError as exc:
            raise RuntimeError(
                f"loading {path} needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        self._tok: Any = lib.Tokenizer.from_file(str(path))
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_token_id: int | None = self._read_eos(path.parent / "tokenizer_config.json")

    def _read_eos(self, config_path: Path) -> int | None:
        if not config_path.is_file():
            return None
        token = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(token, dict):  # {"content": "</s>", ...} in older configs
            token = token.get("content")
        if not isinstance(token, str):
            return None
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text).ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        return render_chat(messages)


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer:
    """None -> ByteTokenizer (needs vocab_size >= 256); a tokenizer.json, or a directory
    holding one -> HFTokenizer (its vocab must fit in the model's vocab_size)."""
    if path is None:
        if vocab_size < _BYTE_VOCAB:
            raise ValueError(
                f"the byte tokenizer needs vocab_size >= {_BYTE_VOCAB}, the model has {vocab_size}"
            )
        return ByteTokenizer()
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"no tokenizer.json at {path}")
    tok = HFTokenizer(file)
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"tokenizer {file} has {tok.vocab_size} tokens, more than the model's {vocab_size}"
        )
    return tok


class StreamDecoder:
    """Turns a stream of token ids into text pieces, never emitting a partial character.

    It decodes a short window (from the start of the previous piece) so tokenizers whose
    text depends on the neighbouring token still join cleanly; a window ending in U+FFFD
    is held back until later tokens complete it (or `flush` gives it up).
    """

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # window start: the first id of the last emitted piece
        self._read = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (maybe "")."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        seen = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]


def find_stop(text: str, stop_strings: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in `text` (the output is cut there)."""
    hits = [i for s in stop_strings if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def stop_holdback(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing chars of `text` could begin a stop string: a stream holds them back."""
    longest = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
