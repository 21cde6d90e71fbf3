"""An engine's role and place are explicit and fixed when it is built: the role decides the
PD decode paths (not whether a hook is set), events are given once at construction, the step
source must agree with the config's place, every (role, place) has a builder, and the
changes an engine reports are what a PP follower replays to the same state."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_helpers import engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_common.core.presets import tiny
from dsv4_worker.engine.changes import Abort, Change, Note, Release, Submit
from dsv4_worker.engine.events import EngineEvents
from dsv4_worker.engine.loop import Engine, Request
from dsv4_worker.engine.role import Place, Role
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.engine.steps import Planner
from dsv4_worker.model.weights import init_weights
from dsv4_worker.pp.stage import Follower, state_check
from dsv4_worker.sched.scheduler import Phase

MODEL = tiny()
WEIGHTS = init_weights(MODEL, seed=3)
PARAMS = SamplingParams(max_new_tokens=3)
WORKER = Path(__file__).resolve().parents[2] / "dsv4_worker"
EVENT_NAMES = {name for name in vars(EngineEvents) if not name.startswith("_")}


def _as(role: Role, events: EngineEvents | None = None, **kw: Any) -> Engine:
    base = engine(MODEL, WEIGHTS)
    config = dataclasses.replace(base.config, role=role, **kw)
    return Engine(base.paged, config, events=events or EngineEvents())


class Recorder(EngineEvents):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_admit(self, req: Request) -> None:
        self.calls.append(("admit", req.rid))

    def on_prealloc(self, req: Request) -> None:
        self.calls.append(("prealloc", req.rid))

    def on_cancel(self, req: Request) -> None:
        self.calls.append(("cancel", req.rid))


def test_the_role_decides_the_decode_paths() -> None:
    colocated, decode = _as(Role.COLOCATED), _as(Role.DECODE, events := Recorder())
    assert colocated.submit([1, 2, 3], PARAMS).phase is Phase.WAITING
    req = decode.submit([1, 2, 3], PARAMS, prefill="p")
    assert (req.phase, req.prefill) == (Phase.PREALLOC, "p")
    decode.step()
    assert req.phase is Phase.TRANSFER and req.slot is not None
    assert events.calls == [("admit", req.rid), ("prealloc", req.rid)]
    decode.abort(req.rid)  # its KV may still be landing: the pages stay held
    assert events.calls[-1] == ("cancel", req.rid) and req.rid in decode.held
    decode.release(req.rid)
    decode.run_until_idle()  # the idle check: every pool back to zero


def test_a_prefill_engine_never_preallocates() -> None:
    prefill = _as(Role.PREFILL, events := Recorder())
    req = prefill.submit([1, 2, 3], PARAMS, keep_pages=True)
    prefill.run_until_idle()
    assert req.finish_reason == "length" and req.rid in prefill.held and events.calls == []


def test_the_step_source_must_be_of_the_configs_place() -> None:
    base = engine(MODEL, WEIGHTS)
    follower = Follower(SimpleNamespace(rank=1, size=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a single engine given a follower step source"):
        Engine(base.paged, base.config, source=follower)
    leader_config = dataclasses.replace(base.config, place=Place.LEADER)
    with pytest.raises(ValueError, match="a leader engine given a single step source"):
        Engine(base.paged, leader_config, source=Planner())


def test_every_role_and_place_has_a_builder() -> None:
    from dsv4_worker.build import BUILDERS

    assert set(BUILDERS) == {(r, p) for r in Role for p in Place}


def test_no_module_sets_an_engine_event_after_construction() -> None:
    """Events are given once, when the engine is built: no attribute assignment of an event
    name anywhere in the worker (`x.on_prealloc = ...`, `runner.after_step = ...`)."""
    found = []
    for path in sorted(WORKER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in EVENT_NAMES:
                        found.append(f"{path.relative_to(WORKER)}:{node.lineno} .{sub.attr}")
    assert {"on_admit", "on_prealloc", "on_cancel", "on_note", "after_step"} <= EVENT_NAMES
    assert found == []


class Log:
    """A leader-like source: records the changes (it plans like a single stage)."""

    place = Place.SINGLE
    always_run_batch = False

    def __init__(self) -> None:
        self.changes: list[Change] = []

    def has_work(self, engine: Engine) -> bool:
        return engine.runnable

    def step(self, engine: Engine) -> list[Request]:
        return engine.execute(engine.plan())

    def run_batch(self, engine: Engine, *args: Any) -> Any:
        return engine.run_local_batch(*args)

    def record(self, change: Change) -> None:
        self.changes.append(change)

    def close(self, engine: Engine) -> None:
        pass


Op = tuple[str, int]  # (submit | abort | note | step, argument)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 40)),
        st.tuples(st.just("abort"), st.integers(0, 6)),
        st.tuples(st.just("note"), st.integers(0, 9)),
    ),
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_a_follower_replays_the_recorded_changes_to_the_same_state(ops: list[Op]) -> None:
    """The change stream `Engine` reports (what a PP leader sends) brings a fresh replica to
    the leader's requests, phases and pools; notes reach the replica's events in order."""
    log = Log()
    base = engine(MODEL, WEIGHTS)
    leader = Engine(base.paged, base.config, source=log)
    for kind, arg in ops:
        if kind == "submit":
            leader.submit(list(range(1, arg + 1)), PARAMS)
        elif kind == "abort":
            leader.abort(f"req-{arg}")  # the engine's name of its arg-th request
        else:
            leader.note(arg)
    notes: list[object] = []

    class Events(EngineEvents):
        def on_note(self, payload: object) -> None:
            notes.append(payload)

    replica_base = engine(MODEL, WEIGHTS)
    source = Follower(SimpleNamespace(rank=1, size=2))  # type: ignore[arg-type]
    config = dataclasses.replace(replica_base.config, place=Place.FOLLOWER)
    replica = Engine(replica_base.paged, config, events=Events(), source=source)
    for change in log.changes:
        source._replay(replica, change)
    assert notes == [c.payload for c in log.changes if isinstance(c, Note)]
    assert state_check(replica) == state_check(leader)
    assert {r: q.phase for r, q in replica.requests.items()} == {
        r: q.phase for r, q in leader.requests.items()
    }
    aborts = [c for c in log.changes if isinstance(c, Abort)]
    assert len(aborts) == sum(kind == "abort" for kind, _ in ops)
    # An abort of an unknown request releases (nothing held): both are recorded, in order.
    for i, change in enumerate(log.changes):
        if isinstance(change, Release):
            assert isinstance(log.changes[i + 1], Abort)
    assert [c.rid for c in log.changes if isinstance(c, Submit)] == [
        f"req-{i}" for i in range(sum(kind == "submit" for kind, _ in ops))
    ]
