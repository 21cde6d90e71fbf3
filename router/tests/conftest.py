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


import pytest  # noqa: E402

# The deployment's PD secret every router under test signs its prefill choices with (a router
# refuses to start without one; test_config checks that).
TEST_PD_SECRET = "router-tests-pd-secret-0123456789abcdef0123456789"


@pytest.fixture(autouse=True)
def pd_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    """In this process's environment, so router subprocesses inherit it too."""
    monkeypatch.setenv("DSV4_PD_SECRET", TEST_PD_SECRET)
    return TEST_PD_SECRET
