"""Typed errors of the KV memory layer: callers map them to wait / reject / crash decisions."""

from __future__ import annotations


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


class IntegrityError(KVMemoryError):
    """`check_integrity()` found an inconsistency (a bug in this package or memory corruption)."""
