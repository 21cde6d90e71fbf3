"""Where an engine's steps come from (its place, `role.Place`): the engine is one class; what
differs between a single stage and the stages of a PP group is this object, given once when
the engine is built.

    single    Planner: plans its own steps, runs the whole model
    leader    pp.stage.Leader: plans, broadcasts the order (with the changes it recorded)
    follower  pp.stage.Follower: receives the leader's orders and replays them

Every method takes the engine it serves (one source per engine); the source keeps only what
its place adds (the leader's recorded changes, a follower's stop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dsv4_worker.engine.changes import Change
from dsv4_worker.engine.role import Place

if TYPE_CHECKING:
    from dsv4_worker.engine.loop import Engine, Request, SampleAt, Scored
    from dsv4_worker.engine.paged import Segment


class StepSource(Protocol):
    @property
    def place(self) -> Place: ...

    @property
    def always_run_batch(self) -> bool:
        """Takes part in every step's batch, even an empty one (a PP stage's exchange)."""
        ...

    def has_work(self, engine: Engine) -> bool:
        """A step would do something now."""
        ...

    def step(self, engine: Engine) -> list[Request]:
        """Plan (or receive) and carry out one step; the requests that finished in it."""
        ...

    def run_batch(
        self, engine: Engine, segments: list[Segment], sample_at: SampleAt, score_at: SampleAt
    ) -> Scored:
        """The step's batch: the whole model here, or this stage's layers over its link."""
        ...

    def record(self, change: Change) -> None:
        """`engine` applied `change` outside a step (in this order)."""
        ...

    def close(self, engine: Engine) -> None:
        """The serving loop is ending."""
        ...


class Planner:
    """A single stage: plans its own steps and runs the whole model; nobody replays it."""

    place = Place.SINGLE
    always_run_batch = False

    def has_work(self, engine: Engine) -> bool:
        return engine.runnable

    def step(self, engine: Engine) -> list[Request]:
        return engine.execute(engine.plan())

    def run_batch(
        self, engine: Engine, segments: list[Segment], sample_at: SampleAt, score_at: SampleAt
    ) -> Scored:
        return engine.run_local_batch(segments, sample_at, score_at)

    def record(self, change: Change) -> None:
        """Nobody replays a single stage."""

    def close(self, engine: Engine) -> None:
        """Nothing to tell."""
