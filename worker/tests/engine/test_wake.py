"""When a serving thread wakes by itself (`engine.wake`, pure): never later than the first
thing due (or the floor, when that is in the past), never a spin (at least the floor), and
forever when nothing is due. The liveness boundaries it sleeps until (`liveness`) are exactly
where the checks they stand for turn true."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dsv4_worker.engine import wake
from dsv4_worker.pd.liveness import (
    Heartbeat,
    gone,
    gone_after_s,
    next_ping_s,
    ping_due,
    silent,
    silent_after_s,
)

instants = st.floats(0.0, 1e6, allow_nan=False)
maybe = st.none() | instants


@given(st.lists(maybe, max_size=8), instants)
def test_the_wait_ends_at_the_first_due_instant_or_the_floor(
    due: list[float | None], now_s: float
) -> None:
    first = wake.earliest(*due)
    waited = wake.wait_s(first, now_s)
    if all(t is None for t in due):
        assert first is None and waited is None  # blocks until woken
        assert wake.wait_ms(first, now_s) is None
        return
    assert first == min(t for t in due if t is not None)
    assert waited is not None and waited >= wake.MIN_WAIT_S  # never a spin
    # never late: at the first due instant, or one floor from now when that is past
    assert now_s + waited <= max(first, now_s + wake.MIN_WAIT_S) + 1e-9 * max(1.0, now_s)
    assert now_s + waited >= first - 1e-9 * max(1.0, now_s)  # and not needlessly early
    ms = wake.wait_ms(first, now_s)
    assert ms is not None and ms >= 1 and ms / 1000 >= waited - 1e-9  # rounded up, not down
    assert ms / 1000 < waited + 0.001 + 1e-9


heartbeats = st.builds(
    lambda interval_s, extra_s: Heartbeat(interval_s, interval_s + extra_s),
    st.floats(0.01, 5.0),
    st.floats(0.01, 10.0),
)


@given(heartbeats, instants)
def test_the_liveness_instants_are_where_the_checks_turn(hb: Heartbeat, since_s: float) -> None:
    """A moment before the instant a thread sleeps until, the check it stands for does not
    hold yet (nothing was missed before it); a moment after, it does (the wake, or the floor's
    next one, acts on it). The checks subtract, the instants add: they agree to within
    rounding. A session is gone `timeout + interval` after its freshest echo, a peer silent
    `timeout` after it was heard, a ping due `interval` after the last."""
    eps = 1e-9 * max(1.0, since_s)  # far above rounding, below MIN_WAIT_S (instants < 1e6 s)
    gone_at = gone_after_s(since_s, hb)
    assert not gone(since_s, gone_at - eps, hb) and gone(since_s, gone_at + eps, hb)
    silent_at = silent_after_s(since_s, hb)
    assert not silent(since_s, silent_at - eps, hb) and silent(since_s, silent_at + eps, hb)
    ping_at = next_ping_s(since_s, since_s, hb)
    assert not ping_due(since_s, ping_at - eps, hb) and ping_due(since_s, ping_at + eps, hb)
    assert next_ping_s(None, since_s, hb) == since_s and ping_due(None, since_s, hb)
    assert eps < wake.MIN_WAIT_S
