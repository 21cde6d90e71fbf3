"""How the router's process runs (`runtime`): which event loop, the collector's settings, and
the HTTP behaviours that touch the loop's transports and accept path run again on uvloop (the
router's loop when it is installed; the other tests run on asyncio's)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator

import pytest
import test_http
import test_http_guard

from dsv4_router import runtime


@pytest.mark.parametrize(
    ("env", "installed", "name"),
    [
        (None, True, "uvloop"),
        (None, False, "asyncio"),
        ("asyncio", True, "asyncio"),
        (" AsyncIO ", True, "asyncio"),
        ("uvloop", False, "asyncio"),  # asked for but missing: asyncio's, never a failure
        ("uvloop", True, "uvloop"),
    ],
)
def test_the_loop_is_uvloop_unless_missing_or_refused(
    env: str | None, installed: bool, name: str
) -> None:
    assert runtime.loop_name(env, installed) == name


def test_the_loop_factory_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.LOOP_ENV, "asyncio")
    assert runtime.loop_factory() == ("asyncio", asyncio.new_event_loop)
    monkeypatch.delenv(runtime.LOOP_ENV)
    uvloop = pytest.importorskip("uvloop")
    name, factory = runtime.loop_factory()
    loop = factory()
    try:
        assert (name, type(loop)) == ("uvloop", uvloop.Loop)
    finally:
        loop.close()


def test_settling_freezes_start_up_and_collects_the_young_less_often() -> None:
    before = gc.get_threshold()
    try:
        runtime.settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (runtime.YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.fixture
def on_uvloop() -> Iterator[None]:
    uvloop = pytest.importorskip("uvloop")
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(None)


@pytest.mark.usefixtures("on_uvloop")
@pytest.mark.parametrize(
    "scenario",
    [
        test_http.test_stream_pass_through_on_chat,
        test_http.test_no_first_byte_in_time_is_retried_and_the_upstream_closed,
        test_http.test_client_disconnect_mid_stream_closes_the_upstream,
        test_http.test_a_stream_that_breaks_ends_with_an_error_event,
        test_http_guard.test_past_the_bound_with_every_connection_busy_a_new_one_gets_a_fast_503,
        test_http_guard.test_connections_of_one_accept_batch_count_against_the_bound,
        test_http_guard.test_a_client_leaving_a_non_streaming_request_closes_the_upstream_at_once,
    ],
    ids=lambda scenario: scenario.__name__,
)
def test_on_uvloop(scenario: Callable[[], None]) -> None:
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert asyncio.run(loop_type()).__module__.startswith("uvloop")
    scenario()
