"""An idle PD pair wakes only when its heartbeat needs it (#38 item 6). Once a request has gone
through and both sides are drained, over a window of K pongs (the decode's heartbeat, so the
window is measured in the heartbeat's own turns, not in seconds):

- the decode's engine thread never wakes by itself: nothing it holds depends on the clock;
- the prefill's engine thread wakes by itself at most once per fresh echo plus one: it sleeps
  until the session's freshest echoed pong would make it `gone`, and finds the session fresh
  only if a newer echo came meanwhile (before: every 50 ms, ~10 times per pong);
- the prefill's control thread turns once per ping (plus one): no poll timer (before: 100 ms);
- the decode's control thread once per ping sent and once per pong (plus one).
"""

from __future__ import annotations

import pytest
from engine_helpers import engine
from pd_support import Pair, on_engine, pd_pair, wait_drained, wait_until

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.server.runner import EngineRunner

WEIGHTS = init_weights(tiny(), seed=5)
PONGS = 4  # the window: ~2 s at the default heartbeat


def _make() -> Engine:
    return engine(tiny(), WEIGHTS)


def _pongs(pair: Pair) -> int:
    """The number of the last pong the decode got from its prefill (control thread state; an
    int read across threads)."""
    return max((p.echo for p in list(pair.decode_agent._prefills.values())), default=0)


def _settled(runner: EngineRunner) -> bool:
    """The engine is idle and its integrity check (due a moment after its last step) ran."""
    eng = runner.engine
    return bool(on_engine(runner, lambda: eng.idle and not eng.idle_check_pending))


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_an_idle_pd_pair_wakes_only_for_its_heartbeat(backend: str) -> None:
    prompt = [(3 * j) % 200 + 3 for j in range(40)]
    with pd_pair(backend, _make, _make) as pair:
        [(tokens, _)] = pair.generate([prompt], [SamplingParams(max_new_tokens=3)])
        assert len(tokens) == 3
        wait_drained(pair)
        for runner in (pair.prefill_runner, pair.decode_runner):
            wait_until(lambda r=runner: _settled(r), "the engine's idle check")  # type: ignore[misc]
        pr, dr, pa, da = (
            pair.prefill_runner,
            pair.decode_runner,
            pair.prefill_agent,
            pair.decode_agent,
        )
        before = (pr.timed_wakes, dr.timed_wakes, pa.control_turns, da.control_turns)
        first = _pongs(pair)
        wait_until(lambda: _pongs(pair) >= first + PONGS, f"{PONGS} pongs")
        after = (pr.timed_wakes, dr.timed_wakes, pa.control_turns, da.control_turns)
        pongs = _pongs(pair) - first
    prefill_wakes, decode_wakes, prefill_turns, decode_turns = (
        b - a for a, b in zip(before, after, strict=True)
    )
    assert decode_wakes == 0, "the idle decode's engine thread woke by itself"
    assert prefill_wakes <= pongs + 1, (prefill_wakes, pongs)
    assert prefill_turns <= pongs + 2, (prefill_turns, pongs)  # the pings: one per pong, +1
    assert decode_turns <= 2 * (pongs + 1) + 1, (decode_turns, pongs)
