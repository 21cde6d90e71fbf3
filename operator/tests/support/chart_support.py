"""The Helm chart, rendered with the helm binary from scripts/tools.sh (.tools/bin/helm), for the
tests that read what the chart deploys. Tests skip, saying so, only when helm is missing, which
CI never allows (scripts/setup.sh runs tools.sh)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml
from repo_paths import CHART, TOOLS_BIN

HELM = TOOLS_BIN / "helm"
K8S_VERSIONS = ("1.30", "1.37")
needs_helm = pytest.mark.skipif(
    not HELM.exists(), reason=f"{HELM} missing: run scripts/tools.sh (CI always does)"
)


def helm(*args: str) -> str:
    result = subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(*values: str, include_crds: bool = False) -> list[dict[str, Any]]:
    """`helm template` of the chart as release `dsv4` in namespace dsv4-system."""
    args = ["template", "dsv4", str(CHART), "--namespace", "dsv4-system", *values]
    if include_crds:
        args.append("--include-crds")
    return [d for d in yaml.safe_load_all(helm(*args)) if d]
