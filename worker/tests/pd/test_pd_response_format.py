"""response_format through PD: prefill masks the first token with the request's grammar, and
decode rebuilds the matcher by replaying that token (`Engine._accept`), so the output is the
colocated worker's: JSON the schema accepts, ended by "stop"."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from engine_helpers import engine
from pd_support import pd_pair, wait_drained, wait_until

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.grammar import GrammarCompiler, canonical_schema
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.server.tokenizer import ByteTokenizer

MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=21)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "bc"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
PROMPTS = [[(13 * i % 240) + 5 for i in range(30)], [7, 8, 9]]
PARAMS = [
    SamplingParams(max_new_tokens=100, json_schema=canonical_schema(SCHEMA)),
    SamplingParams(
        max_new_tokens=100, json_schema=canonical_schema(SCHEMA), temperature=1.0, seed=3
    ),
]


def _make() -> Engine:
    eng = engine(MODEL, WEIGHTS)
    eng.grammar = GrammarCompiler(ByteTokenizer(), MODEL.weights.vocab_size)
    return eng


def test_pd_output_is_the_colocated_json() -> None:
    colocated = _make()
    reqs = [colocated.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
    colocated.run_until_idle()
    with pd_pair("zmq", _make, _make) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        out = pair.generate(PROMPTS, PARAMS)
        wait_drained(pair)
    for (tokens, done), req in zip(out, reqs, strict=True):
        assert done.reason == "stop" and req.finish_reason == "stop"
        assert tokens == req.output
        jsonschema.validate(json.loads(bytes(tokens).decode("utf-8")), SCHEMA)
