"""scripts/checkov_scan.py (the inputs and verdict of scripts/checkov.sh) as a module: the tests
render every sample exactly as the scan does, and check its allowlist and verdict logic."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from repo_paths import ROOT


def load() -> ModuleType:
    name = "checkov_scan_script"
    if name in sys.modules:  # one module object: its dataclasses compare across test files
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "checkov_scan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
