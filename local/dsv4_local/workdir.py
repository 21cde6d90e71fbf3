"""The work directory of `dsv4 up` (side effects: files): every config document of a launch
plan at its path, and an empty log directory.

    WORKDIR/<role>-<replica>/<role>-rank-<pp>.json   rank configs of one worker group
    WORKDIR/router/router.json                      the router config
    WORKDIR/api-key                                 the API key (with one; mode 0600)
    WORKDIR/logs/<process>.log                      stdout + stderr of each process (a
                                                    restart appends, after a marker line)
    WORKDIR/status.json                             every unit's state, pids and restarts
                                                    (written by the supervisor)
    WORKDIR/pd-secret                               the run's PD secret (new each run, 0600):
                                                    authenticates its PD channels
"""

from __future__ import annotations

import json
import os
import secrets

from dsv4_local.plan import LaunchPlan

__all__ = ["write_workdir"]


def write_workdir(plan: LaunchPlan) -> None:
    """Create the directories and write the documents (raises OSError)."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    write_secret(plan)
    for path, document in plan.documents.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    if plan.api_key is not None:  # readable by this user only, from its first byte
        fd = os.open(plan.api_key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(plan.api_key + b"\n")


def write_secret(plan: LaunchPlan) -> None:
    """A new random PD secret for this run, readable by its owner only."""
    path = plan.secret_path
    path.unlink(missing_ok=True)  # a file left by another user's run: not ours to reuse
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
