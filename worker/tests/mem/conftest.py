"""Makes the shared helpers of the mem tests importable (`import mem_helpers`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
