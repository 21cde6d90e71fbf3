"""The docs' hand-made recipes run as written: README's PD trio (prefill, decode, router) and
docs/pp.md's PP pair, each block run by bash as it stands, its ports swapped for free ones (the
machine is shared), with `dsv4` on PATH. Each waits for readiness before its completion, so
the completion succeeds, and its last line stops the servers it started."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_local.ports import free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {  # doc -> what marks its recipe block
    "README.md": "dsv4 serve --role prefill",
    "docs/pp.md": "--pp-size 2 --pp-rank 1",
}
RUN_S = 600.0  # the whole block, servers' exits included, on a loaded 2-core machine


def bash_block(doc: str, marker: str) -> str:
    """The one ```bash block of `doc` holding `marker`."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return str(block)


def on_free_ports(block: str) -> tuple[str, dict[int, int]]:
    """Every port of the block (its 4- and 5-digit numbers) swapped for a distinct free one."""
    ports = sorted({int(p) for p in re.findall(r"\b\d{4,5}\b", block)})
    free = dict(zip(ports, free_ports(len(ports)), strict=True))
    return re.sub(r"\b\d{4,5}\b", lambda m: str(free[int(m.group())]), block), free


def completion_in(out: str) -> dict[str, object]:
    """The completion curl printed, among the servers' lines."""
    start = out.index('{"id": "cmpl-')
    document, _ = json.JSONDecoder().raw_decode(out, start)
    assert isinstance(document, dict)
    return document


@pytest.mark.parametrize("doc", sorted(RECIPES))
def test_the_recipe_runs_as_written(doc: str) -> None:
    block, ports = on_free_ports(bash_block(doc, RECIPES[doc]))
    assert len(ports) >= 3, ports  # every server has its own
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "UCX_NET_DEVICES": "lo",  # as dsv4 up sets it: NIXL over loopback only
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the servers too: whatever is left is killed below
    )
    try:
        # Returns once every server the block started has exited (they hold its stdout):
        # the block's own `kill` stops them.
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out[-4000:]
    completion = completion_in(out)
    choices = completion["choices"]
    assert isinstance(choices, list) and choices[0]["finish_reason"] == "length", completion
