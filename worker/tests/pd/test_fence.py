"""The target's fence (#37 item 2) and the transfer sessions' authentication (item 3): a write
lands only under a live grant, into its units, from an authentic session; a zmq target
refuses anything else before a byte lands (and a replayed message, however authentic), a
NIXL target reports the tag of none of it (its bytes cannot be refused: the decode holds
such pages; `flight`)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_common.api.pd_secret import PDSecret
from dsv4_worker.pd.auth import SessionKeys
from dsv4_worker.pd.transfer import (
    Block,
    Grant,
    Region,
    Session,
    TransferError,
    TransferInitiator,
    TransferTarget,
    make_initiator,
    make_target,
)
from dsv4_worker.pd.transfer.base import region_bytes
from dsv4_worker.pd.transfer.fence import Fence
from dsv4_worker.pd.transfer.nixl_backend import load_nixl
from dsv4_worker.pd.transfer.zmq_backend import Header

KEYS = SessionKeys(PDSecret(b"test-fence-secret-" + b"0123456789abcdef" * 2))
OTHER = SessionKeys(PDSecret(b"another-deployment-" + b"0123456789abcdef" * 2))
LAYERS, UNITS, UNIT_BYTES = 3, 16, 64
WAIT_S = 30.0


def session(keys: SessionKeys, sid: str = "inst.a") -> Session:
    return Session(sid, keys.key(sid))


def regions(seed: int) -> list[Region]:
    """Two fenced KV regions ([layers, units, bytes], full and SWA pages) and a slot region."""
    gen = torch.Generator().manual_seed(seed)

    def make(units: int) -> torch.Tensor:
        return torch.randint(0, 256, (LAYERS, units, UNIT_BYTES), dtype=torch.uint8, generator=gen)

    return [
        Region("kv", make(UNITS), "full_page"),
        Region("swa", make(UNITS), "swa_page"),
        Region("state", make(8), "req_slot"),
    ]


def unit_blocks(region: str, units: Sequence[int]) -> list[Block]:
    """Every layer of `units` (the same units on both sides)."""
    n = UNITS if region != "state" else 8
    return [
        Block(region, (i * n + u) * UNIT_BYTES, (i * n + u) * UNIT_BYTES, UNIT_BYTES)
        for i in range(LAYERS)
        for u in units
    ]


def snapshot(rs: Sequence[Region]) -> dict[str, np.ndarray[Any, Any]]:
    return {r.name: region_bytes(r.tensor).numpy().copy() for r in rs}


def changed(before: dict[str, np.ndarray[Any, Any]], rs: Sequence[Region]) -> dict[str, int]:
    return {
        r.name: int((region_bytes(r.tensor).numpy() != before[r.name]).sum())
        for r in rs
        if (region_bytes(r.tensor).numpy() != before[r.name]).any()
    }


@contextlib.contextmanager
def pair(
    backend: str, writer: Session
) -> Iterator[tuple[TransferTarget, TransferInitiator, list[Region]]]:
    if backend == "nixl":
        try:
            load_nixl()
        except TransferError:
            pytest.skip("NIXL is not installed")
    dst = regions(1)
    target = make_target(backend, KEYS)
    initiator = make_initiator(backend, name="fence-test", threads=0)
    try:
        target.register(dst)
        initiator.register(regions(2))
        initiator.connect("d", target.descriptor(), writer)
        yield target, initiator, dst
    finally:
        initiator.close()
        target.close()


def landed(target: TransferTarget, want: str | None = None) -> list[str]:
    """What the target reports now (waiting until `want` is among it)."""
    seen: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while True:
        seen += target.poll_landed()
        if want is None or want in seen or time.monotonic() > deadline:
            return seen
        time.sleep(0.002)


# ---- the fence, pure ----------------------------------------------------------------------


def test_a_grant_covers_its_units_until_revoked() -> None:
    fence = Fence(regions(0))
    fence.grant(Grant(7, "r", {"full_page": (3, 4), "swa_page": (4,), "req_slot": (2,)}, "s"))
    assert fence.refuse_tag("s", 7, "r:0:0:0") is None
    assert fence.refuse_blocks(7, unit_blocks("kv", [3, 4]) + unit_blocks("swa", [4])) is None
    assert "not granted to epoch 7" in str(fence.refuse_blocks(7, unit_blocks("kv", [5])))
    assert "another session" in str(fence.refuse_tag("t", 7, "r:0:0:0"))
    assert "not of room" in str(fence.refuse_tag("s", 7, "x:0:0:0"))
    assert "not granted" in str(fence.refuse_tag("s", 8, "r:0:0:0"))
    half = Block("kv", 3 * UNIT_BYTES, 3 * UNIT_BYTES, UNIT_BYTES // 2)
    assert "not whole units" in str(fence.refuse_blocks(7, [half]))
    across = Block("kv", (UNITS - 1) * UNIT_BYTES, (UNITS - 1) * UNIT_BYTES, 2 * UNIT_BYTES)
    assert "spans two layers" in str(fence.refuse_blocks(7, [across]))
    assert fence.revoke(7) is not None and fence.revoke(7) is None  # idempotent
    assert "not granted" in str(fence.refuse_tag("s", 7, "r:0:0:0"))
    assert fence.granted_units() == {"full_page": 0, "swa_page": 0, "req_slot": 0}


def test_a_unit_cannot_be_granted_twice_nor_an_epoch_reused() -> None:
    fence = Fence(regions(0))
    fence.grant(Grant(1, "a", {"full_page": (3,)}))
    with pytest.raises(ValueError, match="still granted to epoch 1"):
        fence.grant(Grant(2, "b", {"full_page": (3, 5)}))
    assert fence.granted_units()["full_page"] == 1  # the refused grant changed nothing
    with pytest.raises(ValueError, match="not new"):
        fence.grant(Grant(1, "c", {"full_page": (6,)}))  # a live epoch
    with pytest.raises(ValueError, match="outside"):
        fence.grant(Grant(3, "c", {"full_page": (0,)}))  # unit 0 means "none"


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["grant", "revoke", "write"]),
            st.integers(1, 6),
            st.sets(st.integers(1, UNITS - 1), max_size=5),
        ),
        max_size=30,
    )
)
def test_a_write_passes_exactly_when_every_unit_is_live_under_its_epoch(
    ops: list[tuple[str, int, set[int]]],
) -> None:
    """Against a model (epoch -> units while live): any grants, revokes and writes. (The
    engine never grants an epoch twice; the fence refuses only a live one.)"""
    fence = Fence(regions(0))
    live: dict[int, set[int]] = {}
    for op, epoch, units in ops:
        if op == "grant":
            owned = set().union(*live.values()) if live else set()
            ok = epoch not in live and not units & owned
            try:
                fence.grant(Grant(epoch, "r", {"full_page": tuple(sorted(units))}))
            except ValueError:
                assert not ok
            else:
                assert ok
                live[epoch] = units
        elif op == "revoke":
            fence.revoke(epoch)
            live.pop(epoch, None)
        else:
            blocks = unit_blocks("kv", sorted(units))
            allowed = fence.refuse_tag("s", epoch, "r:0") is None
            allowed = allowed and fence.refuse_blocks(epoch, blocks) is None
            assert allowed == (epoch in live and units <= live[epoch])
    assert fence.granted_units()["full_page"] == sum(len(u) for u in live.values())


# ---- the backends ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_write_lands_only_under_a_live_grant(backend: str) -> None:
    """Granted: bytes and tag land. Revoked: zmq refuses the write before a byte lands (the
    writer gets the reason), NIXL lets its bytes land (one-sided) but never reports its tag."""
    with pair(backend, session(KEYS)) as (target, initiator, dst):
        target.grant(Grant(5, "r", {"full_page": (2, 3)}, "inst.a"))
        initiator.write("d", unit_blocks("kv", [2, 3]), "r:0", WAIT_S, epoch=5)
        assert "5/r:0" in landed(target, "5/r:0")
        target.revoke(5)
        before = snapshot(dst)
        if backend == "zmq":
            with pytest.raises(TransferError, match="epoch 5 is not granted"):
                initiator.write("d", unit_blocks("kv", [2]), "r:1", WAIT_S, epoch=5)
            assert changed(before, dst) == {}
        else:
            initiator.write("d", unit_blocks("kv", [2]), "r:1", WAIT_S, epoch=5)
        # A later write that does land proves the refused one's tag would have been seen.
        target.grant(Grant(6, "q", {"full_page": (9,)}, "inst.a"))
        initiator.write("d", unit_blocks("kv", [9]), "q:0", WAIT_S, epoch=6)
        seen = landed(target, "6/q:0")
        assert "5/r:1" not in seen


def test_zmq_refuses_a_write_outside_its_grant_before_a_byte_lands() -> None:
    with pair("zmq", session(KEYS)) as (target, initiator, dst):
        target.grant(Grant(1, "r", {"full_page": (2,), "req_slot": (1,)}, "inst.a"))
        before = snapshot(dst)
        # The granted unit and one it was not granted, in one write: none of it lands.
        with pytest.raises(TransferError, match=r"units 4\.\.4 are not granted to epoch 1"):
            initiator.write("d", unit_blocks("kv", [2, 4]), "r:0", WAIT_S, epoch=1)
        with pytest.raises(TransferError, match="not of room"):
            initiator.write("d", unit_blocks("kv", [2]), "other:0", WAIT_S, epoch=1)
        assert changed(before, dst) == {}
        initiator.write(
            "d", unit_blocks("kv", [2]) + unit_blocks("state", [1]), "r:1", WAIT_S, epoch=1
        )
        assert set(changed(before, dst)) == {"kv", "state"}


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_grant_to_one_session_refuses_another(backend: str) -> None:
    with pair(backend, session(KEYS, "inst.b")) as (target, initiator, dst):
        target.grant(Grant(1, "r", {"full_page": (2,)}, "inst.a"))
        before = snapshot(dst)
        if backend == "zmq":
            with pytest.raises(TransferError, match="another session"):
                initiator.write("d", unit_blocks("kv", [2]), "r:0", WAIT_S, epoch=1)
            assert changed(before, dst) == {}
        else:
            initiator.write("d", unit_blocks("kv", [2]), "r:0", WAIT_S, epoch=1)
            time.sleep(0.2)  # the notification would be there by now (the pump: 2 ms)
            assert landed(target) == []


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_forged_write_changes_nothing_it_can_refuse(backend: str) -> None:
    """A writer whose session key is not from this deployment's secret: zmq drops every
    message (no reply: the write times out), nothing lands; NIXL (its bytes, one-sided, cannot
    be refused) never reports its tag, so no request completes on it."""
    with pair(backend, session(OTHER)) as (target, initiator, dst):
        target.grant(Grant(1, "r", {"full_page": (2,)}))  # any session of this deployment
        before = snapshot(dst)
        if backend == "zmq":
            with pytest.raises(TransferError, match="timed out"):
                initiator.write("d", unit_blocks("kv", [2]), "r:0", 1.0, epoch=1)
            assert changed(before, dst) == {}
        else:
            initiator.write("d", unit_blocks("kv", [2]), "r:0", WAIT_S, epoch=1)
        time.sleep(0.2)
        assert landed(target) == []


def test_zmq_drops_a_replayed_write_even_an_authentic_one() -> None:
    """Every message of an authentic write, captured and sent again from another socket: the
    target scatters nothing and reports no tag a second time."""
    with pair("zmq", session(KEYS)) as (target, initiator, dst):
        target.grant(Grant(1, "r", {"full_page": (2,)}, "inst.a"))
        sent: list[list[Any]] = []
        peer = initiator._peers["d"]  # type: ignore[attr-defined]
        real = peer.sock.send_multipart

        def record(frames: list[Any], *args: Any, **kwargs: Any) -> None:
            sent.append([bytes(f) for f in frames])
            real(frames, *args, **kwargs)

        peer.sock.send_multipart = record
        initiator.write("d", unit_blocks("kv", [2]), "r:0", WAIT_S, epoch=1)
        assert landed(target, "1/r:0") == ["1/r:0"]
        region_bytes(dst[0].tensor).zero_()  # a replay that scattered would show here
        before = snapshot(dst)
        header = Header.decode(sent[0][0])
        assert header.session == "inst.a" and header.epoch == 1
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(json.loads(target.descriptor())["endpoint"])
        try:
            for frames in sent:
                sock.send_multipart(frames)
            assert not sock.poll(500), "the target answered a replay"
        finally:
            sock.close(linger=0)
            ctx.term()
        assert changed(before, dst) == {}
        assert landed(target) == []
