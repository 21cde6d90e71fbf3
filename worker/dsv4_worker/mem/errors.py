"""Typed errors of the KV memory layer: callers map them to wait / reject / crash decisions,
and `Verdict`, the answer of a `can_x()` query (the error `x()` would raise, as a value)."""

from __future__ import annotations

from dataclasses import dataclass


class KVMemoryError(RuntimeError):
    """Base class of every error raised by `dsv4_worker.mem`."""


class OutOfPages(KVMemoryError):
    """A batch allocation needs more units than a pool has free; nothing was changed."""

    def __init__(self, pool: str, needed: int, available: int) -> None:
        super().__init__(f"{pool} pool: need {needed} free units, only {available} available")
        self.pool = pool
        self.needed = needed
        self.available = available


class RequestTooLong(KVMemoryError):
    """A request would exceed the per-request page table; nothing was changed."""


class OwnershipError(KVMemoryError):
    """A double free, a free by a non-owner, a stale mapping or an operation on a closed slot."""


class InvalidArgument(KVMemoryError, ValueError):
    """An argument outside the contract (type, dtype, device, shape, range, a negative count);
    nothing was changed. Also a ValueError, which these checks raised before they were typed."""


class IntegrityError(KVMemoryError):
    """`check_integrity()` found an inconsistency (a bug in this package or memory corruption)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Truthy iff the paired command would succeed with the same arguments; otherwise `refusal`
    is the error it would raise (OutOfPages: wait or retract; RequestTooLong: reject)."""

    refusal: KVMemoryError | None = None

    def __bool__(self) -> bool:
        return self.refusal is None
