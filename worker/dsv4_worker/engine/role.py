"""What an engine is: its role in PD disaggregation and its place in a PP group, decided once
when it is built (`dsv4_worker.build` picks the builder from the pair).

    role   colocated: prefill and decode here | prefill: computes prompts for decode workers
           (finished requests keep their pages until released) | decode: takes prompts'
           KV from a prefill worker (requests start in PREALLOC)
    place  single: plans its own steps | leader: PP rank 0, plans and broadcasts the orders |
           follower: PP ranks 1..n-1, replays the leader's orders (`Engine.steps` agrees)

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dsv4_worker.sched.budget import PoolRoom
from dsv4_worker.sched.scheduler import SchedulerConfig


class Role(StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class Place(StrEnum):
    SINGLE = "single"
    LEADER = "leader"
    FOLLOWER = "follower"

    @classmethod
    def of(cls, rank: int, size: int) -> Place:
        """PP rank `rank` of a group of `size` stages."""
        if not 0 <= rank < size:
            raise ValueError(f"PP rank {rank} outside [0, {size})")
        if size == 1:
            return cls.SINGLE
        return cls.LEADER if rank == 0 else cls.FOLLOWER


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig
    role: Role = Role.COLOCATED
    place: Place = Place.SINGLE
    # What the scheduler may hand out: a PP group's smallest stage's pools, so a plan fits
    # every stage. None: this engine's own pools.
    schedulable: PoolRoom | None = None
