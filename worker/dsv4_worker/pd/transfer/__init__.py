"""KV transfer between prefill (initiator) and decode (target) behind one small protocol
(`base`), with backends chosen by name: `nixl` (NIXL over UCX) and `zmq` (pyzmq, the portable
fallback). A backend's module, and NIXL itself, is imported only when that backend is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

from dsv4_worker.pd.auth import SessionKeys
from dsv4_worker.pd.transfer.base import (
    Block,
    Region,
    Session,
    TransferError,
    TransferInitiator,
    TransferTarget,
    check_blocks,
    check_same_regions,
    epoch_of,
    landed_key,
    merge_blocks,
)
from dsv4_worker.pd.transfer.fence import Grant

__all__ = [
    "BACKENDS",
    "Block",
    "Grant",
    "Region",
    "Session",
    "SessionKeys",
    "TransferError",
    "TransferInitiator",
    "TransferTarget",
    "check_blocks",
    "check_same_regions",
    "epoch_of",
    "landed_key",
    "make_initiator",
    "make_target",
    "merge_blocks",
]

T = TypeVar("T")


def _nixl_target(keys: SessionKeys, host: str) -> TransferTarget:
    from dsv4_worker.pd.transfer.nixl_backend import NixlTarget

    del host  # UCX picks its own addresses; they travel in the agent metadata
    return NixlTarget(keys)


def _zmq_target(keys: SessionKeys, host: str) -> TransferTarget:
    from dsv4_worker.pd.transfer.zmq_backend import ZmqTarget

    return ZmqTarget(keys, host)


def _nixl_initiator(name: str, threads: int | None) -> TransferInitiator:
    from dsv4_worker.pd.transfer.nixl_backend import WRITE_THREADS, NixlInitiator

    return NixlInitiator(name, WRITE_THREADS if threads is None else threads)


def _zmq_initiator(name: str, threads: int | None) -> TransferInitiator:
    from dsv4_worker.pd.transfer.zmq_backend import ZmqInitiator

    del threads  # writes are sends on the calling thread
    return ZmqInitiator(name)


_TARGETS: Final[dict[str, Callable[[SessionKeys, str], TransferTarget]]] = {
    "nixl": _nixl_target,
    "zmq": _zmq_target,
}
_INITIATORS: Final[dict[str, Callable[[str, int | None], TransferInitiator]]] = {
    "nixl": _nixl_initiator,
    "zmq": _zmq_initiator,
}
BACKENDS: Final = tuple(_TARGETS)


def make_target(backend: str, keys: SessionKeys, *, host: str = "127.0.0.1") -> TransferTarget:
    """The receiving side, serving writes of sessions keyed from `keys`' secret; `host`: the
    address initiators dial (zmq binds it)."""
    return _choose(_TARGETS, backend)(keys, host)


def make_initiator(backend: str, *, name: str, threads: int | None = None) -> TransferInitiator:
    """The sending side; `name` shows in the peer's logs; `threads`: nixl's poster threads
    for big writes (None: the backend's default; zmq ignores it)."""
    return _choose(_INITIATORS, backend)(name, threads)


def _choose(registry: dict[str, T], backend: str) -> T:
    if backend not in registry:
        raise TransferError(
            f"kv transfer: unknown backend {backend!r}; choose one of {', '.join(registry)}"
        )
    return registry[backend]
