"""EngineEvents: what an engine tells the component that serves its role (the PD agent), on
the engine thread. Given once, when the engine is built; every method of this base is a
no-op (a colocated engine's events), and a PD agent overrides those its role hears.

    decode     on_admit (the step's plan preallocates a request; before its pages exist)
               on_allocated (its pages exist on this stage; its grant epoch is set)
               on_prealloc (its pages exist on every stage; after the step's batch)
               on_cancel (aborted while its KV may still be landing; pages held until release)
               on_transfer_end (its transfer ends: before its pages decode, are held or freed)
    follower   on_note (what the leader's component told, `Engine.note`, in order)
    every      after_step (after each turn of the serving loop, `EngineRunner`)
               wake_at_s (when after_step next has a deadline or a heartbeat to check)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from dsv4_worker.engine.loop import Request


class EngineEvents:
    def on_admit(self, req: Request) -> None:
        """PD decode: this step's plan preallocates `req` (final: its allocation cannot
        fail); called before its slot and pages exist."""

    def on_allocated(self, req: Request) -> None:
        """PD decode, every stage: `req`'s pages exist here and `req.epoch` names their
        grant (a stage's target lets writes of that epoch land in them)."""

    def on_prealloc(self, req: Request) -> None:
        """PD decode: `req`'s pages exist (in a PP group: on every stage); where to write."""

    def on_cancel(self, req: Request) -> None:
        """PD decode: `req` was aborted while its KV may still be landing; its pages stay
        held until `Engine.release` (or `fail_transfer`)."""

    def on_transfer_end(self, req: Request) -> None:
        """PD decode, every stage: `req`'s transfer ended (it decodes, failed, or its held
        pages go); called before its pages change hands, maybe more than once: close its
        grant (the target refuses or ignores the epoch's later writes)."""

    def on_note(self, payload: object) -> None:
        """A PP follower: what the leader's component told its peers (`Engine.note`), in
        order with the leader's changes."""

    def after_step(self, finished: list[Request]) -> None:
        """After every turn of the serving loop, with the requests that finished in it."""

    def wake_at_s(self, now_s: float) -> float | None:
        """When (`time.monotonic()` seconds) `after_step` next has something to do that
        depends on the clock (a deadline, a heartbeat), so the serving loop must turn by then
        even while the engine is idle; at or before `now_s`: at once. None: nothing until a
        step, a submission or a call. Waking earlier is harmless (the loop asks again);
        another thread that makes something due earlier than this said must kick the loop
        (`EngineRunner.call`)."""
        return None


NO_EVENTS: Final = EngineEvents()
