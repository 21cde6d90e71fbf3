"""The control plane's outbox: messages reach the owner's PULL socket in order from any thread;
a kick never blocks or raises, also when the owner is far behind or the outbox is closed."""

from __future__ import annotations

import threading

import zmq

from dsv4_worker.pd.channel import Mailbox, Outbox


def test_messages_from_many_threads_arrive_whole_and_in_each_threads_order() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    box = Outbox(ctx, "test")
    try:

        def send(k: int) -> None:
            for i in range(50):
                box.put([str(k).encode(), str(i).encode()])

        threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        got: dict[int, list[int]] = {k: [] for k in range(4)}
        for _ in range(200):
            assert box.pull.poll(30_000), "a message did not arrive"
            k, i = box.pull.recv_multipart()
            got[int(k)].append(int(i))
        for t in threads:
            t.join()
        assert got == {k: list(range(50)) for k in range(4)}
    finally:
        box.close()
        ctx.term()


def test_kick_never_blocks_when_nobody_reads_and_never_raises_after_close() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    box = Outbox(ctx, "test")
    hwm = int(box.pull.getsockopt(zmq.RCVHWM)) + int(box._push.getsockopt(zmq.SNDHWM))
    for _ in range(hwm + 100):  # past both queues' high-water marks: the rest are dropped
        box.kick(b"wake")
    assert box.pull.poll(30_000)
    assert box.pull.recv() == b"wake"
    box.close()
    box.kick(b"wake")  # after close: dropped
    ctx.term()


def test_mailbox_messages_from_many_threads_arrive_in_each_threads_order_and_wake_the_owner() -> (
    None
):
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    box: Mailbox[tuple[int, int]] = Mailbox(ctx, "test")
    try:

        def send(k: int) -> None:
            for i in range(500):
                box.put((k, i))

        threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        got: dict[int, list[int]] = {k: [] for k in range(4)}
        while sum(map(len, got.values())) < 2000:
            assert box.pull.poll(30_000), "a message queued and did not wake the owner"
            for k, i in box.take():
                got[k].append(i)
        for t in threads:
            t.join()
        assert got == {k: list(range(500)) for k in range(4)}
        assert box.take() == []
        box.kick()  # a wake-up with nothing to take
        assert box.pull.poll(30_000)
        assert box.take() == []
    finally:
        box.close()
        ctx.term()


def test_hand_over_waits_for_the_first_message_of_each_turn_only() -> None:
    """The first message handed over in a turn returns once the owner handled it; a later one
    in the same turn returns at once, unhandled (a new turn waits again)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    box: Mailbox[int] = Mailbox(ctx, "test")
    try:

        def owner() -> None:
            assert box.pull.poll(30_000), "no wake-up"
            assert box.take() == [1]
            box.handled()

        thread = threading.Thread(target=owner)
        thread.start()
        first = box.put(1)
        box.hand_over(first, 30.0, turn=7)
        assert box.wait_handled(first, 0.0)  # it returned because the owner handled it
        thread.join()
        second = box.put(2)  # nobody takes it
        box.hand_over(second, 30.0, turn=7)  # the same turn: no wait (else 30 s, then fail)
        assert not box.wait_handled(second, 0.0)
        third = box.put(3)
        box.hand_over(third, 0.01, turn=8)  # a new turn waits (here: its bound)
        assert box.take() == [2, 3]
    finally:
        box.close()
        ctx.term()


def test_a_kick_arrives_while_puts_fill_their_pipe() -> None:
    """A kick does not share the puts' pipe: with that pipe at its high-water mark (as zmq may
    see it for a while after the owner read it all, which dropped kicks under load: 9 of 200
    trials), the kick still arrives."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    box = Outbox(ctx, "test")
    try:
        puts = 0
        while True:  # fill the puts' pipe to its mark (a blocking put would wait here)
            try:
                box._push.send(b"m", zmq.NOBLOCK)
            except zmq.Again:
                break
            puts += 1
        assert puts >= int(box._push.getsockopt(zmq.SNDHWM))
        box.kick(b"kick")
        frames = []
        while box.pull.poll(1_000):
            frames.append(box.pull.recv())
        assert frames.count(b"m") == puts
        assert b"kick" in frames
    finally:
        box.close()
        ctx.term()
