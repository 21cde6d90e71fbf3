"""Every change made to an engine's requests outside a step, as data, in the order it was
made: what `Engine` reports to its step source (`StepSource.record`). A PP leader sends them
to its followers with the next step's order, and they replay them (`pp.stage.Follower`); a
single stage drops them. Pickled over the PP group's control channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_worker.engine.logprobs import TokenLogprob
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.sched.scheduler import RequestId


@dataclass(frozen=True, slots=True)
class Submit:
    rid: RequestId
    prompt: tuple[int, ...]
    params: SamplingParams
    keep_pages: bool = False
    prefill: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    rid: RequestId


@dataclass(frozen=True, slots=True)
class Release:
    rid: RequestId


@dataclass(frozen=True, slots=True)
class CompleteTransfer:
    rid: RequestId
    first_token: int
    generator_state: Any = None  # a torch.Tensor (uint8) or None
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class FailTransfer:
    rid: RequestId
    why: str
    hold: bool = False


@dataclass(frozen=True, slots=True)
class Note:
    """Something a component of the leader (e.g. the PD prefill agent) tells its peers on the
    followers, delivered in order with the engine's own changes (`EngineEvents.on_note`)."""

    payload: Any


Change = Submit | Abort | Release | CompleteTransfer | FailTransfer | Note
