"""One PipeLink rank as a spawned process (test_link.py): meet, gather the ranks, report, and
hold the group up until the test has looked at the listeners."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from dsv4_worker.pp.link import PipeLink


def rank_main(
    rank: int, host: str, port: int, listen_host: str, timeout_s: float, out: Any, done: Any
) -> None:
    try:
        link = PipeLink(
            rank,
            2,
            host,
            port,
            device=torch.device("cpu"),
            start_timeout_s=timeout_s,
            timeout_s=timeout_s,
            listen_host=listen_host,
        )
        out.put((rank, link.all_gather(rank)))
        done.wait(timeout_s)
        link.close()
    except BaseException:
        out.put((rank, traceback.format_exc()))
