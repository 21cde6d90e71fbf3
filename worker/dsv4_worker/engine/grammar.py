"""Constrained decoding for OpenAI's `response_format` (json_object, json_schema): a request
whose output must be JSON gets a `Matcher`, which says which tokens keep the output a valid
prefix (a bitmask the sampler applies to the logits), advances with each sampled token, and
says when the JSON is complete (the request then ends with finish_reason "stop").

The library is llguidance (MIT; docs/engine.md has the measurements that chose it), behind
`Matcher` and `GrammarCompiler`: nothing else imports it, and only once a request asks for a
grammar. A request carries its grammar as text (`SamplingParams.json_schema`: a JSON schema,
json_object is `JSON_OBJECT`; or Lark text opening with `LARK_HEADER`, for tool calls and
thinking mode), so it travels as it is to a PD prefill and to every PP stage.

NOTE: the mask covers the model's vocabulary (logits' width). Ids past the tokenizer's have no
bytes and are never allowed. A tokenizer without EOS (the byte tokenizer) gets a virtual EOS
one past the model's vocabulary: it is allowed only once the JSON is complete, and it is cut
off with the other columns past the logits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import threading
from collections.abc import Sequence
from typing import Any, Final, Protocol

import numpy as np
import torch

JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
# A grammar given as Lark text (llguidance's dialect) starts with this; any other grammar
# text is a JSON schema (server/tool_grammar.py writes the Lark ones).
LARK_HEADER: Final = "%llguidance {}"
# The JSON the output may be: json.dumps's separators and no other whitespace (free whitespace
# lets a model pad forever; the schema's own "x-guidance" cannot turn it back on).
JSON_FORM: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The longest schema (compact JSON text) a request may carry: compiling one this long takes
# about 0.1 s here (a 50,000-value enum takes 1.5 s; OpenAI's own limits are far smaller).
MAX_SCHEMA_CHARS: Final = 64 * 1024
PROBE_BYTES: Final = 256  # how far `schema_error` walks a grammar looking for a complete value
_PROBE_VOCAB: Final = 257  # the byte tokenizer's bytes and its EOS
# Bytes that end a value or a string soonest, then the cheapest values to write.
_PROBE_ORDER: Final = tuple(b'}]"0ntf,:{[')
_PROBE_LOCK = threading.Lock()
_PROBE_TOKENIZER: Any = None


class Matcher(Protocol):
    @property
    def mask_words(self) -> int:
        """The mask's length in int32 words (its tokenizer's vocabulary, rounded up)."""
        ...

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into `words` (int32 [ceil(vocab / 32)], bit t % 32 of
        word t // 32 for token t)."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher is then
        in error and allows nothing more)."""
        ...

    @property
    def done(self) -> bool:
        """The output is complete: no token but an end may follow."""
        ...


class TokenSource(Protocol):
    """What the compiler reads from the server's tokenizer (`server/tokenizer.py`)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def tokenizer_json(self) -> str | None:
        """The HuggingFace tokenizer.json text; None for the byte tokenizer (id == byte)."""
        ...


def schema_error(schema: str) -> str | None:
    """Why a grammar (a JSON schema or Lark text) cannot be enforced, or None: refused by
    the library, or, a JSON schema, past MAX_SCHEMA_CHARS (compiling takes time linear in its
    size, on the server's event loop and again on the engine thread) or admitting no JSON
    value as far as `_probe` sees (a `$ref` cycle with no way out, an empty enum): such a
    request could only fail. (Lark text is the server's own, `tool_grammar`: not probed, its
    special tokens have no bytes.)"""
    lark = schema.startswith(LARK_HEADER)
    if not lark and len(schema) > MAX_SCHEMA_CHARS:
        return f"{len(schema)} characters; at most {MAX_SCHEMA_CHARS} (as compact JSON)"
    lib = _library()
    try:
        grammar = _grammar(lib, schema)
    except ValueError as exc:
        return str(exc)
    is_error, messages = lib.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return str(messages[0])
    return None if lark else _probe(lib, grammar)


def _probe(lib: Any, grammar: str) -> str | None:
    """Walk the grammar byte by byte (over the byte tokenizer), preferring the bytes that
    close a value (`_PROBE_ORDER`), for at most PROBE_BYTES bytes: why it cannot produce a
    complete JSON value, or None when the walk completed one or ran out of bytes (a grammar
    the walk cannot finish is not proven empty; the engine fails such a request alone)."""
    matcher = lib.LLMatcher(_probe_tokenizer(lib), grammar, log_level=0)
    words = np.zeros(-(-_PROBE_VOCAB // 32), dtype=np.int32)
    for _ in range(PROBE_BYTES):
        if matcher.is_error():
            return _unsatisfiable(str(matcher.get_error()))
        if matcher.is_stopped() or matcher.is_accepting():
            return None
        words[:] = 0
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:256]
        if not bits.any():
            return _unsatisfiable(str(matcher.get_error()) if matcher.is_error() else "")
        byte = next((b for b in _PROBE_ORDER if bits[b]), int(np.flatnonzero(bits)[0]))
        matcher.consume_token(byte)
    return None


def _unsatisfiable(detail: str) -> str:
    why = "no JSON value satisfies it (e.g. a $ref cycle with no way out, or an empty enum)"
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    return f"{why}: {first}" if first else why


def _probe_tokenizer(lib: Any) -> Any:
    global _PROBE_TOKENIZER
    with _PROBE_LOCK:
        if _PROBE_TOKENIZER is None:
            _PROBE_TOKENIZER = lib.LLTokenizer(lib.TokenizerWrapper(_ByteTokens(256)))
        return _PROBE_TOKENIZER


def allowed_tokens(matchers: Sequence[Matcher], vocab: int, device: torch.device) -> torch.Tensor:
    """The allowed next tokens of each matcher: bool [len(matchers), vocab], on `device`."""
    width = max(m.mask_words for m in matchers)
    assert width * 32 >= vocab, "a mask covers the logits"
    words = np.zeros((len(matchers), width), dtype=np.int32)
    for row, matcher in zip(words, matchers, strict=True):
        matcher.fill_mask(row[: matcher.mask_words])
    # Little-endian int32 words as bytes, each byte's bits low first: token 32w + b.
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.astype(np.bool_)).to(device)


class GrammarCompiler:
    """Builds matchers for one tokenizer and model vocabulary. The library's tokenizer is
    built on first use (tens of ms for a 32K vocabulary), once, under a lock."""

    def __init__(self, tokens: TokenSource, model_vocab: int) -> None:
        self._tokens = tokens
        self.model_vocab = model_vocab
        self._lock = threading.Lock()
        self._lib_tokenizer: Any = None

    def warm_in_background(self) -> None:
        """Build the library's tokenizer on a daemon thread now (seconds for a 129K
        vocabulary) rather than inside the first response_format request's step."""
        threading.Thread(target=self._warm, name="grammar-warm", daemon=True).start()

    def _warm(self) -> None:
        with contextlib.suppress(RuntimeError):  # no llguidance: requests are refused (400)
            self._tokenizer()

    def matcher(self, schema: str) -> Matcher:
        lib = _library()
        grammar = _grammar(lib, schema)
        tokenizer = self._tokenizer()
        inner = lib.LLMatcher(tokenizer, grammar, log_level=0)
        if inner.is_error():
            raise ValueError(f"json_schema: {inner.get_error()}")
        return _LLMatcher(inner, -(-int(tokenizer.vocab_size) // 32))

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._lib_tokenizer is None:
                self._lib_tokenizer = self._build()
            return self._lib_tokenizer

    def _build(self) -> Any:
        lib = _library()
        source = self._tokens
        text = source.tokenizer_json()
        if text is not None:
            vocab = max(self.model_vocab, source.vocab_size)
            eos = list(source.eos_token_ids) or None  # None: the library reads tokenizer.json's
            return lib.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
        return lib.LLTokenizer(lib.TokenizerWrapper(_ByteTokens(self.model_vocab)))


class _LLMatcher:
    def __init__(self, inner: Any, mask_words: int) -> None:
        self._inner = inner
        self._words = mask_words

    @property
    def mask_words(self) -> int:
        return self._words

    def fill_mask(self, words: np.ndarray) -> None:
        assert words.dtype == np.int32 and words.flags["C_CONTIGUOUS"]
        self._inner.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token: int) -> bool:
        return bool(self._inner.consume_token(token))

    @property
    def done(self) -> bool:
        return bool(self._inner.is_stopped()) and not self._inner.is_error()


class _ByteTokens:
    """The byte tokenizer as llguidance's `TokenizerWrapper` reads it: ids 0-255 are the
    bytes, ids up to the model's vocabulary have no bytes, and one more is the virtual EOS."""

    def __init__(self, model_vocab: int) -> None:
        self.eos_token_id = model_vocab
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (model_vocab - 256) + [b""]
        self.special_token_ids = [model_vocab]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def canonical_schema(schema: object) -> str:
    """A JSON schema (a parsed object) as the text a request carries."""
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def _grammar(lib: Any, spec: str) -> Any:
    if spec.startswith(LARK_HEADER):
        return lib.LLMatcher.grammar_from_lark(spec)
    return lib.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_FORM)


def _library() -> Any:
    try:
        return importlib.import_module("llguidance")
    except ImportError as exc:
        raise RuntimeError(
            "response_format json_object/json_schema needs the `llguidance` package "
            "(the worker extra): pip install llguidance"
        ) from exc
