"""The router's drain on SIGTERM (issue #25 item 4), as a worker's: its listeners stay open,
`/ready` answers 503 `draining` at once and new completions 503 + Retry-After (code
`draining`); the completions open then get `shutdown_timeout_s` to finish (a second signal:
no more). Those still open are cut: a stream ends with an error event and `[DONE]`
(`proxy`), a request with no byte sent yet gets a 503; closing the upstream connection makes
its worker abort the request. Only then do the listeners close.

`lifecycle.next_move` is the decision; `RouterDrain` is the state, on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4_common.api.lifecycle import Move, next_move

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the draining router looks at what is left
REFUSED = "the router is shutting down (draining); retry"
CUT = "the router is shutting down: the request did not finish within its drain"


@dataclass(slots=True, eq=False)
class RouterDrain:
    """Whether the router drains, and the handler tasks of the completions open now."""

    draining: bool = False
    _open: set[asyncio.Task[object]] = field(default_factory=set)
    _cut: set[asyncio.Task[object]] = field(default_factory=set)

    @property
    def open(self) -> int:
        return len(self._open)

    def start(self) -> None:
        self.draining = True

    def track(self) -> _Tracked:
        """The current task is an open completion while inside (`with drain.track():`)."""
        task = asyncio.current_task()
        assert task is not None
        return _Tracked(self, task)

    def _leave(self, task: asyncio.Task[object]) -> None:
        self._open.discard(task)
        self._cut.discard(task)

    def was_cut(self) -> bool:
        """The current task was cancelled by the drain (not by its client leaving)."""
        return asyncio.current_task() in self._cut

    def cut_all(self) -> int:
        """Cancel every open completion; how many."""
        for task in self._open:
            self._cut.add(task)
            task.cancel()
        return len(self._open)


class _Tracked:
    """`RouterDrain.track`'s context (a class: it runs for every completion)."""

    __slots__ = ("_drain", "_task")

    def __init__(self, drain: RouterDrain, task: asyncio.Task[object]) -> None:
        self._drain = drain
        self._task = task

    def __enter__(self) -> None:
        self._drain._open.add(self._task)

    def __exit__(self, *_: object) -> None:
        self._drain._leave(self._task)


async def drain(
    state: RouterDrain,
    *,
    timeout_s: float,
    hurried: asyncio.Event,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Wait for the open completions (`state.start()` was called) until they are done, the
    deadline `timeout_s` from now, or `hurried`; cut the rest. How many were cut."""
    deadline_s, cut_at_s, cut = clock() + timeout_s, None, 0
    while True:
        now_s = clock()
        move = next_move(
            now_s,
            deadline_s=deadline_s,
            aborted_at_s=cut_at_s,
            in_flight=state.open,
            engine_busy=False,
            hurried=hurried.is_set(),
        )
        if move is Move.EXIT:
            return cut
        if move is Move.ABORT:
            cut_at_s, cut = now_s, state.cut_all()
            log.warning("drain: cutting %d open requests", cut)
        await asyncio.sleep(POLL_S)
