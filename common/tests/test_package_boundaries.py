"""The three packages as the images install them: `dsv4 plan` and `dsv4 render` run with torch
unimportable (the operator image), the worker never imports kopf or the Kubernetes client,
and the shared package imports neither side. Each check runs in a fresh interpreter whose
import system refuses the blocked packages, as if they were not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from repo_paths import SAMPLES

# Installed in the child before anything else: blocked top-level packages raise ImportError.
BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
"""


def run_blocked(blocked: set[str], body: str) -> subprocess.CompletedProcess[str]:
    code = BLOCKER.format(blocked=sorted(blocked)) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_plan_and_render_run_without_torch() -> None:
    proc = run_blocked(
        {"torch", "numpy", "zmq", "nixl_cu12", "nixl_cu13"},
        f"""
        import sys
        from dsv4_cli.main import main
        assert main(["plan", "--model", "deepseek-v4-pro", "--gpu", "h200", "--tp", "8",
                     "--pp", "4", "--role", "decode"]) == 0
        assert main(["render", {str(SAMPLES / "tiny-cpu.yaml")!r}]) == 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "dsv4_worker"))
        assert not loaded, loaded
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bottleneck rank" in proc.stdout  # the plan table
    assert "kind: StatefulSet" in proc.stdout  # the rendered objects


def test_the_worker_never_imports_kopf_or_the_kubernetes_client() -> None:
    proc = run_blocked(
        {"kopf", "kubernetes", "dsv4_operator"},
        """
        import importlib, pkgutil
        import dsv4_worker
        names = [m.name for m in pkgutil.walk_packages(dsv4_worker.__path__, "dsv4_worker.")]
        for name in names:
            importlib.import_module(name)
        assert len(names) > 5, names
        print(len(names))
        """,
    )
    assert proc.returncode == 0, proc.stderr


ABOVE_THE_SHARED_PACKAGE = {"dsv4_worker", "dsv4_operator", "dsv4_router", "dsv4_local", "dsv4_cli"}


def test_the_shared_package_imports_nothing_above_it_nor_torch() -> None:
    proc = run_blocked(
        {"torch", "numpy", "kopf", "kubernetes", "zmq", *ABOVE_THE_SHARED_PACKAGE},
        """
        import importlib, pkgutil
        import dsv4_common
        names = [m.name for m in pkgutil.walk_packages(dsv4_common.__path__, "dsv4_common.")]
        for name in names:
            importlib.import_module(name)
        assert "dsv4_common.api.rank_config" in names and "dsv4_common.api.serve_flags" in names
        """,
    )
    assert proc.returncode == 0, proc.stderr


def test_render_without_the_operator_package_says_what_to_install() -> None:
    proc = run_blocked(
        {"dsv4_operator"},
        f"""
        import sys
        from dsv4_cli.main import main
        sys.exit(main(["render", {str(SAMPLES / "tiny-cpu.yaml")!r}]))
        """,
    )
    assert proc.returncode == 2
    assert "dsv4 render: error: needs the operator package" in proc.stderr
    assert "pip install 'dsv4-serve[operator]'" in proc.stderr
