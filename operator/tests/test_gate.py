"""The reconcile gate: one lock per deployment, event-triggered reconciles coalesced."""

from __future__ import annotations

import threading
import time

import pytest

from dsv4_operator.gate import ReconcileGate, deployment_key


def test_one_lock_per_deployment() -> None:
    gate = ReconcileGate()
    key = deployment_key("ns", "a")
    assert key == "ns/a"
    assert gate.lock(key) is gate.lock(key)
    assert gate.lock(key) is not gate.lock(deployment_key("ns", "b"))


def test_an_event_waits_for_the_lock_and_later_events_fold_into_it() -> None:
    gate = ReconcileGate()
    turns: list[bool] = []
    with gate.lock("ns/a"):  # a change handler or the timer is reconciling
        waiter = threading.Thread(target=lambda: turns.append(_take_turn(gate, "ns/a")))
        waiter.start()
        deadline = time.monotonic() + 10
        while not gate.waiting("ns/a") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.waiting("ns/a")
        assert [_take_turn(gate, "ns/a") for _ in range(3)] == [False] * 3
        with gate.event_turn("ns/b") as other:  # another deployment is not held up
            assert other is True
    waiter.join(10)
    assert turns == [True] and not gate.waiting("ns/a")
    assert _take_turn(gate, "ns/a") is True  # nobody waits any more


def test_the_lock_is_released_when_the_reconcile_fails() -> None:
    gate = ReconcileGate()
    with pytest.raises(RuntimeError), gate.event_turn("ns/a"):
        raise RuntimeError("the API server went away")
    assert not gate.lock("ns/a").locked() and not gate.waiting("ns/a")


def _take_turn(gate: ReconcileGate, key: str) -> bool:
    with gate.event_turn(key) as turn:
        assert not turn or gate.lock(key).locked()
        return turn
