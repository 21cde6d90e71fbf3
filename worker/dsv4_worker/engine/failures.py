"""How one request (or one batch) fails inside a step without taking the engine down: the
failure each gets, with the OpenAI error code its answer carries, and the rule for turning an
exception into one. Pure (logging aside).

    where it happens                          who fails                  code
    sampling, processors, grammar, logprobs   that request               sampling_failed (a
      (`Engine.sample`), accepting its token                               NoTokenAllowed) or
                                                                           internal_error
    the batch's forward (not attributable)    every request of the batch internal_error
    anything else in a step                   the engine thread dies: `/live` fails

NOTE: a failed request is finished like any other (`Engine._finish` frees its pages); in a PP
group the failures travel with the last stage's tokens, so every stage fails the same ones.
"""

from __future__ import annotations

import logging
from typing import Final, NamedTuple

from dsv4_worker.engine.sampler import NoTokenAllowed

log = logging.getLogger(__name__)

INTERNAL_CODE: Final = "internal_error"  # a bug or a broken device: the request is not at fault
SAMPLING_CODE: Final = "sampling_failed"  # its scores left no token (NoTokenAllowed)


class Failure(NamedTuple):
    """Why a request failed and the code its error answer carries."""

    why: str
    code: str


def failure_of(what: str, rid: object, exc: BaseException) -> Failure:
    """The failure an exception raised while doing `what` for request `rid` gives it (logged:
    an internal error with its traceback, the caller being inside an `except`)."""
    if isinstance(exc, NoTokenAllowed):
        log.warning("request %s: %s: %s", rid, what, exc)
        return Failure(f"{what}: {exc}", SAMPLING_CODE)
    log.exception("request %s: %s failed; the request fails alone", rid, what)
    return Failure(f"internal error in {what}: {exc!r}", INTERNAL_CODE)


def batch_failure(exc: BaseException) -> Failure:
    """The failure of every request of a batch whose forward raised (logged with its
    traceback, the caller being inside an `except`)."""
    log.exception("the batch's forward failed; its requests fail, the engine goes on")
    return Failure(f"internal error in the batch's forward: {exc!r}", INTERNAL_CODE)
