"""The admission decision (pure, hypothesis): the queue never grows past its bound unless the
engine can take everything queued now, a queue that does not drain within its deadline sheds,
shedding is monotone in the queue's depth and age, and a request expires exactly at its
deadline."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_worker.server.admission import (
    DEFAULT_QUEUE_TIMEOUT_S,
    QUEUE_PER_RUNNING,
    SHED_REASONS,
    AdmissionPolicy,
    QueueView,
    decide,
    default_policy,
    expired,
)

PROPERTY = settings(max_examples=300, deadline=None)

policies = st.builds(
    AdmissionPolicy,
    max_queue_requests=st.integers(1, 64),
    queue_timeout_s=st.floats(0.01, 30, allow_nan=False),
)
views = st.builds(
    QueueView,
    waiting=st.integers(0, 200),
    oldest_wait_s=st.floats(0, 60, allow_nan=False),
    free_request_slots=st.integers(0, 64),
    free_full_tokens=st.integers(0, 100_000),
)
needs = st.integers(1, 8192)


def _fits_now(view: QueueView, need: int) -> bool:
    return (
        view.waiting < view.free_request_slots
        and (view.waiting + 1) * need <= view.free_full_tokens
    )


@PROPERTY
@given(views, policies, needs)
def test_an_admitted_request_keeps_the_queue_bounded(
    view: QueueView, policy: AdmissionPolicy, need: int
) -> None:
    verdict = decide(view, policy, need)
    if verdict.admitted:
        # Past the bound only when the engine takes every queued request at its next step.
        assert view.waiting < policy.max_queue_requests or _fits_now(view, need)
        assert verdict.reason is None
    else:
        assert verdict.reason in SHED_REASONS and verdict.message
        assert not _fits_now(view, need)


@PROPERTY
@given(views, policies, needs)
def test_a_full_or_stalled_queue_sheds_with_its_reason(
    view: QueueView, policy: AdmissionPolicy, need: int
) -> None:
    verdict = decide(view, policy, need)
    if _fits_now(view, need):
        assert verdict.admitted
    elif view.waiting >= policy.max_queue_requests:
        assert verdict.reason == "queue_full"
    elif view.oldest_wait_s >= policy.queue_timeout_s:
        assert verdict.reason == "queue_stalled"
    else:
        assert verdict.admitted


@PROPERTY
@given(views, policies, needs, st.integers(0, 50), st.floats(0, 30, allow_nan=False))
def test_shedding_is_monotone_in_depth_and_age(
    view: QueueView, policy: AdmissionPolicy, need: int, more: int, older_s: float
) -> None:
    """A longer or older queue never admits what a shorter, younger one shed."""
    if decide(view, policy, need).admitted:
        return
    worse = QueueView(
        view.waiting + more,
        view.oldest_wait_s + older_s,
        view.free_request_slots,
        view.free_full_tokens,
    )
    assert not decide(worse, policy, need).admitted


@PROPERTY
@given(policies, st.floats(0, 60, allow_nan=False))
def test_a_request_expires_exactly_at_its_deadline(
    policy: AdmissionPolicy, waited_s: float
) -> None:
    assert expired(waited_s, policy) == (waited_s >= policy.queue_timeout_s)


@PROPERTY
@given(st.integers(1, 4096))
def test_the_default_bound_follows_the_running_requests(max_running: int) -> None:
    policy = default_policy(max_running)
    assert policy.max_queue_requests == QUEUE_PER_RUNNING * max_running
    assert policy.queue_timeout_s == DEFAULT_QUEUE_TIMEOUT_S
    given_values = default_policy(max_running, max_queue_requests=3, queue_timeout_s=0.5)
    assert (given_values.max_queue_requests, given_values.queue_timeout_s) == (3, 0.5)


@pytest.mark.parametrize(("bound", "timeout_s"), [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -2.0)])
def test_a_policy_refuses_a_bound_or_deadline_out_of_range(bound: int, timeout_s: float) -> None:
    with pytest.raises(ValueError, match=r"max_queue_requests|queue_timeout_s"):
        AdmissionPolicy(max_queue_requests=bound, queue_timeout_s=timeout_s)
