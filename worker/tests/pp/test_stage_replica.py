"""The follower's replica checks, without processes: a leader check that disagrees with the
replica stops the group (rather than corrupt KV), an agreeing one passes, and a replayed
submit takes the leader's request id (one it already holds means it diverged)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from engine_helpers import engine

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.changes import Submit
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.role import EngineConfig, Place
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pp.link import StageLost
from dsv4_worker.pp.order import Check
from dsv4_worker.pp.stage import Follower, state_check


def follower() -> tuple[Follower, Engine]:
    base = engine(tiny(), init_weights(tiny(), seed=0))
    link: Any = SimpleNamespace(rank=1, size=2)
    source = Follower(link)
    config = EngineConfig(base.config.scheduler, place=Place.FOLLOWER, schedulable=base.total)
    return source, Engine(base.paged, config, source=source)


def test_an_agreeing_check_passes_and_a_diverged_one_stops_the_group() -> None:
    f, eng = follower()
    f._submit(eng, Submit("req-0", (1, 2, 3), SamplingParams()))
    f._verify(eng, state_check(eng))  # the leader's own state, as the leader would send it
    used = tuple((pool, n + 1 if pool == "full" else n) for pool, n in state_check(eng).used)
    with pytest.raises(StageLost, match="diverged from the leader"):
        f._verify(eng, Check(used, state_check(eng).slots))


def test_a_replayed_submit_takes_the_leaders_request_id_and_a_clash_is_divergence() -> None:
    f, eng = follower()
    f._submit(eng, Submit("lead-7", (1, 2, 3), SamplingParams()))
    assert list(eng.requests) == ["lead-7"]
    with pytest.raises(StageLost, match="diverged from the leader: request id 'lead-7'"):
        f._submit(eng, Submit("lead-7", (4,), SamplingParams()))
