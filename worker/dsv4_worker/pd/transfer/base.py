"""The KV transfer protocol: regions, blocks, the target/initiator protocols and the pure block
checks both backends share. No sockets, no NIXL.

An initiator (prefill) writes byte blocks of its registered regions into the regions of the same
name of a target (decode). A write is tagged; the target reports the tag once every byte landed.

Every write belongs to a session (`Session`: its id and key, from the PD control handshake,
`pd.auth`) and carries the epoch of the destination the decode granted it (`fence.Grant`): the
target reports `landed_key(epoch, tag)` only for authentic writes of a live grant, and a zmq
target refuses any other write before a byte lands (`fences`); a NIXL one cannot (one-sided
writes), so the decode holds a failed transfer's pages until its writer is provably done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from dsv4_worker.pd.transfer.fence import Grant


class TransferError(Exception):
    """A transfer operation failed; the message names the backend, the peer and the region or
    block involved. After a failed write, that write's destination bytes are undefined and its
    tag may or may not land."""


@dataclass(frozen=True, slots=True)
class Region:
    """One registered memory region: a contiguous tensor (CPU or CUDA), any dtype, addressed in
    bytes from its first element."""

    name: str
    tensor: torch.Tensor
    # The index space of dim 1 (a layer-major KV buffer, [layers, units, ...]): the target
    # checks that a write touches only units granted to it. None: byte-addressed, any live
    # grant may write anywhere in it (the worker's pools always name their space).
    space: str | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(frozen=True, slots=True)
class Block:
    """Copy `nbytes` from the initiator's region `region` at `src_offset` to the target's region
    of the same name at `dst_offset`."""

    region: str
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True, repr=False)
class Session:
    """The transfer session a write belongs to: its id (assigned at the PD handshake) and key
    (`pd.auth.SessionKeys.key`)."""

    id: str
    key: bytes

    def __repr__(self) -> str:
        return f"Session({self.id!r})"


def landed_key(epoch: int, tag: str) -> str:
    """How a target reports a landed write: the tag under the grant it landed for."""
    return f"{epoch}/{tag}"


def epoch_of(key: str) -> int:
    """The epoch of a `landed_key`."""
    return int(key.partition("/")[0])


class TransferTarget(Protocol):
    """The receiving side (decode): initiators write into its regions."""

    backend: str
    # True: after `revoke(epoch)` returns, no byte of that grant can land (the target checks
    # every write first). False: a revoked grant's writes may still land (one-sided writes):
    # hold its pages until the writer's session is provably closed.
    fences: bool

    def register(self, regions: Sequence[Region]) -> None:
        """Once, before `descriptor()`."""

    def descriptor(self) -> bytes:
        """Opaque: everything an initiator needs to `connect` (address, each region's size)."""

    def grant(self, grant: Grant) -> None:
        """Let writes of `grant.epoch` land in its units (before its destination is sent)."""

    def revoke(self, epoch: int) -> None:
        """End a grant (idempotent): its later writes are refused (`fences`) or ignored."""

    def poll_landed(self) -> list[str]:
        """`landed_key`s of writes that fully landed for a live grant since the last call,
        each once. Never blocks."""

    def on_landed(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the target's own thread; it must not block) whenever a tag
        has landed, so the owner need not poll `poll_landed` on a timer."""

    def expect(self, expecting: bool) -> None:
        """A hint: writes are landing now (decode: a request's `done` arrived and it waits for
        its tags). A target that polls its transport polls at its busy rate while expecting
        (else it backs off: a fast poll takes CPU from a prefill on the same host); one woken
        by its transport ignores it."""

    def close(self) -> None:
        """Idempotent."""


def nothing() -> None:
    """A target's `on_landed` callback until its owner sets one."""


def drain(landed: deque[str]) -> list[str]:
    """Every tag queued by a target's receiving thread, oldest first (each tag once: popleft is
    atomic against the thread's appends)."""
    tags: list[str] = []
    while landed:
        tags.append(landed.popleft())
    return tags


class TransferInitiator(Protocol):
    """The sending side (prefill). NOTE: one thread at a time drives an initiator."""

    backend: str

    def register(self, regions: Sequence[Region]) -> None:
        """Once, before `connect`."""

    def connect(self, peer: str, descriptor: bytes, session: Session) -> None:
        """`peer`: any id the caller picks; its writes belong to `session`. Raises
        TransferError on a bad descriptor, or when the target's region names differ from the
        local ones (sizes may differ)."""

    def write(
        self, peer: str, blocks: Sequence[Block], tag: str, timeout_s: float, *, epoch: int
    ) -> None:
        """Return once every byte of `blocks` is in the target's memory; the target then reports
        `landed_key(epoch, tag)` (also for no blocks). Checks every block (`check_blocks`)
        before moving a byte. Raises TransferError on a bad block, a dead peer, a write the
        target refuses (zmq: no live grant of `epoch` for it), or after `timeout_s`."""

    def disconnect(self, peer: str) -> None: ...

    def close(self) -> None:
        """Idempotent."""


def merge_blocks(blocks: Sequence[Block]) -> list[Block]:
    """Merge each run of consecutive blocks that are contiguous in both source and destination
    of one region; the order is kept, so the merged list copies exactly the same bytes."""
    merged: list[Block] = []
    for b in blocks:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.region == b.region
            and last.src_offset + last.nbytes == b.src_offset
            and last.dst_offset + last.nbytes == b.dst_offset
        ):
            merged[-1] = Block(b.region, last.src_offset, last.dst_offset, last.nbytes + b.nbytes)
        else:
            merged.append(b)
    return merged


def split_blocks(blocks: Sequence[Block], parts: int) -> list[list[Block]]:
    """`blocks` as `parts` consecutive shares of equal bytes (the first ones take the
    remainder, one byte each), cutting a block where a share ends; together the shares copy
    exactly the same bytes. A share is empty only when there are fewer bytes than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    total = sum(b.nbytes for b in blocks)
    quota, extra = divmod(total, parts)
    shares: list[list[Block]] = [[] for _ in range(parts)]
    share, room = 0, quota + (1 if extra > 0 else 0)
    for b in blocks:
        done = 0
        while done < b.nbytes:
            while room == 0:  # this share is full: on to the next that has room
                share += 1
                room = quota + (1 if share < extra else 0)
            take = min(room, b.nbytes - done)
            shares[share].append(Block(b.region, b.src_offset + done, b.dst_offset + done, take))
            done += take
            room -= take
    return shares


def check_blocks(
    blocks: Sequence[Block],
    local_sizes: Mapping[str, int],
    remote_sizes: Mapping[str, int],
    *,
    peer: str = "?",
) -> None:
    """Raise TransferError naming the first bad block: unknown region, `nbytes <= 0`, a range
    outside either region, or a destination range that overlaps another block's.
    NOTE: backends may copy the blocks of one write in any order, hence no overlaps."""
    for i, b in enumerate(blocks):
        if b.region not in local_sizes or b.region not in remote_sizes:
            raise TransferError(f"block {i} {b}: unknown region {b.region!r} (peer {peer!r})")
        if b.nbytes <= 0 or b.src_offset < 0 or b.dst_offset < 0:
            raise TransferError(f"block {i} {b}: nbytes must be > 0, offsets >= 0 (peer {peer!r})")
        _check_range(i, b, "src", b.src_offset, local_sizes[b.region], peer)
        _check_range(i, b, "dst", b.dst_offset, remote_sizes[b.region], peer)
    _check_no_overlap(blocks, peer)


def check_same_regions(
    local_sizes: Mapping[str, int], remote_sizes: Mapping[str, int], *, peer: str
) -> None:
    """Raise TransferError naming the regions only one side has. Sizes may differ: each side
    sizes its own pools, and `check_blocks` bounds every block on both sides."""
    only_remote = sorted(set(remote_sizes) - set(local_sizes))
    only_local = sorted(set(local_sizes) - set(remote_sizes))
    if only_remote or only_local:
        raise TransferError(
            f"peer {peer!r}: region sets differ: target-only {only_remote}, local-only {only_local}"
        )


def check_regions(regions: Sequence[Region]) -> dict[str, int]:
    """Region name -> nbytes; raises TransferError on a duplicate name, an empty region or a
    non-contiguous tensor (regions are addressed as flat bytes)."""
    sizes: dict[str, int] = {}
    for r in regions:
        if r.name in sizes:
            raise TransferError(f"region {r.name!r} registered twice")
        if not r.tensor.is_contiguous():
            raise TransferError(f"region {r.name!r}: tensor is not contiguous")
        if r.nbytes <= 0:
            raise TransferError(f"region {r.name!r}: tensor is empty")
        sizes[r.name] = r.nbytes
    return sizes


def region_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 view (no copy; the tensor must be contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


def _check_range(i: int, b: Block, side: str, offset: int, size: int, peer: str) -> None:
    if offset + b.nbytes > size:
        raise TransferError(
            f"block {i} {b}: {side} range [{offset}, {offset + b.nbytes}) is outside region "
            f"{b.region!r} of {size} bytes (peer {peer!r})"
        )


def _check_no_overlap(blocks: Sequence[Block], peer: str) -> None:
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i].region, blocks[i].dst_offset))
    for prev, cur in pairwise(order):
        a, b = blocks[prev], blocks[cur]
        if a.region == b.region and a.dst_offset + a.nbytes > b.dst_offset:
            raise TransferError(
                f"block {cur} {b}: destination overlaps block {prev} {a} (peer {peer!r})"
            )
