"""Tokenizers behind one small Protocol (bytes for the tiny models, a HuggingFace model
directory's `tokenizer.json` and chat template otherwise), the incremental detokenizer for
streaming, and stop-string search.

Prompt tokens (HFTokenizer):

    prompt                       text                       BOS
    completion (a string)        as given                   `add_bos_token` when the config
                                                            sets it (true: exactly one BOS in
                                                            front, false: none); else what
                                                            tokenizer.json's post-processor adds
    chat, with a template        the rendered template      none added: the template writes
                                                            its own (HF's add_special_tokens=False)
    chat, without a template     DeepSeek-V4's encoding     none added: the encoding writes it
                                 (`dsv4_encoding.py`)

Generation ends at any of `eos_token_ids`: tokenizer_config.json's eos_token, then
generation_config.json's eos_token_id(s). The byte tokenizer has no EOS and no template: its
chat prompts are DeepSeek-V4's encoding as UTF-8 bytes (the special tokens are text there).
Decoding skips special tokens, except the protocol tags the reply parser reads (<think>,
</think> and DSML tags, should a tokenizer mark them special).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from dsv4_worker.server.chat_template import ChatTemplate
from dsv4_worker.server.conversation import Conversation, render
from dsv4_worker.server.dsml import MARK, THINK_END, THINK_START
from dsv4_worker.server.tokenizer_config import (
    CONFIG_FILE,
    GENERATION_FILE,
    AddedTokenSpec,
    TokenizerConfig,
    read_tokenizer_config,
)

_REPLACEMENT = "\ufffd"
_BYTE_VOCAB = 256
TOKENIZER_FILE = "tokenizer.json"


class ChatPrompt(NamedTuple):
    text: str  # the rendered conversation
    ids: tuple[int, ...]  # its tokens, BOS by the table above


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None  # the first of eos_token_ids (None: no EOS)
    eos_token_ids: tuple[int, ...]  # every id that ends generation

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, conv: Conversation) -> str: ...

    def encode_chat(self, conv: Conversation) -> ChatPrompt: ...

    def tokenizer_json(self) -> str | None:
        """tokenizer.json's text (with the added tokens), for the grammar library; None: the
        byte tokenizer."""
        ...


def is_protocol_tag(token: str) -> bool:
    """A token the reply parser must see in the decoded text."""
    return token in (THINK_START, THINK_END) or MARK in token


class ByteTokenizer:
    """Token id == UTF-8 byte value (vocab 256), for the tiny test models.

    Ids outside [0, 256) have no text. Invalid UTF-8 decodes to U+FFFD. No EOS token.
    Chat prompts are DeepSeek-V4's encoding, as bytes.
    """

    def __init__(self) -> None:
        self.vocab_size: int = _BYTE_VOCAB
        self.eos_token_id: int | None = None
        self.eos_token_ids: tuple[int, ...] = ()

    def tokenizer_json(self) -> str | None:
        return None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < _BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, conv: Conversation) -> str:
        return render(conv, None)

    def encode_chat(self, conv: Conversation) -> ChatPrompt:
        text = render(conv, None)
        return ChatPrompt(text, tuple(self.encode(text)))


class HFTokenizer:
    """A local HuggingFace `tokenizer.json`, through the `tokenizers` package (imported here),
    with what the files beside it say (`tokenizer_config.py`): special tokens, add_bos_token,
    added tokens, the chat template (none: DeepSeek-V4's encoding) and the EOS ids."""

    def __init__(self, path: Path) -> None:
        try:
            lib = importlib.import_module("tokenizers")
        except ImportError as exc:
            raise RuntimeError(
                f"loading {path} needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        try:
            self._tok: Any = lib.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: the tokenizers package cannot read it ({exc})") from exc
        config = read_tokenizer_config(path.parent)
        where = str(path.parent / CONFIG_FILE)
        _add_missing_tokens(lib, self._tok, config.added_tokens, where, path)
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        specials = {
            int(i): str(t.content)
            for i, t in self._tok.get_added_tokens_decoder().items()
            if t.special
        }
        # Special tokens decoding hides, and whether some special ones must show (the tags).
        self._hidden = frozenset(i for i, c in specials.items() if not is_protocol_tag(c))
        self._shows_special = len(self._hidden) < len(specials)
        self.bos_token_id: int | None = self._special_id(config.bos_token, "bos_token", where)
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(config, where, path.parent)
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self._add_bos = config.add_bos_token
        if self._add_bos and self.bos_token_id is None:
            raise ValueError(f"{where}: add_bos_token is true but no bos_token is set")
        template = config.chat_template
        self.chat_template: ChatTemplate | None = (
            None
            if template is None
            else ChatTemplate(
                template.text, origin=template.origin, special_tokens=config.special_tokens
            )
        )

    def tokenizer_json(self) -> str | None:
        return str(self._tok.to_str())

    def encode(self, text: str) -> list[int]:
        """A plain prompt (a completion, or chat without a template): BOS as the module's
        table says."""
        if self._add_bos is False:
            return self._ids(text, special=False)
        ids = self._ids(text, special=True)
        if self._add_bos and ids[:1] != [self.bos_token_id]:
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if not self._shows_special:
            return str(self._tok.decode(list(ids)))
        kept = [i for i in ids if i not in self._hidden]
        return str(self._tok.decode(kept, skip_special_tokens=False))

    def apply_chat_template(self, conv: Conversation) -> str:
        """The conversation as text (ChatTemplateError when the template refuses it)."""
        return render(conv, self.chat_template)

    def encode_chat(self, conv: Conversation) -> ChatPrompt:
        text = self.apply_chat_template(conv)
        # NOTE: the template (or the encoding) writes the BOS text itself; adding special
        # tokens would double it.
        return ChatPrompt(text, tuple(self._ids(text, special=False)))

    def _ids(self, text: str, *, special: bool) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=special).ids]

    def _special_id(self, token: str | None, key: str, where: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{where}: {key} {token!r} is not a token of the tokenizer")
        return int(token_id)

    def _eos_ids(self, config: TokenizerConfig, where: str, directory: Path) -> tuple[int, ...]:
        eos = self._special_id(config.eos_token, "eos_token", where)
        for i in config.generation_eos_ids:
            if i >= self.vocab_size:
                raise ValueError(
                    f"{directory / GENERATION_FILE}: eos_token_id {i} is outside the "
                    f"tokenizer's {self.vocab_size} tokens"
                )
        return tuple(dict.fromkeys([*([] if eos is None else [eos]), *config.generation_eos_ids]))


def _add_missing_tokens(
    lib: Any, tok: Any, specs: Sequence[AddedTokenSpec], where: str, path: Path
) -> None:
    """Check `added_tokens_decoder` against tokenizer.json; add the tokens it lacks (as
    transformers does), each of which must land on its declared id."""
    for spec in specs:
        known = tok.token_to_id(spec.content)
        if known is None:
            token = lib.AddedToken(
                spec.content,
                single_word=spec.single_word,
                lstrip=spec.lstrip,
                rstrip=spec.rstrip,
                normalized=spec.normalized,
                special=spec.special,
            )
            tok.add_tokens([token])
            known = tok.token_to_id(spec.content)
        if known != spec.token_id:
            raise ValueError(
                f"{where}: added_tokens_decoder gives {spec.content!r} id {spec.token_id}, "
                f"but {path} gives it id {known}"
            )


def load_tokenizer(path: str | None, vocab_size: int, *, byte_fallback: bool = False) -> Tokenizer:
    """None -> ByteTokenizer (needs vocab_size >= 256); a tokenizer.json, or a model directory
    holding one -> HFTokenizer (its vocab must fit in the model's vocab_size). A directory
    without tokenizer.json is an error, or the byte tokenizer with `byte_fallback` (for a
    model directory that may hold no tokenizer, like the tiny test models')."""
    file = None if path is None else Path(path)
    if file is not None and file.is_dir():
        file = file / TOKENIZER_FILE
        if byte_fallback and not file.is_file():
            file = None
    if file is None:
        if vocab_size < _BYTE_VOCAB:
            raise ValueError(
                f"the byte tokenizer needs vocab_size >= {_BYTE_VOCAB}, the model has {vocab_size}"
            )
        return ByteTokenizer()
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
