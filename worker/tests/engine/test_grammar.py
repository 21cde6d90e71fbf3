"""Constrained decoding (`grammar.py`): the mask's bit layout; a walk that only ever takes
allowed tokens (any of them) ends in JSON the schema accepts, for the byte tokenizer and a BPE
one; in the engine, a request with a schema ends ("stop") with valid JSON while a request
without one in the same batch gets exactly its solo tokens; n seeded choices differ."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from engine_helpers import engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_support import MODEL_VOCAB, build_bpe

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.grammar import (
    JSON_OBJECT,
    GrammarCompiler,
    Matcher,
    allowed_tokens,
    canonical_schema,
    schema_error,
)
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.server.tokenizer import ByteTokenizer

# Every walk through this schema is short: enums, bounded strings and integers, a short array.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "bc", None]},
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
# A short one for the engine tests (each token is a forward).
SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "bc"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
MAX_WALK = 400  # tokens; far more than the longest output SCHEMA allows in bytes
MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=5)


class _Bpe:
    """tokenizer_support's BPE as the compiler reads a tokenizer (as HFTokenizer gives it)."""

    def __init__(self) -> None:
        self.tok = build_bpe()
        self.vocab_size = int(self.tok.get_vocab_size())
        self.eos_token_ids = (1,)

    def tokenizer_json(self) -> str | None:
        return str(self.tok.to_str())


BYTES = GrammarCompiler(ByteTokenizer(), MODEL.weights.vocab_size)


def test_the_mask_sets_token_t_at_bit_t_mod_32_of_word_t_div_32() -> None:
    class Fixed:
        def __init__(self, tokens: list[int]) -> None:
            self.tokens = tokens

        @property
        def mask_words(self) -> int:
            return 10

        def fill_mask(self, words: np.ndarray) -> None:
            for t in self.tokens:
                words[t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))

        def accept(self, token: int) -> bool:
            return True

        @property
        def done(self) -> bool:
            return False

    rows: list[Matcher] = [Fixed([0, 31, 32, 299]), Fixed([255, 300])]
    allowed = allowed_tokens(rows, 300, torch.device("cpu"))
    assert allowed.shape == (2, 300) and allowed.dtype == torch.bool
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 31, 32, 299]
    assert torch.nonzero(allowed[1]).flatten().tolist() == [255]  # 300 is past the logits


def _walk(compiler: GrammarCompiler, schema: str, picks: st.DataObject, vocab: int) -> list[int]:
    """Take any allowed token (hypothesis picks which) until the matcher is done."""
    matcher = compiler.matcher(schema)
    out: list[int] = []
    for _ in range(MAX_WALK):
        if matcher.done:
            return out
        allowed = torch.nonzero(allowed_tokens([matcher], vocab, torch.device("cpu"))[0])
        choices = allowed.flatten().tolist()
        assert choices, f"a valid prefix allows no token: {out}"
        token = picks.draw(st.sampled_from(choices))
        assert matcher.accept(token)
        out.append(token)
    raise AssertionError(f"not done after {MAX_WALK} tokens: {out}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_walk_over_allowed_bytes_is_json_the_schema_accepts(picks: st.DataObject) -> None:
    vocab = MODEL.weights.vocab_size
    out = _walk(BYTES, canonical_schema(SCHEMA), picks, vocab)
    jsonschema.validate(json.loads(bytes(out).decode("utf-8")), SCHEMA)


BPE = _Bpe()
BPE_COMPILER = GrammarCompiler(BPE, MODEL_VOCAB)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_walk_over_allowed_bpe_tokens_is_json_the_schema_accepts(
    picks: st.DataObject,
) -> None:
    out = _walk(BPE_COMPILER, canonical_schema(SCHEMA), picks, MODEL_VOCAB)
    assert all(t < BPE.vocab_size for t in out), "ids past the tokenizer's have no text"
    jsonschema.validate(json.loads(BPE.tok.decode(out)), SCHEMA)


def test_schema_errors_name_the_problem() -> None:
    assert schema_error(canonical_schema(SCHEMA)) is None
    assert schema_error(JSON_OBJECT) is None
    why = schema_error(canonical_schema({"type": "nonsense"}))
    assert why is not None and "nonsense" in why


def _engine() -> Engine:
    eng = engine(MODEL, WEIGHTS)
    eng.grammar = BYTES
    return eng


def test_a_request_with_a_schema_ends_with_valid_json_beside_a_plain_one() -> None:
    plain_prompt, params = [5, 6, 7, 8], SamplingParams(max_new_tokens=4)
    solo = _engine()
    alone = solo.submit(plain_prompt, params)
    solo.run_until_idle()

    eng = _engine()
    schema = canonical_schema(SMALL)
    constrained = [
        eng.submit([1, 2, 3], SamplingParams(max_new_tokens=MAX_WALK, json_schema=schema)),
        eng.submit(
            [9, 9],
            SamplingParams(max_new_tokens=MAX_WALK, json_schema=schema, temperature=1.0, seed=4),
        ),
    ]
    plain = eng.submit(plain_prompt, params)
    eng.run_until_idle()
    assert plain.output == alone.output and plain.finish_reason == "length"
    for req in constrained:
        assert req.finish_reason == "stop", bytes(req.output)
        jsonschema.validate(json.loads(bytes(req.output).decode("utf-8")), SMALL)


def test_a_schema_without_a_compiler_is_refused_at_submit() -> None:
    eng = engine(MODEL, WEIGHTS)
    with pytest.raises(ValueError, match="grammar"):
        eng.submit([1], SamplingParams(json_schema=JSON_OBJECT))


def test_the_last_allowed_token_ends_an_unfinished_json_with_length() -> None:
    eng = _engine()
    schema = canonical_schema(SMALL)  # b'{"ok": ' or b'{"tag": ' must open it
    req = eng.submit([1, 2], SamplingParams(max_new_tokens=3, json_schema=schema))
    eng.run_until_idle()
    assert req.finish_reason == "length" and bytes(req.output) in (b'{"o', b'{"t')
