"""Paths into the repository that tests read (`import repo_paths`: on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
SAMPLES: Final = ROOT / "crds" / "samples"
MODEL_DATA: Final = ROOT / "common" / "tests" / "data"  # published config.json files (README)
CRD_FILE: Final = ROOT / "crds" / "dsv4deployment.yaml"
CHART: Final = ROOT / "charts" / "dsv4-operator"
SHARED_EXAMPLES: Final = ROOT.parent / "shared" / "examples"
TOOLS_BIN: Final = ROOT / ".tools" / "bin"  # helm and kubectl (scripts/tools.sh)
