"""KV transfer backends (nixl, zmq) against one protocol: bytes land exactly where asked and
nowhere else, each tag lands once (also for no blocks), bad blocks fail before a byte moves,
descriptors are checked at connect, a dead target fails a write within its timeout.
Two-process cases run the target in a spawned child; everything stays on 127.0.0.1."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing
import os
import runpy
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_support import wait_until

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
    merge_blocks,
    nixl_backend,
    zmq_backend,
)
from dsv4_worker.pd.transfer.base import region_bytes, split_blocks
from dsv4_worker.pd.transfer.nixl_backend import (
    MAX_WRITE_THREADS,
    PARALLEL_MIN_BYTES,
    WRITE_THREADS,
    load_nixl,
    ucx_params,
)

os.environ.setdefault("UCX_NET_DEVICES", "lo")

BACKENDS = ["nixl", "zmq"]
WAIT_S = 30.0  # generous: the machine may be loaded
# name -> (dtype, shape): small regions of three dtypes
REGIONS: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "kv": (torch.uint8, (3, 40, 64)),
    "swa": (torch.bfloat16, (3, 20, 32)),
    "state": (torch.float32, (10, 50)),
}
CHILD_RUN_NAME = "__transfer_target_child__"
KEYS = SessionKeys(PDSecret(b"test-transfer-secret-" + b"0123456789abcdef" * 2))
SESSION = Session("inst.s1", KEYS.key("inst.s1"))  # every connection's session here
ROOM, EPOCH = "r", 1  # every write's grant here (a room's tags are `r:...`)
# KV pages: [layers, units, unit_bytes]; decode has more units than prefill
LAYERS, SRC_UNITS, DST_UNITS, UNIT_BYTES = 4, 48, 64, 4096


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """Each of BACKENDS (`pytest_generate_tests`); skips nixl when it is not installed."""
    name: str = request.param
    if name == "nixl":
        try:
            load_nixl()
        except TransferError:
            pytest.skip("NIXL is not installed")
    return name


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test runs on each backend; one that takes `threads` runs nixl with its default
    poster threads (a big write's byte shares posted in parallel) and with none (every write
    on the calling thread), and zmq once (it has no write threads)."""
    if "threads" in metafunc.fixturenames and not _marks(metafunc, "threads"):
        metafunc.parametrize(
            ("backend", "threads"),
            [("nixl", None), ("nixl", 0), ("zmq", None)],
            ids=["nixl-default-threads", "nixl-no-threads", "zmq"],
            indirect=["backend"],
        )
    elif "backend" in metafunc.fixturenames and not _marks(metafunc, "backend"):
        metafunc.parametrize("backend", BACKENDS, indirect=True)


def _marks(metafunc: pytest.Metafunc, name: str) -> bool:
    """The test chose its own values of `name` with a parametrize mark."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if name in (names.split(",") if isinstance(names, str) else names):
            return True
    return False


@pytest.fixture
def every_write_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """nixl posters take any write, however small: shares cut blocks at odd offsets."""
    monkeypatch.setattr(nixl_backend, "PARALLEL_MIN_BYTES", 1)


# ---- helpers ---------------------------------------------------------------------------------


def random_tensor(dtype: torch.dtype, shape: Sequence[int], seed: int) -> torch.Tensor:
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(*shape)


def make_regions(
    spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], seed: int
) -> list[Region]:
    return [
        Region(name, random_tensor(dtype, shape, seed + i))
        for i, (name, (dtype, shape)) in enumerate(spec.items())
    ]


def as_bytes(regions: Sequence[Region]) -> dict[str, np.ndarray[Any, Any]]:
    return {r.name: region_bytes(r.tensor).cpu().numpy().copy() for r in regions}


def apply(
    dst: Mapping[str, np.ndarray[Any, Any]],
    src: Mapping[str, np.ndarray[Any, Any]],
    blocks: Sequence[Block],
) -> dict[str, np.ndarray[Any, Any]]:
    """What the target's bytes must be after a write of `blocks`."""
    out = {name: a.copy() for name, a in dst.items()}
    for b in blocks:
        out[b.region][b.dst_offset : b.dst_offset + b.nbytes] = src[b.region][
            b.src_offset : b.src_offset + b.nbytes
        ]
    return out


def random_blocks(rng: np.random.Generator, sizes: Mapping[str, int]) -> list[Block]:
    """Disjoint destinations, random sources, in runs that are sometimes mergeable; run order
    shuffled across regions."""
    runs: list[list[Block]] = []
    for name, size in sizes.items():
        dst = int(rng.integers(0, 64))
        while True:
            n = int(rng.integers(1, 200))
            if dst + n > size:
                break
            run = runs[-1] if runs and runs[-1][-1].region == name else None
            prev = run[-1] if run else None
            if run and prev and prev.dst_offset + prev.nbytes == dst and rng.random() < 0.6:
                src = prev.src_offset + prev.nbytes
                if src + n <= size:
                    run.append(Block(name, src, dst, n))
                    dst += n
                    continue
            runs.append([Block(name, int(rng.integers(0, size - n + 1)), dst, n)])
            dst += n + (0 if rng.random() < 0.4 else int(rng.integers(1, 100)))
    order = rng.permutation(len(runs))
    return [b for i in order for b in runs[i]]


def tagged(name: str) -> str:
    """A write's tag in the grant's room."""
    return f"{ROOM}:{name}"


def granted_target(
    backend: str, regions: Sequence[Region], host: str = "127.0.0.1"
) -> TransferTarget:
    """A target over `regions` with the grant every write here carries (no units: the test
    regions name no index space, so the grant covers them whole)."""
    target = make_target(backend, KEYS, host=host)
    target.register(regions)
    target.grant(Grant(EPOCH, ROOM, {}))
    return target


def landed_names(target: TransferTarget) -> list[str]:
    """The names (`tagged`) of the writes that landed since the last call, each once."""
    out = []
    for key in target.poll_landed():
        epoch, _, tag = key.partition("/")
        assert epoch == str(EPOCH) and tag.startswith(f"{ROOM}:"), key
        out.append(tag.removeprefix(f"{ROOM}:"))
    return out


def wait_tags(target: TransferTarget, want: Sequence[str], seen: list[str]) -> None:
    """Poll until every tag of `want` is in `seen` (which collects all tags polled)."""
    deadline = time.monotonic() + WAIT_S
    while not set(want) <= set(seen):
        seen.extend(landed_names(target))
        assert time.monotonic() < deadline, f"tags {want} did not land; saw {seen}"
        time.sleep(0.002)


@dataclass
class Pair:
    target: TransferTarget
    initiator: TransferInitiator
    src: list[Region]
    dst: list[Region]

    @property
    def sizes(self) -> dict[str, int]:
        return {r.name: r.nbytes for r in self.dst}


@contextlib.contextmanager
def connected(
    backend: str, threads: int | None, src: list[Region], dst: list[Region]
) -> Iterator[Pair]:
    """A target over `dst` and an initiator over `src` in this process, connected as peer
    "t"; both closed on exit."""
    target = granted_target(backend, dst)
    initiator = make_initiator(backend, name="test", threads=threads)
    try:
        initiator.register(src)
        initiator.connect("t", target.descriptor(), SESSION)
        yield Pair(target, initiator, src, dst)
    finally:
        initiator.close()
        target.close()


@pytest.fixture
def pair(backend: str, threads: int | None, every_write_parallel: None) -> Iterator[Pair]:
    """CPU regions on both sides, connected (`connected`)."""
    src, dst = make_regions(REGIONS, seed=1), make_regions(REGIONS, seed=100)
    with connected(backend, threads, src, dst) as p:
        yield p


def assert_bytes_equal(got: Sequence[Region], want: Mapping[str, np.ndarray[Any, Any]]) -> None:
    for name, a in as_bytes(got).items():
        diff = np.flatnonzero(a != want[name])
        assert diff.size == 0, f"region {name}: {diff.size} bytes differ, first at {diff[:5]}"


# ---- one process -----------------------------------------------------------------------------


def test_random_blocks_land_exactly_where_asked_and_tags_once(
    pair: Pair, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "zmq":  # cut writes into many small messages and split big blocks
        monkeypatch.setattr(zmq_backend, "MESSAGE_NBYTES", 500)
    rng = np.random.default_rng(7)
    src, want = as_bytes(pair.src), as_bytes(pair.dst)
    tags = [f"w{i}" for i in range(6)]
    for tag in tags:
        blocks = random_blocks(rng, pair.sizes)
        assert len(merge_blocks(blocks)) < len(blocks)  # the pattern exercises merging
        pair.initiator.write("t", blocks, tagged(tag), timeout_s=WAIT_S, epoch=EPOCH)
        want = apply(want, src, blocks)
    # a last write: a duplicate of an earlier tag would most likely arrive before its tag
    pair.initiator.write("t", [], tagged("end"), timeout_s=WAIT_S, epoch=EPOCH)
    seen: list[str] = []
    wait_tags(pair.target, [*tags, "end"], seen)
    assert Counter(seen) == Counter([*tags, "end"])
    assert_bytes_equal(pair.dst, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("threads", [None, 0], ids=["default-threads", "no-threads"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_cuda_regions_land_exactly_where_asked(
    backend: str, threads: int | None, every_write_parallel: None
) -> None:
    """GPU pools on both sides (nixl: VRAM_SEG; zmq: through host frames), writes in shares
    too: the bytes and tags are exactly those of the CPU case."""
    src = [Region(r.name, r.tensor.cuda()) for r in make_regions(REGIONS, seed=1)]
    dst = [Region(r.name, r.tensor.cuda()) for r in make_regions(REGIONS, seed=100)]
    with connected(backend, threads, src, dst) as p:
        rng = np.random.default_rng(3)
        want = as_bytes(dst)
        tags = [f"w{i}" for i in range(3)]
        for tag in tags:
            blocks = random_blocks(rng, p.sizes)
            p.initiator.write("t", blocks, tagged(tag), timeout_s=WAIT_S, epoch=EPOCH)
            want = apply(want, as_bytes(src), blocks)
        seen: list[str] = []
        wait_tags(p.target, tags, seen)
        assert Counter(seen) == Counter(tags)
        torch.cuda.synchronize()
        assert_bytes_equal(dst, want)


def test_on_landed_wakes_the_owner_after_the_tag_is_there(pair: Pair) -> None:
    woke: list[list[str]] = []
    ready = threading.Event()

    def landed() -> None:  # on the target's thread: the tag is already queued
        woke.append(landed_names(pair.target))
        ready.set()

    pair.target.on_landed(landed)
    pair.target.expect(True)
    pair.initiator.write("t", [Block("kv", 0, 0, 64)], tagged("a"), timeout_s=WAIT_S, epoch=EPOCH)
    assert ready.wait(WAIT_S), "on_landed was not called"
    assert woke[0] == ["a"]
    pair.target.expect(False)


def test_nixl_pump_polls_fast_while_busy_and_backs_off_while_idle() -> None:
    """Doubling from the busy period to the quiet one (an idle decode then wakes 20 times a
    second, not 500: #38 item 6)."""
    busy, quiet = nixl_backend.PUMP_INTERVAL_S, nixl_backend.PUMP_QUIET_INTERVAL_S
    assert nixl_backend.pump_interval_s(quiet, busy=True) == busy
    periods = [busy]
    for _ in range(12):
        periods.append(nixl_backend.pump_interval_s(periods[-1], busy=False))
    assert periods[1] == 2 * busy and periods[-1] == quiet
    assert all(b == min(2 * a, quiet) for a, b in itertools.pairwise(periods))
    assert nixl_backend.PUMP_IDLE_INTERVAL_S < quiet <= 0.05


@given(previous_s=st.floats(nixl_backend.PUMP_INTERVAL_S, nixl_backend.PUMP_UNGRANTED_INTERVAL_S))
def test_nixl_pump_backs_off_further_while_nothing_is_granted(previous_s: float) -> None:
    """With no grant live nothing may land: the quiet back-off goes on up to the ungranted
    period (an idle decode wakes twice a second, not 20 times: #38 item 6), and a grant brings
    it back under the quiet period at once (its writes are coming)."""
    quiet = nixl_backend.PUMP_QUIET_INTERVAL_S
    ungranted = nixl_backend.PUMP_UNGRANTED_INTERVAL_S
    interval = nixl_backend.pump_interval_s
    assert quiet < ungranted <= 1.0
    assert interval(previous_s, busy=False, granted=False) == min(2 * previous_s, ungranted)
    assert interval(previous_s, busy=False, granted=True) == min(2 * previous_s, quiet)
    assert interval(previous_s, busy=True, granted=False) == nixl_backend.PUMP_INTERVAL_S


@given(
    previous_s=st.floats(nixl_backend.PUMP_INTERVAL_S, nixl_backend.PUMP_IDLE_INTERVAL_S),
    busy=st.booleans(),
    told_idle=st.booleans(),
)
def test_nixl_pump_goes_idle_at_once_when_told_and_fast_while_expecting(
    previous_s: float, busy: bool, told_idle: bool
) -> None:
    """Expecting writes: the busy rate, whatever else. Told to stop expecting: the idle rate at
    once, even right after a tag (that tag was what the owner waited for), never a back-off
    through faster polls that would take the CPU the owner needs to answer."""
    interval = nixl_backend.pump_interval_s
    assert (
        interval(previous_s, busy=busy, expecting=True, told_idle=told_idle)
        == nixl_backend.PUMP_INTERVAL_S
    )
    if told_idle:
        assert interval(previous_s, busy=busy, told_idle=True) == nixl_backend.PUMP_IDLE_INTERVAL_S
    else:
        assert interval(previous_s, busy=busy) == nixl_backend.pump_interval_s(
            previous_s, busy=busy
        )


def test_nixl_target_drops_to_its_idle_poll_once_told_to_stop_expecting(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pump sees `expect(False)` at its next poll (only a True -> False change counts)
    and waits its idle period from then on, without a back-off in between."""
    if backend != "nixl":
        pytest.skip("only the nixl target polls")
    calls: list[tuple[bool, bool]] = []  # (expecting, told_idle) per poll
    real = nixl_backend.pump_interval_s

    def spy(
        previous_s: float,
        *,
        busy: bool,
        expecting: bool = False,
        told_idle: bool = False,
        granted: bool = True,
    ) -> float:
        calls.append((expecting, told_idle))
        return real(
            previous_s, busy=busy, expecting=expecting, told_idle=told_idle, granted=granted
        )

    monkeypatch.setattr(nixl_backend, "pump_interval_s", spy)
    target = granted_target("nixl", make_regions(REGIONS, seed=100))
    try:
        target.expect(False)  # never expected: not a change
        target.expect(True)
        wait_until(lambda: (True, False) in calls, "a poll while expecting")
        target.expect(False)
        wait_until(lambda: calls[-1][0] is False and any(t for _, t in calls), "told idle")
        told = [i for i, (_, t) in enumerate(calls) if t]
        assert len(told) == 1, f"told idle once per True -> False change: {calls}"
        assert calls[told[0]] == (False, True)
    finally:
        target.close()


def test_empty_write_delivers_its_tag_and_moves_nothing(pair: Pair) -> None:
    before = as_bytes(pair.dst)
    pair.initiator.write("t", [], tagged("empty"), timeout_s=WAIT_S, epoch=EPOCH)
    seen: list[str] = []
    wait_tags(pair.target, ["empty"], seen)
    assert seen == ["empty"]
    assert_bytes_equal(pair.dst, before)


def test_whole_regions_in_one_block_each(pair: Pair) -> None:
    blocks = [Block(r.name, 0, 0, r.nbytes) for r in pair.src]
    pair.initiator.write("t", blocks, tagged("all"), timeout_s=WAIT_S, epoch=EPOCH)
    wait_tags(pair.target, ["all"], [])
    assert_bytes_equal(pair.dst, as_bytes(pair.src))


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (Block("nope", 0, 0, 8), "unknown region 'nope'"),
        (Block("kv", 0, 0, 0), "nbytes must be > 0"),
        (Block("kv", -1, 0, 8), "offsets >= 0"),
        (Block("swa", 3836, 0, 8), "src range [3836, 3844)"),
        (Block("state", 0, 1999, 2), "dst range [1999, 2001)"),
        (Block("kv", 100, 10, 8), "destination overlaps block 0"),
    ],
    ids=["unknown-region", "zero-bytes", "negative", "src-out", "dst-out", "overlap"],
)
def test_bad_block_raises_before_any_byte_moves(pair: Pair, bad: Block, words: str) -> None:
    before = as_bytes(pair.dst)
    good = [Block("kv", 0, 0, 16), Block("state", 0, 0, 100)]
    with pytest.raises(TransferError) as err:
        pair.initiator.write("t", [*good, bad], tagged("bad"), timeout_s=WAIT_S, epoch=EPOCH)
    assert words in str(err.value) and "block 2" in str(err.value)
    pair.initiator.write("t", [], tagged("after"), timeout_s=WAIT_S, epoch=EPOCH)
    seen: list[str] = []
    wait_tags(pair.target, ["after"], seen)
    assert seen == ["after"]
    assert_bytes_equal(pair.dst, before)


def test_connect_refuses_a_different_region_set(backend: str) -> None:
    other = {**REGIONS, "extra": (torch.uint8, (8,))}
    del other["swa"]
    target = granted_target(backend, make_regions(other, seed=5))
    initiator = make_initiator(backend, name="test")
    try:
        initiator.register(make_regions(REGIONS, seed=1))
        with pytest.raises(TransferError) as err:
            initiator.connect("t", target.descriptor(), SESSION)
        assert "'extra'" in str(err.value) and "'swa'" in str(err.value)
        with pytest.raises(TransferError, match="not connected"):
            initiator.write("t", [], tagged("x"), timeout_s=1.0, epoch=EPOCH)
    finally:
        initiator.close()
        target.close()


@pytest.mark.parametrize(
    "descriptor",
    [b"", b"not json", b"[]", b'{"backend": "other"}', b'{"backend": "nixl", "agent": 1}'],
)
def test_connect_refuses_a_bad_descriptor(backend: str, descriptor: bytes) -> None:
    initiator = make_initiator(backend, name="test")
    try:
        initiator.register(make_regions(REGIONS, seed=1))
        with pytest.raises(TransferError, match="bad descriptor from peer 'p'"):
            initiator.connect("p", descriptor, SESSION)
    finally:
        initiator.close()


def test_ucx_params_give_each_poster_a_shared_worker() -> None:
    assert ucx_params(0) == ucx_params(1) == {}
    assert ucx_params(3) == {"num_workers": "4"}
    for bad in (-1, MAX_WRITE_THREADS + 1):
        with pytest.raises(TransferError, match=f"write threads {bad}: expected 0 to 64"):
            ucx_params(bad)


@pytest.mark.parametrize("backend", ["nixl"], indirect=True)
def test_nixl_big_writes_go_to_the_posters_small_ones_stay(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which thread posts what: a write of PARALLEL_MIN_BYTES per poster or more is posted by
    every poster, one share each, then its tag by the calling thread; a smaller one by the
    calling thread alone, tag included. Bytes and tags land either way."""
    posts: list[tuple[str, int, bytes]] = []
    real_post = nixl_backend._post

    def spy(agent: Any, peer: str, job: Any, notif: bytes, what: str) -> Any:
        nbytes = int(job.local[:, 1].sum())
        posts.append((threading.current_thread().name, nbytes, notif))
        return real_post(agent, peer, job, notif, what)

    monkeypatch.setattr(nixl_backend, "_post", spy)
    monkeypatch.setattr(nixl_backend, "PARALLEL_MIN_BYTES", 1000)
    src, dst = make_regions(REGIONS, seed=1), make_regions(REGIONS, seed=100)
    target = granted_target(backend, dst)
    initiator = nixl_backend.NixlInitiator("spy", threads=3)
    try:
        initiator.register(src)
        initiator.connect("t", target.descriptor(), SESSION)
        want = as_bytes(dst)
        big = [Block("kv", 0, 100, 2000), Block("state", 8, 0, 1001)]
        small = [Block("kv", 4000, 4500, 2999)]
        for blocks, tag in ((big, "big"), (small, "small")):
            initiator.write("t", blocks, tagged(tag), timeout_s=WAIT_S, epoch=EPOCH)
            want = apply(want, as_bytes(src), blocks)
        wait_tags(target, ["big", "small"], [])
        assert_bytes_equal(dst, want)
    finally:
        initiator.close()
        target.close()
    me = threading.current_thread().name
    shares, (tag_post, small_post) = posts[:3], posts[3:]
    by_poster = sorted((name.removeprefix(f"{initiator.name}-poster-"), n) for name, n, _ in shares)
    assert by_poster == [("0", 1001), ("1", 1000), ("2", 1000)]
    assert all(notif == b"" for _, _, notif in shares)
    tag_notif = nixl_backend.notification(SESSION.key, SESSION.id, EPOCH, tagged("big"))
    small_notif = nixl_backend.notification(SESSION.key, SESSION.id, EPOCH, tagged("small"))
    assert tag_post == (me, 1, tag_notif) and small_post == (me, 2999, small_notif)


def test_unknown_backend_names_the_choices() -> None:
    for make in (lambda: make_target("rdma", KEYS), lambda: make_initiator("rdma", name="x")):
        with pytest.raises(TransferError) as err:
            make()
        assert "'rdma'" in str(err.value) and "nixl, zmq" in str(err.value)


# ---- two processes ---------------------------------------------------------------------------


def kv_spec(units: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {
        "full": (torch.uint8, (LAYERS, units, UNIT_BYTES)),
        "swa": (torch.bfloat16, (LAYERS, units, UNIT_BYTES // 2)),
    }


def digests(regions: Sequence[Region] | Mapping[str, np.ndarray[Any, Any]]) -> dict[str, str]:
    arrays = as_bytes(regions) if isinstance(regions, Sequence) else regions
    return {name: hashlib.sha256(a.tobytes()).hexdigest() for name, a in arrays.items()}


def target_child(conn: Connection, backend: str) -> None:
    """The decode side: register KV pages, send the descriptor; on ("wait", tag) report the
    region digests once `tag` landed; stop on "stop" (or get killed)."""
    os.setsid()  # out of the test's process group: no job-control signals reach it
    regions = make_regions(kv_spec(DST_UNITS), seed=300)
    target = granted_target(backend, regions)
    conn.send(target.descriptor())
    seen: list[str] = []
    try:
        while (msg := conn.recv()) != "stop":
            wait_tags(target, [msg[1]], seen)
            conn.send((Counter(seen), digests(regions)))
    finally:
        target.close()


@dataclass
class Child:
    proc: multiprocessing.process.BaseProcess
    conn: Connection
    descriptor: bytes


@pytest.fixture
def child(backend: str) -> Iterator[Child]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    # NOTE: pytest imports this file under a name a spawned child cannot import, so the child
    # runs the file itself, as CHILD_RUN_NAME, and the bottom of the file calls target_child.
    proc = ctx.Process(
        target=runpy.run_path,
        args=(__file__,),
        kwargs={"init_globals": {"CHILD_ARGS": (there, backend)}, "run_name": CHILD_RUN_NAME},
        daemon=True,
    )
    proc.start()
    try:
        deadline = time.monotonic() + 2 * WAIT_S
        while not here.poll(0.05):
            assert proc.is_alive(), f"the target process exited with {proc.exitcode}"
            assert time.monotonic() < deadline, "the target process did not start"
        yield Child(proc, here, here.recv())
    finally:
        if proc.is_alive():
            with contextlib.suppress(OSError):
                here.send("stop")
            proc.join(WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def kv_blocks(rng: np.random.Generator) -> list[Block]:
    """Scattered source units to scattered destination units, every layer of both regions."""
    run_src, run_dst = list(range(10, 14)), list(range(40, 44))  # contiguous on both sides
    src_units = rng.choice(sorted(set(range(SRC_UNITS)) - set(run_src)), 16, replace=False)
    dst_units = rng.choice(sorted(set(range(DST_UNITS)) - set(run_dst)), 16, replace=False)
    src_units = np.concatenate([src_units[:5], run_src, src_units[5:]])
    dst_units = np.concatenate([dst_units[:5], run_dst, dst_units[5:]])
    blocks = []
    for name, unit_bytes in (("full", UNIT_BYTES), ("swa", UNIT_BYTES)):
        for layer in range(LAYERS):
            for s, d in zip(src_units.tolist(), dst_units.tolist(), strict=True):
                src = (layer * SRC_UNITS + s) * unit_bytes
                blocks.append(Block(name, src, (layer * DST_UNITS + d) * unit_bytes, unit_bytes))
    return blocks


def test_kv_pages_land_in_another_process(backend: str, threads: int | None, child: Child) -> None:
    src = make_regions(kv_spec(SRC_UNITS), seed=200)
    want = as_bytes(make_regions(kv_spec(DST_UNITS), seed=300))  # the child's start
    initiator = make_initiator(backend, name="prefill", threads=threads)
    try:
        initiator.register(src)
        initiator.connect("decode", child.descriptor, SESSION)
        rng = np.random.default_rng(11)
        for step in range(3):
            blocks = kv_blocks(rng)
            assert sum(b.nbytes for b in blocks) >= WRITE_THREADS * PARALLEL_MIN_BYTES
            initiator.write("decode", blocks, tagged(f"room:{step}"), timeout_s=WAIT_S, epoch=EPOCH)
            want = apply(want, as_bytes(src), blocks)
        child.conn.send(("wait", "room:2"))
        assert child.conn.poll(WAIT_S), "the target process did not answer"
        seen, got = child.conn.recv()
    finally:
        initiator.close()
    assert seen == Counter(f"room:{i}" for i in range(3))
    assert got == digests(want)


def test_hung_then_dead_target_fails_writes_within_their_timeout(
    backend: str, threads: int | None, child: Child
) -> None:
    """Stopped (SIGSTOP): the write times out, no sooner, or (nixl's posters: the kernel
    copies into a stopped process, and the tag waits in the socket) returns with every byte in
    place; resumed: writes work again, and each tag lands once; killed: the write fails
    (NIXL: at once, zmq: on its timeout); the initiator still works after. The writes are big
    enough for nixl's posters."""
    regions = make_regions(kv_spec(SRC_UNITS), seed=200)
    initiator = make_initiator(backend, name="prefill", threads=threads)
    blocks = kv_blocks(np.random.default_rng(5))
    try:
        initiator.register(regions)
        initiator.connect("decode", child.descriptor, SESSION)
        initiator.write("decode", blocks, tagged("before"), timeout_s=WAIT_S, epoch=EPOCH)

        stop_process(child.proc.pid)
        try:
            error, elapsed_s = write_in_thread(initiator, "decode", blocks, "hung", 1.5)
        finally:
            os.kill(child.proc.pid, signal.SIGCONT)
        if error is None:
            assert backend == "nixl" and threads is None, (elapsed_s, landed(child, "before"))
        else:
            assert isinstance(error, TransferError), error
            assert "timed out after 1.5 s" in str(error) and elapsed_s >= 1.5

        initiator.write("decode", blocks, tagged("after"), timeout_s=WAIT_S, epoch=EPOCH)
        seen = landed(child, "after")
        assert seen["before"] == 1 and seen["after"] == 1, seen
        assert seen["hung"] == 1 if error is None else seen["hung"] <= 1, seen

        child.proc.kill()
        child.proc.join(WAIT_S)
        error, elapsed_s = write_in_thread(initiator, "decode", blocks, "dead", 3.0)
        assert isinstance(error, TransferError), error
        assert "'decode'" in str(error) and elapsed_s < 3.0 + 5.0
        _still_usable(initiator, backend, regions)
    finally:
        initiator.close()


def landed(child: Child, tag: str) -> Counter[str]:
    """Every tag the child's target reported, once `tag` landed there."""
    child.conn.send(("wait", tag))
    assert child.conn.poll(WAIT_S), "the target process did not answer"
    seen: Counter[str] = child.conn.recv()[0]
    return seen


def stop_process(pid: int) -> None:
    """SIGSTOP, then wait until every thread of `pid` is stopped (kill returns before)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while not all(_thread_state(pid, tid) in "tT" for tid in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.002)


def _thread_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread exited
        return "T"


def test_closed_target_fails_the_write(pair: Pair) -> None:
    pair.initiator.write(
        "t", [Block("kv", 0, 0, 64)], tagged("open"), timeout_s=WAIT_S, epoch=EPOCH
    )
    pair.target.close()
    for blocks in ([Block("kv", 0, 0, 64)], []):
        error, _ = write_in_thread(pair.initiator, "t", blocks, "closed", timeout_s=1.0)
        assert isinstance(error, TransferError), error
    # the fixture then closes the initiator: it must not abort the process (see nixl_backend)


def write_in_thread(
    initiator: TransferInitiator, peer: str, blocks: Sequence[Block], tag: str, timeout_s: float
) -> tuple[BaseException | None, float]:
    """The write's exception (None if it returned) and its seconds; fails the test if the
    write hangs."""
    box: list[BaseException | None] = []

    def run() -> None:
        try:
            initiator.write(peer, blocks, tagged(tag), timeout_s=timeout_s, epoch=EPOCH)
            box.append(None)
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout_s + 20.0)
    assert not thread.is_alive(), "write hung past its timeout"
    return box[0], time.monotonic() - started


def _still_usable(initiator: TransferInitiator, backend: str, regions: Sequence[Region]) -> None:
    """After a failed write, the initiator still reaches a fresh target."""
    dst = make_regions(kv_spec(DST_UNITS), seed=9)
    target = granted_target(backend, dst)
    try:
        initiator.disconnect("decode")
        initiator.connect("decode", target.descriptor(), SESSION)
        initiator.write(
            "decode", [Block("full", 0, 64, 128)], tagged("again"), timeout_s=WAIT_S, epoch=EPOCH
        )
        wait_tags(target, ["again"], [])
        assert torch.equal(
            region_bytes(dst[0].tensor)[64:192], region_bytes(regions[0].tensor)[:128]
        )
    finally:
        target.close()


# ---- merge_blocks ----------------------------------------------------------------------------

SIZE = 48
block_st = st.builds(
    lambda region, src, dst, n: Block(region, min(src, SIZE - n), min(dst, SIZE - n), n),
    st.sampled_from(["a", "b"]),
    st.integers(0, SIZE - 1),
    st.integers(0, SIZE - 1),
    st.integers(1, 12),
)


def _copy(blocks: Sequence[Block]) -> dict[str, bytearray]:
    src = {r: bytes(range(i * 100, i * 100 + SIZE)) for i, r in enumerate("ab")}
    dst = {r: bytearray(SIZE) for r in "ab"}
    for b in blocks:
        dst[b.region][b.dst_offset : b.dst_offset + b.nbytes] = src[b.region][
            b.src_offset : b.src_offset + b.nbytes
        ]
    return dst


@settings(deadline=None)  # the machine may be loaded
@given(st.lists(block_st, max_size=20), st.data())
def test_merged_blocks_copy_the_same_bytes(blocks: list[Block], data: st.DataObject) -> None:
    # add runs that are contiguous on both sides, so merges happen
    for _ in range(data.draw(st.integers(0, 3))):
        if blocks and blocks[-1].dst_offset + 2 * blocks[-1].nbytes <= SIZE:
            last = blocks[-1]
            if last.src_offset + 2 * last.nbytes <= SIZE:
                blocks.append(
                    Block(
                        last.region,
                        last.src_offset + last.nbytes,
                        last.dst_offset + last.nbytes,
                        last.nbytes,
                    )
                )
    merged = merge_blocks(blocks)
    assert _copy(merged) == _copy(blocks)
    assert sum(b.nbytes for b in merged) == sum(b.nbytes for b in blocks)
    assert merge_blocks(merged) == merged  # nothing left to merge


@settings(deadline=None)
@given(st.lists(block_st, max_size=20), st.integers(1, 9))
def test_split_blocks_cuts_equal_shares_of_the_same_bytes(blocks: list[Block], parts: int) -> None:
    shares = split_blocks(blocks, parts)
    assert len(shares) == parts
    sizes = [sum(b.nbytes for b in share) for share in shares]
    total = sum(b.nbytes for b in blocks)
    assert sizes == [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    pieces = [b for share in shares for b in share]
    assert all(b.nbytes > 0 for b in pieces)
    assert merge_blocks(pieces) == merge_blocks(blocks)  # the same bytes, in the same order
    assert _copy(pieces) == _copy(blocks)


def test_split_blocks_refuses_no_parts() -> None:
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        split_blocks([], 0)


def test_merge_blocks_merges_runs_and_keeps_order() -> None:
    blocks = [
        Block("a", 0, 10, 4),
        Block("a", 4, 14, 4),
        Block("b", 8, 18, 4),
        Block("a", 8, 18, 2),
    ]
    assert merge_blocks(blocks) == [
        Block("a", 0, 10, 8),
        Block("b", 8, 18, 4),
        Block("a", 8, 18, 2),
    ]


def test_split_messages_bounds_every_message() -> None:
    blocks = [Block("a", 0, 0, 1000), Block("b", 5, 7, 10), Block("a", 2000, 3000, 300)]
    messages = zmq_backend.split_messages(blocks, 256)
    assert all(0 < sum(b.nbytes for b in m) <= 256 for m in messages)
    pieces = [b for m in messages for b in m]
    assert merge_blocks(pieces) == blocks
    assert zmq_backend.split_messages([], 256) == [[]]


if __name__ == CHILD_RUN_NAME:  # in the spawned target process (see the `child` fixture)
    target_child(*globals()["CHILD_ARGS"])
