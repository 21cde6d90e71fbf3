"""The fetcher as the images install it: `dsv4 fetch` and every dsv4_fetch module import with
torch, numpy, kopf and the Kubernetes client unimportable (the download Job runs the worker
image, the operator its own; neither needs them for a fetch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "numpy", "kopf", "kubernetes", "dsv4_worker"}:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
"""


def test_the_fetcher_needs_no_torch_nor_a_kubernetes_client() -> None:
    body = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import dsv4_fetch
        for m in pkgutil.walk_packages(dsv4_fetch.__path__, "dsv4_fetch."):
            importlib.import_module(m.name)
        from dsv4_cli.main import main
        try:
            main(["fetch", "--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "kopf"))
        assert not loaded, loaded
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER + body], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "hf://ORG/NAME" in done.stdout
