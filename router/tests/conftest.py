"""Makes `router_support` (the stub workers and the in-process router harness) importable.

The other test folders are on pytest's `pythonpath` in pyproject.toml; adding `router/tests`
there would make this file unnecessary.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
