"""Where a worker's queue bound and deadline come from: `dsv4 serve` flags, else the rank
config's fields, else derived from its request slots."""

from __future__ import annotations

import argparse

from rank_configs import rank_config

from dsv4_cli.main import build_parser
from dsv4_worker.options import ServeOptions
from dsv4_worker.serve import _admission_policy
from dsv4_worker.server.admission import DEFAULT_QUEUE_TIMEOUT_S, QUEUE_PER_RUNNING


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--model", "tiny", *argv])


def test_derived_from_the_request_slots_by_default() -> None:
    policy = _admission_policy(ServeOptions.from_args(args()), 6)
    assert policy.max_queue_requests == QUEUE_PER_RUNNING * 6
    assert policy.queue_timeout_s == DEFAULT_QUEUE_TIMEOUT_S


def test_the_rank_config_then_the_flags_win() -> None:
    config = rank_config(max_queue_requests=9, queue_timeout_s=1.5)
    policy = _admission_policy(ServeOptions.from_rank_config(config, args("--role", "decode")), 6)
    assert (policy.max_queue_requests, policy.queue_timeout_s) == (9, 1.5)
    flags = args("--role", "decode", "--max-queue-requests", "3", "--queue-timeout-s", "0.5")
    policy = _admission_policy(ServeOptions.from_rank_config(config, flags), 6)
    assert (policy.max_queue_requests, policy.queue_timeout_s) == (3, 0.5)
