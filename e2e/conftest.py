"""e2e fixtures. Tests marked `cluster` need a real cluster with the operator installed (see
kind.sh); without KUBECONFIG, kubectl or helm they are skipped, never errors. Other e2e tests
(local multi-process runs) are left alone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from repo_paths import TOOLS_BIN


def kubectl_path() -> str | None:
    local = TOOLS_BIN / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


def cluster_skip_reason() -> str | None:
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        return "cluster tests are opt-in: set KUBECONFIG (e.g. run e2e/kind.sh)"
    if not all(Path(p).exists() for p in kubeconfig.split(os.pathsep) if p):
        return f"KUBECONFIG={kubeconfig} does not exist"
    if kubectl_path() is None:
        return "kubectl not found (scripts/tools.sh puts it in .tools/bin)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cluster_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        # The marker, not a keyword: `"cluster" in item.keywords` also matched tests merely
        # named or parametrized "cluster" (test_install_like_helm's cluster-wide install), and
        # skipped them everywhere.
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)
