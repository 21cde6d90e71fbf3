"""The target's fence: which pages a write may touch now. No sockets, no NIXL (numpy only).

A decode grants a destination to one transfer: `Grant(epoch, room, units, session)`, the
epoch unique for the target's life (the decode engine numbers its preallocations). The
fence keeps a generation per unit of each index space: `epoch` while the unit is granted, 0
once the grant is revoked. A write carries its epoch; it is accepted only while

    the grant is live (granted, not revoked) and, if it names a session, from that session;
    its tag belongs to the grant's room (`room:...`);
    every block lies in units whose generation is the write's epoch (for a region with an
    index space; `Region.space`), whole units, inside one layer.

NOTE: a zmq target checks under its lock before it scatters, and `revoke` takes that lock, so
after `revoke` returns no byte of the grant lands. A NIXL write is one-sided: the fence only
decides whether its notification counts; its pages stay held (quarantined) by the decode
until the writer's session is provably closed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dsv4_worker.pd.transfer.base import Block, Region


@dataclass(frozen=True, slots=True)
class Grant:
    """Pages of one destination handed to one transfer."""

    epoch: int  # > 0; never granted twice (the decode engine numbers preallocations)
    room: str  # the request: its writes' tags are `room:...`
    units: Mapping[str, Sequence[int]]  # index space -> the granted units (no 0)
    session: str | None = None  # the only session that may write (None: any authentic one)


@dataclass(frozen=True, slots=True)
class _Geometry:
    space: str
    units: int
    unit_bytes: int


class Fence:
    """Per-unit generations of one target's regions; the caller serializes calls."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self._geometry: dict[str, _Geometry] = {}
        units: dict[str, int] = {}
        for r in regions:
            if r.space is None:
                continue
            t = r.tensor
            if t.dim() < 2:
                raise ValueError(f"region {r.name!r}: a fenced region is [layers, units, ...]")
            n_units = int(t.shape[1])
            unit_bytes = r.nbytes // (int(t.shape[0]) * n_units)
            self._geometry[r.name] = _Geometry(r.space, n_units, unit_bytes)
            if units.setdefault(r.space, n_units) != n_units:
                raise ValueError(
                    f"region {r.name!r}: {n_units} units, its space has {units[r.space]}"
                )
        self._gen = {space: np.zeros(n, dtype=np.int64) for space, n in units.items()}
        self._grants: dict[int, Grant] = {}

    def grant(self, grant: Grant) -> None:
        """Open `grant`; ValueError when its epoch is live, or a unit is out of range or still
        granted to another (a page handed out twice: a bug upstream)."""
        if grant.epoch <= 0 or grant.epoch in self._grants:
            raise ValueError(f"grant: epoch {grant.epoch} is not new")
        for space, units in grant.units.items():
            gen = self._gen.get(space)
            if gen is None:
                continue  # no region of this target lies in that space
            idx = np.asarray(units, dtype=np.int64)
            if idx.size and (idx.min() < 1 or idx.max() >= gen.size):
                raise ValueError(f"grant {grant.epoch}: {space} units outside 1..{gen.size - 1}")
            busy = gen[idx]
            if busy.any():
                raise ValueError(
                    f"grant {grant.epoch}: {space} units still granted to epoch "
                    f"{int(busy[busy > 0][0])}"
                )
        for space, units in grant.units.items():
            if space in self._gen:
                self._gen[space][np.asarray(units, dtype=np.int64)] = grant.epoch
        self._grants[grant.epoch] = grant

    def revoke(self, epoch: int) -> Grant | None:
        """Close the grant (idempotent); it is returned the first time."""
        grant = self._grants.pop(epoch, None)
        if grant is not None:
            for space, units in grant.units.items():
                gen = self._gen.get(space)
                if gen is not None:
                    idx = np.asarray(units, dtype=np.int64)
                    gen[idx[gen[idx] == epoch]] = 0
        return grant

    @property
    def granted(self) -> bool:
        """Some grant is live (a write may land now)."""
        return bool(self._grants)

    def live(self, epoch: int) -> Grant | None:
        return self._grants.get(epoch)

    def refuse_tag(self, session: str, epoch: int, tag: str) -> str | None:
        """Why a write (or its notification) of `tag` under `epoch` from `session` does not
        count (None: it does)."""
        grant = self._grants.get(epoch)
        if grant is None:
            return f"epoch {epoch} is not granted (revoked, or never)"
        if grant.session is not None and grant.session != session:
            return f"epoch {epoch} is granted to another session"
        if not tag.startswith(grant.room + ":"):
            return f"tag {tag!r} is not of room {grant.room!r}"
        return None

    def refuse_blocks(self, epoch: int, blocks: Sequence[Block]) -> str | None:
        """Why a block of a write under `epoch` may not land (None: every one may); call after
        `refuse_tag` passed."""
        for i, b in enumerate(blocks):
            g = self._geometry.get(b.region)
            if g is None:
                continue  # a region without an index space: the grant covers it whole
            size = g.unit_bytes
            if b.dst_offset % size or b.nbytes % size:
                return f"block {i} of region {b.region!r}: not whole units of {size} bytes"
            first = (b.dst_offset // size) % g.units
            count = b.nbytes // size
            if first + count > g.units:
                return f"block {i} of region {b.region!r}: spans two layers"
            if not bool((self._gen[g.space][first : first + count] == epoch).all()):
                return (
                    f"block {i} of region {b.region!r}: units {first}..{first + count - 1} "
                    f"are not granted to epoch {epoch}"
                )
        return None

    def granted_units(self) -> dict[str, int]:
        """Units granted now, per index space (tests and metrics)."""
        return {space: int((gen > 0).sum()) for space, gen in self._gen.items()}
