"""A forward that raises on one stage of a PP group fails the requests of that batch on every
stage and the group goes on (issue #37 item 1): the request decoding when stage `rank`'s
forward broke ends with internal_error, the requests after it equal a clean run token for
token, no stage fails, and every stage's pools are back to zero."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pp_support import GroupRun, run_group

from dsv4_worker.engine.sampler import SamplingParams

pytestmark = pytest.mark.slow

# One request at a time: the broken forward's batch holds the first request only.
RUN = GroupRun(
    prompts=(tuple(b"Hello there"), tuple(b"Once upon"), tuple(b"The license")),
    params=(SamplingParams(max_new_tokens=4),) * 3,
    max_running_requests=1,
)
BROKEN_CALL = 3  # the prompt's forward, then decodes: the third is mid-decode


@pytest.fixture(scope="module")
def clean() -> dict[int, dict[str, Any]]:
    return run_group(RUN)


@pytest.mark.parametrize("rank", [0, 1], ids=["first stage", "last stage (samples)"])
def test_a_stage_whose_forward_raises_fails_its_batch_and_the_group_goes_on(
    clean: dict[int, dict[str, Any]], rank: int
) -> None:
    broken = run_group(dataclasses.replace(RUN, extra={"fail_forward": (rank, BROKEN_CALL)}))
    lead = broken[0]
    assert lead["endings"][0] == ("error", "internal_error")
    assert lead["endings"][1:] == [("length", None)] * 2
    assert lead["outputs"][1:] == clean[0]["outputs"][1:]
    for result in broken.values():
        assert result["failure"] is None
        assert all(used == 0 for _, used in result["used"]), result["used"]
