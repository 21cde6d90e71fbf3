"""A `dsv4 up`-like driver for the signal tests: `launch` (what `dsv4 up` runs once its plan is
made) on stand-in processes, in its own interpreter so a test can signal it.

    python driver.py PLAN.json

PLAN.json: {"workdir": ..., "router_url": ..., "timeout_s": ..., "stop_grace_s": ...,
"processes": [ProcessSpec fields, config_dir as a string], "policy": RestartPolicy fields
(optional)}. Exits with launch's code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsv4_local.plan import LaunchPlan, ProcessSpec
from dsv4_local.supervise import RestartPolicy
from dsv4_local.up import launch


def main() -> int:
    doc = json.loads(Path(sys.argv[1]).read_text())
    processes = tuple(
        ProcessSpec(**{**p, "argv": tuple(p["argv"]), "config_dir": Path(p["config_dir"])})
        for p in doc["processes"]
    )
    plan = LaunchPlan(Path(doc["workdir"]), processes, {}, doc["router_url"])
    policy = RestartPolicy(**doc["policy"]) if "policy" in doc else None
    return launch(plan, timeout_s=doc["timeout_s"], stop_grace_s=doc["stop_grace_s"], policy=policy)


if __name__ == "__main__":
    sys.exit(main())
