"""How the router's process runs; its hop is mostly interpreter and event-loop work
(bench/router.py measures it):

- the event loop: uvloop's when it is installed, else asyncio's own (`DSV4_EVENT_LOOP=asyncio`
  forces asyncio's, to compare or to rule uvloop out). uvloop's transports are not
  `asyncio.Transport` subclasses: code that needs a transport's methods casts, never asserts
  its class;
- the garbage collector: what start-up built is frozen out of its scans, and the youngest
  generation is collected every YOUNG_THRESHOLD allocations instead of 700 (a request's
  objects are nearly all freed by reference counting; scanning them as often cost ~7% of
  the router's CPU).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
from collections.abc import Callable
from typing import Final, Literal

LoopName = Literal["uvloop", "asyncio"]
LOOP_ENV: Final = "DSV4_EVENT_LOOP"
YOUNG_THRESHOLD: Final = 7000


def loop_name(env: str | None, uvloop_installed: bool) -> LoopName:
    """uvloop unless `env` says asyncio or uvloop is missing."""
    if env is not None and env.strip().lower() == "asyncio":
        return "asyncio"
    return "uvloop" if uvloop_installed else "asyncio"


def loop_factory() -> tuple[LoopName, Callable[[], asyncio.AbstractEventLoop]]:
    """The loop to run on (for `asyncio.Runner(loop_factory=...)`) and its name."""
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        uvloop = None
    name = loop_name(os.environ.get(LOOP_ENV), uvloop is not None)
    if name == "uvloop" and uvloop is not None:
        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return name, factory
    return "asyncio", asyncio.new_event_loop


def settle_gc() -> None:
    """Once start-up is done: freeze what it built, collect the young less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
