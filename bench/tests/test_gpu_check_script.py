"""scripts/gpu_check.sh's contract with the device tool, checked without a device: its logs fit
what the tool brings back (8 files), every step is recorded in env.log as it ends (a run killed
at the tool's limit keeps them), and a spent budget skips steps instead of running past it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
MAX_FILES_BACK = 8  # /work/.library/device/README.md, Limits: files back from $OUT


def _steps() -> list[str]:
    return re.findall(r"^step (\S+) \d+ ", SCRIPT.read_text(), flags=re.M)


def test_the_logs_fit_what_the_device_tool_brings_back() -> None:
    logs = set(re.findall(r"\$OUT/([\w.-]+)", SCRIPT.read_text())) | {"env.log"}
    assert len(logs) <= MAX_FILES_BACK, sorted(logs)


def test_item_7_steps_run_before_the_rest() -> None:
    steps = _steps()
    assert steps[:3] == ["alloc", "flash-layers", "moe"], steps
    assert len(steps) == len(set(steps)) >= 10, steps


def test_a_spent_budget_skips_every_step_and_still_writes_the_summary(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "GPU_CHECK_BUDGET_S": "0",
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_SITE": "",
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_SCALE": "0",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    env_log = (tmp_path / "env.log").read_text()
    recorded = re.findall(r"^step (\S+)\s+rc=(\S+)", env_log, flags=re.M)
    assert recorded == [(name, "skip") for name in _steps()], env_log
    assert "=== summary" in env_log
    assert len(list(tmp_path.iterdir())) <= MAX_FILES_BACK
