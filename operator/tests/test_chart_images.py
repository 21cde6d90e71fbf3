"""Dockerfiles and tools, checked by reading (no Docker engine here): non-root final stages,
torch pinned like pyproject, the kopf entry point, the CPU switch; tools.sh is a fast no-op."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from repo_paths import ROOT, TOOLS_BIN


def stages(dockerfile: Path) -> dict[str, list[str]]:
    """Instructions per stage (continuation lines joined), keyed by stage name or index."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    out: dict[str, list[str]] = {}
    current = "<preamble>"
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            m = re.search(r"\bAS\s+(\S+)", line, re.IGNORECASE)
            current = m.group(1) if m else f"stage{len(out)}"
            out[current] = []
        out.setdefault(current, []).append(line)
    return out


def final_stage(dockerfile: Path) -> list[str]:
    return list(stages(dockerfile).values())[-1]


def pinned_torch() -> str:
    m = re.search(r'"torch==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml pins torch"
    return m.group(1)


@pytest.mark.parametrize("name", ["Dockerfile.operator", "Dockerfile.worker"])
def test_final_stage_runs_as_non_root(name: str) -> None:
    users = [i.split()[1] for i in final_stage(ROOT / name) if i.upper().startswith("USER ")]
    assert users, f"{name}: no USER in the final stage"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_operator_image_runs_kopf_with_liveness() -> None:
    (entry,) = [i for i in final_stage(ROOT / "Dockerfile.operator") if i.startswith("ENTRYPOINT")]
    assert entry.startswith('ENTRYPOINT ["kopf", "run", "-m", "dsv4_operator.main"')
    assert "--liveness=http://0.0.0.0:8080/healthz" in entry
    assert len(stages(ROOT / "Dockerfile.operator")) >= 2, "build the wheel in its own stage"
    assert not any("torch" in i for i in final_stage(ROOT / "Dockerfile.operator"))


def test_worker_image_pins_torch_like_pyproject() -> None:
    text = (ROOT / "Dockerfile.worker").read_text()
    assert f"ARG TORCH_VERSION={pinned_torch()}" in text
    assert '"torch==${TORCH_VERSION}${TORCH_LOCAL}"' in text


def test_worker_image_switches_base_with_cpu_arg() -> None:
    parts = stages(ROOT / "Dockerfile.worker")
    assert parts["<preamble>"][0] == "ARG CPU=0"  # CUDA by default
    assert parts["base-0"][0].startswith("FROM ${CUDA_BASE}")
    assert parts["base-1"][0].startswith("FROM ${CPU_BASE}")
    assert "download.pytorch.org/whl/cpu" in " ".join(parts["base-1"])
    assert list(parts)[-1] == "runtime" and parts["runtime"][0] == "FROM base-${CPU} AS runtime"
    assert "nvidia/cuda" in " ".join(parts["<preamble>"])


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools", "**/__pycache__"} <= ignored
    for needed in ("pyproject.toml", "worker", "operator"):
        assert needed not in ignored


def test_tools_script_is_a_fast_no_op_when_done() -> None:
    script = ROOT / "scripts" / "tools.sh"
    assert os.access(script, os.X_OK)
    if not (TOOLS_BIN / "helm").exists():
        pytest.skip("tools not installed yet: run scripts/tools.sh")
    before = {tool: (TOOLS_BIN / tool).stat().st_mtime_ns for tool in ("helm", "kubectl")}
    done = subprocess.run([str(script)], check=True, capture_output=True, timeout=60)
    # A no-op: nothing fetched or unpacked again, nothing said.
    assert done.stdout == b"" and done.stderr == b""
    for tool, mtime in before.items():
        assert os.access(TOOLS_BIN / tool, os.X_OK)
        assert (TOOLS_BIN / tool).stat().st_mtime_ns == mtime
