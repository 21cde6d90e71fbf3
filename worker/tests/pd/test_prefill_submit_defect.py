"""A defect while a prefill takes a request fails that request alone (#37 item 1): the
prefill answers `failed` naming an internal error, the decode's client gets an error, and the
next request through the same session is served and both sides drain."""

from __future__ import annotations

import pytest
from engine_helpers import engine
from pd_support import pd_pair, wait_drained, wait_until

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights

WEIGHTS = init_weights(tiny(), seed=0)
DEFECT_LEN = 13  # a prompt of this length trips the injected defect


def make() -> Engine:
    return engine(tiny(), WEIGHTS)


def prompt(n: int) -> list[int]:
    return [((17 * i) % 250) + 3 for i in range(n)]


def test_a_submit_defect_fails_one_request_and_the_session_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pd_pair("zmq", make, make) as pair:
        wait_until(lambda: pair.decode_agent.kv_status()[0], "the handshake")
        sessions = set(pair.prefill_agent._peers)
        real_submit = pair.prefill.submit

        def submit(prompt_ids, params, **kw):  # type: ignore[no-untyped-def]
            if len(prompt_ids) == DEFECT_LEN:
                raise RuntimeError("injected defect")
            return real_submit(prompt_ids, params, **kw)

        monkeypatch.setattr(pair.prefill, "submit", submit)
        params = SamplingParams(max_new_tokens=4)
        [(tokens, done)] = pair.generate([prompt(DEFECT_LEN)], [params])
        assert tokens == [] and done.reason == "error", done
        assert done.error is not None and "internal error: RuntimeError" in done.error
        [(tokens, done)] = pair.generate([prompt(40)], [params])
        assert done.reason == "length" and len(tokens) == 4
        assert set(pair.prefill_agent._peers) == sessions  # the same session served it
        wait_drained(pair)
