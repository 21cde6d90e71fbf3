"""Port allocation for `dsv4 up`: distinct, free, and below the kernel's ephemeral range (where
outgoing connections of the started processes cannot take them first)."""

from __future__ import annotations

import socket
from pathlib import Path

from dsv4_local.plan import HOST
from dsv4_local.ports import DEFAULT_EPHEMERAL_LOW, ephemeral_low, free_ports, port_is_free


def test_the_ephemeral_range_is_read_or_defaulted(tmp_path: Path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t60999\n")
    assert ephemeral_low(good) == 40000
    bad = tmp_path / "bad"
    bad.write_text("")
    assert ephemeral_low(bad) == DEFAULT_EPHEMERAL_LOW
    assert ephemeral_low(tmp_path / "missing") == DEFAULT_EPHEMERAL_LOW


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low = ephemeral_low()
    ports = free_ports(32)
    assert len(set(ports)) == 32
    assert all(p < low for p in ports)  # this machine's range leaves room below it
    assert all(port_is_free(p) for p in ports)


def test_excluded_and_taken_ports_are_skipped() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        first = free_ports(1)[0]
        taken.bind((HOST, first))
        taken.listen()
        ports = free_ports(200, exclude=frozenset({first + 1}))
    assert first not in ports and first + 1 not in ports
