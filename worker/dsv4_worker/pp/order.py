"""What the PP leader (rank 0) tells its followers each step, and what the last stage tells
everyone back. Pure data, pickled over the group's control channel.

Every follower holds a replica of the leader's engine state (the same requests, phases,
slots and page tables; only the KV bytes differ, each stage holding its own layers). The
replicas stay equal because every change reaches them in the same order:

    events (submit, abort, ...: `engine.changes`) the leader applied since the last order
    the step plan the leader's scheduler chose (followers never plan)
    the tokens the last stage sampled (broadcast at the end of every step)

`check` carries the leader's pool usage and slot map after the previous step; a follower
that disagrees has diverged and stops the group rather than corrupt KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4_worker.engine.changes import Change
from dsv4_worker.engine.failures import Failure
from dsv4_worker.engine.logprobs import TokenLogprob
from dsv4_worker.sched.scheduler import RequestId, StepPlan


@dataclass(frozen=True, slots=True)
class Check:
    """The leader's state after the previous step: (pool, used units) and rid -> slot."""

    used: tuple[tuple[str, int], ...] = ()
    slots: tuple[tuple[RequestId, int], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOrder:
    events: tuple[Change, ...] = ()  # in the order the leader applied them
    plan: StepPlan = field(default_factory=StepPlan)
    check: Check = field(default_factory=Check)
    stop: bool = False  # the leader is shutting down: followers end their loop


@dataclass(frozen=True, slots=True)
class Sampled:
    """The last stage's tokens, one per sampling request in batch order (with their logprob
    entries, the batch's prompt logprobs and its failures, as `loop.Scored` has them; every
    other stage sends back its own forward's failure or None), and the generator
    states of seeded requests that finished holding their pages (a PD prefill hands the
    sampler's state to decode)."""

    tokens: tuple[int, ...] = ()
    generator_states: tuple[tuple[RequestId, Any], ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_logprobs: tuple[tuple[RequestId, int, tuple[TokenLogprob, ...]], ...] = ()
    failed: tuple[tuple[RequestId, Failure], ...] = ()  # requests whose sampling raised
    batch: Failure | None = None  # the last stage's forward raised: the batch fails
