"""One builder of observed pods (`PodState`) for the operator's pure-function tests."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsv4_operator.observe import PodState


def running_pod(name: str, **fields: Any) -> PodState:
    """A running, ready, never restarted decode pod of PP rank 0, named `name` (also its uid;
    its group is the name up to the last '-'), with no template hash, times or IP; `fields`
    override any of these."""
    base = PodState(
        name=name,
        uid=name,
        role="decode",
        group=name.rsplit("-", 1)[0],
        pp_rank=0,
        phase="Running",
        ready=True,
        restart_count=0,
        deleting=False,
        template_hash=None,
        created_at=None,
        started_at=None,
        ip=None,
    )
    return dataclasses.replace(base, **fields)
